"""The prototype Hopper backward micro-kernel (tests/emulate/kernels/hopper_backward.cu): inputs, the
host-side preprocess (L in log2 units, D = rowsum(dO o O)), tensor maps, the launch, dq's scaling and
the check against the float64 oracle, shared by the emulator's test
(tests/emulate/test_emulate_hopper_backward.py) and the GPU's (tests/gpu/test_gpu_hopper_backward.py),
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
from fagen.reference import attention_backward, attention_forward, attention_same_dtype

KERNEL = Path(__file__).parents[1] / "emulate" / "kernels" / "hopper_backward.cu"
HEAD_DIM, BLOCK_M, BLOCK_N, THREADS = 64, 64, 128, 384
# Alignment slack, K and V, two stages of Q and dO, dS^T and dQ's fp32 partial per consumer, two
# stages of L and D (the kernel's kShared + 1024).
SHARED = 1024 + 2 * 128 * 128 + 2 * 2 * 64 * 128 + 2 * 64 * 128 + 2 * 64 * 64 * 4 + 2 * 2 * 64 * 4
TAIL = BLOCK_N   # rows of poison past dk and dv, where a store of a key past Nk would land
# FlashAttention-2's rule for gradients (tests/support/kernel_cases.py): each gradient's error against
# the float64 oracle at most 3x a same-dtype PyTorch implementation's, with the suite's absolute floor.
GRAD_FACTOR, ABS_FLOOR = 3.0, 1e-5
LOG2E = 1.4426950408889634


def inputs(batch: int, nq: int, nk: int, heads: int, dtype: str, seed: int = 0):
    """q, dO (B, Nq, H, 64), k and v (B, Nk, H, 64): standard normal, in `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, n, heads, HEAD_DIM, generator=generator).to(TORCH_DTYPE[dtype])
                     for n in (nq, nk, nk, nq))
    return q, k, v, dout


def padded(nq: int) -> int:
    return math.ceil(nq / BLOCK_M) * BLOCK_M


def preprocess(q, k, v, dout, causal: bool):
    """What the forward and the backward's preprocess hand the main kernel: O from the float64
    oracle rounded to the inputs' dtype (as a forward kernel stores it), lse_log2 = lse log2(e)
    and delta = rowsum(dO o O), both fp32 (B, H, Nq_pad), the padding zero. Returns
    (out, lse_log2, delta)."""
    batch, nq, heads, _ = q.shape
    out, lse = attention_forward(q.cpu(), k.cpu(), v.cpu(), causal=causal)
    out = out.to(q.dtype)
    delta = (dout.cpu().double() * out.double()).sum(-1).transpose(1, 2)   # (B, H, Nq)
    lse_log2 = torch.zeros(batch, heads, padded(nq), dtype=torch.float32)
    delta_pad = torch.zeros(batch, heads, padded(nq), dtype=torch.float32)
    lse_log2[..., :nq] = (lse * LOG2E).float()    # +inf on rows that see no key: the kernel masks them
    delta_pad[..., :nq] = delta.float()
    return out, lse_log2, delta_pad


def maps(q, k, v, dout, lse_log2, delta, encode: str) -> list[bytes]:
    """Q and dO: box (1, 64 rows, 1, 64) with the 128B swizzle; K and V: (1, 128 rows, 1, 64);
    L and D: (1, 1, 64) of (B, H, Nq_pad) fp32, unswizzled. `encode`: "emulated_bytes" or
    "driver_bytes"."""
    tiles = [TensorMapSpec.of_tensor(t, (1, rows, 1, HEAD_DIM), swizzle=Swizzle.B128)
             for t, rows in ((q, BLOCK_M), (k, BLOCK_N), (v, BLOCK_N), (dout, BLOCK_M))]
    rows = [TensorMapSpec.of_tensor(t, (1, 1, BLOCK_M)) for t in (lse_log2, delta)]
    return [getattr(spec, encode)(t) for spec, t in zip(tiles + rows, (q, k, v, dout, lse_log2, delta))]


@functools.lru_cache(maxsize=4)
def module(racecheck: bool = False, source: str | None = None):
    return load_module(KERNEL.read_text() if source is None else source, racecheck=racecheck)


def launch(kernel, q, k, v, dout, lse_log2, delta, causal: bool, encode: str):
    """(dq, dk, dv) of one launch of `kernel` (a RawKernel-style callable) on tensors where they
    live: dk, dv are views of poisoned buffers TAIL rows longer, whose tails must stay poisoned
    (keys past Nk are not to be stored); dq = scale dq_accum[:, :, :Nq], cast to the dtype
    (the production path's convert kernel), in q's (B, Nq, H, 64) layout."""
    batch, nq, heads, _ = q.shape
    nk = k.shape[1]
    scale = 1 / math.sqrt(HEAD_DIM)
    buffers = [poison_(torch.empty(k.numel() + TAIL * heads * HEAD_DIM, dtype=k.dtype, device=k.device))
               for _ in range(2)]
    dk, dv = (buffer[:k.numel()].view(k.shape) for buffer in buffers)
    dq_accum = torch.zeros(batch, heads, padded(nq), HEAD_DIM, dtype=torch.float32, device=q.device)
    grid = (math.ceil(nk / BLOCK_N), heads, batch)
    kernel(grid, (THREADS,), (*maps(q, k, v, dout, lse_log2, delta, encode), dk, dv, dq_accum, np.int32(nq),
                              np.int32(nk), np.int32(heads), np.int32(int(causal)), np.float32(scale)),
           shared_mem=SHARED)
    for buffer in buffers:
        assert unwritten_mask(buffer[k.numel():].cpu()).all(), "a key past Nk was stored"
    dq_accum = dq_accum.cpu()
    assert (dq_accum[:, :, nq:] == 0).all(), "a query row past Nq received a nonzero dQ"
    dq = (dq_accum[:, :, :nq] * scale).to(q.dtype).transpose(1, 2).contiguous()
    return dq, dk.cpu(), dv.cpu()


def run(kernel, batch: int, nq: int, nk: int, heads: int, dtype: str, causal: bool, *, seed: int = 0,
        encode: str = "emulated_bytes", device: str = "cpu"):
    """Inputs, preprocess and one launch; returns ((q, k, v, dout), (dq, dk, dv)) on the CPU."""
    q, k, v, dout = inputs(batch, nq, nk, heads, dtype, seed)
    _, lse_log2, delta = preprocess(q, k, v, dout, causal)
    on = [t.to(device) for t in (q, k, v, dout, lse_log2, delta)]
    return (q, k, v, dout), launch(kernel, *on, causal, encode)


def run_emulated(batch: int, nq: int, nk: int, heads: int, dtype: str = "bf16", causal: bool = False, *,
                 racecheck: bool = False, seed: int = 0):
    kernel = module(racecheck).get_function(f"hopper_backward_{dtype}")
    return run(kernel, batch, nq, nk, heads, dtype, causal, seed=seed)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check(q, k, v, dout, dq, dk, dv, causal: bool) -> dict:
    """Assert FlashAttention-2's rule on dQ, dK and dV; returns {name: (error, PyTorch's error)}."""
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_written(t, name)
    q, k, v, dout = (t.cpu() for t in (q, k, v, dout))
    ref_out, _ = attention_forward(q, k, v, causal=causal)
    refs = attention_backward(q, k, v, ref_out, dout, causal=causal)
    pytorch = attention_same_dtype(q, k, v, dout, causal=causal)[1:]
    errors = {}
    for name, got, ref, pt in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, pytorch):
        errors[name] = (max_error(got, ref), max_error(pt, ref))
    for name, (kernel_err, torch_err) in errors.items():
        assert kernel_err <= GRAD_FACTOR * torch_err + ABS_FLOOR, (
            f"{name} error {kernel_err:.3g} exceeds {GRAD_FACTOR}x PyTorch's {torch_err:.3g}: {errors}")
    return errors


# Planted bugs, as edits of the kernel's text: (old, new), or a list of them applied in turn. Each
# must give wrong data or a fault under at least one of SCHEDULES, most under racecheck only where
# said (tests/emulate/test_emulate_hopper_backward.py). CAUSAL_MUTANTS run the causal kernel.
# Not here: deleting the tail masks (key < nk, query < nq) is an equivalent mutant, as TMA's zero
# fill makes K, dO past the tensors zero: a key past Nk adds dS K = 0 to dQ and is not stored; a
# query past Nq has dP = 0 and D = 0, so dS = 0, and P^T dO = 0.
SCHEDULES = ("forward", "producer-first", "consumer-first", "random")
RELEASE = "    __syncwarp();\n    if (fagen::elect_one_sync()) fagen::mbarrier_arrive(&bars->empty[s]);"
MUTANTS = {
    "no wait_group.read before the dQ tile is rewritten": ("    if (t == 0) fagen::bulk_wait_group_read<0>();\n", ""),
    "no wait on full": (
        "fagen::mbarrier_wait_parity(&bars->full[s], static_cast<uint32_t>(it / kStages) & 1);", ""),
    "full parity flipped": ("static_cast<uint32_t>(it / kStages) & 1);",
                            "(static_cast<uint32_t>(it / kStages) & 1) ^ 1);"),
    "no wait on empty": ("fagen::mbarrier_wait_parity(&bars->empty[s], (round & 1) ^ 1);", ""),
    "no wait on K and V": ("fagen::mbarrier_wait_parity(&bars->kv_full, 0);", ""),
    "no arrive on empty": ("    if (fagen::elect_one_sync()) fagen::mbarrier_arrive(&bars->empty[s]);", ""),
    "stage released before dK and dV's wgmma retire": [
        (RELEASE, ""),
        ("    fagen::wgmma_commit();\n    fagen::wgmma_fence_fragments<4>(pa);",
         "    fagen::wgmma_commit();\n" + RELEASE + "\n    fagen::wgmma_fence_fragments<4>(pa);")],
    "no barrier before dQ's wgmma reads dS": (
        "    fagen::fence_proxy_async_shared();\n    fagen::named_barrier_sync(sync_id, 128);\n    // dQ_i",
        "    // dQ_i"),
    "no fence.proxy.async before the bulk reduction": (
        "    fagen::fence_proxy_async_shared();   // the tile's stores", "    // the tile's stores"),
    "no barrier before the bulk reduction": (
        "    fagen::named_barrier_sync(sync_id, 128);\n    if (t == 0) {", "    if (t == 0) {"),
    "dS^T's fragment transposed": (
        "const uint32_t key = 16 * warp + g + 8 * (r % 2), query = 16 * kk + 8 * (r / 2) + 2 * quad;",
        "const uint32_t query = 16 * warp + g + 8 * (r % 2), key = 16 * kk + 8 * (r / 2) + 2 * quad;"),
    "L read from the wrong row": ("lse_log2[col]", "lse_log2[col ^ 1]"),
    "D read from the wrong row": ("delta[col])", "delta[col ^ 8])"),
    "dQ's A read K-major": ("fagen::wgmma_ss<64, kBf16, 1, 1>", "fagen::wgmma_ss<64, kBf16, 0, 1>"),
    "dK not scaled": ("pack2<T>(dk[i] * scale, dk[i + 1] * scale)", "pack2<T>(dk[i], dk[i + 1])"),
    "keys past Nk stored": ("if (key >= nk) continue;", "if (key >= nk + 64) continue;"),
    "no causal mask": ("(!causal || key <= query + nk - nq)", "true"),
    "causal walk starts a block late": ("row / kBlockM);", "row / kBlockM + 1);"),
}
CAUSAL_MUTANTS = {"no causal mask", "causal walk starts a block late"}


def mutant_source(mutant: str) -> str:
    edits = MUTANTS[mutant]
    source = KERNEL.read_text()
    for old, new in edits if isinstance(edits, list) else [edits]:
        assert source.count(old) == 1, f"the mutant {mutant!r} no longer matches the kernel"
        source = source.replace(old, new)
    return source


def catching_schedules(mutant: str, schedules=SCHEDULES, *, racecheck: bool = False,
                       shape=(1, 200, 200, 1)) -> list[str]:
    """The schedules under which the kernel with `mutant` planted gives wrong data or a fault
    (bf16, `shape` = (B, Nq, Nk, H): two key blocks, four query blocks, ragged both ways; causal
    for CAUSAL_MUTANTS)."""
    import os
    from unittest import mock

    kernel = load_module(mutant_source(mutant), racecheck=racecheck).get_function("hopper_backward_bf16")
    causal = mutant in CAUSAL_MUTANTS
    caught = []
    for schedule in schedules:
        with mock.patch.dict(os.environ, {"FAGEN_EMULATE_SCHEDULE": schedule}):
            try:
                inputs, grads = run(kernel, *shape, "bf16", causal)
                check(*inputs, *grads, causal)
            except (AssertionError, EmulationError):
                caught.append(schedule)
    return caught
