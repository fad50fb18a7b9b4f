"""fagen's element types: the names a Spec carries ("fp16", "bf16", "e4m3": spec.DTYPES) and the torch
dtypes of the tensors they stand for. The one table between the two; every module that turns a
tensor's dtype into a Spec's, or a Spec's into a tensor's, reads it here. (An 8-bit spec's output
is in another dtype than its inputs: Spec.output_dtype.)
"""

from __future__ import annotations

import torch

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16,
               "e4m3": torch.float8_e4m3fn}                         # a Spec's dtype name -> torch dtype
DTYPE_NAME = {dtype: name for name, dtype in TORCH_DTYPE.items()}  # torch dtype -> a Spec's dtype name
FP8_TORCH_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}   # Spec.dout_dtype's names ...
FP8_DTYPE_NAME = {dtype: name for name, dtype in FP8_TORCH_DTYPE.items()}        # ... and back
