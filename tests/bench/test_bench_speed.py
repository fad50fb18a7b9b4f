"""The speed section on the CPU with stand-in systems: failing soft, the sanity check, the time guard,
the too-slow cut and a lost CUDA context."""


import dataclasses
import os

import pytest
import torch

from fagen.arch_families import ARCH_FAMILY_ENV
from fagen.bench.measure import GUARD_REASON
from fagen.bench.peers import failure_reason, make_system
from fagen.bench.plan import Plan
from fagen.bench.speed.config import FORWARD_ONLY
from fagen.bench.speed.run import run_speed_sweep
from fagen.bench.timing import Timing

from bench_stand_ins import (Exact, NoBackward, OutOfMemoryAbove, Raises, Unavailable, fake_timer, open_deadline,
                             passed_deadline)


TINY = Plan(name="tiny", dtypes=("bf16",), head_dims=(16,), causal=(False,), seqlens=(32, 64, 128),
            tokens_per_batch=128, hidden_dim=32, sanity_shape=(1, 48, 2))


def sweep(systems, deadline=None):
    return run_speed_sweep(TINY, systems, deadline or open_deadline(), device="cpu",
                           timer=fake_timer, log=lambda line: None)


def cell(section, system, pass_, seqlen):
    point = next(p for p in section["points"] if p["pass"] == pass_ and p["seqlen"] == seqlen)
    return point["results"][system]


def test_a_peer_that_raises_is_recorded_as_skipped_with_its_reason():
    good, bad = Exact(), Raises()
    section = sweep([good, bad, NoBackward("fagen_v1"), OutOfMemoryAbove(64), Unavailable()])
    assert section["status"] == "ok"
    # Every cell of the good system ran and its rate is flops / 2 ms.
    for point in section["points"]:
        assert point["results"]["fagen_v2"]["tflops"] == pytest.approx(point["flops"] / 2e-3 / 1e12)
    first = cell(section, "sdpa_flash", "bwd", 32)["skipped"]
    assert first == "RuntimeError: no kernel image is available for execution on the device"
    # Sticky for the rest of the panel: the failing forward is not retried.
    assert cell(section, "sdpa_flash", "fwd", 128)["skipped"].endswith("(as at N=32)")
    assert bad.calls == 1
    # A system without autograd keeps its forward number and skips the rest.
    assert "tflops" in cell(section, "fagen_v1", "fwd", 64)
    assert "has no backward" in cell(section, "fagen_v1", "bwd", 64)["skipped"]
    # Out of memory at one length skips the longer ones.
    assert "tflops" in cell(section, "sdpa_math", "fwd_bwd", 64)
    assert cell(section, "sdpa_math", "fwd", 128)["skipped"] == "OOM"
    assert section["systems"]["flex"] == {"label": "FlexAttention", "available": False,
                                         "reason": "triton is not installed"}
    assert cell(section, "flex", "fwd", 32)["skipped"] == "not available: triton is not installed"


def test_sanity_flags_a_fast_but_wrong_fagen_kernel():
    section = sweep([Exact("fagen_v2"), Exact("fagen_v1", scale=1.05)])
    label = TINY.configs()[0].label
    right, wrong = section["sanity"]["fagen_v2"][label], section["sanity"]["fagen_v1"][label]
    assert right["ok"] and right["fwd_err"] <= right["fwd_torch_err"] * 2 + 1e-4 and "dq_err" in right
    assert not wrong["ok"]


def test_time_guard_stops_the_sweep_and_says_so():
    good = Exact()
    section = sweep([good], deadline=passed_deadline())
    assert good.calls == 0
    assert section["status"] == "partial" and "time guard" in section["note"]
    assert section["not_run"] == len(TINY.seqlens) * 3
    assert all(p["results"]["fagen_v2"]["skipped"] == GUARD_REASON for p in section["points"])


def test_a_system_too_slow_for_the_next_point_is_skipped():
    slow, fast = Exact("fagen_v1"), Exact("fagen_v2")

    def timer(fn, **kwargs):  # fagen_v1 takes 3 s per call, fagen_v2 2 ms
        fn()
        ms = 3000.0 if fn_owner[0] is slow else 2.0
        return Timing(median_ms=ms, min_ms=ms, max_ms=ms, repeats=3, host_ms=0.1)

    fn_owner = [None]
    original = slow.forward, fast.forward
    slow.forward = lambda *a: (fn_owner.__setitem__(0, slow), original[0](*a))[1]
    fast.forward = lambda *a: (fn_owner.__setitem__(0, fast), original[1](*a))[1]
    section = run_speed_sweep(TINY, [slow, fast], open_deadline(), device="cpu", timer=timer,
                              log=lambda line: None)
    assert "tflops" in cell(section, "fagen_v1", "fwd", 32)
    # Twice the flops at N=64: 6 s a call, times every warm-up and repeat of 3 passes > 20 s.
    assert cell(section, "fagen_v1", "fwd", 64)["skipped"].startswith("skipped: too slow (predicted 6.0 s")
    assert all("tflops" in cell(section, "fagen_v2", p, 128) for p in ("fwd", "bwd", "fwd_bwd"))


def test_failure_reason_is_one_line():
    assert failure_reason(torch.OutOfMemoryError("CUDA out of memory")) == "OOM"
    assert failure_reason(ValueError("a\n  b")) == "ValueError: a b"


def test_a_kernel_fault_stops_the_sweep_with_a_note():
    class Faults(Exact):
        def forward(self, q, k, v, causal):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    after = Exact("sdpa_flash", is_fagen=False)
    section = sweep([Faults("fagen_v1", is_fagen=False), after])
    assert section["status"] == "error" and "CUDA context was lost at fagen v1" in section["note"]
    assert after.calls == 0  # nothing runs on a broken context


def test_fagen_sm90_is_timed_in_every_pass():
    """Its own backward (issue 44): forward, backward and both, as fagen v2."""
    assert FORWARD_ONLY == {}
    section = sweep([Exact("fagen_v2"), Exact("fagen_sm90")])
    for pass_ in ("fwd", "bwd", "fwd_bwd"):
        assert "tflops" in cell(section, "fagen_sm90", pass_, 64)
    two = dataclasses.replace(TINY, systems=("fagen_v2", "fagen_sm90"))
    assert two.timed_runs() == 3 * (3 + 3)


def test_a_forward_only_system_is_timed_forward_only_with_its_reason(monkeypatch):
    """The mechanism the fp8 forward will use until its backward lands (fagen sm90 used it)."""
    monkeypatch.setitem(FORWARD_ONLY, "fagen_sm90", "forward only: no backward yet")
    section = sweep([Exact("fagen_v2"), Exact("fagen_sm90")])
    assert "tflops" in cell(section, "fagen_sm90", "fwd", 64)
    for pass_ in ("bwd", "fwd_bwd"):
        assert cell(section, "fagen_sm90", pass_, 64)["skipped"] == "forward only: no backward yet"
        assert "tflops" in cell(section, "fagen_v2", pass_, 64)
    two = dataclasses.replace(TINY, systems=("fagen_v2", "fagen_sm90"))
    assert two.timed_runs() == 3 * (3 + 1)   # 3 lengths x (fagen v2's 3 passes, the other's forward)
    # Past the deadline: the time guard counts what would have run, the plan's count.
    guarded = sweep([Exact("fagen_v2"), Exact("fagen_sm90")], deadline=passed_deadline())
    assert guarded["not_run"] == len(TINY.seqlens) * (3 + 1)
    assert cell(guarded, "fagen_sm90", "fwd", 64)["skipped"] == GUARD_REASON
    assert cell(guarded, "fagen_sm90", "fwd_bwd", 64)["skipped"] == "forward only: no backward yet"


def test_fagen_sm90_asks_for_the_hopper_family_around_its_calls_only(monkeypatch):
    system = make_system("fagen_sm90")
    seen = []
    system._func = lambda q, k, v, causal, version: seen.append((os.environ.get(ARCH_FAMILY_ENV), version))
    monkeypatch.delenv(ARCH_FAMILY_ENV, raising=False)
    system.forward(None, None, None, True)
    assert seen == [("sm90", 2)] and ARCH_FAMILY_ENV not in os.environ
    monkeypatch.setenv(ARCH_FAMILY_ENV, "sm80")
    system.forward(None, None, None, True)
    assert seen[-1] == ("sm90", 2) and os.environ[ARCH_FAMILY_ENV] == "sm80"
    assert system.label == "fagen sm90" and make_system("fagen_v2").forward.__self__.family == ""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        assert "compute capability 9.0 only" in (system.unavailable_reason() or "cupy")
