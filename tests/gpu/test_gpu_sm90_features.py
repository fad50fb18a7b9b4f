"""The sm90 family's later features on a compute capability 9.0 GPU: past d = 256
(tests/kernels/test_sm90_wide_head_dims.py on the emulator: the forward at d = 512 and 320, O in
two column slices, a d = 512 decoding step, and absorbed MLA, V's slices read from K's tile), and
packed queries over a paged cache (tests/ops/test_varlen_paged.py), against the float64 oracle by
FlashAttention-2's rule. Marked `gpu` but not `twins`: the pipeline they build on is
test_gpu_sm90_forward.py's. FAGEN_GPU_TESTS_DEVICE=cpu runs them through the emulator, and a
record run (fagen.bench.record_plugin) as far as their first call, so that precompile builds
their kernels."""

from __future__ import annotations

import os

import pytest
import torch

from kernel_cases import Shape, run_and_check
from fagen.bench import gpu_cases as cases
from fagen.spec import Spec

DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def hopper():
    if DEVICE == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family's cubins are sm_90a: compute capability 9.0 only")


@pytest.mark.parametrize("spec", [Spec(**fields, arch_family="sm90") for fields in cases.SM90_WIDE_SPECS],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("shape", [Shape(2, 150, 200, heads=4, kv_heads=2), Shape(1, 1000, 2049, heads=3, kv_heads=1)],
                         ids=str)
def test_the_forward_past_d_256_meets_the_oracle(spec, shape):
    run_and_check(spec, shape, device=DEVICE)


def _sm90_steps(monkeypatch):
    from fagen.ops import kvcache

    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    monkeypatch.setattr(kvcache, "_plans", {})
    return kvcache


def test_a_d_512_decoding_step_meets_the_oracle(monkeypatch):
    from kvcache_cases import Case, check_call

    kvcache = _sm90_steps(monkeypatch)
    case, call = cases.SM90_WIDE_DECODE
    check_call(Case(**case), device=DEVICE, **call)
    assert {plan.source.spec.arch_family for plan in kvcache._plans.values()} == {"sm90"}


@pytest.mark.parametrize("layout", cases.SM90_MLA_LAYOUTS)
def test_absorbed_mla_meets_the_oracle(layout, monkeypatch):
    from kvcache_cases import check_mla

    kvcache = _sm90_steps(monkeypatch)
    check_mla(device=DEVICE, **cases.SM90_MLA_LAYOUTS[layout])
    assert {plan.source.spec.arch_family for plan in kvcache._plans.values()} == {"sm90"}


def test_packed_queries_over_a_paged_cache_meet_the_oracle(monkeypatch):
    """flash_attn_varlen_func with a block_table: ragged and empty sequences, pages of 16 (a TMA box
    each), a window, the softcap and ALiBi, causal."""
    import fagen
    from varlen_paged_cases import LENGTHS_K, LENGTHS_Q, check_against_the_oracle, cu, paged, recorded_families

    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    built = recorded_families(monkeypatch)
    variant = dict(cases.SM90_VARLEN_PAGED_VARIANT, alibi_slopes=torch.tensor(cases.SM90_VARLEN_PAGED_SLOPES))
    q, k, v, table = paged(cases.SM90_VARLEN_PAGED_PAGE, seed=16)
    on = [t.to(DEVICE) for t in (q, k, v, table, cu(LENGTHS_Q), cu(LENGTHS_K))]
    out, lse = fagen.flash_attn_varlen_func(*on[:3], on[4], on[5], max(LENGTHS_Q), max(LENGTHS_K), causal=True,
                                            block_table=on[3], return_lse=True,
                                            **{**variant, "alibi_slopes": variant["alibi_slopes"].to(DEVICE)})
    assert set(built) == {"sm90"}
    check_against_the_oracle(out.cpu(), lse.cpu(), q, k, v, table, True, variant)
