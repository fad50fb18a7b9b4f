"""Checking a candidate's output and timing it.

Both are plain callables taking a Spec, so tests can inject fakes:

- `ReferenceCheck(spec, ...)(candidate) -> CheckOutcome`: runs the candidate on
  random inputs and holds its output to FlashAttention-2's rule against the
  float64 oracle: max |out - ref| <= 2 x (max error of the same-dtype PyTorch
  attention `fagen.reference.attention_same_dtype`) + 1e-5.
- `CudaEventTimer(spec, ...)(candidate) -> float`: median milliseconds of one
  forward call, measured with CUDA events on buffers rotated through at least
  twice the L2 cache.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..dtypes import TORCH_DTYPE
from ..kernels import attention_kernels
from ..kernels.render import source_for
from ..spec import Spec
from .device import cuda_index

TOLERANCE_FACTOR = 2.0      # FlashAttention-2's rule for the forward output
TOLERANCE_FLOOR = 1e-5      # absolute floor, for problems where PyTorch happens to be exact
CHECK_SEQLEN = 257          # > 2 tiles of 128 rows, and ragged, so tails are exercised
CHECK_SEQLEN_LONGER = 321   # the key length when keys outnumber queries
CHECK_DROPOUT_P = 0.17
CHECK_DROPOUT_SEED = 0x5EED_F00D

Runner = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class CheckOutcome:
    ok: bool
    error: float        # max abs error of the candidate vs the float64 reference
    tolerance: float

    def __bool__(self) -> bool:
        return self.ok

    @property
    def reason(self) -> str:
        return f"wrong output: max error {self.error:.3g} > tolerance {self.tolerance:.3g}"


def ops_runner(spec: Spec, q, k, v, **kwargs) -> torch.Tensor:
    """Render `spec` and run its forward kernel on q's device."""
    return attention_kernels.forward(source_for(spec), q, k, v, **kwargs)[0]


def check_shape(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """A small problem of the same kind as the tuned one (Nq vs Nk kept in order)."""
    if seqlen_q == seqlen_k:
        n = min(seqlen_q, CHECK_SEQLEN)
        return n, n
    if seqlen_q < seqlen_k:
        return min(seqlen_q, CHECK_SEQLEN), min(seqlen_k, CHECK_SEQLEN_LONGER)
    return min(seqlen_q, CHECK_SEQLEN_LONGER), min(seqlen_k, CHECK_SEQLEN)


def random_qkv(spec: Spec, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normal random q, k, v in flash-attn's layout (never zeros: zeros hide wrong indexing)."""
    dtype = TORCH_DTYPE[spec.dtype]

    def draw(n):
        return torch.randn(batch, n, heads, spec.head_dim, generator=generator, device=generator.device,
                           dtype=torch.float32).to(device=device, dtype=dtype)

    return draw(seqlen_q), draw(seqlen_k), draw(seqlen_k)


class ReferenceCheck:
    """Holds candidates of one spec family to the FlashAttention-2 tolerance rule.

    The inputs, the float64 reference and the tolerance are computed once;
    each call runs one candidate through `runner` (the real kernel by
    default; tests pass a fake) and compares.
    """

    def __init__(self, spec: Spec, *, seqlen_q: int, seqlen_k: int | None = None, device,
                 runner: Runner = ops_runner, seed: int = 0):
        from .. import reference
        from ..reference import dropout_keep_mask

        self.runner = runner
        self.device = torch.device(device)
        nq, nk = check_shape(seqlen_q, seqlen_q if seqlen_k is None else seqlen_k)
        batch, heads = (2 if spec.key_padding else 1), 2
        generator = torch.Generator().manual_seed(seed)
        self.q, self.k, self.v = random_qkv(spec, batch, heads, nq, nk, self.device, generator)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.seqlens_k = None
        if spec.key_padding:   # one full row of keys and one cut mid-tile
            self.seqlens_k = torch.tensor([nk, max(1, nk // 2 + 3)], dtype=torch.int32, device=self.device)
        self.dropout_p, keep_mask, self.dropout_args = 0.0, None, {}
        if spec.dropout:
            # The kernel replays Philox from (seed, offset); the reference
            # uses the same mask (DESIGN: "the reference uses the kernel's own mask").
            self.dropout_p = CHECK_DROPOUT_P
            self.dropout_args = {"seed": CHECK_DROPOUT_SEED + seed, "philox_offset": 0}
            keep_mask = dropout_keep_mask(self.dropout_args["seed"], 0, batch, heads, nq, nk, self.dropout_p)
        # The oracle runs on the CPU whatever the device: float64 matmuls on a
        # GPU are slow, and on some GPUs not IEEE-exact.
        ref, _ = reference.attention_forward(
            self.q.cpu(), self.k.cpu(), self.v.cpu(), softmax_scale=self.scale, causal=spec.causal,
            seqlens_k=None if self.seqlens_k is None else self.seqlens_k.cpu(),
            dropout_p=self.dropout_p, keep_mask=keep_mask)
        self.reference = ref
        dout = torch.randn(self.q.shape, generator=generator).to(self.q)   # the yardstick also runs backward
        baseline = reference.attention_same_dtype(
            self.q, self.k, self.v, dout, softmax_scale=self.scale, causal=spec.causal, seqlens_k=self.seqlens_k,
            dropout_p=self.dropout_p, keep_mask=None if keep_mask is None else keep_mask.to(self.device))[0]
        self.baseline_error = self._error(baseline)
        self.tolerance = TOLERANCE_FACTOR * self.baseline_error + TOLERANCE_FLOOR

    def _error(self, out: torch.Tensor) -> float:
        diff = (out.detach().to("cpu", torch.float64) - self.reference).abs()
        return float(diff.max()) if torch.isfinite(diff).all() else math.inf

    def __call__(self, spec: Spec) -> CheckOutcome:
        kwargs = {"softmax_scale": self.scale, "seqlens_k": self.seqlens_k, "dropout_p": self.dropout_p,
                  **self.dropout_args}
        out = self.runner(spec, self.q, self.k, self.v, **kwargs)
        if tuple(out.shape) != tuple(self.reference.shape):
            return CheckOutcome(False, math.inf, self.tolerance)
        error = self._error(out)
        return CheckOutcome(error <= self.tolerance, error, self.tolerance)


# -- timing ----------------------------------------------------------------

L2_MULTIPLE = 2        # rotate through at least twice the L2 cache
MEMORY_SHARE = 0.5     # of the free device memory, at most, for the rotated inputs
MAX_HOLD_SECONDS = 0.5


def rotation_sets(set_bytes: int, l2_bytes: int, free_bytes: int) -> int:
    """How many input sets to cycle through so that each call finds its inputs outside L2.

    At least two (consecutive calls never share inputs), enough to cover
    L2_MULTIPLE x the L2 size, but no more than MEMORY_SHARE of free memory
    allows (beyond two). The sets are views into one buffer, so even
    thousands of tiny ones cost a single allocation."""
    set_bytes = max(set_bytes, 1)
    wanted = math.ceil(L2_MULTIPLE * l2_bytes / set_bytes)
    affordable = int(MEMORY_SHARE * free_bytes // set_bytes)
    return max(2, min(wanted, affordable))


class CudaEventTimer:
    """Median milliseconds of one forward call of a candidate, on the tuned shape.

    - random normal inputs (zeros toggle fewer bits, draw less power and
      let the clocks run higher than they would on real data);
    - enough input sets that cycling through them touches at least twice the
      L2 cache, so every call reads its inputs from HBM as in a real model;
    - `warmup` calls first (module load, clocks, caches), then `repeats`
      calls each bracketed by CUDA events; the median resists stragglers.
    """

    def __init__(self, spec: Spec, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device,
                 warmup: int = 10, repeats: int = 100, seed: int = 0, runner: Runner = ops_runner):
        if not torch.cuda.is_available():
            raise RuntimeError("timing needs a CUDA GPU (torch.cuda.is_available() is False)")
        self.device = torch.device("cuda", cuda_index(device))
        self.warmup, self.repeats, self.runner = warmup, repeats, runner
        props = torch.cuda.get_device_properties(self.device)
        dtype = TORCH_DTYPE[spec.dtype]
        self.shapes = [(batch, n, heads, spec.head_dim) for n in (seqlen_q, seqlen_k, seqlen_k)]  # q, k, v
        self.set_elements = sum(math.prod(shape) for shape in self.shapes)
        self.set_count = rotation_sets(self.set_elements * torch.finfo(dtype).bits // 8,
                                       getattr(props, "L2_cache_size", 0), torch.cuda.mem_get_info(self.device)[0])
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.pool = torch.randn(self.set_count * self.set_elements, generator=generator, device=self.device,
                                dtype=dtype)
        self.kwargs = {"dropout_p": CHECK_DROPOUT_P, "seed": seed, "philox_offset": 0} if spec.dropout else {}
        if spec.key_padding:   # random lengths, most of them long, like a padded batch
            lengths = torch.randint(max(1, seqlen_k // 2), seqlen_k + 1, (batch,), generator=generator,
                                    device=self.device)
            self.kwargs["seqlens_k"] = lengths.to(torch.int32)

    def __call__(self, spec: Spec) -> float:
        def call(i: int):
            self.runner(spec, *self.inputs(i), **self.kwargs)

        with torch.cuda.device(self.device):
            for i in range(self.warmup):
                call(i)
            torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
            self._hold_gpu(call)
            for i in range(self.repeats):
                starts[i].record()
                call(self.warmup + i)
                ends[i].record()
            torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

    def inputs(self, i: int) -> list[torch.Tensor]:
        """q, k, v of input set i (mod the set count): contiguous views into the pool."""
        offset = (i % self.set_count) * self.set_elements
        views = []
        for shape in self.shapes:
            size = math.prod(shape)
            views.append(self.pool[offset:offset + size].view(shape))
            offset += size
        return views

    def _hold_gpu(self, call) -> None:
        """Keep the GPU busy while Python queues the timed calls.

        Without this, a short kernel's events would also measure the host's
        launch overhead; with the stream held, all launches are queued
        before the first event fires. The hold is sized from one call's
        host time, times the repeat count, with a 2x margin."""
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return
        start = time.perf_counter()
        call(0)
        host_seconds = time.perf_counter() - start
        cycles_per_second = 2e9   # about the highest SM clock: the hold errs long, never short
        sleep(int(min(MAX_HOLD_SECONDS, 2 * host_seconds * self.repeats) * cycles_per_second))
