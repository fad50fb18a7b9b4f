"""What fagen knows of each GPU architecture without a GPU: the largest shared memory a thread
block may opt in to, the arch names' base forms, and the archs built by default."""

from __future__ import annotations

import re

# Largest shared memory one thread block may opt in to, per arch: the CUDA C++
# Programming Guide's "Technical Specifications per Compute Capability" table
# (shared memory per SM less the 1 KB the driver reserves per block). Every
# sm_80-or-newer target NVRTC 12.9 or 13.x accepts is listed, except sm_107,
# whose limit the guide does not give (on such a GPU the driver's reported
# limit is used, see `launch`). sm_101 is NVRTC 12.9's name for what CUDA 13
# calls sm_110. Arch-specific targets (sm_90a, sm_100a, sm_100f, ...) share
# their base arch's entry.
SMEM_LIMIT_BYTES = {
    "sm_80": 166912,    # A100: 163 KB
    "sm_86": 101376,    # RTX 30xx, A40: 99 KB
    "sm_87": 166912,    # Jetson Orin: 163 KB
    "sm_88": 101376,    # 99 KB, as sm_86
    "sm_89": 101376,    # RTX 40xx, L4, L40: 99 KB
    "sm_90": 232448,    # H100, H200: 227 KB
    "sm_100": 232448,   # B200: 227 KB
    "sm_101": 232448,   # CUDA 12.9's name for sm_110
    "sm_103": 232448,   # B300: 227 KB
    "sm_110": 232448,   # Jetson Thor: 227 KB
    "sm_120": 101376,   # RTX 50xx, RTX PRO Blackwell: 99 KB
    "sm_121": 101376,   # DGX Spark: 99 KB
}
DEFAULT_ARCHS = ("sm_80", "sm_90")


def base_arch(arch: str) -> str:
    """The table's name for a target: `sm_90a` -> `sm_90`, `sm_100f` -> `sm_100`,
    `compute_90` (a PTX target) -> `sm_90`."""
    match = re.fullmatch(r"(?:sm|compute)_(\d+)[af]?", arch)
    return f"sm_{match.group(1)}" if match else arch


def smem_limit(arch: str) -> int:
    base = base_arch(arch)
    if base not in SMEM_LIMIT_BYTES:
        known = ", ".join(SMEM_LIMIT_BYTES)
        raise ValueError(f"unknown arch {arch!r}; known archs: {known} (fagen's kernels need sm_80 "
                         f"or newer; arch-specific forms such as sm_90a are accepted too)")
    return SMEM_LIMIT_BYTES[base]
