"""The models section: its plan and parameter count, tokens/s and ratios, its report rows, and the
section end to end on the emulator with a tiny Llama (skipped without transformers)."""

import dataclasses
import json

import pytest
import torch

from fagen.bench import report
from fagen.bench.measure import GUARD_REASON
from fagen.bench.models.config import ModelsConfig
from fagen.bench.plan import OPTIONAL_SECTIONS, SECTIONS, Plan, full_plan, quick_plan
from fagen.bench.plan_text import describe
from fagen.bench.schedule import replay
from fagen.bench.timing import Deadline

from bench_stand_ins import (assert_reserved, fake_timer, open_deadline, passed_deadline, reserving_run,
                             sum_without_the_sweep)
from bench_synthetic import (SYNTHETIC_DECODE_TABLE, SYNTHETIC_MODELS_TABLE, synthetic_decode, synthetic_models,
                             synthetic_results)


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
    from fagen.bench.models.run import build_model

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
    from fagen.bench.models.markdown import add_rates, tokens_per_s

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
    from fagen.bench.models.run import run_models_section

    return run_models_section(Plan(models=config), deadline or Deadline(10.0, clock=lambda: 0.0), device="cpu",
                              timer=fake_timer, log=lambda line: None, **kwargs)


def test_the_models_section_end_to_end_on_the_emulator(tmp_path, monkeypatch):
    """transformers' Llama built once, trained and decoded through fagen (emulated) and SDPA, after
    fagen's logits are checked against fp32 eager; Flex cut by the time guard."""
    from fagen.bench.models.run import FLEX_GUARD_REASON

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
    from fagen.bench.models.run import import_transformers, model_sanity
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
    from fagen.bench.models import run as models
    from fagen.bench.models.markdown import short_lines

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
    from fagen.bench.models.markdown import short_lines

    section = models_section(deadline=passed_deadline())
    assert section["status"] == "partial" and section["not_run"] == 5 and section["sanity"] == {}
    assert all(cell == {"skipped": GUARD_REASON} for row in section["rows"] for cell in row["results"].values())
    assert "sanity not run" in section["note"] and "time guard: 5 measurements not run" in section["note"]
    assert "  SDPA           skipped: time guard" in "\n".join(short_lines({"models": section}))
