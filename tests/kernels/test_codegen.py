"""Rendering: deterministic, strict, annotated."""

import dataclasses
import re

import jinja2
import pytest

from fagen.kernels import render as codegen
from fagen.kernels.render import render
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
    keys_per_block = spec.backward_tiles.block_n
    assert source.kernels.bwd_main.grid(batch=2, heads=3, seqlen_q=10, seqlen_k=130) == (
        -(-130 // keys_per_block), 3, 2)
    for label in ("FA-2 Algorithm 1, line 8: S_ij = Q_i K_j^T", "Algorithm 4, line 7", "Line 21: dQ_i"):
        assert label in source.code


def test_deterministic_specs_swap_atomics_for_a_dq_pass():
    atomic = render(Spec(64)).kernels
    deterministic = render(Spec(64, deterministic=True)).kernels
    assert atomic.bwd_dq is None and atomic.bwd_dq_convert is not None
    assert deterministic.bwd_dq is not None and deterministic.bwd_dq_convert is None
    deterministic_code = render(Spec(64, deterministic=True)).code
    assert "atomicAdd(" not in deterministic_code and "atomic_add_pair(" not in deterministic_code
    assert "fagen::atomic_add_pair(" in render(Spec(64)).code


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
        env.get_template("translation_unit.cu.j2").render(spec=Spec(64))


# A loop counter or product in 32-bit int that multiplies a sequence length by a head dim,
# a tile or a stride overflows once Nq * d >= 2**31 (FA-1's O buffer, say). Such products
# must be taken in 64 bits: `(long long)seqlen_q * kHeadDim`.
LENGTH_TIMES = r"[^;]*\bseqlen_[qk]\b[^;]*\*[^;]*|[^;]*\*[^;]*\bseqlen_[qk]\b[^;]*"
INT_LOOP_BOUND = re.compile(rf"for \(int (\w+) = [^;]*; \1 < ({LENGTH_TIMES});")
UNCAST_PRODUCT = re.compile(r"(?<!\(long long\))\bseqlen_[qk] \* k[A-Z]\w*")


def wide_products_problems(code: str) -> list[str]:
    return [m.group(0) for m in INT_LOOP_BOUND.finditer(code)] + [m.group(0) for m in UNCAST_PRODUCT.finditer(code)]


def test_no_32_bit_products_of_lengths_and_head_dims():
    specs = [Spec(d, version=version, mask=mask, key_padding=True, dropout=True, deterministic=det)
             for d in (64, 256) for version in (1, 2) for mask in ("none", "causal") for det in (False, True)]
    for spec in specs:
        for debug in (False, True):
            problems = wide_products_problems(render(spec, debug=debug).code)
            assert not problems, f"{spec.name}: 32-bit products {problems}"


def test_the_overflow_check_sees_the_old_fa1_loops():
    """Positive control: the FA-1 loops this check was written for."""
    old = ("  for (int idx = threadIdx.x; idx < seqlen_q * kHeadDim; idx += kThreads) o_head[idx] = 0.f;\n"
           "  for (int chunk = threadIdx.x; chunk < seqlen_q * kChunksPerRow; chunk += kThreads) {\n")
    assert len(wide_products_problems(old)) == 4
    fixed = "  for (long long idx = threadIdx.x; idx < (long long)seqlen_q * kHeadDim; idx += kThreads)\n"
    assert wide_products_problems(fixed) == []


@pytest.mark.parametrize("spec", [Spec(64, mask="causal"), Spec(128, dropout=True, deterministic=True),
                                  Spec(128, arch_family="sm90", window=True),
                                  Spec(64, kv_cache="paged", key_padding=True, dtype="bf16")],
                         ids=lambda s: s.name)
def test_the_passes_units_make_up_the_whole_source(spec):
    """NVRTC compiles a source as its passes' units (the forward and the backward apart, in
    parallel); the emulator, `fagen build` and the caches read the whole. Both are one rendering:
    the prelude, then each pass, exactly as the translation unit includes them all."""
    source = render(spec)
    whole = codegen.environment().get_template("translation_unit.cu.j2").render(
        **codegen._context(spec, source.kernels, False),
        pass_templates=[t for found in codegen.kernel_family(spec).passes_of(spec) for t in found.templates])
    assert source.code == whole and len(source.units) == 2
    prelude = source.units[0].prelude
    assert source.code == prelude + "".join(unit.body for unit in source.units)
    assert "__global__" not in prelude and all(unit.code.startswith(prelude) for unit in source.units)
    names = [name for unit in source.units for name in unit.names]
    assert sorted(names) == sorted(e.name for e in source.entries)   # every kernel in exactly one unit
    for unit in source.units:
        defined = re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(", unit.body)
        assert sorted(defined) == sorted(unit.names)


def test_a_source_whose_units_do_not_make_up_its_code_is_refused():
    source = render(Spec(64))
    with pytest.raises(ValueError, match="pass_units do not make up its code"):
        dataclasses.replace(source, code=source.code + "// edited\n")
    whole = dataclasses.replace(source, code=source.code + "// edited\n", pass_units=())
    assert [unit.code for unit in whole.units] == [whole.code]   # code alone: one unit, every kernel
    assert whole.units[0].names == tuple(e.name for e in source.entries)
