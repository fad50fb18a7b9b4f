"""fagen.decode: attention at decoding time, built on fagen's ops (kv cache, split-KV, merge).

  merge   merge_attention: combine the (out, lse) of attention over disjoint key sets into
          the attention over their union, exactly (fp32), differentiable

Nothing in fagen imports this package but `fagen` itself (tests/test_layering.py).
"""

from .merge import merge_attention

__all__ = ["merge_attention"]
