"""fagen.integrations: glue for other libraries. Import a submodule to use it:

  transformers   `import fagen.integrations.transformers` registers attn_implementation="fagen"
                 with Hugging Face transformers (needs the `transformers` extra)

Nothing in fagen imports this package (tests/top/test_layering.py).
"""
