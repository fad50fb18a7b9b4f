"""The GPU check's CPU-side contract: the plan, the FLOP count, the report,
failing soft, and the time guard. (The GPU run itself is `python -m fagen.bench
gpu-check`; its measurements need a GPU and are not asserted here.)"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fagen.bench import report
from fagen.bench.correctness import parse_pytest_summary, parse_sanitizer
from fagen.bench.flops import attention_flops, tflops
from fagen.bench.gpu_check import run_gpu_check
from fagen.bench.peers import System, failure_reason
from fagen.bench.plan import (OPTIONAL_SECTIONS, SECTIONS, DecodeConfig, ModelsConfig, Plan, VariantsConfig,
                              full_plan, quick_plan)
from fagen.bench.plan_text import describe
from fagen.bench.schedule import estimate_line, replay
from fagen.bench.sweep import GUARD_REASON, run_speed_sweep, torch_attention
from fagen.bench.timing import Budget, Deadline, Timing, repeats_for
from fagen.bench.versions import found_versions, versions_line

REPO = Path(__file__).resolve().parents[1]


# -- the plan and --dry-run -------------------------------------------------------------

def test_full_plan_is_the_papers_setup():
    plan = full_plan()
    assert plan.seqlens == (512, 1024, 2048, 4096, 8192, 16384)
    assert [plan.batch(n) * n for n in plan.seqlens] == [16384] * 6
    assert (plan.heads(64), plan.heads(128)) == (32, 16)
    assert plan.timed_runs() == 8 * 6 * 3 * 7
    assert max(plan.memory.seqlens) == 65536
    # The 8 minutes: the sweep is elastic (the time guard gives it what the others leave),
    # so what must fit the budget is every other section with the sweep at its minimum.
    assert sum_without_the_sweep(plan) + plan.min_speed_s <= plan.budget_s
    assert quick_plan().timed_runs() < plan.timed_runs() / 5


def sum_without_the_sweep(plan):
    estimate = replay(plan, sanitizers=True)
    assert estimate["total"] == pytest.approx(sum(v for k, v in estimate.items() if k in SECTIONS))
    return estimate["total"] - estimate["speed"]


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


def test_dry_run_prints_the_plan_and_exits_zero(tmp_path):
    env = dict(os.environ, FAGEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "fagen.bench", "gpu-check", "--dry-run"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert f"timed runs: {full_plan().timed_runs()}" in out
    for needle in ("sections, in order: setup, precompile, peak, correctness, sanitizers, speed, "
                   "variants, decode, models, ring, memory, report",
                   "fagen v2, fagen v1, SDPA flash, SDPA cuDNN, SDPA efficient, SDPA math, FlexAttention",
                   "[     ok] precompile's kernels for sm_90 (recorded from the calls): ",
                   "[     ok] the sections' reserves fit the budget (with compute-sanitizer's runs): 420 s of 420 s",
                   "[     ok] fagen flash_attn_func", "dry run: ok"):
        assert needle in out, needle
    assert out.startswith("versions found: " + versions_line(found_versions()))
    assert out.rstrip().endswith(estimate_line(full_plan(), sanitizer_found=False) + ")")
    # The variants section: its rows in the plan, and its kernels traced and one compiled.
    for needle in ("  variants: passes forward, forward + backward; bf16 d=128 causal N=16k B=1 H=16",
                   "    variant window: sliding window 4096, window_size=(W, 0)",
                   "    variant softcap: softcap 50, softcap=C",
                   "    variant alibi: ALiBi, alibi_slopes 2^(-8 i / H) fp32 (H,)",
                   "    variant document: document mask (8 docs), mask_mod doc[b, q] == doc[b, k]",
                   "    systems: fagen v2 (same mod), FlexAttention (same mod), SDPA flash (plain causal, "
                   "measured once), fagen v2 (no mod) (plain causal, measured once)",
                   f"    timed runs: {full_plan().variants.timed_runs()}; fagen variant kernels to compile: 4",
                   "[     ok] the variants section's fagen kernels compile for sm_90: "
                   "fa2_d128_causal_window_bf16_m128n128w8s2, fa2_d128_causal_softcap_bf16_m128n128w8s2, "
                   "fa2_d128_causal_alibi_bf16_m128n128w8s2, fa2_d128_causal_mmod"):
        assert needle in out, needle
    assert " compiles in " in out.split("the variants section's fagen kernels")[1].splitlines()[0]
    assert "variants " in out.split("estimated seconds:")[1].splitlines()[0]
    # The decode section: its rows in the plan, its estimate, and its kernels rendered and one compiled.
    decode = full_plan().decode
    for needle in ("  decode: cap 30 s;",
                   "    decode step: bf16 B=64 cache 8k Hq=32 Hk=8 d=128 Nq=1 non-causal, full caches",
                   "    systems: fagen (flash_attn_with_kvcache, contiguous cache), fagen paged (the same keys in "
                   "pages of 256, seeded random block table), SDPA math, SDPA efficient, SDPA flash, FlexAttention",
                   "bytes per step: K + V read (B N Hk d, 2 B each) + q + out = 2.15 GB (K/V expanded to Hq heads: "
                   "8.59 GB)",
                   f"    document lengths (seed 0): {', '.join(map(str, decode.document_lengths()))}",
                   "    timed runs: 12; fagen kernels to compile: 3",
                   "[     ok] fagen flash_attn_with_kvcache and flash_attn_varlen_func",
                   "[     ok] the decode section's fagen kernels compile for sm_90: "):
        assert needle in out, needle
    kernels = out.split("the decode section's fagen kernels")[1].splitlines()[0]
    assert "_paged_packgqa_" in kernels and "_cache_packgqa_" in kernels and "varlen" in kernels
    assert " compiles in " in kernels
    assert " decode 25," in out.split("estimated seconds:")[1].splitlines()[0]
    # The models section: its rows in the plan, its estimate, its kernels, and the model counted.
    for needle in ("  models: cap 40 s; Hugging Face transformers, Llama 1.10B (16 layers, hidden 2048, Hq=32 Hk=8 "
                   "d=64), random weights, bf16;",
                   "    parameters: 1,104,218,112 = 2 V h",
                   "    train B=1 x N=4096: forward + loss + backward on random tokens",
                   "systems fagen (fagen.integrations.transformers), SDPA, FlexAttention (torch.compile; last, only "
                   "with >= 20 s left)",
                   "    generate: 32 prompts of 64-128 tokens, left-padded, + 32 new tokens each, greedy; new tokens/s "
                   "= 32 x 32 / call time",
                   f"    prompt lengths (seed 0): {', '.join(map(str, full_plan().models.prompt_lengths()))}",
                   "[     ok] the models section's fagen kernels compile for sm_90: fa2_d64_causal_bf16_m128n64w4s3, "
                   "fa2_d64_causal_bf16_varlen_m128n64w4s3; fa2_d64_causal_bf16_varlen_m128n64w4s3 compiles in ",
                   "[     ok] transformers and the models section's Llama (models section): transformers "):
        assert needle in out, needle
    assert "1,104,218,112 parameters (as counted)" in out
    assert " models 40," in out.split("estimated seconds:")[1].splitlines()[0]
    # The ring section: its rows in the plan, its estimate, and step_blocks' pair counts checked.
    for needle in ("  ring: cap 10 s; fagen.distributed.ring_attention in a world-1 process group (NCCL, else gloo) "
                   "on this GPU, bf16 B=1 N=16k H=16 Hk=16 d=128 causal, layouts zigzag, contiguous",
                   "the step's pair kernels summed (zigzag 3, contiguous 1)",
                   "    overlap MODEL, not measured: zigzag at W = 2, 4, 8;",
                   "over NVLink 4 450 GB/s, IB NDR 50 GB/s (assumed: vendor specs, per direction)",
                   "[     ok] fagen.distributed and the ring section's chunk pairs (step_blocks): world 1 pairs: "
                   "zigzag 3, contiguous 1; zigzag pairs per step at W = 2: 2, 4: 2, 8: 2"):
        assert needle in out, needle
    assert " models 40, ring 5, memory 20," in out.split("estimated seconds:")[1].splitlines()[0]


def test_the_plan_has_a_variants_section_at_the_sweeps_longest_point():
    plan, quick = full_plan(), quick_plan()
    v = plan.variants
    assert SECTIONS.index("speed") < SECTIONS.index("variants") < SECTIONS.index("memory")
    assert "variants" in OPTIONAL_SECTIONS
    assert v.cases == ("window", "softcap", "alibi", "document")
    assert (v.dtype, v.head_dim, v.causal, v.passes) == ("bf16", 128, True, ("fwd", "fwd_bwd"))
    # The speed sweep's 16k point: B = 1, H = 2048 / d.
    assert v.seqlen == max(plan.seqlens) and v.batch == plan.batch(v.seqlen) == 1 and v.heads == plan.heads(128)
    assert v.flops("fwd") == plan.flops("fwd", plan.configs()[1], 16384)  # bf16 d=128 causal, counted alike
    assert v.systems == ("fagen_v2", "flex", "sdpa_flash", "fagen_v2_nomod")
    # Each variant in fagen and Flex, the two plain-causal peers once.
    assert v.timed_runs() == 2 * (4 * 2 + 2) == 20
    estimate = replay(plan, sanitizers=True)
    assert 0 < estimate["variants"] <= v.cap_s and sum_without_the_sweep(plan) + plan.min_speed_s <= plan.budget_s
    assert plan.variant_kernels() == 4
    # --quick shrinks it: fewer variants, a smaller cap, and the whole quick plan in its budget.
    assert 0 < len(quick.variants.cases) < len(v.cases) and quick.variants.cap_s < v.cap_s
    assert replay(quick, sanitizers=True)["total"] < quick.budget_s
    # Document lengths: seeded, about `documents` of them, covering the sequence exactly.
    lengths = v.document_lengths()
    assert len(lengths) == 8 and sum(lengths) == 16384 and min(lengths) > 16384 // 8 // 4 - 1
    assert lengths == v.document_lengths() and lengths != VariantsConfig(seed=1).document_lengths()
    assert sum(VariantsConfig().document_lengths(48)) == 48


def test_the_variants_section_is_reserved_time_by_the_sections_before_it(tmp_path):
    plan = full_plan()
    assert reserving_run(plan, tmp_path).needs()["variants"] == plan.variants.cap_s
    assert_reserved(plan, tmp_path, "variants", "speed", plan.variants.cap_s + plan.decode.cap_s + plan.models.cap_s
                    + plan.ring.cap_s + plan.memory_cap_s + plan.report_reserve_s)


def test_main_runs_by_path_from_elsewhere(tmp_path):
    """No install step: the entry point finds fagen in the tree it lives in."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(REPO / "fagen" / "bench" / "__main__.py"), "gpu-check", "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--dry-run" in run.stdout and "--quick" in run.stdout


# -- FLOPs ------------------------------------------------------------------------------

def test_flop_formula():
    shape = dict(batch=2, heads=3, seqlen=1024, head_dim=64)
    forward = 4 * 1024 * 1024 * 64 * 3 * 2
    assert attention_flops("fwd", causal=False, **shape) == forward
    assert attention_flops("bwd", causal=False, **shape) == 2.5 * forward
    assert attention_flops("fwd_bwd", causal=False, **shape) == 3.5 * forward
    for pass_ in ("fwd", "bwd", "fwd_bwd"):
        assert attention_flops(pass_, causal=True, **shape) == attention_flops(pass_, causal=False, **shape) / 2
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        attention_flops("backward", causal=False, **shape)
    plan = full_plan()
    config = plan.configs()[0]  # bf16 d=128 non-causal
    assert plan.flops("fwd", config, 16384) == 4 * 16384**2 * 128 * 16 * 1


def test_repeats_and_budget_deadlines():
    assert repeats_for(10.0, target_ms=30, min_repeats=3, max_repeats=20) == 3
    assert repeats_for(0.1, target_ms=30, min_repeats=3, max_repeats=20) == 20
    now = [100.0]
    budget = Budget(60.0, clock=lambda: now[0])
    now[0] = 110.0
    assert budget.remaining() == 50.0
    assert budget.deadline(reserve_s=20.0).remaining() == 30.0   # end 160 - 20 = 140
    assert budget.deadline(reserve_s=20.0, cap_s=5.0).remaining() == 5.0
    late = budget.deadline(reserve_s=55.0)
    assert late.expired()


# -- the sweep, failing soft ---------------------------------------------------------------

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


# -- the report -------------------------------------------------------------------------------

def synthetic_results():
    rates = {"fagen_v2": 100.0, "fagen_v1": 50.0, "sdpa_flash": 200.0, "sdpa_cudnn": 250.0}
    points = []
    for causal in (False, True):
        for seqlen in (1024, 2048):
            for pass_ in ("fwd", "bwd", "fwd_bwd"):
                results = {name: {"ms": 1.0, "tflops": rate, "host_bound": False} for name, rate in rates.items()}
                results["sdpa_math"] = {"skipped": "OOM", "oom": True}
                results["flex"] = {"skipped": "not available: triton does not import"}
                points.append({"pass": pass_, "dtype": "bf16", "head_dim": 128, "causal": causal,
                               "seqlen": seqlen, "batch": 16384 // seqlen, "heads": 16, "flops": 1e12,
                               "results": results})
    return {
        "meta": {"device": "NVIDIA H200", "plan": "synthetic"},
        "sections": {"speed": {"status": "ok", "seconds": 12.0, "note": ""}},
        "peak": {"matmul": {"what": "torch.matmul 8192x8192x8192 bfloat16", "tflops": 790.0, "ms": 1.4},
                 "copy": {"what": "device copy of 2 GiB", "tb_per_s": 4.3, "ms": 1.0}},
        "correctness": {"status": "passed", "summary": "40 passed, 8 skipped in 30.0s", "failures": [],
                        "skips": {"no backward yet": 8}, "command": "pytest -m gpu"},
        "speed": {"status": "ok", "points": points, "systems": {}, "sanity": {}},
        "memory": {"config": {"dtype": "bf16", "head_dim": 128, "heads": 16, "batch": 1},
                   "points": [{"seqlen": n, "results": {
                       "fagen_v2": {"status": "ok", "fwd_bwd_peak_bytes": n * 1e5},
                       "sdpa_math": ({"status": "ok", "fwd_bwd_peak_bytes": n * n * 64.0} if n < 4096
                                     else {"status": "OOM"})}} for n in (1024, 2048, 4096)]},
    }


def test_report_writes_json_markdown_and_plots(tmp_path):
    results = synthetic_results()
    files = report.write_report(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    point = data["speed"]["points"][0]
    assert point["best_peer"] == "sdpa_cudnn"
    assert point["ratios"]["fagen_v2/best"] == pytest.approx(0.4)
    assert point["ratios"]["fagen_v2/sdpa_flash"] == pytest.approx(0.5)
    assert point["ratios"]["fagen_v1/best"] == pytest.approx(0.2)
    md = (tmp_path / "results.md").read_text()
    assert "| bf16 | 128 | no | 1k | 16 | 100.0 | 50.0 | 200.0 | 250.0 | oom | - | 0.40 (SDPA cuDNN) | 0.20 |" in md
    assert "FlexAttention: not available: triton does not import (12 cells)" in md
    assert "**790.0 TFLOP/s**" in md and "40 passed" in md
    pytest.importorskip("matplotlib")
    names = sorted(Path(p).name for p in files["plots"])
    assert names == ["memory.png", "speed_bwd.png", "speed_fwd.png", "speed_fwd_bwd.png"]
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def test_short_table_fits_the_returned_output():
    table = report.short_table(synthetic_results())
    assert "matmul peak 790 TFLOP/s" in table
    assert "pass    N |   v2   v1 flsh cdnn math | v2/best" in table  # flex never ran: no column
    assert "fwd    1k |  100   50  200  250  oom | 0.40 cdnn" in table
    assert "f+b    2k |" in table
    # The full plan's table must fit in the 12,000 characters the device tool returns.
    plan = full_plan()
    points = [{"pass": p, "dtype": c.dtype, "head_dim": c.head_dim, "causal": c.causal, "seqlen": n,
               "batch": plan.batch(n), "heads": plan.heads(c.head_dim), "flops": 1.0,
               "results": {s: {"tflops": 555.5} for s in plan.systems}}
              for c in plan.configs() for n in plan.seqlens for p in plan.passes]
    big = report.short_table({"speed": {"points": points}, "meta": {"device": "NVIDIA H200"}})
    assert len(big) < 9_500
    # With the variants' rows too, 2,200 characters are left for the summary printed before it.
    variants = synthetic_variants()
    for point in variants["points"]:
        point["results"] = {s: {"tflops": 555.5} for s in point["results"]}
    both = report.short_table({"speed": {"points": points}, "variants": variants, "meta": {"device": "NVIDIA H200"}})
    assert both.startswith(big) and both.count("\n") == big.count("\n") + 2 + len(variants["points"])
    assert len(both) < 9_800


def test_summary_parsers():
    parsed = parse_pytest_summary("....F\n=== 1 failed, 10 passed, 2 skipped, 1 error in 3.21s ===\n")
    assert parsed["counts"]["failed"] == 1 and parsed["counts"]["passed"] == 10
    assert parsed["counts"]["skipped"] == 2 and parsed["counts"]["errors"] == 1
    assert parse_pytest_summary("no summary here")["summary"] == ""
    assert parse_sanitizer("memcheck", "========= ERROR SUMMARY: 0 errors")["errors"] == 0
    race = parse_sanitizer("racecheck", "RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)")
    assert (race["errors"], race["warnings"]) == (2, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_without_a_gpu_writes_what_it_knows(tmp_path):
    lines = []
    code = run_gpu_check(quick_plan(), tmp_path, log=lines.append)
    assert code == 2
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["sections"]["setup"]["status"] == "error"
    assert "no CUDA GPU" in data["sections"]["setup"]["note"]
    assert (tmp_path / "results.md").exists()


def test_sigterm_stops_the_run_and_still_writes_the_report(tmp_path):
    """The wrapper's hard timeout sends SIGTERM: the run stops where it is,
    writes results.json/results.md from what it has, and exits 124."""
    script = (
        "import sys, time\n"
        "from fagen.bench import gpu_check\n"
        "from fagen.bench.plan import quick_plan\n"
        "gpu_check.found_versions = lambda: time.sleep(60) or {}\n"
        f"sys.exit(gpu_check.run_gpu_check(quick_plan(), {str(tmp_path)!r}))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait until the run is inside its first section
        if line.startswith("== setup"):
            break
    proc.terminate()
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 124, output
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["stopped"].startswith("stopped from outside")
    assert (tmp_path / "results.md").exists()
    assert "== fagen GPU check" in output  # the short table is still printed last


def test_a_kernel_fault_stops_the_sweep_with_a_note():
    class Faults(Exact):
        def forward(self, q, k, v, causal):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    after = Exact("sdpa_flash", is_fagen=False)
    section = sweep([Faults("fagen_v1", is_fagen=False), after])
    assert section["status"] == "error" and "CUDA context was lost at fagen v1" in section["note"]
    assert after.calls == 0  # nothing runs on a broken context


def test_sanitizer_runs_are_recorded_whatever_happens(tmp_path, monkeypatch):
    """With a stand-in compute-sanitizer that runs the script and prints a
    summary: on this GPU-less machine the script cannot finish, and the run is
    recorded as failed (not clean), with the summary parsed."""
    from fagen.bench.correctness import run_sanitizers

    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nshift 4\n\"$@\"\nstatus=$?\necho '========= ERROR SUMMARY: 0 errors'\nexit $status\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    section = run_sanitizers(REPO, timeout_s=60, tools=("memcheck",))
    run = section["runs"]["memcheck"]
    assert section["path"] == str(fake)
    assert run["summary"] == "ERROR SUMMARY: 0 errors" and run["errors"] == 0
    if torch.cuda.is_available():
        assert run["status"] == "clean"
    else:
        assert run["status"] == "failed" and not run["script_finished"]
        assert section["status"] == "problems"


def test_the_summary_names_the_driver_and_nvrtc():
    from fagen.bench import gpu_check, report

    meta = {"device": "NVIDIA H200", "capability": "sm_90", "cuda": "13.0",
            **gpu_check._toolchain_meta("sm_90")}
    assert meta["nvrtc_target"] == "sm_90" and meta["driver"]
    first = report.summary_lines({"meta": meta, "sections": {}})[0]
    assert first.startswith("toolchain: driver ") and f"NVRTC {meta['nvrtc']}" in first and "sm_90" in first
    assert "NVRTC" in gpu_check.toolchain_line(meta)


# -- the variants section ------------------------------------------------------------------------

SMALL_VARIANTS = VariantsConfig(head_dim=16, heads=2, batch=2, seqlen=96, window=24, documents=4)


@pytest.mark.parametrize("name", SMALL_VARIANTS.cases)
def test_each_variants_flex_mods_and_dense_form_are_fagens_variant(name):
    """fagen's call (through fagen's float64 oracle), FlexAttention with the section's mods
    (eager, on CPU) and the dense torch form the sanity check uses compute one attention;
    and `visible_pairs` counts the keys the variant leaves."""
    import warnings

    from fagen.bench.variants import FlexVariant, make_case
    from fagen.reference.naive import attention_forward

    flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
    torch.manual_seed(0)
    case = make_case(name, SMALL_VARIANTS, batch=2, seqlen=96, heads=2, device="cpu")
    q, k, v = (torch.randn(2, 96, 2, 16, dtype=torch.float64) for _ in range(3))
    ref, _ = attention_forward(q, k, v, causal=True, **case.fagen_kwargs)
    assert (case.dense(q, k, v, torch.float64) - ref).abs().max() < 1e-6  # the oracle rounds its scale
    flex = FlexVariant(case)
    flex._compiled = flex_attention  # eager Flex: no Triton here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex.forward(q.float(), k.float(), v.float(), True)
    assert (out.double() - ref).abs().max() < 1e-5
    # The variant changes the result (a mod that did nothing would pass the checks above).
    plain, _ = attention_forward(q, k, v, causal=True)
    assert (plain - ref).abs().max() > 1e-3
    i, j = torch.arange(96).unsqueeze(1), torch.arange(96).unsqueeze(0)
    visible = (j <= i).expand(2, 96, 96)
    if case.window is not None:
        visible = visible & (i - j <= case.window)
    if case.doc is not None:
        visible = visible & (case.doc[:, :, None] == case.doc[:, None, :])
    assert SMALL_VARIANTS.visible_pairs(name, 96) == visible[0].sum().item() == visible[1].sum().item()
    if name == "alibi":
        assert case.slopes.dtype == torch.float32 and case.slopes.tolist() == [2 ** -4, 2 ** -8]
    if name == "document":
        assert case.doc.dtype == torch.int32 and case.doc.shape == (2, 96) and case.doc.max().item() == 3


class EagerFlex:
    """FlexAttention's variant system, runnable here: eager Flex (no Triton on CPU)."""

    def __new__(cls, case):
        from fagen.bench.variants import FlexVariant

        flex = FlexVariant(case)
        flex._compiled = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
        flex.unavailable_reason = lambda: None
        # Flex has no CPU backward: its forward is timed, its forward + backward is not.
        flex.forward = lambda q, k, v, causal: FlexVariant.forward(flex, q.detach(), k.detach(), v.detach(),
                                                                   causal)
        return flex


def variants_plan(**changes):
    return Plan(name="tiny-variants", sanity_shape=(1, 48, 2),
                variants=VariantsConfig(head_dim=16, heads=2, batch=1, seqlen=64, window=8, documents=3, **changes))


def real_factories(flex=EagerFlex):
    """fagen for real (the CPU emulator), Flex eagerly, SDPA's flash backend (its CPU kernel)."""
    from fagen.bench.peers import FagenSystem, SdpaSystem
    from fagen.bench.variants import FagenVariant, Renamed

    return {"fagen_v2": FagenVariant, "flex": flex, "sdpa_flash": lambda case: SdpaSystem("sdpa_flash"),
            "fagen_v2_nomod": lambda case: Renamed(FagenSystem(2), "fagen_v2_nomod")}


def variant_sweep(plan, factories, deadline=None, clock=None):
    import warnings

    from fagen.bench.variants import run_variant_sweep

    kwargs = {"clock": clock} if clock else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_variant_sweep(plan, deadline or open_deadline(), device="cpu", timer=fake_timer,
                                 log=lambda line: None, factories=factories, **kwargs)


def variant_cell(section, system, variant, pass_):
    point = next(p for p in section["points"] if p["variant"] == variant and p["pass"] == pass_)
    return point["results"][system]


def test_the_variants_section_times_fagen_against_flex_and_the_no_mod_peers(tmp_path, monkeypatch):
    """The section end to end on CPU: fagen's real variant kernels (emulated), each checked
    against the dense variant, in the speed sweep's point structure with fagen / peer ratios."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    pytest.importorskip("torch.nn.attention.flex_attention")
    plan = variants_plan()
    section = variant_sweep(plan, real_factories())
    assert section["status"] == "ok", section["note"]
    assert [(p["variant"], p["pass"]) for p in section["points"]] == [
        (c, p) for c in ("window", "softcap", "alibi", "document") for p in ("fwd", "fwd_bwd")]
    for point in section["points"]:
        assert point["flops"] == plan.variants.flops(point["pass"])
        for system in ("fagen_v2", "sdpa_flash", "fagen_v2_nomod"):
            assert point["results"][system]["tflops"] == pytest.approx(point["flops"] / 2e-3 / 1e12)
        # The plain-causal peers are measured once and shared by every row.
        for system in ("sdpa_flash", "fagen_v2_nomod"):
            assert point["results"][system]["shared"].startswith("plain causal")
            assert point["ratios"][f"fagen_v2/{system}"] == pytest.approx(1.0)
        if point["pass"] == "fwd":
            assert point["results"]["flex"]["tflops"] == pytest.approx(point["flops"] / 2e-3 / 1e12)
            assert point["ratios"]["fagen_v2/flex"] == pytest.approx(1.0)
        else:  # eager Flex here has no backward: a skipped cell with its reason, no ratio
            assert "has no backward" in point["results"]["flex"]["skipped"]
            assert "fagen_v2/flex" not in point["ratios"]
    shares = {p["variant"]: p["visible_share"] for p in section["points"]}
    assert shares["softcap"] == shares["alibi"] == 1.0 and 0 < shares["document"] < 1 and 0 < shares["window"] < 1
    causal = 64 * 65 // 2
    assert shares["window"] == (8 * 9 // 2 + (64 - 8) * 9) / causal
    assert shares["document"] == sum(n * (n + 1) // 2 for n in plan.variants.document_lengths()) / causal
    sanity = section["sanity"]["fagen_v2"]
    assert set(sanity) == {"window", "softcap", "alibi", "document"}
    assert all(r["ok"] and "dq_err" in r for r in sanity.values()), sanity
    assert "fagen v2 / Flex: window fwd 1.00" in section["note"]


def test_variant_sanity_flags_a_kernel_that_ignores_the_mod(monkeypatch):
    from fagen.bench.variants import make_case, variant_sanity

    class IgnoresTheMod(Exact):
        def forward(self, q, k, v, causal):
            return (torch_attention(q, k, v, True, torch.float32)).to(q.dtype)

    config = variants_plan().variants
    for name in ("window", "document"):
        case = make_case(name, config, batch=1, seqlen=48, heads=2, device="cpu")
        qkv = [torch.randn(1, 48, 2, 16, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
        assert not variant_sanity(IgnoresTheMod(), case, *qkv)["ok"]


class DenseVariant(Exact):
    """A stand-in that computes the case's variant densely (fp32, rounded)."""

    def __init__(self, name, case, is_fagen=False):
        super().__init__(name, is_fagen=is_fagen)
        self.case = case

    def forward(self, q, k, v, causal):
        self.calls += 1
        if self.case is None:
            return torch_attention(q, k, v, causal, torch.float32).to(q.dtype)
        return self.case.dense(q, k, v, torch.float32).to(q.dtype)


def dense_factories(calls):
    def factory(name, is_fagen=False):
        def make(case):
            system = DenseVariant(name, case, is_fagen)
            calls.append((name, None if case is None else case.name))
            return system
        return make

    return {"fagen_v2": factory("fagen_v2", True), "flex": factory("flex"), "sdpa_flash": factory("sdpa_flash"),
            "fagen_v2_nomod": factory("fagen_v2_nomod")}


def test_the_variants_section_keeps_to_its_deadline_and_flex_allowance():
    plan = variants_plan()
    # No time at all: nothing runs, every cell says why, and the count is the plan's.
    section = variant_sweep(plan, dense_factories([]), deadline=passed_deadline())
    assert section["status"] == "partial" and "time guard" in section["note"]
    assert section["not_run"] == plan.variants.timed_runs()
    assert all(cell["skipped"].startswith(GUARD_REASON) for p in section["points"] for cell in p["results"].values())
    # Flex's compiles take 50 s each on this clock: the first case spends the 40 s allowance,
    # the rest are skipped with a note, and fagen's rows are all there.
    now = [0.0]
    calls = []
    factories = dense_factories(calls)
    make_flex = factories["flex"]

    def slow_flex(case):
        system = make_flex(case)
        original = system.forward

        def forward(*args):
            now[0] += 25.0
            return original(*args)

        system.forward = forward
        return system

    factories["flex"] = slow_flex
    section = variant_sweep(variants_plan(flex_allowance_s=40.0), factories, clock=lambda: now[0])
    # The masks run first in Flex (its cases are ordered document, window, softcap, alibi).
    assert "tflops" in variant_cell(section, "flex", "document", "fwd_bwd")
    for case in ("window", "softcap", "alibi"):
        assert "time allowance (40 s) is used up" in variant_cell(section, "flex", case, "fwd")["skipped"]
        assert "tflops" in variant_cell(section, "fagen_v2", case, "fwd_bwd")
    assert section["flex_seconds"] >= 40.0
    # The no-mod peers were built (and timed) once for all four variants.
    assert calls.count(("sdpa_flash", None)) == 2 and calls.count(("fagen_v2_nomod", None)) == 2  # probe + run


def test_an_unavailable_flex_is_a_note_in_every_variant_row():
    factories = dense_factories([])
    factories["flex"] = lambda case: Unavailable()
    section = variant_sweep(variants_plan(), factories)
    assert section["systems"]["flex"]["available"] is False
    assert all(p["results"]["flex"]["skipped"] == "not available: triton is not installed"
               for p in section["points"])
    assert section["status"] == "ok" and "no fagen v2 / Flex ratio" in section["note"]


def synthetic_variants():
    points = []
    rates = {"fagen_v2": 300.0, "flex": 200.0, "sdpa_flash": 400.0, "fagen_v2_nomod": 250.0}
    for case, share in (("window", 0.44), ("softcap", 1.0), ("alibi", 1.0), ("document", 0.14)):
        for pass_ in ("fwd", "fwd_bwd"):
            results = {n: {"ms": 1.0, "tflops": r, "host_bound": False} for n, r in rates.items()}
            if case == "document":
                results["flex"] = {"skipped": "skipped: FlexAttention's time allowance (70 s) is used up"}
            points.append({"pass": pass_, "variant": case, "label": f"{case} label", "dtype": "bf16",
                           "head_dim": 128, "causal": True, "seqlen": 16384, "batch": 1, "heads": 16,
                           "flops": 1e12, "visible_share": share, "results": results})
    return {"status": "ok", "note": "", "config": {"label": "bf16 d=128 causal N=16k B=1 H=16"},
            "systems": {}, "points": points,
            "sanity": {"fagen_v2": {"window": {"ok": True, "fwd_err": 1e-3, "fwd_torch_err": 2e-3}}}}


def test_report_has_the_variant_rows_with_their_ratios(tmp_path):
    results = synthetic_results()
    results["variants"] = synthetic_variants()
    report.write_report(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    point = data["variants"]["points"][0]
    assert point["ratios"]["fagen_v2/flex"] == pytest.approx(1.5)
    assert point["ratios"]["fagen_v2/sdpa_flash"] == pytest.approx(0.75)
    assert point["ratios"]["fagen_v2/fagen_v2_nomod"] == pytest.approx(1.2)
    md = (tmp_path / "results.md").read_text()
    assert "## Variants (TFLOP/s)" in md
    assert ("| variant | keys seen | fagen v2 | FlexAttention | SDPA flash | fagen v2 (no mod) | v2 / FlexAttention "
            "| v2 / SDPA flash | v2 / fagen v2 (no mod) |") in md
    assert "| window label | 44% | 300.0 | 200.0 | 400.0 | 250.0 | 1.50 | 0.75 | 1.20 |" in md
    assert "| document label | 14% | 300.0 | - | 400.0 | 250.0 | - | 0.75 | 1.20 |" in md
    assert "FlexAttention: skipped: FlexAttention's time allowance (70 s) is used up (2 cells)" in md
    assert "| window | True | 1.00e-03 | 2.00e-03 |" in md
    table = report.short_table(results)
    assert "pass variant  seen |   v2 flex flsh v2nm | v2/flex v2/flsh v2/v2nm" in table
    assert "fwd  window    44% |  300  200  400  250 |    1.50    0.75    1.20" in table
    assert "f+b  document  14% |  300    -  400  250 |       -    0.75    1.20" in table
    assert len(list(tmp_path.iterdir())) <= 8


# -- the decode section ------------------------------------------------------------------------

def test_the_plan_has_a_decode_section_after_the_variants():
    from fagen.bench.flops import attention_flops

    plan, quick = full_plan(), quick_plan()
    d = plan.decode
    assert SECTIONS.index("variants") < SECTIONS.index("decode") < SECTIONS.index("memory")
    assert "decode" in OPTIONAL_SECTIONS
    assert (d.batch, d.cache_len, d.q_heads, d.kv_heads, d.head_dim, d.dtype, d.page_size) == (
        64, 8192, 32, 8, 128, "bf16", 256)
    assert d.decode_systems == ("fagen", "fagen_paged", "sdpa_math", "sdpa_efficient", "sdpa_flash", "flex")
    assert d.varlen_systems == ("fagen_varlen", "fagen_padded", "sdpa_padded")
    assert (d.varlen_tokens, d.varlen_heads, d.varlen_passes) == (16384, 16, ("fwd", "fwd_bwd"))
    assert d.timed_runs() == 6 + 2 * 3 and d.pages_per_entry == 32 and d.group == 4
    # The section's cap is in the forecast, and --quick keeps it (without Flex's compile, smaller).
    estimate = replay(plan, sanitizers=True)
    assert 0 < estimate["decode"] <= d.cap_s == 30.0 and estimate["decode"] == d.estimate_seconds()
    assert "flex" not in quick.decode.decode_systems and quick.decode.cap_s < d.cap_s
    assert 0 < replay(quick, sanitizers=True)["decode"] < estimate["decode"]
    assert replay(quick, sanitizers=True)["total"] < quick.budget_s
    assert DecodeConfig(decode_systems=(), varlen_systems=()).estimate_seconds() == 0.0
    # fagen's kernels: decode step, paged, varlen; the padded batch's is the sweep's causal kernel.
    assert plan.decode_kernels() == 3
    assert Plan(systems=("sdpa_flash",)).decode_kernels() == 4
    text = describe(plan)
    assert "\n  decode: cap 30 s" in text and "decode 25" in text.split("estimated seconds:")[1]
    # Documents: seeded, between about 1/4 and 7/4 of the mean, covering the 16k tokens exactly.
    lengths = d.document_lengths()
    mean = 16384 / len(lengths)
    assert len(lengths) == 10 and sum(lengths) == 16384 and lengths == d.document_lengths()
    assert all(mean / 4 - 1 <= n <= 7 * mean / 4 + 10 for n in lengths)
    assert lengths != DecodeConfig(seed=1).document_lengths()
    assert d.padded_shape() == (10, max(lengths))
    # Useful FLOPs only: each document's causal count, forward and x3.5 for both passes.
    assert d.varlen_flops("fwd") == sum(4 * n * n * 128 * 16 / 2 for n in lengths)
    assert d.varlen_flops("fwd_bwd") == 3.5 * d.varlen_flops("fwd")
    assert d.varlen_flops("fwd") < attention_flops("fwd", batch=10, heads=16, seqlen=max(lengths), head_dim=128,
                                                   causal=True)


def test_decode_bytes_count_k_and_v_read_and_q_and_out():
    d = DecodeConfig()
    kv = 2 * 64 * 8192 * 8 * 128 * 2   # K and V, bf16
    q_and_out = 2 * 64 * 32 * 128 * 2
    assert d.decode_bytes() == kv + q_and_out == 2_148_532_224
    assert d.decode_bytes(32) == 4 * kv + q_and_out           # a peer given K/V expanded to 32 heads
    assert d.decode_bytes(batch=2, cache_len=1024) == 2 * 2 * 1024 * 8 * 128 * 2 + 2 * 2 * 32 * 128 * 2


def test_the_decode_section_is_reserved_time_by_the_sections_before_it(tmp_path):
    plan = full_plan()
    run = reserving_run(plan, tmp_path)
    assert run.needs()["decode"] == plan.decode.cap_s == 30.0
    assert_reserved(plan, tmp_path, "decode", "variants", plan.decode.cap_s + plan.models.cap_s + plan.ring.cap_s
                    + plan.memory_cap_s + plan.report_reserve_s)
    skipped = reserving_run(plan, tmp_path, {"decode"})
    assert skipped.section("decode", lambda: pytest.fail("a skipped section ran")) is None
    assert skipped.results["sections"]["decode"]["status"] == "skipped"


def test_bandwidth_and_its_share_of_the_copy_bandwidth():
    from fagen.bench.decode_report import add_bandwidth, add_varlen_ratios, bandwidth_tb_per_s

    assert bandwidth_tb_per_s(2e9, 1.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bandwidth_tb_per_s(2e9, 0.0)
    section = {"copy": {"tb_per_s": 4.0}, "points": [
        {"part": "decode", "results": {"a": {"ms": 0.5, "bytes": 1e9}, "b": {"skipped": "OOM"}}},
        {"part": "varlen", "pass": "fwd", "results": {"fagen_varlen": {"tflops": 300.0}, "p": {"tflops": 200.0},
                                                      "q": {"skipped": "x"}}}]}
    add_varlen_ratios(add_bandwidth(section))
    cell = section["points"][0]["results"]["a"]
    assert cell["tb_per_s"] == pytest.approx(2.0) and cell["copy_fraction"] == pytest.approx(0.5)
    assert "tb_per_s" not in section["points"][0]["results"]["b"]
    assert section["points"][1]["ratios"] == {"fagen_varlen/p": pytest.approx(1.5)}
    section["copy"] = {"tb_per_s": None}   # no copy figure: the bandwidth stands without a share
    assert add_bandwidth(section)["points"][0]["results"]["a"]["copy_fraction"] is None


def synthetic_decode():
    from fagen.bench.decode import FLEX_GUARD_REASON

    d = DecodeConfig()
    expanded = "K/V expanded to 32 heads beforehand (enable_gqa refused: RuntimeError: No available kernel)"
    decode = {"part": "decode", "pass": "fwd", "label": d.decode_label, "batch": 64, "cache_len": 8192, "results": {
        "fagen": {"ms": 0.5, "bytes": 2e9, "kv_heads_read": 8, "expanded": False, "gqa": "native"},
        "fagen_paged": {"ms": 0.625, "bytes": 2e9, "kv_heads_read": 8, "expanded": False, "gqa": "native"},
        "sdpa_math": {"skipped": "OOM", "oom": True},
        "sdpa_efficient": {"ms": 2.0, "bytes": 8e9, "kv_heads_read": 32, "expanded": True, "gqa": expanded},
        "sdpa_flash": {"ms": 1.0, "bytes": 2e9, "kv_heads_read": 8, "expanded": False, "gqa": "enable_gqa"},
        "flex": {"skipped": FLEX_GUARD_REASON}}}
    varlen = [{"part": "varlen", "pass": p, "label": d.varlen_label, "flops": flops, "results": results}
              for p, flops, results in (
                  ("fwd", 1e11, {"fagen_varlen": {"ms": 0.25, "tflops": 400.0},
                                 "fagen_padded": {"ms": 0.4, "tflops": 250.0},
                                 "sdpa_padded": {"ms": 0.5, "tflops": 200.0, "backend": "SDPA flash"}}),
                  ("fwd_bwd", 3.5e11, {"fagen_varlen": {"ms": 1.0, "tflops": 350.0},
                                       "fagen_padded": {"ms": 1.4, "tflops": 250.0},
                                       "sdpa_padded": {"skipped": "RuntimeError: boom"}}))]
    return {"status": "ok", "note": "", "copy": {"tb_per_s": 5.0, "source": "the peak section's device copy"},
            "config": {"lengths": d.document_lengths(), "padded": list(d.padded_shape())},
            "bytes_note": "K and V read + q + out", "systems": {}, "points": [decode] + varlen,
            "sanity": {"fagen": {"ok": True, "fwd_err": 1e-3, "fwd_torch_err": 2e-3},
                       "fagen_varlen": {"ok": False, "fwd_err": 9e-2, "fwd_torch_err": 2e-3}}}


SYNTHETIC_DECODE_TABLE = """\
-- decode bf16 B=64 cache 8k Hq=32 Hk=8 d=128 Nq=1 non-causal; copy 5.00 TB/s; SANITY FAILED: fagen varlen
system             ms GB/step   TB/s of copy
fagen           0.500    2.00   4.00     80%
fagen paged     0.625    2.00   3.20     64%
SDPA math      skipped: OOM
SDPA efficient  2.000    8.00   4.00     80% K/V expanded
SDPA flash      1.000    2.00   2.00     40%
FlexAttention  skipped: time guard (the section's deadline was reached) (too...
-- varlen bf16 16k tokens in 10 docs (max 2362) H=16 d=128 causal; TFLOP/s of the documents' causal FLOPs
system          fwd ms TFLOP/s  f+b ms TFLOP/s | varlen/this  fwd  f+b
fagen varlen     0.250   400.0   1.000   350.0 |                -    -
fagen padded     0.400   250.0   1.400   250.0 |             1.60 1.40
SDPA padded      0.500   200.0       -       - |             2.00    - (SDPA flash)"""


def test_report_has_the_decode_rows_with_their_bandwidth_and_ratios(tmp_path):
    results = synthetic_results()
    results["variants"], results["decode"] = synthetic_variants(), synthetic_decode()
    table = report.short_table(results)
    assert table.endswith("\n" + SYNTHETIC_DECODE_TABLE)
    report.write_report(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    cells = data["decode"]["points"][0]["results"]
    assert cells["fagen"]["tb_per_s"] == pytest.approx(4.0) and cells["fagen"]["copy_fraction"] == pytest.approx(0.8)
    assert data["decode"]["points"][2]["ratios"] == {"fagen_varlen/fagen_padded": pytest.approx(1.4)}
    md = (tmp_path / "results.md").read_text()
    assert md.index("## Variants") < md.index("## Decode and varlen training") < md.index("## Peak GPU memory")
    for needle in ("### Decode step: bf16 B=64 cache 8k Hq=32 Hk=8 d=128 Nq=1 non-causal",
                   "Copy bandwidth: **5.00 TB/s**, the peak section's device copy.",
                   "| fagen | 0.500 | 2.00 | 4.00 | 80% | 8 (native) |  |",
                   "| SDPA efficient | 2.000 | 8.00 | 4.00 | 80% | 32 (K/V expanded to 32 heads beforehand (enable_gqa "
                   "refused: RuntimeError: No available kernel)) | K/V expanded",
                   "| SDPA math | - | - | - | - | - | skipped: OOM |",
                   "| FlexAttention | - | - | - | - | - | skipped: time guard",
                   "### Varlen training: bf16 16k tokens in 10 docs (max 2362) H=16 d=128 causal",
                   "the padded systems run B = 10 x N = 2362",
                   "| fwd | SDPA padded | 0.500 | 200.0 | 2.00 | backend: SDPA flash |",
                   "| f+b | fagen padded | 1.400 | 250.0 | 1.40 |  |",
                   "| f+b | SDPA padded | - | - | - | skipped: RuntimeError: boom |",
                   "| fagen varlen | False | 9.00e-02 | 2.00e-03 |"):
        assert needle in md, needle




class _Tiny:
    """The decode section's plan at sizes the CPU emulator runs in seconds."""

    config = DecodeConfig(batch=2, cache_len=64, q_heads=4, kv_heads=2, head_dim=16, page_size=16,
                          sanity_shape=(2, 32), varlen_tokens=96, varlen_heads=2, documents=3,
                          varlen_sanity_shape=(3, 48, 2))
    plan = Plan(decode=config)


def eager_flex_decode():
    from fagen.bench.decode import FlexDecode

    flex = FlexDecode()
    flex.flex._compiled = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
    flex.unavailable_reason = lambda: None   # eager Flex: no Triton needed
    return flex


def decode_section(factories=None, deadline=None, plan=_Tiny.plan, **kwargs):
    import warnings

    from fagen.bench.decode import default_factories, run_decode_section

    factories = {**default_factories(), "flex": eager_flex_decode, **(factories or {})}
    kwargs.setdefault("measure_copy", lambda: {"tb_per_s": 0.02, "what": "a stand-in copy"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_decode_section(plan, deadline or open_deadline(), device="cpu", timer=fake_timer,
                                  log=lambda line: None, factories=factories, **kwargs)


def test_the_decode_section_end_to_end_on_the_emulator(tmp_path, monkeypatch):
    """fagen's real decode, paged and varlen calls (emulated), each checked against fp32 torch,
    beside SDPA on CPU and eager Flex, in the section's point structure."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    checkpoints = []
    section = decode_section(checkpoint=lambda s: checkpoints.append(s["status"]))
    config = _Tiny.config
    assert section["status"] == "ok", section["note"]
    assert section["copy"]["tb_per_s"] == 0.02 and "a stand-in copy" in section["copy"]["source"]
    decode, fwd, fwd_bwd = section["points"]
    assert (decode["part"], fwd["pass"], fwd_bwd["pass"]) == ("decode", "fwd", "fwd_bwd")
    native = config.decode_bytes()
    for name in ("fagen", "fagen_paged", "sdpa_math", "sdpa_flash", "flex"):
        cell = decode["results"][name]
        assert cell["bytes"] == native and cell["kv_heads_read"] == 2 and not cell["expanded"], (name, cell)
        assert cell["tb_per_s"] == pytest.approx(native / 2e-3 / 1e12)
        assert cell["copy_fraction"] == pytest.approx(cell["tb_per_s"] / 0.02)
    assert "enable_gqa" in decode["results"]["sdpa_efficient"]["skipped"]   # no CPU kernel: a skipped cell
    for point in (fwd, fwd_bwd):
        assert point["flops"] == config.varlen_flops(point["pass"])
        for name in ("fagen_varlen", "fagen_padded", "sdpa_padded"):
            assert point["results"][name]["tflops"] == pytest.approx(point["flops"] / 2e-3 / 1e12)
        assert point["results"]["sdpa_padded"]["backend"] == "SDPA flash"
        assert point["ratios"]["fagen_varlen/sdpa_padded"] == pytest.approx(1.0)
    sanity = section["sanity"]
    assert set(sanity) == {"fagen", "fagen_paged", "fagen_varlen", "fagen_padded"}
    assert all(r["ok"] for r in sanity.values()), sanity
    assert "dq_err" in sanity["fagen_varlen"] and sanity["fagen"]["shape"] == "B=2 cache 32"
    assert "sanity ok" in section["note"] and "fagen varlen / fagen padded fwd 1.00 f+b 1.00" in section["note"]
    assert len(checkpoints) >= 3


def test_the_decode_inputs_page_the_same_keys():
    from fagen.bench.decode import make_decode_inputs

    inputs = make_decode_inputs(_Tiny.config, 2, 64, "cpu")
    table = inputs.block_table
    assert table.dtype == torch.int32 and table.shape == (2, 4)
    assert sorted(table.flatten().tolist()) == list(range(8)) and table.flatten().tolist() != list(range(8))
    for b in range(2):
        for page in range(4):
            assert torch.equal(inputs.k_pages[table[b, page]], inputs.k_cache[b, 16 * page:16 * (page + 1)])
            assert torch.equal(inputs.v_pages[table[b, page]], inputs.v_cache[b, 16 * page:16 * (page + 1)])
    assert inputs.cache_seqlens.tolist() == [64, 64] and inputs.cache_seqlens.dtype == torch.int32
    q, k, v = inputs.torch_layout()
    assert q.shape == (2, 4, 1, 16) and k.shape == (2, 2, 64, 16) and k.is_contiguous()


def test_an_sdpa_backend_without_gqa_runs_on_expanded_kv_and_is_counted_so():
    from fagen.bench.decode import SdpaDecode, make_decode_inputs, measure_decode

    class NoGqa(SdpaDecode):
        def _call(self, q, k, v, gqa):
            if gqa:
                raise RuntimeError("No available kernel. Aborting execution.")
            return super()._call(q, k, v, gqa)

    config = _Tiny.config
    inputs = make_decode_inputs(config, 2, 64, "cpu")
    cell = measure_decode(NoGqa("sdpa_flash"), inputs, config, fake_timer, {}, batch=2, cache_len=64)
    assert cell["expanded"] and cell["kv_heads_read"] == 4 and cell["bytes"] == config.decode_bytes(4)
    assert cell["gqa"].startswith("K/V expanded to 4 heads beforehand (enable_gqa refused: RuntimeError: No avail")
    step, _ = NoGqa("sdpa_flash").prepare(inputs, config)
    exact, _ = SdpaDecode("sdpa_math").prepare(inputs, config)
    assert (step().float() - exact().float()).abs().max() < 1e-2   # expanding kept the head mapping


def test_the_decode_section_keeps_to_its_deadline():
    from fagen.bench.decode import FLEX_GUARD_REASON

    section = decode_section(deadline=passed_deadline())
    assert section["status"] == "partial" and section["not_run"] == _Tiny.config.timed_runs()
    assert all(cell["skipped"].startswith(GUARD_REASON) for p in section["points"] for cell in p["results"].values())
    assert section["sanity"] == {} and "sanity not run" in section["note"]
    # 10 s left on a frozen clock: everything runs but Flex, whose compile needs 20.
    section = decode_section(deadline=Deadline(10.0, clock=lambda: 0.0))
    assert section["points"][0]["results"]["flex"] == {"skipped": FLEX_GUARD_REASON}
    assert section["not_run"] == 1 and "tb_per_s" in section["points"][0]["results"]["fagen_paged"]


def test_the_decode_section_flags_a_wrong_kernel_and_stops_on_a_lost_context():
    from fagen.bench.decode import FagenDecode, FagenVarlen

    class Wrong(FagenDecode):
        def prepare(self, inputs, config):
            step, info = super().prepare(inputs, config)
            return (lambda: step() * 1.05), info

    class Faults(FagenVarlen):
        def forward(self, q, k, v, causal):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    section = decode_section({"fagen": lambda: Wrong(paged=False)})
    assert not section["sanity"]["fagen"]["ok"] and section["sanity"]["fagen_paged"]["ok"]
    assert "SANITY FAILED: fagen" in section["note"]
    section = decode_section({"fagen_varlen": Faults})
    assert section["status"] == "error" and "CUDA context was lost at fagen varlen's sanity check" in section["note"]
    assert "flex" not in section["points"][0]["results"]   # nothing ran after it
    assert "fagen_padded" not in section["points"][1]["results"]


def test_the_decode_section_uses_the_peak_sections_copy_bandwidth():
    section = decode_section(copy_tb_per_s=4.5, measure_copy=lambda: pytest.fail("measured again"),
                             plan=Plan(decode=DecodeConfig(**{**_Tiny.config.__dict__, "varlen_systems": (),
                                                              "decode_systems": ("sdpa_math",)})))
    assert section["copy"] == {"tb_per_s": 4.5, "source": "the peak section's device copy (read + write bytes)"}
    assert len(section["points"]) == 1 and section["points"][0]["results"]["sdpa_math"]["copy_fraction"] > 0


# -- the models section ------------------------------------------------------------------------

def test_the_plan_has_a_models_section_after_decode():
    plan, quick = full_plan(), quick_plan()
    m = plan.models
    assert SECTIONS.index("decode") < SECTIONS.index("models") < SECTIONS.index("memory")
    assert "models" in OPTIONAL_SECTIONS
    # The row: a 1B-class Llama, bf16, B=1 x 4096, fagen against SDPA and Flex; generate on 32 prompts.
    assert (m.hidden_size, m.intermediate_size, m.layers, m.heads, m.kv_heads, m.head_dim, m.vocab_size) == (
        2048, 8192, 16, 32, 8, 64, 32000)
    assert (m.dtype, m.train_batch, m.train_seqlen, m.train_tokens) == ("bf16", 1, 4096, 4096)
    assert m.train_systems == ("fagen", "sdpa", "flex_attention") and m.decode_systems == ("fagen", "sdpa")
    assert (m.decode_batch, m.new_tokens) == (32, 32)
    # Its cap is in the forecast, and the whole check still fits with the sweep at its minimum.
    estimate = replay(plan, sanitizers=True)
    assert 0 < estimate["models"] == m.estimate_seconds() <= m.cap_s == 40.0
    assert sum_without_the_sweep(plan) + plan.min_speed_s <= plan.budget_s
    # --quick: the training row against SDPA only, a smaller cap, inside its budget.
    assert quick.models.train_systems == ("fagen", "sdpa") and quick.models.decode_systems == ()
    assert 0 < replay(quick, sanitizers=True)["models"] < estimate["models"] and quick.models.cap_s < m.cap_s
    assert replay(quick, sanitizers=True)["total"] < quick.budget_s
    off = ModelsConfig(train_systems=(), decode_systems=())
    assert not off.enabled and off.estimate_seconds() == 0.0
    assert "  models: none in this plan" in describe(Plan(models=off))
    # Prompts: seeded, the first the longest (the padded width), all within the plan's range.
    lengths = m.prompt_lengths()
    assert len(lengths) == 32 and lengths[0] == 128 == max(lengths) and min(lengths) >= 64
    assert len(set(lengths)) > 10 and lengths == m.prompt_lengths() != ModelsConfig(seed=1).prompt_lengths()
    # fagen's kernels: the training step's plain causal one is the sweep's (bf16 d=64); generate's varlen is new.
    assert plan.models_kernels() == 1 and Plan(systems=("sdpa_flash",)).models_kernels() == 2
    assert Plan(models=ModelsConfig(train_systems=("sdpa",), decode_systems=("sdpa",))).models_kernels() == 0
    text = describe(plan)
    assert "\n  models: cap 40 s; Hugging Face transformers, Llama 1.10B" in text
    assert " models 40," in text.split("estimated seconds:")[1]


def test_the_parameter_count_is_the_models():
    transformers = pytest.importorskip("transformers")
    from fagen.bench.models import build_model

    # 2 V h + L (q, k, v, o + gate, up, down + 2 norms) + h, by hand for the plan's model.
    layer = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192 + 2 * 2048
    assert ModelsConfig().parameter_count() == 2 * 32000 * 2048 + 16 * layer + 2048 == 1_104_218_112
    assert ModelsConfig().parameter_count(layers=2) == 2 * 32000 * 2048 + 2 * layer + 2048
    for config in (TINY_MODELS, ModelsConfig()):
        model = build_model(config, "meta", torch.bfloat16)
        assert isinstance(model, transformers.LlamaForCausalLM)
        assert sum(p.numel() for p in model.parameters()) == config.parameter_count()
        assert model.config.eos_token_id is None and model.config.num_key_value_heads == config.kv_heads


def test_tokens_per_second_and_fagens_ratios():
    from fagen.bench.models_report import add_rates, tokens_per_s

    assert tokens_per_s(4096, 100.0) == pytest.approx(40960.0)
    assert tokens_per_s(32 * 32, 1024.0) == pytest.approx(1000.0)
    with pytest.raises(ValueError):
        tokens_per_s(4096, 0.0)
    section = {"rows": [{"part": "train", "results": {"fagen": {"ms": 100.0, "tokens": 4096},
                                                      "sdpa": {"ms": 125.0, "tokens": 4096},
                                                      "flex_attention": {"skipped": "boom"}}},
                        {"part": "decode", "results": {"fagen": {"skipped": "OOM"},
                                                       "sdpa": {"ms": 10.0, "tokens": 8}}}]}
    add_rates(section)
    train, decode = section["rows"]
    assert train["results"]["sdpa"]["tokens_per_s"] == pytest.approx(32768.0)
    assert train["ratios"] == {"fagen/sdpa": pytest.approx(1.25)}   # no ratio against a skipped cell
    assert decode["ratios"] == {} and decode["results"]["sdpa"]["tokens_per_s"] == pytest.approx(800.0)


def test_the_models_section_is_reserved_time_by_the_sections_before_it(tmp_path):
    plan = full_plan()
    assert reserving_run(plan, tmp_path).needs()["models"] == plan.models.cap_s == 40.0
    assert_reserved(plan, tmp_path, "models", "decode",
                    plan.models.cap_s + plan.ring.cap_s + plan.memory_cap_s + plan.report_reserve_s)
    skipped = reserving_run(plan, tmp_path, {"models"})
    assert skipped.section("models", lambda: pytest.fail("a skipped section ran")) is None
    assert skipped.results["sections"]["models"]["status"] == "skipped"


def synthetic_models():
    from fagen.bench.models import FLEX_GUARD_REASON
    from fagen.bench.models_report import decode_label, model_label, train_label

    m = ModelsConfig()
    train = {"part": "train", "label": train_label(m), "results": {
        "fagen": {"ms": 100.0, "tokens": 4096, "loss": 10.4321},
        "sdpa": {"ms": 125.0, "tokens": 4096, "loss": 10.4325},
        "flex_attention": {"skipped": FLEX_GUARD_REASON}}}
    decode = {"part": "decode", "label": decode_label(m), "results": {
        "fagen": {"ms": 1280.0, "tokens": 1024, "new_tokens": 32, "same_tokens_as_sdpa": 0.97},
        "sdpa": {"ms": 1024.0, "tokens": 1024, "new_tokens": 32}}}
    return {"status": "ok", "note": "", "transformers": "5.18.0", "not_run": 1, "rows": [train, decode],
            "config": {"model": model_label(m), "parameters": m.parameter_count(), "prompt_lengths": [128, 64]},
            "sanity": {"logits": {"ok": True, "fwd_err": 0.13, "fwd_torch_err": 0.12, "shape": "B=2 N=256, 2 layers"},
                       "logits, left-padded": {"ok": False, "fwd_err": 5.0, "fwd_torch_err": 0.12,
                                               "shape": "B=2 N=256, 2 layers"}}}


SYNTHETIC_MODELS_TABLE = """\
-- models (transformers 5.18.0): Llama 1.10B (16 layers, hidden 2048, Hq=32 Hk=8 d=64), random weights, bf16; \
SANITY FAILED: logits, left-padded
train B=1 x N=4096: forward + loss + backward
  system               ms  tokens/s fagen/this
  fagen             100.0     40960          -
  SDPA              125.0     32768       1.25
  FlexAttention  skipped: time guard (the section's deadline was reached) ...
generate: 32 prompts of 64-128 tokens, left-padded, + 32 new tokens each, greedy
  system               ms new tok/s fagen/this
  fagen            1280.0       800          -
  SDPA             1024.0      1000       0.80"""


def test_report_has_the_models_rows_with_their_tokens_per_second(tmp_path):
    results = synthetic_results()
    results["decode"], results["models"] = synthetic_decode(), synthetic_models()
    table = report.short_table(results)
    assert table.endswith(SYNTHETIC_DECODE_TABLE + "\n" + SYNTHETIC_MODELS_TABLE)
    report.write_report(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    train, decode = data["models"]["rows"]
    assert train["results"]["fagen"]["tokens_per_s"] == pytest.approx(40960.0)
    assert train["ratios"] == {"fagen/sdpa": pytest.approx(1.25)}
    assert decode["ratios"] == {"fagen/sdpa": pytest.approx(0.8)}
    md = (tmp_path / "results.md").read_text()
    assert md.index("## Decode and varlen training") < md.index("## Models (transformers)") < md.index("## Peak GPU")
    for needle in ("Llama 1.10B (16 layers, hidden 2048, Hq=32 Hk=8 d=64), random weights, bf16: 1,104,218,112 "
                   "parameters, in Hugging Face transformers 5.18.0",
                   "Prompt lengths: 128, 64.",
                   "### Train B=1 x N=4096: forward + loss + backward",
                   "| system | ms | tokens/s | fagen / this | note |",
                   "| fagen | 100.0 | 40960 | - | loss 10.4321 |",
                   "| SDPA | 125.0 | 32768 | 1.25 | loss 10.4325 |",
                   "| FlexAttention | - | - | - | skipped: time guard (the section's deadline was reached) (too little "
                   "left for a Flex compile) |",
                   "### Generate: 32 prompts of 64-128 tokens, left-padded, + 32 new tokens each, greedy",
                   "| system | ms | new tokens/s | fagen / this | note |",
                   "| fagen | 1280.0 | 800 | - | 32 new tokens per prompt; 97% of the new tokens are SDPA's |",
                   "| SDPA | 1024.0 | 1000 | 0.80 | 32 new tokens per prompt |",
                   "| logits, left-padded | False | 5.00e+00 | 1.20e-01 | - | B=2 N=256, 2 layers |"):
        assert needle in md, needle




TINY_MODELS = ModelsConfig(hidden_size=64, intermediate_size=128, layers=2, heads=4, kv_heads=2, head_dim=16,
                           vocab_size=96, train_seqlen=64, decode_batch=4, prompt_len=16, min_prompt_len=8,
                           new_tokens=4, sanity_seqlen=32)


def models_section(config=TINY_MODELS, deadline=None, **kwargs):
    """The section on the CPU (fagen on its emulator) with the stand-in timer. The deadline's
    frozen clock leaves 10 s: everything runs but Flex, whose compile needs 20 (Flex trains only on
    a GPU, and compiling it for the CPU would take longer than the rest)."""
    pytest.importorskip("transformers")
    from fagen.bench.models import run_models_section

    return run_models_section(Plan(models=config), deadline or Deadline(10.0, clock=lambda: 0.0), device="cpu",
                              timer=fake_timer, log=lambda line: None, **kwargs)


def test_the_models_section_end_to_end_on_the_emulator(tmp_path, monkeypatch):
    """transformers' Llama built once, trained and decoded through fagen (emulated) and SDPA, after
    fagen's logits are checked against fp32 eager; Flex cut by the time guard."""
    from fagen.bench.models import FLEX_GUARD_REASON

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    checkpoints = []
    section = models_section(checkpoint=lambda s: checkpoints.append(s["status"]))
    assert section["status"] == "partial" and section["not_run"] == 1, section["note"]
    assert section["transformers"] == pytest.importorskip("transformers").__version__
    train, decode = section["rows"]
    assert [train["part"], decode["part"]] == ["train", "decode"]
    for name in ("fagen", "sdpa"):
        cell = train["results"][name]
        assert cell["tokens"] == 64 and cell["tokens_per_s"] == pytest.approx(64 / 2e-3)
        cell = decode["results"][name]
        assert (cell["tokens"], cell["new_tokens"]) == (4 * 4, 4) and cell["tokens_per_s"] == pytest.approx(8000)
    # One model switched between systems: the same weights and tokens give the same loss.
    assert train["results"]["fagen"]["loss"] == pytest.approx(train["results"]["sdpa"]["loss"], abs=0.05)
    assert 0.0 <= decode["results"]["fagen"]["same_tokens_as_sdpa"] <= 1.0
    assert train["results"]["flex_attention"] == {"skipped": FLEX_GUARD_REASON}
    assert train["ratios"] == {"fagen/sdpa": pytest.approx(1.0)} and decode["ratios"] == {"fagen/sdpa": 1.0}
    sanity = section["sanity"]
    assert set(sanity) == {"logits", "logits, left-padded"} and all(r["ok"] for r in sanity.values()), sanity
    assert sanity["logits"]["fwd_err"] > 0 and sanity["logits"]["shape"] == "B=2 N=32, 2 layers"
    assert "train tokens/s, fagen / SDPA 1.00" in section["note"] and "sanity ok" in section["note"]
    assert "time guard: 1 measurements not run" in section["note"]
    assert len(checkpoints) >= 4


def test_the_models_sanity_flags_a_fagen_that_ignores_causality(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from fagen.bench.models import import_transformers, model_sanity
    from fagen.integrations.transformers import attention_forward

    import_transformers()

    def non_causal(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, **{**kwargs, "is_causal": False})

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "fagen", non_causal)
    sanity = model_sanity(TINY_MODELS, "cpu")
    for result in sanity.values():
        assert not result["ok"] and result["fwd_err"] > 2 * result["fwd_torch_err"], sanity


def test_a_system_that_raises_is_a_skipped_cell_and_a_lost_context_stops_the_section(monkeypatch):
    transformers = pytest.importorskip("transformers")

    def raises(message):
        def attention(*args, **kwargs):
            raise RuntimeError(message)
        return attention

    mapping = transformers.AttentionInterface._global_mapping
    monkeypatch.setitem(mapping, "broken", raises("boom"))
    monkeypatch.setitem(mapping, "faults", raises("CUDA error: an illegal memory access was encountered"))
    config = dataclasses.replace(TINY_MODELS, train_systems=("broken", "sdpa"), decode_systems=())
    section = models_section(config)
    cells = section["rows"][0]["results"]
    assert cells["broken"] == {"skipped": "RuntimeError: boom", "oom": False} and "ms" in cells["sdpa"]
    assert section["status"] == "ok" and section["sanity"] == {}   # no fagen in the plan: nothing to check
    config = dataclasses.replace(TINY_MODELS, train_systems=("faults", "sdpa"))
    section = models_section(config)
    assert section["status"] == "error" and "CUDA context was lost at train faults" in section["note"]
    assert section["rows"][0]["results"]["sdpa"] == {"skipped": "not run: the CUDA context was lost"}
    assert set(section["rows"][1]["results"]) == {"fagen", "sdpa"}   # every cell says why it has no number


def test_without_transformers_the_models_section_skips_itself(monkeypatch):
    from fagen.bench import models
    from fagen.bench.models_report import short_lines

    def missing():
        raise ModuleNotFoundError("No module named 'transformers'")

    monkeypatch.setattr(models, "import_transformers", missing)
    section = models.run_models_section(full_plan(), open_deadline(), log=lambda line: None)
    assert section["status"] == "skipped" and "No module named 'transformers'" in section["note"]
    cells = [cell for row in section["rows"] for cell in row["results"].values()]
    assert len(cells) == 5 and all("does not import" in cell["skipped"] for cell in cells)
    table = "\n".join(short_lines({"models": section}))
    assert "-- models (transformers missing)" in table and "  fagen          skipped: transformers" in table
    assert models.run_models_section(Plan(models=ModelsConfig(train_systems=(), decode_systems=())),
                                     passed_deadline())["note"] == "no models section in this plan"


def test_the_models_section_keeps_to_its_deadline():
    from fagen.bench.models_report import short_lines

    section = models_section(deadline=passed_deadline())
    assert section["status"] == "partial" and section["not_run"] == 5 and section["sanity"] == {}
    assert all(cell == {"skipped": GUARD_REASON} for row in section["rows"] for cell in row["results"].values())
    assert "sanity not run" in section["note"] and "time guard: 5 measurements not run" in section["note"]
    assert "  SDPA           skipped: time guard" in "\n".join(short_lines({"models": section}))


# -- the ring section (context parallelism) ----------------------------------------------------

def test_the_plan_has_a_ring_section_after_models():
    plan, quick = full_plan(), quick_plan()
    r = plan.ring
    assert SECTIONS.index("models") < SECTIONS.index("ring") < SECTIONS.index("memory")
    assert "ring" in OPTIONAL_SECTIONS
    # The shape: bf16, B=1, N=16k, H=Hk=16, d=128, causal, both layouts; the model at W = 2, 4, 8.
    assert (r.dtype, r.batch, r.seqlen, r.heads, r.kv_heads, r.head_dim, r.causal) == (
        "bf16", 1, 16384, 16, 16, 128, True)
    assert r.layouts == ("zigzag", "contiguous") and r.model_worlds == (2, 4, 8)
    # The plain op, per layout the ring and its pairs (3 + 1), one full pair per world: 10 measurements.
    assert r.timed_runs() == 1 + (1 + 3) + (1 + 1) + 3
    estimate = replay(plan, sanitizers=True)
    assert estimate["ring"] == r.estimate_seconds() == 5.0 and r.cap_s == 10.0
    # The whole check still fits with the sweep at its minimum, and --quick inside its budget.
    assert sum_without_the_sweep(plan) + plan.min_speed_s <= plan.budget_s
    assert replay(quick, sanitizers=True)["total"] < quick.budget_s
    off = Plan(ring=dataclasses.replace(r, layouts=()))
    assert off.ring.estimate_seconds() == 0.0 and "  ring: none in this plan" in describe(off)


def test_the_ring_section_is_reserved_time_by_the_sections_before_it(tmp_path):
    plan = full_plan()
    assert reserving_run(plan, tmp_path).needs()["ring"] == plan.ring.cap_s == 10.0
    assert_reserved(plan, tmp_path, "ring", "models", plan.ring.cap_s + plan.memory_cap_s + plan.report_reserve_s)
    skipped = reserving_run(plan, tmp_path, {"ring"})
    assert skipped.section("ring", lambda: pytest.fail("a skipped section ran")) is None


def test_the_ring_steps_pairs_come_from_step_blocks():
    from fagen.bench.ring import pair_equivalents, ring_pairs

    # World 1: zigzag's two causal halves and one full block; contiguous's causal whole.
    assert [(b.q_chunk, b.k_chunk, b.causal) for b in ring_pairs("zigzag")] == [(0, 0, True), (1, 0, False),
                                                                                 (1, 1, True)]
    assert [(b.q_chunk, b.k_chunk, b.causal) for b in ring_pairs("contiguous")] == [(0, 0, True)]
    assert pair_equivalents("zigzag", 1) == 2.0 and pair_equivalents("contiguous", 1) == 0.5
    # Zigzag balances: every step with a transfer in flight holds 2 full blocks on every rank.
    assert [pair_equivalents("zigzag", w) for w in (2, 4, 8)] == [2.0, 2.0, 2.0]
    # Contiguous does not: from step 1 rank 0 holds only later keys and idles while the block moves.
    assert pair_equivalents("contiguous", 4) == 0


def test_the_overlap_model_computes_compute_transfer_and_overlap():
    from fagen.bench.ring_report import RingConfig, overlap_row

    c = RingConfig()
    # W = 2: chunks of 4096; the K/V block is 2 x 1 x 8192 x 16 x 128 x 2 bytes = 67.1 MB.
    assert c.chunk(2) == 4096 and c.chunk(8) == 1024
    assert c.kv_bytes(2) == 2 * 8192 * 16 * 128 * 2 == 67_108_864
    row = overlap_row(2, 2.0, 0.4, c.kv_bytes(2), c.links)
    assert row["compute_ms"] == pytest.approx(0.8)
    nvlink, ib = row["links"]["NVLink 4"], row["links"]["IB NDR"]
    assert nvlink["transfer_ms"] == pytest.approx(67_108_864 / 450e9 * 1e3) == pytest.approx(0.14913, rel=1e-4)
    assert nvlink["overlap"] == 1.0   # 0.149 ms under 0.8 ms of kernels: hidden
    assert ib["transfer_ms"] == pytest.approx(1.34218, rel=1e-5)
    assert ib["overlap"] == pytest.approx(0.8 / 1.34218, rel=1e-5)   # 60 % hidden, the rest exposed


def synthetic_ring():
    from fagen.bench.ring_report import RingConfig, overlap_row

    c = RingConfig()
    rows = [{"world": 2, "chunk": 4096, **overlap_row(2, 2.0, 0.4, c.kv_bytes(2), c.links)},
            {"world": 4, "chunk": 2048, **overlap_row(4, 2.0, 0.12, c.kv_bytes(4), c.links)},
            {"world": 8, "chunk": 1024, "skipped": "time guard (the section's deadline was reached)"}]
    return {"status": "failed", "note": "", "backend": "nccl", "plain": {"ms": 3.2},
            "config": {"label": c.label, "cap_s": 20.0},
            "layouts": {"zigzag": {"equal": {"ok": True, "max_err": 0.0039, "tol": 0.0625}, "ring": {"ms": 3.36},
                                   "pairs": {"ms": 3.28, "count": 3}},
                        "contiguous": {"equal": {"ok": False, "max_err": 0.5, "tol": 0.0625},
                                       "ring": {"skipped": "RuntimeError: launch failed"},
                                       "pairs": {"ms": 3.2, "count": 1}}},
            "model": {"label": "model, not measured", "links": dict(c.links), "rows": rows}}


SYNTHETIC_RING_TABLE = """\
-- ring, world 1 (nccl): bf16 B=1 N=16k H=16 Hk=16 d=128 causal; plain 3.200 ms
zigzag     ok     err 3.9e-03 tol 6.2e-02; ring 3.360 ms 1.05x; 3 pairs 3.280 ms 1.02x
contiguous FAILED err 5.0e-01 tol 6.2e-02; ring -; 1 pairs 3.200 ms 1.00x; skipped: RuntimeError: launch failed
MODEL, not measured (zigzag step): compute ms | transfer ms (overlap) over NVLink 4 450, IB NDR 50 GB/s (assumed)
  W=2 0.800 | 0.149 (1.00), 1.342 (0.60); W=4 0.240 | 0.075 (1.00), 0.671 (0.36); W=8 skipped: time guard (the..."""


def test_report_has_the_ring_rows_and_the_labelled_model(tmp_path):
    results = synthetic_results()
    results["ring"] = synthetic_ring()
    table = report.short_table(results)
    assert table.endswith(SYNTHETIC_RING_TABLE)
    report.write_report(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["ring"]["layouts"]["zigzag"]["ring/plain"] == pytest.approx(1.05)
    md = (tmp_path / "results.md").read_text()
    assert md.index("## Ring attention (context parallelism)") < md.index("## Peak GPU")
    for needle in ("`fagen.distributed.ring_attention` in a single-rank process group (nccl), bf16 B=1 N=16k",
                   "| zigzag | True | 3.90e-03 | 6.25e-02 | 3.360 | 3 | 3.280 | 1.05 | 1.02 |  |",
                   "| contiguous | False | 5.00e-01 | 6.25e-02 | - | 1 | 3.200 | - | 1.00 | skipped: RuntimeError: "
                   "launch failed |",
                   "### Overlap at W ranks (model, not measured)",
                   "assumed per direction: NVLink 4 450 GB/s, IB NDR 50 GB/s (vendor specs, not measured)",
                   "| 2 | 4096 | 2.0 | 0.400 | 0.800 | 67.1 | 0.149 | 1.00 | 1.342 | 0.60 |",
                   "Not modelled: W=8: skipped: time guard"):
        assert needle in md, needle


def test_the_short_table_with_every_section_still_fits_the_returned_output():
    plan = full_plan()
    points = [{"pass": p, "dtype": c.dtype, "head_dim": c.head_dim, "causal": c.causal, "seqlen": n,
               "batch": plan.batch(n), "heads": plan.heads(c.head_dim), "flops": 1.0,
               "results": {s: {"tflops": 555.5} for s in plan.systems}}
              for c in plan.configs() for n in plan.seqlens for p in plan.passes]
    results = {"speed": {"points": points}, "variants": synthetic_variants(), "decode": synthetic_decode(),
               "models": synthetic_models(), "ring": synthetic_ring(), "meta": {"device": "NVIDIA H200"}}
    table = report.short_table(results)
    assert table.endswith(SYNTHETIC_RING_TABLE)
    # The whole table still comes back in the device tool's last 12,000 characters (the summary
    # printed before it is cut first; results.md holds it whole).
    assert len(table) < 11_750


def test_the_ring_section_end_to_end_on_the_emulator():
    """A gloo world-1 group on the CPU, fagen on its emulator, the stand-in timer: both layouts
    equal the plain op, every cell measured, the model filled in, and the group shut down."""
    import torch.distributed as dist

    from fagen.bench.ring import run_ring_section
    from fagen.bench.ring_report import RingConfig

    plan = Plan(ring=RingConfig(seqlen=64, heads=2, kv_heads=2, head_dim=16, model_worlds=(2, 4)))
    section = run_ring_section(plan, open_deadline(), device="cpu", timer=fake_timer, log=lambda line: None)
    assert not dist.is_initialized()
    assert section["status"] == "ok" and section["backend"] == "gloo", section
    for layout, pairs in (("zigzag", 3), ("contiguous", 1)):
        cell = section["layouts"][layout]
        assert cell["equal"]["ok"] and cell["equal"]["max_err"] <= cell["equal"]["tol"]
        assert cell["pairs"] == {"ms": 2.0 * pairs, "each_ms": [2.0] * pairs, "count": pairs}
        assert cell["ring/plain"] == 1.0
    rows = section["model"]["rows"]
    assert [(r["world"], r["chunk"], r["compute_ms"]) for r in rows] == [(2, 16, 4.0), (4, 8, 4.0)]
    # Out of time: every measurement is a recorded skip, not a crash.
    late = run_ring_section(plan, Deadline(0.0, clock=lambda: 1.0), device="cpu", timer=fake_timer,
                            log=lambda line: None)
    assert late["layouts"]["zigzag"]["ring"] == {"skipped": "time guard (the section's deadline was reached)"}
    assert late["status"] == "ok" and not dist.is_initialized()
