"""The variants section: its plan, its reserve, each variant's mods against fagen's oracle, the
section end to end on the emulator, its deadline and Flex allowance, and its report rows."""

import json

import pytest
import torch

from fagen.bench import report
from fagen.bench.measure import GUARD_REASON, torch_attention
from fagen.bench.plan import OPTIONAL_SECTIONS, SECTIONS, Plan, full_plan, quick_plan
from fagen.bench.schedule import replay
from fagen.bench.variants.config import VariantsConfig

from bench_stand_ins import (Exact, Unavailable, assert_reserved, fake_timer, open_deadline, passed_deadline,
                             reserving_run, sum_without_the_sweep)
from bench_synthetic import synthetic_results, synthetic_variants


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
    assert v.systems == ("fagen_v2", "fagen_sm90", "flex", "sdpa_flash", "fagen_v2_nomod")
    # Each variant in fagen v2, fagen sm90 and Flex (both passes), the two plain-causal peers once.
    assert v.timed_runs() == 4 * (2 + 2 + 2) + 2 * 2 == 28
    estimate = replay(plan, sanitizers=True)
    assert 0 < estimate["variants"] <= v.cap_s and sum_without_the_sweep(plan) + plan.min_speed_s <= plan.budget_s
    assert plan.variant_kernels() == 8   # each variant's kernel in the sm80 and the sm90 family
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


SMALL_VARIANTS = VariantsConfig(head_dim=16, heads=2, batch=2, seqlen=96, window=24, documents=4)


@pytest.mark.parametrize("name", SMALL_VARIANTS.cases)
def test_each_variants_flex_mods_and_dense_form_are_fagens_variant(name):
    """fagen's call (through fagen's float64 oracle), FlexAttention with the section's mods
    (eager, on CPU) and the dense torch form the sanity check uses compute one attention;
    and `visible_pairs` counts the keys the variant leaves."""
    import warnings

    from fagen.bench.variants.run import FlexVariant, make_case
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
        from fagen.bench.variants.run import FlexVariant

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
    from fagen.bench.variants.run import FagenVariant, Renamed

    return {"fagen_v2": FagenVariant, "flex": flex, "sdpa_flash": lambda case: SdpaSystem("sdpa_flash"),
            "fagen_v2_nomod": lambda case: Renamed(FagenSystem(2), "fagen_v2_nomod")}


def variant_sweep(plan, factories, deadline=None, clock=None):
    import warnings

    from fagen.bench.variants.run import run_variant_sweep

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
    from fagen.bench.variants.run import make_case, variant_sanity

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

    return {"fagen_v2": factory("fagen_v2", True), "fagen_sm90": factory("fagen_sm90", True), "flex": factory("flex"),
            "sdpa_flash": factory("sdpa_flash"), "fagen_v2_nomod": factory("fagen_v2_nomod")}


def test_the_variants_section_keeps_to_its_deadline_and_flex_allowance():
    plan = variants_plan()
    # No time at all: nothing runs, every cell says why, and the count is the plan's.
    section = variant_sweep(plan, dense_factories([]), deadline=passed_deadline())
    assert section["status"] == "partial" and "time guard" in section["note"]
    assert section["not_run"] == plan.variants.timed_runs()
    for point in section["points"]:
        for name, cell in point["results"].items():
            assert cell["skipped"].startswith(GUARD_REASON), (name, cell)
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


def test_fagen_sm90_times_each_variant_beside_fagen_v2_and_flex(tmp_path):
    """The sm90 family's system (stand-ins here): a sanity check, a forward and a forward +
    backward per variant; fagen sm90 / Flex in the note and the tables."""
    calls = []
    section = variant_sweep(variants_plan(), dense_factories(calls))
    assert section["status"] == "ok", section["note"]
    assert set(section["sanity"]) == {"fagen_v2", "fagen_sm90"}
    assert all(r["ok"] for checked in section["sanity"].values() for r in checked.values())
    for case in ("window", "softcap", "alibi", "document"):
        assert "tflops" in variant_cell(section, "fagen_sm90", case, "fwd")
        assert "tflops" in variant_cell(section, "fagen_sm90", case, "fwd_bwd")
        point = next(p for p in section["points"] if p["variant"] == case and p["pass"] == "fwd")
        assert point["ratios"]["fagen_sm90/flex"] == pytest.approx(1.0)
    # Its availability probed once (with the first case); per case a system for the sanity check
    # and one for the timed point.
    assert calls.count(("fagen_sm90", "window")) == 3 and calls.count(("fagen_sm90", "softcap")) == 2
    assert "fagen sm90 / Flex: window fwd 1.00, window f+b 1.00, softcap fwd 1.00" in section["note"]
    results = synthetic_results()
    results["variants"] = section
    report.write_report(results, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| fagen v2 | fagen sm90 | FlexAttention | SDPA flash | fagen v2 (no mod) | v2 / FlexAttention " \
           "| v2 / SDPA flash | v2 / fagen v2 (no mod) | sm90 / FlexAttention |" in md
    assert "Sanity of the fagen sm90 variant kernels" in md
    assert "pass variant  seen |   v2 sm90 flex flsh v2nm | v2/flex v2/flsh v2/v2nm s90/flex" in report.short_table(results)


def test_fagen_sm90_runs_each_variant_on_the_sm90_family(monkeypatch, tmp_path):
    """fagen sm90's variant system for real on the emulator (d = 64, the family's smallest head
    dim): its forward is the sm90 family's kernel, and it passes the section's sanity check."""
    from fagen.bench.variants.run import FagenVariant, make_case, variant_sanity
    import fagen.kernels.launch as launch

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    families, load = [], launch.load
    monkeypatch.setattr(launch, "load", lambda source, device: families.append(source.spec.arch_family)
                        or load(source, device))
    config = VariantsConfig(head_dim=64, heads=2, batch=1, seqlen=64, window=16, documents=3)
    for name in ("document",):   # a captured tensor, the heaviest: its mask_mod on the wgmma map
        case = make_case(name, config, batch=1, seqlen=64, heads=2, device="cpu")
        qkv = [torch.randn(1, 64, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
        result = variant_sanity(FagenVariant(case, "sm90"), case, *qkv)
        assert result["ok"] and "dq_err" in result, result
    assert "sm90" in families
