"""Which kernel family a call's forward runs (fagen.arch_families.chosen_family): FAGEN_ARCH_FAMILY=sm90
sends the calls the sm90 family takes (a window or a softcap among them) to its wgmma/TMA forward (on
the CPU, the emulator runs it), with the sm80 backward after it; everything else, and every call by
default, stays on sm80."""

from __future__ import annotations

import pytest
import torch

import fagen
from fagen.arch_families import ARCH_FAMILY_ENV, chosen_family, family_archs
from fagen.ops import call, dense
from fagen.reference import attention_gradients, attention_same_dtype
from fagen.spec import Spec
from kernel_cases import ABS_FLOOR, GRAD_FACTOR, OUTPUT_FACTOR, max_error


@pytest.fixture
def sources(monkeypatch):
    """The names of the specs calls run, from no kept calls."""
    monkeypatch.setattr(call, "_call_sources", {})
    monkeypatch.setattr(dense, "_calls", {})
    return lambda: sorted(source.spec.name for _, source in call._call_sources.values())


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 150, 4, 64, generator=gen).bfloat16()
    k, v = (torch.randn(2, 200, 2, 64, generator=gen).bfloat16() for _ in range(2))
    dout = torch.randn(2, 150, 4, 64, generator=gen).bfloat16()
    return q, k, v, dout


def test_asked_for_the_sm90_family_a_call_runs_its_forward_and_meets_the_oracle(monkeypatch, sources):
    monkeypatch.setenv(ARCH_FAMILY_ENV, "sm90")
    q, k, v, dout = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fagen.flash_attn_func(*leaves, causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    assert sources() == ["fa2_d64_causal_bf16_sm90"]
    exact = attention_gradients(q, k, v, dout, causal=True)
    same = attention_same_dtype(q, k, v, dout, causal=True)
    for name, got, yard, factor in zip(("out", "dq", "dk", "dv"), (out.detach(), *grads), same,
                                       (OUTPUT_FACTOR, GRAD_FACTOR, GRAD_FACTOR, GRAD_FACTOR)):
        assert max_error(got, exact[name]) <= factor * max_error(yard, exact[name]) + ABS_FLOOR, name


def test_what_the_family_cannot_take_and_the_default_stay_on_sm80(monkeypatch, sources):
    q, k, v, _ = _inputs()
    fagen.flash_attn_func(q, k, v, causal=True)   # no FAGEN_ARCH_FAMILY: the default
    monkeypatch.setenv(ARCH_FAMILY_ENV, "sm90")
    fagen.flash_attn_func(q, k, v, version=1)   # FlashAttention-1 stays on the sm80 family
    fagen.flash_attn_func(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous())
    assert sources() == ["fa1_d64_bf16", "fa2_d32_bf16", "fa2_d64_causal_bf16"]


def test_a_call_with_a_score_mod_and_its_captured_tensor_runs_the_sm90_forward(monkeypatch, sources):
    q, k, v, dout = _inputs()
    bias = torch.randn(q.shape[2], 400, generator=torch.Generator().manual_seed(2)) * 0.5

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 200]   # q_idx - kv_idx in [-199, 149]

    results, names = {}, []
    for family in ("sm90", "sm80"):
        monkeypatch.setenv(ARCH_FAMILY_ENV, family)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fagen.flash_attn_func(*leaves, causal=True, score_mod=score_mod)
        results[family] = (out.detach(), *torch.autograd.grad(out, leaves, dout))
        names += sources()
    assert names[0] == names[1] + "_sm90" and names[1].startswith("fa2_d64_causal_smod")
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["sm90"], results["sm80"]):
        assert max_error(a, b) < 2e-2, name   # two kernels, each within the oracle's rule (tests/kernels)


def test_a_windowed_call_runs_the_sm90_forward(monkeypatch, sources):
    monkeypatch.setenv(ARCH_FAMILY_ENV, "sm90")
    q, k, v, _ = _inputs()
    out = fagen.flash_attn_func(q, k, v, causal=True, window_size=(40, 0))
    assert sources() == ["fa2_d64_causal_window_bf16_sm90"]
    monkeypatch.setenv(ARCH_FAMILY_ENV, "sm80")
    assert max_error(out, fagen.flash_attn_func(q, k, v, causal=True, window_size=(40, 0))) < 2e-2


def test_a_warm_call_follows_the_family_asked_for(monkeypatch, sources):
    q, k, v, _ = _inputs()
    names = []
    for asked in ("sm90", "", "sm90"):
        monkeypatch.setenv(ARCH_FAMILY_ENV, asked)
        fagen.flash_attn_func(q, k, v)
        names.append(sources())
    assert names[0] == names[2] == ["fa2_d64_bf16_sm90"] and names[1] == ["fa2_d64_bf16"]


def test_a_bad_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ARCH_FAMILY_ENV, "hopper")
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="FAGEN_ARCH_FAMILY='hopper': expected one of sm80, sm90, or unset"):
        fagen.flash_attn_func(q, k, v)


def test_the_sm90_family_runs_on_compute_capability_9_0_only():
    spec = Spec(128)
    assert chosen_family(spec, "sm90", (9, 0)) == "sm90" and chosen_family(spec, "sm90", None) == "sm90"
    assert chosen_family(spec, "sm90", (8, 0)) == chosen_family(spec, "sm90", (10, 0)) == "sm80"
    assert chosen_family(spec, "", (9, 0)) == "sm80"   # the default until a GPU check has passed


def test_a_command_compiles_a_family_for_the_archs_it_can_use():
    """family_archs: the sm90 family's own target by default (sm_90a), none for sm80's (the command's
    defaults); an --arch the family cannot use is refused, naming every such arch and the family."""
    assert family_archs("sm90", None) == ["sm_90a"] and family_archs("sm90", ["sm_90a"]) == ["sm_90a"]
    assert family_archs("sm80", None) is None and family_archs("sm80", ["sm_80", "sm_90a"]) == ["sm_80", "sm_90a"]
    with pytest.raises(ValueError, match=r"^--arch sm_80,sm_90: the sm90 arch family compiles for sm_90a only"):
        family_archs("sm90", ["sm_80", "sm_90a", "sm_90"])
