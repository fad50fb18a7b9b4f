"""The prototype Hopper forward micro-kernel (tests/emulate/kernels/hopper_forward.cu): inputs, tensor
maps, the launch and the check against the float64 oracle, shared by the emulator's test
(tests/emulate/test_emulate_hopper_forward.py) and the GPU's (tests/gpu/test_gpu_hopper_forward.py),
so the twin and the hardware run the same kernel on the same inputs against the same rule."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch

from fagen.dtypes import TORCH_DTYPE
from fagen.emulate import EmulationError, assert_written, load_module, poison_, unwritten_mask
from fagen.kernels.tensor_map import Swizzle, TensorMapSpec
from fagen.reference import attention_forward, attention_same_dtype

KERNEL = Path(__file__).parents[1] / "emulate" / "kernels" / "hopper_forward.cu"
HEAD_DIM, BLOCK_M, BLOCK_N, THREADS = 128, 128, 128, 384
SHARED = 1024 + 128 * 128 * 2 * (1 + 2 * 2)   # alignment slack, Q, two stages of K and V
TAIL = BLOCK_M   # rows of poison past the outputs, where a store of a row past Nq would land
# FlashAttention-2's rule (DESIGN.md "Numerics"): the output's error against the float64 oracle at
# most twice a same-dtype PyTorch implementation's, with the suite's absolute floor
# (tests/support/kernel_cases.py); L within the suite's 1e-3 of the oracle's logsumexp.
OUTPUT_FACTOR, ABS_FLOOR, LSE_TOLERANCE = 2.0, 1e-5, 1e-3


def inputs(batch: int, nq: int, nk: int, heads: int, dtype: str, seed: int = 0):
    """q (B, Nq, H, 128), k and v (B, Nk, H, 128): standard normal, in `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, heads, HEAD_DIM, generator=generator).to(TORCH_DTYPE[dtype])
            for n in (nq, nk, nk)]


def maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, encode: str) -> list[bytes]:
    """One map per operand, box (1, 128 rows, 1, 64 columns) with the 128B swizzle: a 128-column
    tile is two boxes. `encode`: "emulated_bytes" or "driver_bytes"."""
    return [getattr(TensorMapSpec.of_tensor(t, (1, 128, 1, 64), swizzle=Swizzle.B128), encode)(t)
            for t in (q, k, v)]


@functools.lru_cache(maxsize=1)
def module():
    return load_module(KERNEL.read_text())


def launch(kernel, q, k, v, encode: str):
    """(out, lse) of one launch of `kernel` (a RawKernel-style callable) on q, k, v where they live.
    out and lse are views of poisoned buffers TAIL elements longer, and the tails must stay
    poisoned: rows past Nq are not to be stored."""
    batch, nq, heads, _ = q.shape
    nk = k.shape[1]
    out_buffer = poison_(torch.empty(q.numel() + TAIL * heads * HEAD_DIM, dtype=q.dtype, device=q.device))
    lse_buffer = poison_(torch.empty(batch * heads * nq + TAIL, device=q.device))
    out, lse = out_buffer[:q.numel()].view(q.shape), lse_buffer[:batch * heads * nq].view(batch, heads, nq)
    grid = (math.ceil(nq / BLOCK_M), heads, batch)
    kernel(grid, (THREADS,), (*maps(q, k, v, encode), out, lse, np.int32(nq), np.int32(nk), np.int32(heads),
                              np.float32(1 / math.sqrt(HEAD_DIM))), shared_mem=SHARED)
    out_tail, lse_tail = out_buffer[q.numel():].cpu(), lse_buffer[batch * heads * nq:].cpu()
    assert unwritten_mask(out_tail).all() and unwritten_mask(lse_tail).all(), "a row past Nq was stored"
    return out.cpu(), lse.cpu()


def run_emulated(batch: int, nq: int, nk: int, heads: int, dtype: str = "bf16"):
    q, k, v = inputs(batch, nq, nk, heads, dtype)
    out, lse = launch(module().get_function(f"hopper_forward_{dtype}"), q, k, v, "emulated_bytes")
    return (q, k, v), out, lse


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def check(q, k, v, out, lse) -> dict:
    """Assert FlashAttention-2's rule on O and the tolerance on L; returns the errors."""
    assert_written(out, "out")
    assert_written(lse, "lse")
    q, k, v = (t.cpu() for t in (q, k, v))
    ref_out, ref_lse = attention_forward(q, k, v)
    pt_out = attention_same_dtype(q, k, v, torch.zeros_like(q))[0]
    errors = {"out": max_error(out, ref_out), "pytorch_out": max_error(pt_out, ref_out),
              "lse": max_error(lse, ref_lse)}
    assert errors["out"] <= OUTPUT_FACTOR * errors["pytorch_out"] + ABS_FLOOR, errors
    assert errors["lse"] < LSE_TOLERANCE, errors
    return errors


# Planted bugs, as edits of the kernel's text (old, new): each must give wrong data or a fault under
# at least one of SCHEDULES (consumer-first, whose consumers run ahead of the producer, misses the
# two stage-release bugs: no refill can overtake a consumer there).
SCHEDULES = ("forward", "producer-first", "consumer-first", "random")
MUTANTS = {
    "no tail mask": ("if ((j + 1) * kBlockN > nk) mask_tail(p, nk - j * kBlockN, quad);", ""),
    "full parity flipped": ("static_cast<uint32_t>(j / kStages) & 1);",
                            "(static_cast<uint32_t>(j / kStages) & 1) ^ 1);"),
    "no wait on full": ("fagen::mbarrier_wait_parity(&bars->full[s], static_cast<uint32_t>(j / kStages) & 1);", ""),
    "no wait on empty": ("fagen::mbarrier_wait_parity(&bars->empty[s], (round & 1) ^ 1);", ""),
    "stage released before P V": (
        "    accumulate_pv<kBf16>(o, a, advance(v_desc, stage));\n    __syncwarp();\n"
        "    if (fagen::elect_one_sync()) fagen::mbarrier_arrive(&bars->empty[s]);",
        "    __syncwarp();\n    if (fagen::elect_one_sync()) fagen::mbarrier_arrive(&bars->empty[s]);\n"
        "    accumulate_pv<kBf16>(o, a, advance(v_desc, stage));"),
    "rows past Nq stored": ("if (row >= nq) continue;", "if (row >= nq + 64) continue;"),
    "A registers out of order": ("pack2<T>(p[8 * kk + 2 * r], p[8 * kk + 2 * r + 1])",
                                 "pack2<T>(p[8 * kk + 2 * (r ^ 1)], p[8 * kk + 2 * (r ^ 1) + 1])"),
    "V read K-major": ("fagen::wgmma_rs<kHeadDim, kBf16, 1>", "fagen::wgmma_rs<kHeadDim, kBf16, 0>"),
    "V's LBO half a box": ("kTileBytes, kHalfBytes, 1024,", "kTileBytes, kHalfBytes / 2, 1024,"),
    "O not rescaled": ("    rescale_output(o, rescale);\n", ""),
    "S's k-steps stay in the first box": ("const uint32_t step = (kk / 4) * kHalfBytes + (kk % 4) * 32;",
                                          "const uint32_t step = (kk % 4) * 32;"),
    "expect_tx one box short": ("fagen::mbarrier_arrive_expect_tx(&bars->full[s], 2 * kTileBytes);",
                                "fagen::mbarrier_arrive_expect_tx(&bars->full[s], 2 * kTileBytes - kHalfBytes);"),
}


def catching_schedules(mutant: str, schedules=SCHEDULES) -> list[str]:
    """The schedules under which the kernel with `mutant` planted gives wrong data or a fault
    (B=2, Nq=200, Nk=300, H=2, bf16)."""
    import os
    from unittest import mock

    old, new = MUTANTS[mutant]
    source = KERNEL.read_text()
    assert source.count(old) == 1, f"the mutant {mutant!r} no longer matches the kernel"
    kernel = load_module(source.replace(old, new)).get_function("hopper_forward_bf16")
    caught = []
    for schedule in schedules:
        with mock.patch.dict(os.environ, {"FAGEN_EMULATE_SCHEDULE": schedule}):
            q, k, v = inputs(2, 200, 300, 2, "bf16")
            try:
                check(q, k, v, *launch(kernel, q, k, v, "emulated_bytes"))
            except (AssertionError, EmulationError):
                caught.append(schedule)
    return caught
