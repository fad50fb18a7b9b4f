"""flash-attn's packed entry points (qkv / kv, dense and varlen), on the emulator.

Each is flash_attn_func / flash_attn_varlen_func on views of the packed tensor: the same
outputs bit for bit (deterministic backward), gradients that land in the packed tensor, no
copy on the way to the kernels when the strides allow one to be skipped, and errors that name
the packed argument.
"""

from __future__ import annotations

import pytest
import torch

import fagen
from fagen.kernels import attention_kernels


def packed(*shape, dtype=torch.float16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def kernel_inputs(monkeypatch):
    """The storage each forward kernel launch reads q, k and v from."""
    seen = []
    forward = attention_kernels.forward

    def spy(source, q, k, v, **kwargs):
        seen.append([t.untyped_storage().data_ptr() for t in (q, k, v)])
        return forward(source, q, k, v, **kwargs)

    monkeypatch.setattr(attention_kernels, "forward", spy)
    return seen


def backward_pair(packed_call, split_call, packs: list, unpack):
    """Runs the packed call and the split one on the same data; returns their outputs and the
    packed tensors' gradients next to the split call's, stacked as the pack lays them out."""
    leaves = [p.clone().requires_grad_() for p in packs]
    out = packed_call(*leaves)
    parts = [t.detach().requires_grad_() for t in unpack(*packs)]
    ref = split_call(*parts)
    dout = packed(*ref.shape, seed=9)
    out.backward(dout)
    ref.backward(dout)
    return out, ref, [leaf.grad for leaf in leaves], [t.grad for t in parts]


def test_qkvpacked_is_flash_attn_func_on_views(kernel_inputs):
    qkv = packed(2, 40, 3, 4, 32)
    out, ref, (dqkv,), split = backward_pair(
        lambda qkv: fagen.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True),
        lambda q, k, v: fagen.flash_attn_func(q, k, v, causal=True, deterministic=True), [qkv],
        lambda qkv: qkv.unbind(2))
    assert torch.equal(out, ref) and torch.equal(dqkv, torch.stack(split, dim=2))
    assert len(set(kernel_inputs[0])) == 1   # q, k and v read from the pack itself


def test_no_copy_reaches_the_kernels(kernel_inputs):
    """Views of a contiguous pack (d a multiple of 8) go to the kernels as they are; a head_dim
    that needs padding is copied, as for any q, k, v."""
    qkv = packed(1, 24, 3, 2, 16)
    fagen.flash_attn_qkvpacked_func(qkv)
    q, kv = packed(1, 24, 4, 16), packed(1, 32, 2, 2, 16)
    fagen.flash_attn_kvpacked_func(q, kv)
    assert kernel_inputs[0] == [qkv.untyped_storage().data_ptr()] * 3
    assert kernel_inputs[1] == [q.untyped_storage().data_ptr()] + [kv.untyped_storage().data_ptr()] * 2
    fagen.flash_attn_qkvpacked_func(packed(1, 24, 3, 2, 12))
    assert len(set(kernel_inputs[2])) == 3


def test_kvpacked_with_gqa_and_lse():
    q, kv = packed(2, 24, 4, 32), packed(2, 40, 2, 2, 32, seed=1)
    out, lse = fagen.flash_attn_kvpacked_func(q, kv, causal=True, return_lse=True)
    ref, ref_lse = fagen.flash_attn_func(q, *kv.unbind(2), causal=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    out, lse, probs = fagen.flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 24)
    _, _, (dq, dkv), (rq, rk, rv) = backward_pair(
        lambda q, kv: fagen.flash_attn_kvpacked_func(q, kv, deterministic=True),
        lambda q, k, v: fagen.flash_attn_func(q, k, v, deterministic=True), [q, kv],
        lambda q, kv: (q, *kv.unbind(2)))
    assert torch.equal(dq, rq) and torch.equal(dkv, torch.stack([rk, rv], dim=2))


def test_varlen_packed_forms(kernel_inputs):
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    qkv = packed(40, 3, 2, 32)
    out, ref, (dqkv,), split = backward_pair(
        lambda qkv: fagen.flash_attn_varlen_qkvpacked_func(qkv, cu, 23, causal=True, deterministic=True),
        lambda q, k, v: fagen.flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True, deterministic=True),
        [qkv], lambda qkv: qkv.unbind(1))
    assert torch.equal(out, ref) and torch.equal(dqkv, torch.stack(split, dim=1))
    assert len(set(kernel_inputs[0])) == 1   # q, k and v read from the pack itself
    q, kv, cu_k = packed(40, 4, 32), packed(50, 2, 2, 32, seed=1), torch.tensor([0, 30, 50], dtype=torch.int32)
    out, lse, probs = fagen.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 23, 30, return_attn_probs=True)
    ref, ref_lse = fagen.flash_attn_varlen_func(q, *kv.unbind(1), cu, cu_k, 23, 30, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse) and probs is None and lse.shape == (4, 40)


@pytest.mark.parametrize("call, error, message", [
    (lambda: fagen.flash_attn_qkvpacked_func(packed(1, 8, 2, 2, 16)), ValueError,
     r"qkv must have shape \(batch, seqlen, 3, heads, head_dim\) with 3 = 3"),
    (lambda: fagen.flash_attn_qkvpacked_func(packed(1, 8, 3, 2, 16, dtype=torch.float32)), TypeError,
     "qkv must be float16 or bfloat16"),
    (lambda: fagen.flash_attn_qkvpacked_func(packed(1, 8, 3, 2, 32)[..., ::2]), ValueError,
     "qkv must have a contiguous last dimension"),
    (lambda: fagen.flash_attn_kvpacked_func(packed(1, 8, 2, 16), packed(1, 8, 2, 2, 16).bfloat16()), TypeError,
     "q and kv must share a dtype"),
    (lambda: fagen.flash_attn_kvpacked_func(packed(1, 8, 3, 16), packed(1, 8, 2, 2, 16)), ValueError,
     r"q's number of heads \(3\) must be a multiple of kv's \(2\)"),
    (lambda: fagen.flash_attn_kvpacked_func(packed(2, 8, 2, 16), packed(1, 8, 2, 2, 16)), ValueError,
     "q and kv must have the same batch size"),
    (lambda: fagen.flash_attn_varlen_kvpacked_func(packed(8, 2, 16), packed(8, 2, 2, 32), *[torch.tensor(
        [0, 8], dtype=torch.int32)] * 2, 8, 8), ValueError, "q and kv must have the same head_dim"),
    (lambda: fagen.flash_attn_varlen_qkvpacked_func(packed(8, 3, 2, 16), [0, 8], 8), TypeError,
     "cu_seqlens must be an int32 tensor"),
    (lambda: fagen.flash_attn_varlen_qkvpacked_func(packed(8, 3, 2, 16), torch.tensor([0, 8], dtype=torch.int32), -1),
     ValueError, "max_seqlen must be an int >= 0"),
])
def test_errors_name_the_packed_argument(call, error, message):
    with pytest.raises(error, match=message) as raised:
        call()
    assert not {"k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q"} & set(str(raised.value).split())
