"""The self-test's templates and cases (fagen.selftest.templates, fagen.selftest_cases.cases): every
template has a case, a Spec maps to the templates its kernels use, the family's sources key its
verdicts, and the real cases pass on the emulator (one through `fagen selftest` here, every one
in the slow tier)."""

from __future__ import annotations

import shutil

import pytest
import torch

from fagen.cli import main as fagen_main
from fagen.kernels.render import template_dir
from fagen.selftest_cases.cases import CASES
from fagen.selftest.templates import all_templates, sources_digest, templates_of
from fagen.spec import Spec
from fagen.variants import custom_mod, trace_score_mod


def test_every_template_has_a_case_of_its_family():
    templates = all_templates("sm80") + all_templates("sm90")
    assert sorted(CASES) == sorted(templates) and len(set(templates)) == len(templates)
    assert all(case.family == template.split(".")[0] for template, case in CASES.items())


def _bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


@pytest.mark.parametrize("spec, expected", [
    (Spec(64, arch_family="sm90"), ("sm90.d64", "sm90.backward")),   # its own backward takes it
    (Spec(64, arch_family="sm90", sm80_backward=True), ("sm90.d64", "sm80.d64")),   # sm80's, asked for
    (Spec(64, dropout=True, arch_family="sm90"), ("sm90.d64", "sm90.dropout", "sm90.backward")),
    (Spec(128, dropout=True, arch_family="sm90"), ("sm90.d128", "sm90.dropout", "sm90.backward")),   # the paired form
    (Spec(256, mask="causal", softcap=True, arch_family="sm90"),   # its paired backward
     ("sm90.d256", "sm90.causal", "sm90.softcap", "sm90.backward")),
    (Spec(320, mask="causal", dropout=True, arch_family="sm90"),
     ("sm90.d320", "sm90.causal", "sm90.dropout", "sm80.d512", "sm80.causal", "sm80.dropout")),
    (Spec(192, head_dim_v=128, dropout=True), ("sm80.d256", "sm80.dropout", "sm80.head_dim_v")),
    (Spec(96, version=1, deterministic=True, key_padding=True), ("sm80.d128", "sm80.key_padding", "sm80.fa1",
                                                                  "sm80.deterministic")),
    (Spec(64, score_mod=custom_mod(trace_score_mod(_bias)), varlen=True), ("sm80.d64", "sm80.mods", "sm80.varlen")),
    (Spec.for_kv_cache(64, "fp16", causal=False, page_size=16, pack_gqa=True).replace(arch_family="sm90"),
     ("sm90.d64", "sm90.paged", "sm90.pack_gqa")),
    (Spec.for_kv_cache(64, "fp16", causal=True, page_size=16, varlen=True), ("sm80.d64", "sm80.causal",
                                                                              "sm80.varlen_paged")),
    (Spec.for_kv_cache(576, "fp16", causal=True, page_size=None, head_dim_v=512, v_from_k=True),
     ("sm80.causal", "sm80.decode", "sm80.mla")),
    (Spec(128, dtype="e4m3", arch_family="sm90", mask="causal"),   # the fp8 forward and its sm90 backward
     ("sm90.d128", "sm90.causal", "sm90.fp8", "sm90.backward")),
    (Spec(128, dtype="e4m3", arch_family="sm90", sinks=True), ("sm90.d128", "sm90.sinks", "sm90.fp8")),   # no backward
    (Spec.for_kv_cache(128, "bf16", causal=False, page_size=64, pack_gqa=True, cache_dtype="e4m3"),
     ("sm80.d128", "sm80.paged", "sm80.pack_gqa", "sm80.fp8_cache")),
], ids=["sm90 plain", "sm90 sm80 backward", "sm90 dropout", "sm90 d128 dropout", "sm90 softcap causal",
        "sm90 d320 dropout", "sm80 d_v dropout", "fa1", "mods varlen", "sm90 paged packed", "varlen paged", "mla",
        "fp8 causal", "fp8 sinks", "fp8 cache"])
def test_a_spec_uses_the_templates_of_its_features(spec, expected):
    assert templates_of(spec) == expected


def test_the_sources_digest_follows_the_family_s_templates(tmp_path):
    templates, package = tmp_path / "templates", tmp_path / "fagen"
    shutil.copytree(template_dir(), templates)
    (package / "kernels").mkdir(parents=True)
    before = {family: sources_digest(family, templates, package) for family in ("sm80", "sm90")}
    assert before["sm80"] != before["sm90"]
    softmax = templates / "sm90" / "hopper_softmax.j2"
    softmax.write_text(softmax.read_text() + "{# edit #}\n")
    after = {family: sources_digest(family, templates, package) for family in ("sm80", "sm90")}
    assert after["sm80"] == before["sm80"] and after["sm90"] != before["sm90"]
    (templates / "include" / "fagen" / "mma.cuh").write_text("// edit\n")   # a shared header: both
    assert all(sources_digest(f, templates, package) != after[f] for f in ("sm80", "sm90"))


def test_selftest_command_runs_real_cases_on_the_emulator(capsys):
    """`fagen selftest --device cpu`: the child builds and runs the real sm80 and sm90 cases at
    d = 64 on the emulator, holds them to the rule and prints the verdicts."""
    assert fagen_main(["selftest", "--device", "cpu", "--template", "sm80.d64", "--template", "sm90.d64"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines()[1:3]] == [["sm80.d64", "passed"], ["sm90.d64", "passed"]]


def test_selftest_command_refuses_what_it_cannot_run(capsys):
    assert fagen_main(["selftest", "--device", "cpu", "--template", "sm90.d100"]) == 2
    assert "no template sm90.d100 in the sm80 and sm90 families" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert fagen_main(["selftest"]) == 2
        assert "no CUDA GPU is visible" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("template", sorted(CASES))
def test_every_case_passes_on_the_emulator(template, monkeypatch):
    case = CASES[template]
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", case.family)
    monkeypatch.setenv("FAGEN_SELFTEST", "0")
    assert case.run(torch.device("cpu")) == []
