"""The decode section: its plan, bytes and reserve, its bandwidth arithmetic and report rows, and the
section end to end on the emulator (fagen's real calls, SDPA on CPU, eager Flex)."""

import dataclasses
import json

import pytest
import torch

from fagen.bench import report
from fagen.bench.decode.config import DecodeConfig
from fagen.bench.measure import GUARD_REASON
from fagen.bench.plan import OPTIONAL_SECTIONS, SECTIONS, Plan, full_plan, quick_plan
from fagen.bench.plan_text import describe
from fagen.bench.schedule import replay
from fagen.bench.timing import Deadline

from bench_stand_ins import assert_reserved, fake_timer, open_deadline, passed_deadline, reserving_run
from bench_synthetic import SYNTHETIC_DECODE_TABLE, synthetic_decode, synthetic_results, synthetic_variants


def test_the_plan_has_a_decode_section_after_the_variants():
    from fagen.bench.flops import attention_flops

    plan, quick = full_plan(), quick_plan()
    d = plan.decode
    assert SECTIONS.index("variants") < SECTIONS.index("decode") < SECTIONS.index("memory")
    assert "decode" in OPTIONAL_SECTIONS
    assert (d.batch, d.cache_len, d.q_heads, d.kv_heads, d.head_dim, d.dtype, d.page_size) == (
        64, 8192, 32, 8, 128, "bf16", 256)
    assert d.decode_systems == ("fagen", "fagen_paged", "fagen_fp8", "fagen_fp8_paged", "fagen_sm90", "fagen_sm90_paged",
                                "sdpa_math", "sdpa_efficient", "sdpa_flash", "flex")
    assert d.varlen_systems == ("fagen_varlen", "fagen_padded", "sdpa_padded")
    assert (d.varlen_tokens, d.varlen_heads, d.varlen_passes) == (16384, 16, ("fwd", "fwd_bwd"))
    # + the graph's two, + absorbed MLA's four systems at B = 64 and B = 1
    assert d.timed_runs() == 10 + 2 * 3 + 2 + 4 * 2 and d.pages_per_entry == 32 and d.group == 4
    assert (d.mla_systems, d.mla_batches, d.mla_cache_len, d.mla_heads) == (
        ("fagen_mla", "fagen_sm90_mla", "sdpa", "flex"), (64, 1), 8192, 128)
    # The section's cap is in the forecast, and --quick keeps it (without Flex's compile, smaller).
    estimate = replay(plan, sanitizers=True)
    assert 0 < estimate["decode"] <= d.cap_s == 31.0 and estimate["decode"] == d.estimate_seconds()
    assert "flex" not in quick.decode.decode_systems and quick.decode.cap_s < d.cap_s
    assert 0 < replay(quick, sanitizers=True)["decode"] < estimate["decode"]
    assert replay(quick, sanitizers=True)["total"] < quick.budget_s
    assert DecodeConfig(decode_systems=(), varlen_systems=(), graph_shape=(), mla_systems=()).estimate_seconds() == 0.0
    # fagen's kernels: decode step, paged, both over an 8-bit cache, both on the sm90 family, varlen; the
    # padded batch's is the sweep's causal kernel.
    assert plan.decode_kernels() == 9   # + the MLA steps' (the sm80 and the sm90 family's)
    assert Plan(systems=("sdpa_flash",)).decode_kernels() == 10
    text = describe(plan)
    assert "\n  decode: cap 31 s" in text and "decode 31" in text.split("estimated seconds:")[1]
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


def test_the_decode_section_has_a_cuda_graph_row_within_its_cap():
    """A serving step (append with rotary, split-KV, combine) captured in a CUDA graph: in both plans,
    split (so the combine kernel is in the graph), counted in the forecast, and the whole check still
    inside its budget with and without compute-sanitizer's runs."""
    plan, quick = full_plan(), quick_plan()
    for d in (plan.decode, quick.decode):
        assert d.graph_shape == (8, 4096) and d.graph_splits == 4 > 1
        d = dataclasses.replace(d, mla_systems=())   # below the cap, where the arithmetic shows
        without = dataclasses.replace(d, graph_shape=())
        assert d.timed_runs() == without.timed_runs() + 2
        assert d.estimate_seconds() == pytest.approx(without.estimate_seconds() + 1.0 + 0.3 * 2)
        assert d.estimate_seconds() <= d.cap_s
    for p in (plan, quick):
        for sanitizers in (True, False):
            assert replay(p, sanitizers=sanitizers)["total"] <= p.budget_s
    assert plan.decode.graph_label == "bf16 B=8 cache 4k Hq=32 Hk=8 d=128 Nq=1, 1 new token with rotary, 4 splits"
    assert "    CUDA graph: bf16 B=8 cache 4k Hq=32 Hk=8 d=128 Nq=1, 1 new token with rotary, 4 splits, causal;" in \
        describe(plan)
    # Alone, the row still runs (and compiles the contiguous step's kernel); without it nothing does.
    alone = DecodeConfig(decode_systems=(), varlen_systems=(), mla_systems=())
    assert alone.enabled and alone.fagen_kernels(False) == 1 and alone.timed_runs() == 2
    assert not dataclasses.replace(alone, graph_shape=()).enabled
    assert plan.decode.fagen_kernels(True) == dataclasses.replace(plan.decode, graph_shape=()).fagen_kernels(True)


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
    assert run.needs()["decode"] == plan.decode.cap_s == 31.0
    assert_reserved(plan, tmp_path, "decode", "variants", plan.decode.cap_s + plan.models.cap_s + plan.ring.cap_s
                    + plan.memory_cap_s + plan.report_reserve_s)
    skipped = reserving_run(plan, tmp_path, {"decode"})
    assert skipped.section("decode", lambda: pytest.fail("a skipped section ran")) is None
    assert skipped.results["sections"]["decode"]["status"] == "skipped"


def test_bandwidth_and_its_share_of_the_copy_bandwidth():
    from fagen.bench.decode.markdown import add_bandwidth, add_varlen_ratios, bandwidth_tb_per_s

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
                   "| fagen varlen | False | 9.00e-02 | 2.00e-03 |",
                   "### Decode step in a CUDA graph: bf16 B=8 cache 4k Hq=32 Hk=8 d=128 Nq=1, 1 new token with rotary, "
                   "4 splits",
                   "Replay equals eager: **True** (largest difference of the output: 0.0)",
                   "| graph replay | 0.050 | 0.010 |  |", "| eager step | 0.200 | 0.200 |  |",
                   "Replay / eager: **0.25**"):
        assert needle in md, needle
    assert (md.index("### Varlen training") < md.index("### Decode step in a CUDA graph")
            < md.index("### Sanity of fagen's decode"))


class _Tiny:
    """The decode section's plan at sizes the CPU emulator runs in seconds."""

    config = DecodeConfig(batch=2, cache_len=64, q_heads=4, kv_heads=2, head_dim=16, page_size=16,
                          sanity_shape=(2, 32), varlen_tokens=96, varlen_heads=2, documents=3,
                          varlen_sanity_shape=(3, 48, 2), graph_shape=(2, 64), graph_splits=2,
                          mla_systems=("fagen_mla", "fagen_sm90_mla", "sdpa"), mla_batches=(2,), mla_cache_len=128,
                          mla_heads=4)
    plan = Plan(decode=config)
    graph_only = Plan(decode=dataclasses.replace(config, decode_systems=(), varlen_systems=(), mla_systems=()))


def replayed_eagerly(step, inputs):
    """torch.cuda.graph's stand-in on the CPU: the "graph" is the step itself, run again at every
    replay into the output the capture returned, reading cache_seqlens when it runs (as a graph's
    kernels read it from the device)."""
    out = step()
    return (lambda: out.copy_(step())), out


def replayed_with_the_captured_lengths(step, inputs):
    """A graph that baked the capture's cache_seqlens in (what a host read of them gives)."""
    captured = inputs.cache_seqlens.clone()
    out = step()

    def replay():
        now = inputs.cache_seqlens.clone()
        inputs.cache_seqlens.copy_(captured)
        out.copy_(step())
        inputs.cache_seqlens.copy_(now)
    return replay, out


def refuses_capture(message):
    def capture(step, inputs):
        raise RuntimeError(message)
    return capture


def eager_flex_decode():
    from fagen.bench.decode.step import FlexDecode

    flex = FlexDecode()
    flex.flex._compiled = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
    flex.unavailable_reason = lambda: None   # eager Flex: no Triton needed
    return flex


def decode_section(factories=None, deadline=None, plan=_Tiny.plan, **kwargs):
    import warnings

    from fagen.bench.decode.run import default_factories, run_decode_section

    factories = {**default_factories(), "flex": eager_flex_decode, **(factories or {})}
    kwargs.setdefault("measure_copy", lambda: {"tb_per_s": 0.02, "what": "a stand-in copy"})
    kwargs.setdefault("capture", replayed_eagerly)
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
    decode, fwd, fwd_bwd, mla = section["points"]
    assert (decode["part"], fwd["pass"], fwd_bwd["pass"], mla["part"]) == ("decode", "fwd", "fwd_bwd", "decode")
    # Absorbed MLA: fagen on 64-row pages of one 576-wide cache, SDPA on its views; each credited
    # with reading every cache row once.
    assert mla["label"] == config.mla_label(2) and "V = the cache's first 512 columns" in mla["label"]
    for name in ("fagen_mla", "sdpa"):
        cell = mla["results"][name]
        assert cell["bytes"] == config.mla_bytes(2) == (2 * 128 * 576 + 2 * 4 * (576 + 512)) * 2, (name, cell)
        assert cell["copy_fraction"] == pytest.approx(cell["tb_per_s"] / 0.02)
    # The sm90 family's row says why it does not run off compute capability 9.0, and takes no sanity check.
    assert "compute capability 9.0 only" in mla["results"]["fagen_sm90_mla"]["skipped"]
    native = config.decode_bytes()
    for name in ("fagen", "fagen_paged", "sdpa_math", "sdpa_flash", "flex"):
        cell = decode["results"][name]
        assert cell["bytes"] == native and cell["kv_heads_read"] == 2 and not cell["expanded"], (name, cell)
        assert cell["tb_per_s"] == pytest.approx(native / 2e-3 / 1e12)
        assert cell["copy_fraction"] == pytest.approx(cell["tb_per_s"] / 0.02)
    # The 8-bit cache's rows read a byte per K/V element: the cache's share of the bytes halves.
    eight_bit = config.decode_bytes(cache_element=1)
    assert native - eight_bit == 2 * 2 * 64 * 2 * 16   # B N Hk d, K and V, one byte saved each
    for name in ("fagen_fp8", "fagen_fp8_paged"):
        assert decode["results"][name]["bytes"] == eight_bit, decode["results"][name]
    assert "enable_gqa" in decode["results"]["sdpa_efficient"]["skipped"]   # no CPU kernel: a skipped cell
    for point in (fwd, fwd_bwd):
        assert point["flops"] == config.varlen_flops(point["pass"])
        for name in ("fagen_varlen", "fagen_padded", "sdpa_padded"):
            assert point["results"][name]["tflops"] == pytest.approx(point["flops"] / 2e-3 / 1e12)
        assert point["results"]["sdpa_padded"]["backend"] == "SDPA flash"
        assert point["ratios"]["fagen_varlen/sdpa_padded"] == pytest.approx(1.0)
    sanity = section["sanity"]
    assert set(sanity) == {"fagen", "fagen_paged", "fagen_fp8", "fagen_fp8_paged", "fagen_varlen", "fagen_padded",
                           "fagen_mla"}
    assert all(r["ok"] for r in sanity.values()), sanity
    assert "dq_err" in sanity["fagen_varlen"] and sanity["fagen"]["shape"] == "B=2 cache 32"
    assert "sanity ok" in section["note"] and "fagen varlen / fagen padded fwd 1.00 f+b 1.00" in section["note"]
    assert section["graph"]["equal"] == {"ok": True, "max_err": 0.0} and section["graph"]["replay/eager"] == 1.0
    assert len(checkpoints) >= 4


def test_the_graph_inputs_advance_every_length_within_the_cache():
    from fagen.bench.decode.graph import make_graph_inputs

    config = dataclasses.replace(_Tiny.config, graph_shape=(6, 64))
    inputs = make_graph_inputs(config, "cpu")
    before, after = inputs.cache_seqlens.tolist(), inputs.next_seqlens.tolist()
    assert inputs.cache_seqlens.dtype == inputs.next_seqlens.dtype == torch.int32
    assert all(16 <= b <= 32 and b < a <= b + 16 and a + 1 <= 64 for b, a in zip(before, after)), (before, after)
    assert inputs.q.shape == (6, 1, 4, 16) and inputs.k_new.shape == (6, 1, 2, 16)
    assert inputs.k_cache.shape == inputs.v_cache.shape == (6, 64, 2, 16)
    # RoPE over the whole head dim at every cache position: cos^2 + sin^2 = 1, position 0 unrotated.
    cos, sin = inputs.rotary_cos.float(), inputs.rotary_sin.float()
    assert cos.shape == sin.shape == (64, 8) and torch.allclose(cos ** 2 + sin ** 2, torch.ones(64, 8), atol=1e-2)
    assert torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    assert inputs.cache_seqlens.tolist() == make_graph_inputs(config, "cpu").cache_seqlens.tolist()   # seeded


def test_the_graph_replay_with_new_lengths_equals_the_eager_step_and_is_timed_against_it(tmp_path, monkeypatch):
    """On the emulator, with a stand-in graph that reads cache_seqlens as it replays: equal to the
    eager step bit for bit, timed against it; a replay that kept the capture's lengths computes
    another step, and the section says so and fails the check."""
    from fagen.bench.gpu_check import exit_status

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    section = decode_section(plan=_Tiny.graph_only)
    row = section["graph"]
    assert section["status"] == "ok" and section["points"] == [] and section["not_run"] == 0, section["note"]
    assert row["label"] == "bf16 B=2 cache 64 Hq=4 Hk=2 d=16 Nq=1, 1 new token with rotary, 2 splits"
    assert row["equal"] == {"ok": True, "max_err": 0.0}
    assert row["replay"]["ms"] == row["eager"]["ms"] == 2.0 and row["replay/eager"] == 1.0
    assert "CUDA graph: equal, 2.000 ms vs eager 2.000 ms (1.00x)" in section["note"]
    stale = decode_section(plan=_Tiny.graph_only, capture=replayed_with_the_captured_lengths)
    assert stale["graph"]["equal"]["ok"] is False and stale["graph"]["equal"]["max_err"] > 0.01
    assert stale["status"] == "failed" and "CUDA graph: NOT EQUAL (max err " in stale["note"]
    assert exit_status({"sections": {"decode": {"status": stale["status"]}}}) == 1
    assert exit_status({"sections": {"decode": {"status": section["status"]}}}) == 0
    table = "\n".join(report.short_table({"decode": stale}).splitlines()[2:])   # after the header, no speed
    assert table.startswith("-- decode graph: NOT EQUAL (max err ") and "\n" not in table


def test_a_step_that_does_not_capture_is_a_skipped_row_with_its_reason_in_one_line():
    from fagen.bench.decode.graph import cuda_graph_capture

    section = decode_section(plan=_Tiny.graph_only, capture=refuses_capture(
        "CUDA error: operation not permitted when stream is capturing\nCompile with TORCH_USE_CUDA_DSA"))
    assert section["graph"]["skipped"] == ("capture failed: RuntimeError: CUDA error: operation not permitted when "
                                           "stream is capturing Compile with TORCH_USE_CUDA_DSA")
    assert section["status"] == "ok" and "CUDA graph: skipped: capture failed: RuntimeError" in section["note"]
    if not torch.cuda.is_available():   # torch's own graph, here: refused, said in one line
        section = decode_section(plan=_Tiny.graph_only, capture=cuda_graph_capture)
        assert section["graph"]["skipped"].startswith("capture failed: ") and "\n" not in section["graph"]["skipped"]
    # A kernel fault while capturing loses the context: the section stops there, Flex never runs.
    lost = decode_section(capture=refuses_capture("CUDA error: an illegal memory access was encountered"))
    assert lost["status"] == "error" and "lost at the decode step in a CUDA graph" in lost["note"]
    assert "flex" not in lost["points"][0]["results"]


def test_the_decode_inputs_page_the_same_keys():
    from fagen.bench.decode.step import make_decode_inputs

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
    from fagen.bench.decode.step import SdpaDecode, make_decode_inputs, measure_decode

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
    from fagen.bench.decode.run import FLEX_GUARD_REASON

    section = decode_section(deadline=passed_deadline())
    # The sm90 family's systems are not available here (no compute capability 9.0 GPU): not counted as
    # not run for time.
    unavailable = [name for name, system in section["systems"].items() if not system["available"]]
    assert sorted(unavailable) == ["fagen_sm90", "fagen_sm90_paged"]
    assert section["status"] == "partial" and section["not_run"] == _Tiny.config.timed_runs() - len(unavailable)
    assert all(cell["skipped"].startswith(GUARD_REASON if name not in unavailable else "not available")
               for p in section["points"] for name, cell in p["results"].items())
    assert section["sanity"] == {} and "sanity not run" in section["note"]
    assert section["graph"] == {"label": _Tiny.config.graph_label, "skipped": GUARD_REASON}
    # 10 s left on a frozen clock: everything runs but Flex, whose compile needs 20.
    section = decode_section(deadline=Deadline(10.0, clock=lambda: 0.0))
    assert section["points"][0]["results"]["flex"] == {"skipped": FLEX_GUARD_REASON}
    assert section["not_run"] == 1 and "tb_per_s" in section["points"][0]["results"]["fagen_paged"]


def test_the_decode_section_flags_a_wrong_kernel_and_stops_on_a_lost_context():
    from fagen.bench.decode.step import FagenDecode
    from fagen.bench.decode.varlen import FagenVarlen

    class Wrong(FagenDecode):
        def prepare(self, inputs, config):
            step, info = super().prepare(inputs, config)
            return (lambda: step() * 1.05), info

    class Faults(FagenVarlen):
        def forward(self, q, k, v, causal):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    section = decode_section({"fagen": lambda: Wrong(paged=False)})
    assert section["sanity"]["fagen_mla"]["ok"]
    assert not section["sanity"]["fagen"]["ok"] and section["sanity"]["fagen_paged"]["ok"]
    assert "SANITY FAILED: fagen" in section["note"]
    section = decode_section({"fagen_varlen": Faults})
    assert section["status"] == "error" and "CUDA context was lost at fagen varlen's sanity check" in section["note"]
    assert "flex" not in section["points"][0]["results"] and "graph" not in section   # nothing ran after it
    assert "fagen_padded" not in section["points"][1]["results"]


def test_the_decode_section_uses_the_peak_sections_copy_bandwidth():
    section = decode_section(copy_tb_per_s=4.5, measure_copy=lambda: pytest.fail("measured again"),
                             plan=Plan(decode=DecodeConfig(**{**_Tiny.config.__dict__, "varlen_systems": (),
                                                              "graph_shape": (), "decode_systems": ("sdpa_math",),
                                                              "mla_systems": ()})))
    assert section["copy"] == {"tb_per_s": 4.5, "source": "the peak section's device copy (read + write bytes)"}
    assert len(section["points"]) == 1 and section["points"][0]["results"]["sdpa_math"]["copy_fraction"] > 0
