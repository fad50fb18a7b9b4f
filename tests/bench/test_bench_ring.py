"""The ring section: its plan and reserve, step_blocks' pairs, the overlap model, its report rows,
and the section end to end in a gloo world-1 group on the emulator."""

import dataclasses
import json

import pytest

from fagen.bench import report
from fagen.bench.plan import OPTIONAL_SECTIONS, SECTIONS, Plan, full_plan, quick_plan
from fagen.bench.plan_text import describe
from fagen.bench.schedule import replay
from fagen.bench.timing import Deadline

from bench_stand_ins import assert_reserved, fake_timer, open_deadline, reserving_run, sum_without_the_sweep
from bench_synthetic import SYNTHETIC_RING_TABLE, synthetic_results, synthetic_ring


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
    assert estimate["ring"] == r.estimate_seconds() == 5.0 and r.cap_s == 9.0
    # The whole check still fits with the sweep at its minimum, and --quick inside its budget.
    assert sum_without_the_sweep(plan) + plan.min_speed_s <= plan.budget_s
    assert replay(quick, sanitizers=True)["total"] < quick.budget_s
    off = Plan(ring=dataclasses.replace(r, layouts=()))
    assert off.ring.estimate_seconds() == 0.0 and "  ring: none in this plan" in describe(off)


def test_the_ring_section_is_reserved_time_by_the_sections_before_it(tmp_path):
    plan = full_plan()
    assert reserving_run(plan, tmp_path).needs()["ring"] == plan.ring.cap_s == 9.0
    assert_reserved(plan, tmp_path, "ring", "models", plan.ring.cap_s + plan.memory_cap_s + plan.report_reserve_s)
    skipped = reserving_run(plan, tmp_path, {"ring"})
    assert skipped.section("ring", lambda: pytest.fail("a skipped section ran")) is None


def test_the_ring_steps_pairs_come_from_step_blocks():
    from fagen.bench.ring.run import pair_equivalents, ring_pairs

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
    from fagen.bench.ring.config import RingConfig, overlap_row

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


def test_the_ring_section_end_to_end_on_the_emulator():
    """A gloo world-1 group on the CPU, fagen on its emulator, the stand-in timer: both layouts
    equal the plain op, every cell measured, the model filled in, and the group shut down."""
    import torch.distributed as dist

    from fagen.bench.ring.config import RingConfig
    from fagen.bench.ring.run import run_ring_section

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
