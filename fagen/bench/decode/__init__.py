"""The decode section: a decoding step against a KV cache, and varlen training against padding.

config    systems, sizes, bytes per step, the documents' FLOPs, the forecast (DecodeConfig)
step      the decoding step's inputs and contenders, one timed cell, fagen's sanity check
varlen    the packed and padded documents and their contenders, fagen's sanity check
run       the section: its parts in order under the deadline (run.py says what it measures)
markdown  its lines in the plan, its derived numbers, its short-table rows and results.md
"""
