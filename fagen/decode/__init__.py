"""fagen.decode: attention at decoding time, built on fagen's ops (kv cache, split-KV, merge).

  merge          merge_attention: combine the (out, lse) of attention over disjoint key sets
                 into the attention over their union, exactly (fp32), differentiable
  kvcache        flash_attn_with_kvcache: a decoding step (rotary, in-place append, paged or
                 contiguous cache, GQA packing, split-KV with a combine kernel)
  kvcache_args   its argument checks (nothing is written to the cache on a refused call)

Nothing in fagen imports this package but `fagen` itself (tests/test_layering.py).
"""

from .kvcache import flash_attn_with_kvcache
from .merge import merge_attention

__all__ = ["flash_attn_with_kvcache", "merge_attention"]
