"""Timing on the GPU, and the time budget that keeps the whole run bounded.

Measurements use CUDA events recorded on torch's current stream around each
call, after a warm-up, and report the median: the GPU runs asynchronously, so
host clocks would time the launch, not the work. Each call gets its own pair
of events so a slow first repeat (clock ramp-up) cannot skew an average.

The budget is the time guard: every section asks it for a deadline that
leaves room for the sections after it, and loops check `expired()` before
each measurement, so a slow section is cut short (with a note) instead of
eating the time the report needs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


class Budget:
    """Wall-clock budget of the whole run, with per-section deadlines."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic):
        self.total_s = float(total_s)
        self._clock = clock
        self.start = clock()

    def now(self) -> float:
        return self._clock()

    def elapsed(self) -> float:
        return self.now() - self.start

    def remaining(self) -> float:
        return self.total_s - self.elapsed()

    def deadline(self, *, reserve_s: float = 0.0, cap_s: float | None = None) -> "Deadline":
        """A deadline for the next section: at most `cap_s` from now, and no
        later than the end of the budget minus `reserve_s` (kept for the
        sections that follow)."""
        end = self.start + self.total_s - reserve_s
        if cap_s is not None:
            end = min(end, self.now() + cap_s)
        return Deadline(end, self._clock)


class Deadline:
    def __init__(self, end: float, clock: Callable[[], float] = time.monotonic):
        self.end = end
        self._clock = clock

    def remaining(self) -> float:
        return self.end - self._clock()

    def expired(self, need_s: float = 0.0) -> bool:
        """True when less than `need_s` seconds are left."""
        return self.remaining() <= need_s


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    host_ms: float  # wall time per call on the host: >= median_ms means host-bound

    def to_dict(self) -> dict:
        return {"ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "repeats": self.repeats, "host_ms": self.host_ms}


def repeats_for(estimate_ms: float, *, target_ms: float, min_repeats: int, max_repeats: int) -> int:
    """Enough repeats for about `target_ms` of GPU time, within [min, max]."""
    if estimate_ms <= 0:
        return max_repeats
    return int(min(max_repeats, max(min_repeats, round(target_ms / estimate_ms))))


def time_cuda(fn: Callable[[], object], *, warmup: int = 1, min_repeats: int = 3,
              max_repeats: int = 20, target_ms: float = 30.0) -> Timing:
    """Median GPU time of `fn()` in milliseconds, measured with CUDA events."""
    import torch

    for _ in range(max(0, warmup - 1)):
        fn()
    # The last warm-up call is timed to size the repeat count, so tiny
    # problems get many repeats and 100 ms problems only a few (its time is
    # not in the median: it may include a lazy compile or allocation).
    sizing_start, sizing_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    sizing_start.record()
    fn()
    sizing_end.record()
    sizing_end.synchronize()
    repeats = repeats_for(sizing_start.elapsed_time(sizing_end), target_ms=target_ms,
                          min_repeats=min_repeats, max_repeats=max_repeats)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    host_start = time.perf_counter()
    for start, end in events:
        start.record()
        fn()
        end.record()
    host_ms = (time.perf_counter() - host_start) * 1e3 / repeats
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return Timing(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                  repeats=repeats, host_ms=host_ms)


# -- the machine's ceilings, measured in the same run ---------------------------

def measure_matmul_peak(size: int = 8192, dtype_name: str = "bfloat16", repeats: int = 10) -> dict:
    """TFLOP/s of one large torch.matmul on random data (zeros run faster on
    tensor cores and would overstate the ceiling)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    timing = time_cuda(lambda: a @ b, warmup=3, min_repeats=repeats, max_repeats=repeats)
    flops = 2.0 * size ** 3
    return {"what": f"torch.matmul {size}x{size}x{size} {dtype_name}", "ms": timing.median_ms,
            "tflops": flops / (timing.median_ms * 1e-3) / 1e12, "repeats": timing.repeats}


def measure_copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> dict:
    """Device-to-device copy in TB/s, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    timing = time_cuda(lambda: dst.copy_(src), warmup=2, min_repeats=repeats, max_repeats=repeats)
    return {"what": f"device copy of {nbytes / 2**30:.0f} GiB", "ms": timing.median_ms,
            "tb_per_s": 2 * nbytes / (timing.median_ms * 1e-3) / 1e12}
