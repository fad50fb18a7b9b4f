"""The GPU check against its budget and its GPU, on any machine.

- Time: the sections' reserves against the budget, and each section's deadline where the
  forecast says it starts, replayed through the run's own deadlines with a fake clock (a test
  that read the wall clock would depend on how busy the machine is).
- Kernels: what the precompile section builds for an H200 against what the gpu tests (a record
  run of them) and the sections (their own runners, small) load there.
- Versions: what the dry run says it found.
"""

import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

import pytest

from fagen.bench import gpu_check, schedule
from fagen.bench.gpu_check import _Run
from fagen.bench.models.config import ModelsConfig
from fagen.bench.plan import SECTIONS, Plan, full_plan, quick_plan
from fagen.bench.plan_text import describe
from fagen.bench.precompile import GPU_TEST_KERNELS
from fagen.bench.speed.config import FAGEN_SYSTEMS

REPO = Path(__file__).resolve().parents[2]
PLANS = {"full": full_plan, "quick": quick_plan}
SANITIZER = "/usr/local/cuda/bin/compute-sanitizer"   # where the H200 machine has it
H200 = "sm_90"


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def with_sanitizer(monkeypatch, found: bool) -> None:
    monkeypatch.setattr(gpu_check, "find_compute_sanitizer", lambda: SANITIZER if found else None)


def quiet_run(plan, tmp_path, clock, skip=()):
    return _Run(plan, tmp_path, set(skip), log=lambda line: None, clock=clock)


# -- the time budget ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", PLANS)
def test_with_the_sanitizer_found_the_reserves_add_up_to_at_most_the_budget(name, monkeypatch, tmp_path):
    plan = PLANS[name]()
    with_sanitizer(monkeypatch, True)
    needs = quiet_run(plan, tmp_path, FakeClock()).needs()
    assert needs["sanitizers"] == 2 * plan.sanitizer_cap_s > 0
    assert sum(needs.values()) <= plan.budget_s
    assert schedule.fits(plan, sanitizers=True) is None


@pytest.mark.parametrize("found", [True, False], ids=["sanitizer found", "no sanitizer"])
@pytest.mark.parametrize("name", PLANS)
def test_each_section_gets_its_cap_when_it_starts_as_estimated(name, found, monkeypatch, tmp_path):
    """The forecast replayed through the run's own deadlines: each section starts where the ones
    before it ended (each having taken its forecast, within its deadline); there, its deadline
    leaves it its whole cap (the sweep: its floor), and the run ends inside the budget, at the
    dry run's estimate."""
    plan = PLANS[name]()
    with_sanitizer(monkeypatch, found)
    clock = FakeClock()
    run = quiet_run(plan, tmp_path, clock)
    needs, forecast = run.needs(), schedule.forecast(plan, sanitizers=found)
    for section in SECTIONS:
        room = run.budget.remaining() if section in schedule.UNGUARDED else run.deadline(section).remaining()
        assert room >= needs[section], (f"{section} starts at {run.budget.elapsed():.0f} s with {room:.1f} s left "
                                        f"of its {needs[section]:.0f} s")
        clock.now += min(forecast[section], room)
    assert run.budget.elapsed() <= plan.budget_s
    assert run.budget.elapsed() == pytest.approx(schedule.replay(plan, sanitizers=found)["total"])


def test_a_skipped_section_gives_its_reserve_to_the_sweep(monkeypatch, tmp_path):
    plan = full_plan()
    with_sanitizer(monkeypatch, True)
    run, skipped = quiet_run(plan, tmp_path, FakeClock()), quiet_run(plan, tmp_path, FakeClock(), skip={"variants"})
    assert skipped.needs()["variants"] == 0.0
    assert skipped.deadline("speed").remaining() == run.deadline("speed").remaining() + plan.variants.cap_s


@pytest.mark.parametrize("found", [True, False], ids=["sanitizer found", "no sanitizer"])
@pytest.mark.parametrize("name", PLANS)
def test_the_dry_runs_estimate_is_within_the_budget(name, found):
    plan = PLANS[name]()
    line = schedule.estimate_line(plan, sanitizer_found=found)
    with_runs, without, budget = map(int, re.fullmatch(
        r"estimated (\d+) s with compute-sanitizer's two runs \((?:not )?found here\), (\d+) s without, "
        r"of a (\d+) s budget", line).groups())
    assert budget == plan.budget_s and with_runs <= budget and without <= budget


def test_a_plan_over_its_budget_is_told_apart():
    tight = dataclasses.replace(full_plan(), budget_s=300.0)
    assert "over the 300 s budget" in schedule.fits(tight, sanitizers=True)
    assert "over the 300 s budget" in describe(tight)


# -- the kernels -------------------------------------------------------------------------------

def recorded_by_precompile(plan: Plan, arch: str) -> tuple[list, list]:
    """The names precompile's two recorders give (what it compiles), for `arch`."""
    from fagen.bench.precompile import record_section_kernels, record_test_kernels

    sections, tests = record_section_kernels(plan, arch), record_test_kernels(arch)
    assert not sections.errors and not tests.errors, sections.errors + tests.errors
    return sections.names, tests.names


def recorded_from_the_sections(plan: Plan, arch: str) -> list:
    """The names the sections' own runners load for `arch`, at small sizes, each measurement
    one call (kernels do nothing under the recording, so the sanity checks fail: no matter)."""
    from fagen.kernel_record import Recorded, identity_for, recording

    recorded = Recorded()
    with recording(identity_for(arch), recorded):
        for section in (_sweep, _variants, _decode, _models, _ring, _memory, _sanitizers):
            section(plan)
    return recorded.names


def _one_call(fn, **kwargs):
    from fagen.bench.timing import Timing

    fn()
    return Timing(median_ms=1.0, min_ms=1.0, max_ms=1.0, repeats=1, host_ms=1.0)


def _open_deadline():
    from fagen.bench.timing import Deadline

    return Deadline(float("inf"), clock=lambda: 0.0)


def _sweep(plan: Plan) -> None:
    from fagen.bench.peers import make_system
    from fagen.bench.speed.run import run_speed_sweep

    small = dataclasses.replace(plan, seqlens=(64,), tokens_per_batch=64)
    systems = [make_system(n) for n in plan.systems if n in FAGEN_SYSTEMS]
    for system in systems:   # as on an H200, where the sm90 family's system runs (here: no GPU)
        system.unavailable_reason = lambda: None
    run_speed_sweep(small, systems, _open_deadline(), device="cpu", timer=_one_call, log=lambda line: None)


def _variants(plan: Plan) -> None:
    from fagen.bench.variants.run import default_factories, run_variant_sweep

    factories = default_factories()
    make_sm90 = factories["fagen_sm90"]

    def sm90(case):   # as on an H200, where the sm90 family's system runs (here: no GPU)
        system = make_sm90(case)
        system.unavailable_reason = lambda: None
        return system

    factories["fagen_sm90"] = sm90
    small = dataclasses.replace(plan.variants, seqlen=128, systems=("fagen_v2", "fagen_sm90", "fagen_v2_nomod"))
    run_variant_sweep(dataclasses.replace(plan, variants=small), _open_deadline(), device="cpu", timer=_one_call,
                      log=lambda line: None, factories=factories)


def _decode(plan: Plan) -> None:
    from fagen.bench.decode.run import default_factories, run_decode_section

    factories = default_factories()
    for name in ("fagen_sm90", "fagen_sm90_paged"):
        def available(make=factories[name]):   # as on an H200, where the sm90 family's systems run (here: no GPU)
            system = make()
            system.unavailable_reason = lambda: None
            return system
        factories[name] = available
    d = plan.decode
    small = dataclasses.replace(d, batch=1, cache_len=d.page_size, sanity_shape=(1, d.page_size), varlen_tokens=192,
                                documents=3, graph_shape=(1, d.page_size) if d.graph_shape else (),
                                decode_systems=tuple(s for s in d.decode_systems if s.startswith("fagen")),
                                varlen_systems=tuple(s for s in d.varlen_systems if s.startswith("fagen")))
    with mock.patch("fagen.bench.decode.mla.sm90_unavailable", lambda: None):   # the sm90 MLA rows too
        run_decode_section(dataclasses.replace(plan, decode=small), _open_deadline(), device="cpu", timer=_one_call,
                           log=lambda line: None, copy_tb_per_s=1.0, factories=factories)


def _models(plan: Plan) -> None:
    """A one-layer model with the plan's attention (dtype, heads, K/V heads, head dim)."""
    try:
        import fagen.integrations.transformers  # noqa: F401
    except ImportError:
        return   # the section skips itself, and precompile records no kernel for it
    from fagen.bench.models.run import run_models_section

    m = plan.models
    tiny = ModelsConfig(hidden_size=128, intermediate_size=128, layers=1, heads=m.heads, kv_heads=m.kv_heads,
                        head_dim=m.head_dim, vocab_size=64, dtype=m.dtype, train_seqlen=32, decode_batch=2,
                        prompt_len=16, min_prompt_len=8, new_tokens=2, sanity_layers=1, sanity_seqlen=16,
                        train_systems=tuple(s for s in m.train_systems if s == "fagen"),
                        decode_systems=tuple(s for s in m.decode_systems if s == "fagen"))
    run_models_section(Plan(models=tiny), _open_deadline(), device="cpu", timer=_one_call, log=lambda line: None)


def _ring(plan: Plan) -> None:
    from fagen.bench.ring.run import run_ring_section

    small = dataclasses.replace(plan.ring, seqlen=256)
    run_ring_section(dataclasses.replace(plan, ring=small), _open_deadline(), device="cpu", timer=_one_call,
                     log=lambda line: None)


def _memory(plan: Plan) -> None:
    """The memory section's systems as its peak_memory calls them (its runner needs CUDA's
    allocator statistics)."""
    from fagen.bench.peers import make_system
    from fagen.bench.measure import make_inputs

    m = plan.memory
    for name in (s for s in m.systems if s in FAGEN_SYSTEMS):
        q, k, v = make_inputs(m.batch, 64, m.heads, m.head_dim, m.dtype, "cpu")
        make_system(name).forward(q, k, v, m.causal).sum().backward()


def _sanitizers(plan: Plan) -> None:
    from fagen.bench.kernel_calls import sanitizer_workload

    sanitizer_workload("cpu")   # what the sanitizer script runs, on the GPU there


def test_recording_leaves_fagen_as_it_found_it():
    """The seams and the caches a recording swaps are the module's own again afterwards (so a
    second recording in the same process sees every kernel again), and they still exist."""
    import importlib

    import fagen.kernels.launch
    import fagen.tuning
    from fagen.bench.kernel_calls import sanitizer_workload
    from fagen.kernel_record import _CACHES, identity_for, record

    caches = [getattr(importlib.import_module(module), name) for module, name in _CACHES]
    seams = (fagen.kernels.launch.load, fagen.tuning.lookup)
    calls = [("sanitizers", lambda: sanitizer_workload("cpu"))]
    first, second = record(calls, identity_for(H200)), record(calls, identity_for(H200))
    assert first.names == second.names and len(first.names) == 4 and not first.errors
    assert (fagen.kernels.launch.load, fagen.tuning.lookup) == seams
    assert all(cache is getattr(importlib.import_module(module), name)
               for cache, (module, name) in zip(caches, _CACHES))


def in_a_fresh_process(fn, *args):
    """Recording replaces fagen's seams for its duration: keep it out of this test process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=600)


@pytest.fixture(scope="module")
def gpu_tests_record(tmp_path_factory) -> dict:
    """The gpu tests run under fagen.bench.record_plugin for an H200: the kernels each loads."""
    out = tmp_path_factory.mktemp("record") / "kernels.json"
    env = dict(os.environ, FAGEN_RECORD_KERNELS=str(out), FAGEN_RECORD_ARCH=H200, FAGEN_GPU_TESTS_DEVICE="cpu",
               PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "fagen.bench.record_plugin", "-m", "gpu", "-q",
                          "--tb=no", "--assert=plain", "-p", "no:cacheprovider", str(REPO / "tests")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), (run.stdout + run.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow   # records every call of the gpu tests and the sections (about 150 s on two cores)
def test_precompile_builds_the_kernels_the_gpu_tests_and_the_sections_load_on_an_h200(gpu_tests_record):
    plan = full_plan()
    sections, tests = in_a_fresh_process(recorded_by_precompile, plan, H200)
    loaded_by_sections = in_a_fresh_process(recorded_from_the_sections, plan, H200)
    loaded_by_tests = set(gpu_tests_record["names"])
    assert set(tests) == loaded_by_tests, {"not built": loaded_by_tests - set(tests),
                                           "not loaded": set(tests) - loaded_by_tests}
    assert set(sections) == set(loaded_by_sections), {"not built": set(loaded_by_sections) - set(sections),
                                                      "not loaded": set(sections) - set(loaded_by_sections)}
    assert set(sections) | set(tests) == set(loaded_by_sections) | loaded_by_tests
    assert len(loaded_by_tests) == GPU_TEST_KERNELS   # the precompile forecast's count
    # The kernel-level tests' own Specs are there, and the op-level calls carry the H200's tiles.
    from fagen.spec import Spec
    from fagen.tuning import fallback_spec

    assert Spec(256, version=1, dtype="bf16", deterministic=True, dropout=True).name in loaded_by_tests
    h200_causal = fallback_spec(Spec(128, dtype="bf16", mask="causal"), H200)
    assert h200_causal != Spec(128, dtype="bf16", mask="causal") and h200_causal.name in loaded_by_tests


def test_precompile_compiles_what_it_records(tmp_path, monkeypatch):
    """The section itself (spawned recorders and compilers) on a plan of one sweep kernel and the
    document-mask variant: each kernel its recorder reports, compiled for the H200's target."""
    from fagen.bench.decode.config import DecodeConfig
    from fagen.bench.precompile import precompile
    from fagen.bench.ring.config import RingConfig
    from fagen.bench.variants.config import VariantsConfig

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    small = Plan(systems=("fagen_v2",), dtypes=("bf16",), head_dims=(128,), causal=(True,),
                 variants=VariantsConfig(cases=("document",), systems=("fagen_v2",)),
                 decode=DecodeConfig(decode_systems=(), varlen_systems=(), graph_shape=(), mla_systems=()),
                 models=ModelsConfig(train_systems=(), decode_systems=()), ring=RingConfig(layouts=()),
                 memory=dataclasses.replace(full_plan().memory, systems=()))
    section = precompile(small, H200, timeout_s=300, workers=2, include_tests=False)
    sections, _ = in_a_fresh_process(recorded_by_precompile, small, H200)
    assert section["status"] == "ok" and section["target"] == H200, section
    # The sweep's kernel, the document mask's, and the sanitizer workload's four (fp16 d=64, v2 and v1, causal or not).
    assert set(section["kernels"]) == set(sections) and len(sections) == 6
    assert all(info["arch"] == H200 and info["resources"] for info in section["kernels"].values())
    # The document mask's kernels with the tiles the H200's call takes (kernels.spill_free; its
    # backward at the fallback tiles spills 32 B there): nothing precompiled spills.
    assert any(name.startswith("fa2_d128_causal_mmod") and name.endswith("_bwdn64") for name in sections), sections
    assert all(r["spill_bytes"] == 0 for info in section["kernels"].values() for r in info["resources"].values())


# -- versions ----------------------------------------------------------------------------------

def test_the_versions_line_names_what_the_check_depends_on():
    from fagen.bench.versions import found_versions, versions_line

    found = found_versions()
    line = versions_line(found)
    for name in ("python", "torch", "cupy", "cuda-bindings", "NVRTC", "transformers"):
        assert re.search(rf"(^|, ){name} \S", line), (name, line)
    assert found["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions_line({"python": "3.12.3"}).startswith("python 3.12.3, torch absent, cupy absent")


def test_an_older_transformers_than_fagens_pin_is_not_refused(monkeypatch):
    """The GPU machine has transformers 5.17 (fagen's extra pins >= 5.18; the check runs with no
    install step, so no pin applies there): the models section takes the version it finds."""
    transformers = pytest.importorskip("transformers")
    from fagen.bench.dry_run import _models_pieces

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    assert _models_pieces(full_plan()).startswith("transformers 5.17.0, attn_implementation 'fagen' registered")


def test_the_readme_quotes_the_dry_runs_estimate():
    """docs/gpu-check.md's "Checking on a GPU" gives each run's time in minutes: the dry run's estimate
    (with compute-sanitizer's runs, as on the H200 machine), rounded to the minute."""
    text = (REPO / "docs" / "gpu-check.md").read_text().split("## Checking on a GPU")[1].split("\n## ")[0]
    for name, quoted in (("full", r"the full run \(~(\d+) min\)"), ("quick", r"a subset \(~(\d+) min\)")):
        minutes = int(re.search(quoted, text).group(1))
        assert minutes == round(schedule.replay(PLANS[name](), sanitizers=True)["total"] / 60), name
