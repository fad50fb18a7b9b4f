"""The TMA-into-wgmma micro-kernel (tests/emulate/kernels/tma_wgmma.cu): inputs, the expected C,
the emulated runner and the planted bugs, shared by tests/emulate/test_emulate_tma_wgmma.py, the
GPU's twin test (tests/gpu/test_gpu_tma_wgmma.py) and the mutation score (twin_mutants.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fagen.emulate import load_module, poison_
from fagen.kernels.tensor_map import Swizzle, TensorMapSpec
from twin_mutants import SCHEDULES, PlantedBug

KERNEL = Path(__file__).parents[1] / "emulate" / "kernels" / "tma_wgmma.cu"
SHARED = 1024 + 2 * 8192   # room to align the tiles to 1024 bytes


def inputs(seed: int = 0, device: str = "cpu"):
    """A and B: small integers in bf16, so that every product and sum is exact in fp32."""
    generator = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(-4, 5, (64, 64), generator=generator).to(torch.bfloat16) for _ in range(2))
    return a.to(device), b.to(device), poison_(torch.empty(64, 64)).to(device)


def expected(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.cpu().double() @ b.cpu().double().T


def maps(a: torch.Tensor, b: torch.Tensor, encode: str) -> list[bytes]:
    """The two tensor maps (box 64 x 64, 128B swizzle), `encode`: "emulated_bytes" or "driver_bytes"."""
    specs = [TensorMapSpec.of_tensor(t, (64, 64), swizzle=Swizzle.B128) for t in (a, b)]
    return [getattr(spec, encode)(t) for spec, t in zip(specs, (a, b))]


def kernel():
    """The kernel, loaded as FAGEN_EMULATE_RACECHECK says (load_module keeps each build loaded)."""
    return load_module(KERNEL.read_text()).get_function("tma_wgmma")


def outputs_correct(bug: int) -> bool:
    a, b, c = inputs()
    kernel()((1,), (128,), (*maps(a, b, "emulated_bytes"), c, np.int32(bug)), shared_mem=SHARED)
    return torch.equal(c.double(), expected(a, b))


PLANTED = [
    PlantedBug("TMA into wgmma", "the descriptors' swizzle (64B) differs from the maps' (128B)", 1, SCHEDULES),
    PlantedBug("TMA into wgmma", "the descriptors take CUtensorMapSwizzle's number for 128B (3: 32B)", 2,
               SCHEDULES),
    PlantedBug("TMA into wgmma", "the warpgroup does not wait for the tiles' mbarrier", 3, SCHEDULES),
    PlantedBug("TMA into wgmma", "the k-step is half of k16", 4, SCHEDULES),
    PlantedBug("TMA into wgmma", "LBO and SBO swapped", 5, SCHEDULES),
]
