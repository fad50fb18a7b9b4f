"""The models section: a 1B-class Llama in Hugging Face transformers with attn_implementation
"fagen" against "sdpa" and "flex_attention".

config    the model, systems and sizes, and the forecast (ModelsConfig)
run       the model built once, its sanity, a training step and greedy generate per system
markdown  its lines in the plan, tokens/s and ratios, its short-table rows and results.md
"""
