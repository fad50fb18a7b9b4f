"""The sm90 family's forward (templates/sm90/hopper_fwd.cu.j2, Spec.arch_family='sm90') on a compute
capability 9.0 GPU, with its backward after it (the sm90 family's own: templates/sm90/hopper_bwd.cu.j2 at
d = 64 and 128, hopper_bwd_paired.cu.j2 at d = 256 and 192/128, never run on hardware yet): the emulator's cases
(tests/kernels/test_sm90_forward.py) and larger ones, against the same float64 oracle by the same
rule (kernel_cases.run_and_check), the launch path's tensor maps encoded by the driver. Marked `gpu`
and `twins`: the GPU check runs it among the first, before anything is built on it."""

from __future__ import annotations

import pytest
import torch

from gpu_twin_launch import require_capability
from kernel_cases import Shape, run_and_check
from fagen.spec import Spec

pytestmark = [pytest.mark.gpu, pytest.mark.twins,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPECS = [Spec(64, dtype="bf16", mask="causal", arch_family="sm90"), Spec(128, dtype="fp16", arch_family="sm90"),
         Spec(64, dtype="fp16", key_padding=True, arch_family="sm90"),
         Spec(128, dtype="bf16", mask="causal", key_padding=True, arch_family="sm90"),
         Spec(256, dtype="bf16", mask="causal", arch_family="sm90"), Spec(256, dtype="fp16", arch_family="sm90"),
         Spec(192, head_dim_v=128, dtype="bf16", mask="causal", arch_family="sm90")]
SHAPES = [Shape(2, 150, 200, heads=4, kv_heads=2), Shape(1, 200, 130, 2, 1), Shape(1, 1000, 2049, heads=3, kv_heads=1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_sm90_forward_on_the_gpu(spec, shape):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("the sm90 family's cubins are sm_90a: compute capability 9.0 only")
    run_and_check(spec, shape, device="cuda")


# The mods, a score chain and packed sequences, at the op: the sm90 family against the sm80 family
# on the same GPU (which the kernel matrix holds to the oracle), outputs and gradients (each family's
# own backward: sm90's paired form for the d128 bias and the d256 chain). Both round to bf16: 2e-2 is a few of its ulps at these values.
# (case, head dim): one head dim each, as every case compiles two translation units on the GPU
# (about 1.5 s each) inside the GPU check's correctness budget.
OP_CASES = (("relative_bias", 128), ("documents", 64), ("alibi_softcap", 256), ("window", 128))


def _op_case(name: str) -> dict:
    """flash_attn_func's keywords for a case, its captured tensors on the GPU."""
    bias = torch.randn(4, 4096, generator=torch.Generator().manual_seed(3)).cuda() * 0.5
    docs = torch.sort(torch.randint(0, 6, (2, 1500), generator=torch.Generator().manual_seed(4)), dim=1).values.cuda()
    return {"relative_bias": dict(causal=True, score_mod=lambda s, b, h, q, k: s + bias[h, q - k + 2048]),
            "documents": dict(mask_mod=lambda b, h, q, k: docs[b, q] == docs[b, k]),
            "alibi_softcap": dict(causal=True, softcap=5.0,
                                  alibi_slopes=torch.tensor([0.25, 0.0625, 0.5, 0.125], device="cuda")),
            "window": dict(causal=True, window_size=(300, 0))}[name]


@pytest.mark.parametrize("case, head_dim", OP_CASES, ids=[f"{c}_d{d}" for c, d in OP_CASES])
def test_sm90_forward_with_mods_equals_the_sm80_familys(case, head_dim, monkeypatch):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("the sm90 family's cubins are sm_90a: compute capability 9.0 only")
    import fagen

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 1500, 4, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1500, 2, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    kwargs = _op_case(case)
    results = {}
    for family in ("sm90", "sm80"):
        monkeypatch.setenv("FAGEN_ARCH_FAMILY", family)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fagen.flash_attn_func(*leaves, **kwargs)
        results[family] = (out.detach(), *torch.autograd.grad(out, leaves, dout))
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["sm90"], results["sm80"]):
        assert torch.isfinite(a).all() and (a.float() - b.float()).abs().max().item() < 2e-2 * max(1.0, b.abs().max().item()), name


def test_sm90_forward_on_packed_sequences_equals_the_sm80_familys(monkeypatch):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("the sm90 family's cubins are sm_90a: compute capability 9.0 only")
    import fagen

    lengths = [700, 0, 1300, 5, 333, 2049]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(sum(lengths), heads, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
               for heads in (4, 2, 2))
    outs = {}
    for family in ("sm90", "sm80"):
        monkeypatch.setenv("FAGEN_ARCH_FAMILY", family)
        outs[family] = fagen.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    assert (outs["sm90"].float() - outs["sm80"].float()).abs().max().item() < 2e-2


# Decoding on the sm90 family (templates/sm90/hopper_kv_cache.j2): the emulator's cases
# (tests/ops/test_kvcache_sm90.py) against the float64 oracle on the GPU, each step asserted to
# have run sm90 (FAGEN_ARCH_FAMILY=sm90; what it does not take runs on sm80).
SM90_DECODE_CASES = {
    "contiguous, one packed query, split 3": (dict(capacity=160), dict(num_splits=3)),
    "append + rotary, causal packed queries": (dict(nq=3, new=3, seed=1), dict(causal=True, rotary=(32, False))),
    "paged 64 (a box per 16 keys), append, split 2": (dict(nq=2, new=2, page=64, capacity=256, seed=2),
                                                      dict(causal=True, num_splits=2)),
    "paged 256 (a box per tile)": (dict(nq=1, new=1, page=256, capacity=512, seed=3), dict(num_splits=1)),
    "batch_idx + leftpad, bf16": (dict(dtype=torch.bfloat16, nq=2, new=2, batch_idx=True, leftpad=True, seed=4),
                                  dict(causal=True, num_splits=3)),
}


@pytest.mark.parametrize("name", list(SM90_DECODE_CASES))
def test_sm90_decoding_on_the_gpu_meets_the_oracle(name, monkeypatch):
    if require_capability(9, 0) != "sm_90":
        pytest.skip("the sm90 family's cubins are sm_90a: compute capability 9.0 only")
    from fagen.ops import kvcache
    from kvcache_cases import Case, check_call

    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    monkeypatch.setattr(kvcache, "_plans", {})
    case_args, call_args = SM90_DECODE_CASES[name]
    check_call(Case(**case_args), device="cuda", **call_args)
    assert {plan.source.spec.arch_family for plan in kvcache._plans.values()} == {"sm90"}
