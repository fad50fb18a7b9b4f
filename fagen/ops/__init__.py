"""fagen's front end: every entry point users call, with autograd and torch.compile support.

  common        what every entry point shares (checks, dtype table, alignment, Philox state); the
                only part `distributed/` and `integrations/` import
  dense         flash_attn_func (flash-attn's layout), attention (PyTorch's), the custom ops, and the
                op modules `fagen build` writes (run_generated)
  varlen        flash_attn_varlen_func: packed sequences, and packed queries over a paged cache
  kvcache       flash_attn_with_kvcache: a decoding step (append, rotary, paged, split-KV)
  merge         merge_attention: attention over the union of disjoint key sets
  sdpa          fagen.sdpa: torch's scaled_dot_product_attention signature
  flex          flex_attention: FlexAttention's signature (BlockMask, and_masks / or_masks)
  qkvpacked     flash-attn's packed entry points (qkv, kv; dense and varlen), views into the pack
  autograd      the autograd Function of variant and packed calls
  variant_args, varlen_args, kvcache_args   each family's argument checks
"""

from .dense import attention, flash_attn_func, run_generated
from .flex import flex_attention
from .kvcache import flash_attn_with_kvcache
from .merge import merge_attention
from .qkvpacked import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func)
from .varlen import flash_attn_varlen_func

# fagen.sdpa lives in ops.sdpa and is not re-exported here: a function named like its module would
# shadow the module (fagen.ops.sdpa), and mock targets and imports through it would reach the function.
__all__ = ["attention", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_with_kvcache", "flex_attention", "merge_attention", "run_generated"]
