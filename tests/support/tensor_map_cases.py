"""Tensor maps shared by the CPU tests of TensorMapSpec's rules (tests/kernels/test_tensor_map.py)
and the GPU tests that hand the same maps to the driver (tests/gpu/test_gpu_tensor_map.py)."""

from __future__ import annotations

from fagen.kernels.tensor_map import DataType, Interleave, OobFill, Swizzle, TensorMapSpec

# A (B, N, H, d) = (2, 1000, 8, 128) bf16 q as FlashAttention-3 maps it: dims (d, N, H, B), so the
# rows' stride (4096 B) comes before the heads' (256 B); a box of 64 columns (128 bytes, one 128B
# swizzle span) by 128 rows.
Q_MAP = TensorMapSpec(DataType.BFLOAT16, (128, 1000, 8, 2), (8 * 128 * 2, 128 * 2, 1000 * 8 * 128 * 2),
                      (64, 128, 1, 1), swizzle=Swizzle.B128)

# (what is changed, the field the refusal must name): one case per rule of cuTensorMapEncodeTiled.
REFUSED = [
    (dict(global_dims=(128,) * 6, global_strides=(256,) * 5, box_dims=(64,) * 6), "global_dims"),
    (dict(global_dims=(128, 1000, 8, 0)), "global_dims"),
    (dict(global_dims=(128, 1000, 8, 2**32 + 1)), "global_dims"),
    (dict(global_strides=(8 * 128 * 2 + 8, 256, 2048000)), "global_strides"),
    (dict(global_strides=(2**40, 256, 2048000)), "global_strides"),
    (dict(global_strides=(256, 256)), "global_strides"),
    (dict(box_dims=(64, 257, 1, 1)), "box_dims"),
    (dict(box_dims=(64, 0, 1, 1)), "box_dims"),
    (dict(box_dims=(68, 128, 1, 1), swizzle=Swizzle.NONE), "box_dims"),    # 136 bytes: not a multiple of 16
    (dict(box_dims=(128, 128, 1, 1)), "box_dims"),                         # 256 bytes > the 128B swizzle span
    (dict(box_dims=(32, 128, 1, 1), swizzle=Swizzle.B32, dtype=DataType.FLOAT32), "box_dims"),  # 128 B > 32
    (dict(element_strides=(1, 9, 1, 1)), "element_strides"),
    (dict(element_strides=(1, 1, 1)), "element_strides"),
    (dict(interleave=Interleave.B32, swizzle=Swizzle.B64, box_dims=(16, 128, 1, 1)), "swizzle"),
    (dict(oob_fill=OobFill.NAN_REQUEST_ZERO_FMA, dtype=DataType.INT32, box_dims=(32, 128, 1, 1)), "oob_fill"),
    (dict(swizzle=7), "swizzle"),
]
