"""The decode section: a decoding step against a KV cache, and varlen training against padding.

config    systems, sizes, bytes per step, the documents' FLOPs, the forecast (DecodeConfig)
step      the decoding step's inputs and contenders, one timed cell, fagen's sanity check
varlen    the packed and padded documents and their contenders, fagen's sanity check
graph     the step captured in a CUDA graph, replayed against the eager step
mla       absorbed MLA's step (one 576-wide cache, V its first 512 columns) and its contenders
run       the section: its parts in order under the deadline (run.py says what it measures)
markdown  its lines in the plan, its derived numbers, its short-table rows and results.md
"""
