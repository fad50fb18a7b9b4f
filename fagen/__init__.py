"""fagen: a code-generating kernel compiler for exact attention.

    import fagen
    out = fagen.flash_attn_func(q, k, v, causal=True, dropout_p=0.1)   # (B, N, H, d)
    out = fagen.attention(q, k, v, causal=True)                        # (B, H, N, d)
    spec = fagen.autotune(fagen.Spec(64, mask="causal"), seqlen_q=4096, batch=4, heads=32)
    out = fagen.flash_attn_func(q, k, v, window_size=(256, 0), softcap=30.0)          # flash-attn's variants
    out = fagen.flash_attn_func(q, k, v, score_mod=lambda s, b, h, i, j: fagen.where(i >= j, s, s - 1.0))
    out = fagen.sdpa(q, k, v, is_causal=True)                          # SDPA's signature, (..., H, N, d)
    out = fagen.flex_attention(q, k, v, block_mask=create_block_mask(causal, None, None, N, N))  # FlexAttention's
    out = fagen.flash_attn_qkvpacked_func(qkv, causal=True)            # qkv (B, N, 3, H, d), views, no copy
    import fagen.integrations.transformers                             # attn_implementation="fagen"
"""

from .version import __version__  # noqa: E402
from . import distributed  # noqa: E402  (fagen.distributed.ring_attention: context parallelism)
from . import emulate  # noqa: E402,F401  (registers itself as the launcher's CPU backend)
from .ops import (attention, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,  # noqa: E402
                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                  flash_attn_with_kvcache, flex_attention, merge_attention)
from .ops.fp8_inputs import quantize_qkv  # noqa: E402  (e4m3 q, k, v and their descales for flash_attn_func)
from .ops.fp8_training import FP8Gradients, fp8_attention_backward, fp8_attention_func  # noqa: E402  (fp8 training)
from .ops.sdpa import sdpa  # noqa: E402
from .spec import Spec  # noqa: E402
from .tuning import autotune  # noqa: E402
from .variants import ModError, exp, log, maximum, minimum, sigmoid, sqrt, tanh, where  # noqa: E402

__all__ = ["FP8Gradients", "ModError", "Spec", "attention", "autotune", "distributed", "exp", "flash_attn_func",
           "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "flex_attention", "fp8_attention_backward", "fp8_attention_func", "log", "maximum", "merge_attention",
           "minimum", "quantize_qkv", "sdpa", "sigmoid", "sqrt", "tanh", "where", "__version__"]
