"""Rendering: deterministic, strict, annotated."""

import jinja2
import pytest

from fagen import codegen
from fagen.codegen import render
from fagen.spec import Spec


def test_equal_specs_render_identical_bytes():
    a, b = render(Spec(64, mask="causal")), render(Spec(64, mask="causal"))
    assert a.code == b.code and a.hash == b.hash


def test_different_specs_render_different_hashes():
    hashes = {render(s).hash for s in (Spec(64), Spec(64, mask="causal"), Spec(64, dtype="bf16"),
                                       Spec(128), Spec(64, version=1), Spec(64, key_padding=True))}
    assert len(hashes) == 6


def test_source_names_its_spec_and_kernel():
    spec = Spec(64, mask="causal", dtype="bf16")
    source = render(spec)
    assert source.code.startswith("// ====")
    assert f"fagen generated kernel source: {spec.name}" in source.code
    assert "SIMPLE kernel" in source.code
    assert [e.name for e in source.entries] == [f"{spec.name}_fwd"]
    assert source.entries[0].shared_bytes == spec.shared_layout.total_bytes
    assert source.entries[0].grid(batch=2, heads=3, seqlen_q=200) == (2, 6, 1)
    assert source.entries[0].block == (spec.threads, 1, 1)
    assert "Algorithm 1, line" in source.code


def test_signature_matches_params():
    spec = Spec(64, version=1, key_padding=True)
    source = render(spec)
    for param in source.entries[0].params:
        assert f"{param.ctype} {param.name}" in source.code
    names = [p.name for p in source.entries[0].params]
    assert "row_max_out" in names and "seqlens_k" in names and "lse" not in names


def test_environment_is_strict():
    env = codegen.environment()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        env.get_template("fwd_simple.cu.j2").render(spec=Spec(64))
