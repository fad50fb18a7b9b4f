"""Stand-ins the GPU check's CPU tests share: a frozen clock and its deadlines, the run's time guard
on it, systems that compute attention exactly (or fail on purpose), and a timer that runs the call
once and reports 2 ms."""

import importlib.util
from pathlib import Path

import pytest
import torch

from fagen.bench.measure import torch_attention
from fagen.bench.peers import System
from fagen.bench.plan import SECTIONS
from fagen.bench.schedule import replay
from fagen.bench.timing import Deadline, Timing


REPO = Path(__file__).resolve().parents[2]


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts are no package): their contract tests call
    its functions without running its main."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeClock:
    """A clock that moves only when told to: no budget or deadline test reads the wall clock."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def open_deadline():
    return Deadline(float("inf"), clock=FakeClock())


def passed_deadline():
    return Deadline(0.0, clock=FakeClock(1.0))


def reserving_run(plan, tmp_path, skip=(), clock=None):
    """The run's time guard on a frozen clock."""
    from fagen.bench.gpu_check import _Run

    return _Run(plan, tmp_path, set(skip), log=lambda line: None, clock=clock or FakeClock())


def assert_reserved(plan, tmp_path, section: str, before: str, reserve: float) -> None:
    """While `before` runs, `reserve` seconds are kept for `section` and the sections after it:
    one second short of that, `before` has one second left. Skipping `section` gives its cap to the
    speed sweep (the one section without a cap of its own). The clock is frozen: exact."""
    clock = FakeClock()
    run, skipped = reserving_run(plan, tmp_path, clock=clock), reserving_run(plan, tmp_path, {section}, clock=clock)
    clock.now += plan.budget_s - reserve - 1.0
    assert run.deadline(before).remaining() == 1.0
    assert skipped.needs()[section] == 0.0
    assert skipped.deadline("speed").remaining() == run.deadline("speed").remaining() + run.needs()[section]


def sum_without_the_sweep(plan):
    estimate = replay(plan, sanitizers=True)
    assert estimate["total"] == pytest.approx(sum(v for k, v in estimate.items() if k in SECTIONS))
    return estimate["total"] - estimate["speed"]


class Exact(System):
    """A fagen stand-in: fp32 attention rounded to the input dtype."""

    def __init__(self, name="fagen_v2", is_fagen=True, scale=1.0):
        self.name, self.is_fagen, self.scale, self.calls = name, is_fagen, scale, 0

    def forward(self, q, k, v, causal):
        self.calls += 1
        return (torch_attention(q, k, v, causal, torch.float32) * self.scale).to(q.dtype)


class Raises(System):
    name = "sdpa_flash"

    def __init__(self):
        self.calls = 0

    def forward(self, q, k, v, causal):
        self.calls += 1
        raise RuntimeError("no kernel image is available for execution on the device")


class NoBackward(Exact):
    def forward(self, q, k, v, causal):
        return super().forward(q, k, v, causal).detach()


class OutOfMemoryAbove(Exact):
    def __init__(self, limit):
        super().__init__("sdpa_math", is_fagen=False)
        self.limit = limit

    def forward(self, q, k, v, causal):
        if q.shape[1] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return super().forward(q, k, v, causal)


class Unavailable(Exact):
    def __init__(self):
        super().__init__("flex", is_fagen=False)

    def unavailable_reason(self):
        return "triton is not installed"


def fake_timer(fn, **kwargs):
    fn()  # run the real code path once (autograd included)
    return Timing(median_ms=2.0, min_ms=1.9, max_ms=2.2, repeats=3, host_ms=0.1)
