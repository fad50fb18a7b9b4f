"""fagen.variants: attention variants as a language.

Users write FlexAttention's `score_mod(score, b, h, q_idx, kv_idx)` and
`mask_mod(b, h, q_idx, kv_idx)`; fagen traces them with sympy proxies and builds the
kernels' device functions from the expressions, with flash-attn's window, softcap and
ALiBi and gpt-oss's sinks as built-ins through the same mechanism.

- language.py: the proxies (`Sym`), `where`, math functions, tracing, `ModError`;
- free_values.py: a mod's free values and structure; recording.py: a mod recorded as Dynamo
  traces it, where fagen cannot read it under torch.compile;
- compose.py: a Spec's score chain and mask as sympy expressions (`variant_math`);
- tiles.py: tile classes and loop bounds from the mask's linear atoms;
- cuda.py: the device functions, their kernel parameters and Context (`variant_code`).
"""

from .compose import custom_mod, variant_math
from .language import (ModError, Traced, exp, log, maximum, minimum, sigmoid, sqrt, tanh, trace_mask_mod,
                       trace_score_mod, where)

__all__ = ["ModError", "Traced", "custom_mod", "exp", "log", "maximum", "minimum", "sigmoid", "sqrt", "tanh",
           "trace_mask_mod", "trace_score_mod", "variant_math", "where"]
