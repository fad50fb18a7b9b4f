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
    names = [e.name for e in source.entries]
    assert names == [f"{spec.name}_{role}" for role in ("fwd", "bwd_preprocess", "bwd", "bwd_dq_convert")]
    for name in names:  # the header lists every kernel, and each is exported
        assert f"//   {name}  (" in source.code and f"FAGEN_EXPORT({name})" in source.code
    forward = source.kernels.forward
    assert forward.shared_bytes == spec.shared_layout.total_bytes
    assert forward.grid(batch=2, heads=3, seqlen_q=200) == (2, 3, 2)
    assert forward.block == (spec.threads, 1, 1)
    assert source.kernels.bwd_main.grid(batch=2, heads=3, seqlen_q=10, seqlen_k=130) == (3, 3, 2)
    for label in ("FA-2 Algorithm 1, line 8: S_ij = Q_i K_j^T", "Algorithm 4, line 7", "Line 21: dQ_i"):
        assert label in source.code


def test_deterministic_specs_swap_atomics_for_a_dq_pass():
    atomic = render(Spec(64)).kernels
    deterministic = render(Spec(64, deterministic=True)).kernels
    assert atomic.bwd_dq is None and atomic.bwd_dq_convert is not None
    assert deterministic.bwd_dq is not None and deterministic.bwd_dq_convert is None
    assert "atomicAdd" not in render(Spec(64, deterministic=True)).code
    assert "atomicAdd" in render(Spec(64)).code


def test_version_1_is_kv_outer():
    code = render(Spec(64, version=1)).code
    assert "K/V-outer, Q-inner" in code and "o_accum" in code
    assert render(Spec(64, version=1)).kernels.forward.grid(batch=2, heads=3, seqlen_q=500) == (1, 3, 2)


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
        env.get_template("variant.cu.j2").render(spec=Spec(64))
