"""`fagen.flex_attention` against `torch.nn.attention.flex_attention.flex_attention`, on the emulator.

FlexAttention's documented examples (causal, sliding window, document, prefix LM, ALiBi) as
BlockMasks and score_mods, with its mask combinators (and_masks, or_masks, noop_mask). Torch's
flex_attention runs eagerly on the CPU, in float64 (the reference) and in the inputs' dtype
(the yardstick): fagen's output is held to FlashAttention-2's rule (at most 2x the yardstick's
error), its lse to the reference's. Torch's FlexAttention has no CPU backward, so gradients
(q, k, v and a captured tensor) are checked against fagen.reference's float64 oracle and its
same-dtype implementation (3x).
"""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F

import fagen
from fagen.reference import attention_gradients, attention_same_dtype
from fagen.variants.language import trace_mask_mod

flex = pytest.importorskip("torch.nn.attention.flex_attention")
BlockMask, and_masks, or_masks, noop_mask = flex.BlockMask, flex.and_masks, flex.or_masks, flex.noop_mask

ABS_FLOOR = 1e-5
# The reference calls use return_lse, which torch 2.9+ deprecates for return_aux (absent before 2.9).
pytestmark = pytest.mark.filterwarnings("ignore:return_lse is deprecated:FutureWarning")


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    """Torch's flex_attention without dynamo: the same eager math, a second less per call (forward
    only, which is all these tests ask of it)."""
    monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


def inputs(batch=2, heads=2, kv_heads=2, nq=48, nk=48, d=32, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, nq, d, generator=gen).to(dtype),
            *(torch.randn(batch, kv_heads, nk, d, generator=gen).to(dtype) for _ in range(2)))


def err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def check(q, k, v, **kwargs):
    """fagen.flex_attention and torch's (float64, and in q's dtype) on the same call."""
    out, lse = fagen.flex_attention(q, k, v, return_lse=True, **kwargs)
    exact, exact_lse = flex.flex_attention(q.double(), k.double(), v.double(), return_lse=True, **kwargs)
    same = flex.flex_attention(q, k, v, **kwargs)
    assert out.shape == exact.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert err(out, exact) <= 2 * err(same, exact) + ABS_FLOOR
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[~finite] == float("-inf")).all()
    assert err(lse[finite], exact_lse[finite]) < 1e-3
    return out


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(size):
    return lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= size


def test_causal_block_mask_is_top_left():
    q, k, v = inputs(nq=40, nk=56)
    check(q, k, v, block_mask=flex.create_block_mask(causal, None, None, 40, 56, device="cpu"))


def test_sliding_window_with_and_masks():
    q, k, v = inputs(dtype=torch.bfloat16)
    mask = and_masks(causal, sliding_window(10))
    check(q, k, v, block_mask=flex.create_block_mask(mask, None, None, 48, 48, device="cpu"))


def test_document_mask():
    q, k, v = inputs()
    document_id = torch.tensor([0] * 13 + [1] * 20 + [2] * 15, dtype=torch.int32)

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document_id[q_idx] == document_id[kv_idx])

    check(q, k, v, block_mask=flex.create_block_mask(document_causal, None, None, 48, 48, device="cpu"))


def test_prefix_lm_with_or_masks_and_per_batch_prefix():
    q, k, v = inputs()
    prefix_length = torch.tensor([7, 30], dtype=torch.int32)

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length[b]

    check(q, k, v, block_mask=flex.create_block_mask(or_masks(prefix, causal), 2, None, 48, 48, device="cpu"))


def test_alibi_score_mod_with_gqa_and_scale():
    """h is the query head in both (key head h // 2 here), and score_mod gets the scaled score."""
    q, k, v = inputs(heads=4, kv_heads=2)
    slopes = torch.exp2(-torch.arange(1, 5, dtype=torch.float32))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    check(q, k, v, score_mod=alibi, enable_gqa=True, scale=0.2,
          block_mask=flex.create_block_mask(causal, None, None, 48, 48, device="cpu"))


def test_rows_that_see_no_key_give_zero_and_lse_minus_inf():
    q, k, v = inputs(batch=1)
    mask = and_masks(causal, lambda b, h, q_idx, kv_idx: q_idx >= 5)   # rows 0..4 see no key
    out = check(q, k, v, block_mask=flex.create_block_mask(mask, None, None, 48, 48, device="cpu"))
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))


def test_gradients_of_q_k_v_lse_and_a_captured_tensor():
    q, k, v = inputs(batch=1, heads=4, kv_heads=2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).half()
    dlse = torch.randn(1, 4, 48, generator=torch.Generator().manual_seed(2))
    slopes = torch.exp2(-torch.arange(1, 5, dtype=torch.float32))
    mine, exact_slopes, same_slopes = (slopes.clone().to(dt).requires_grad_() for dt in
                                       (torch.float32, torch.float64, torch.float32))

    def alibi(t):
        return lambda score, b, h, q_idx, kv_idx: score + t[h] * (kv_idx - q_idx)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    block_mask = flex.create_block_mask(and_masks(causal, sliding_window(20)), None, None, 48, 48, device="cpu")
    out, lse = fagen.flex_attention(*leaves, score_mod=alibi(mine), block_mask=block_mask, enable_gqa=True,
                                    return_lse=True)
    torch.autograd.backward((out, lse), (dout, dlse))
    flash = [t.transpose(1, 2) for t in (q, k, v)]
    common = dict(mask_mod=block_mask.mask_mod, dlse=dlse)
    ref = attention_gradients(*flash, dout.transpose(1, 2), score_mod=alibi(exact_slopes), captures=[exact_slopes],
                              **common)
    *same, extra = attention_same_dtype(*flash, dout.transpose(1, 2), score_mod=alibi(same_slopes),
                                        captures=[same_slopes], return_extra=True, **common)
    assert err(out.transpose(1, 2), ref["out"]) <= 2 * err(same[0], ref["out"]) + ABS_FLOOR
    for leaf, name, yardstick in zip(leaves, ("dq", "dk", "dv"), same[1:]):
        assert err(leaf.grad.transpose(1, 2), ref[name]) <= 3 * err(yardstick, ref[name]) + ABS_FLOOR
    assert err(mine.grad, ref["captures"][0]) <= 3 * err(extra["captures"][0], ref["captures"][0]) + ABS_FLOOR


def test_a_block_mask_made_from_block_tables_alone_masks_its_blocks():
    """BlockMask.from_kv_blocks without a mask_mod (noop_mask): the listed blocks are the mask,
    as in FlexAttention's kernels (its eager math ignores them, so SDPA with the dense mask is
    the reference here)."""
    q, k, v = inputs(batch=1)
    rows = [[0], [0, 1], [1, 2]]   # query block i sees these key blocks (16 x 16)
    kv_num_blocks = torch.tensor([[[len(r) for r in rows]]], dtype=torch.int32)
    kv_indices = torch.tensor([[[r + [0] * (3 - len(r)) for r in rows]]], dtype=torch.int32)
    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=16)
    dense = torch.zeros(3, 3, dtype=torch.bool)
    for i, r in enumerate(rows):
        dense[i, r] = True
    dense = dense.repeat_interleave(16, 0).repeat_interleave(16, 1)
    out = fagen.flex_attention(q, k, v, block_mask=block_mask)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=dense)
    same = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    assert err(out, exact) <= 2 * err(same, exact) + ABS_FLOOR


def test_mask_combinators_trace_to_their_conditions():
    """torch's and_masks / or_masks start from b.new_ones / b.new_zeros((), dtype=torch.bool), and
    noop_mask returns b.new_ones(size=(), dtype=torch.bool, device=b.device)."""
    window = sliding_window(3)
    both = trace_mask_mod(lambda b, h, q_idx, kv_idx: causal(b, h, q_idx, kv_idx) & window(b, h, q_idx, kv_idx))
    either = trace_mask_mod(lambda b, h, q_idx, kv_idx: causal(b, h, q_idx, kv_idx) | window(b, h, q_idx, kv_idx))
    assert trace_mask_mod(and_masks(causal, window)).expr == both.expr
    assert trace_mask_mod(or_masks(causal, window)).expr == either.expr
    assert trace_mask_mod(noop_mask).expr is sympy.true and trace_mask_mod(or_masks()).expr is sympy.false
    like = trace_mask_mod(lambda b, h, q_idx, kv_idx: torch.ones_like(b, dtype=torch.bool) & (q_idx >= kv_idx))
    assert like.expr == trace_mask_mod(causal).expr


@pytest.mark.parametrize("mod", [
    lambda b, h, q_idx, kv_idx: b.new_ones((2,), dtype=torch.bool),
    lambda b, h, q_idx, kv_idx: b.new_ones((), dtype=torch.int32),
    lambda b, h, q_idx, kv_idx: (q_idx + 1).new_zeros((), dtype=torch.bool),
    lambda b, h, q_idx, kv_idx: torch.zeros_like(q_idx, dtype=torch.float32),
])
def test_other_constants_in_a_mod_are_refused(mod):
    with pytest.raises(fagen.ModError, match="as FlexAttention's and_masks"):
        trace_mask_mod(mod)


def test_noop_mask_runs_as_no_mask():
    q, k, v = inputs(batch=1)
    out = fagen.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), mask_mod=noop_mask).transpose(1, 2)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert err(out, exact) <= 2 * err(F.scaled_dot_product_attention(q, k, v), exact) + ABS_FLOOR


@pytest.mark.parametrize("change, error, message", [
    (dict(query=lambda q: q.float()), TypeError, "query must be float16 or bfloat16"),
    (dict(value=lambda v: v[:, :, :5]), ValueError, r"key and value must have the same shape but for the head dim"),
    (dict(value=lambda v: torch.cat([v, v], -1)), ValueError, r"value's head dim \(value.shape\[-1\] = "),
    (dict(key=lambda k: k[:, :1], value=lambda v: v[:, :1]), ValueError, "enable_gqa=True"),
    (dict(scale=-1.0), ValueError, "scale must be a positive finite float"),
    (dict(block_mask=torch.ones(48, 48, dtype=torch.bool)), TypeError, "block_mask must be a"),
    (dict(block_mask=flex.create_block_mask(causal, None, None, 32, 48, device="cpu")), ValueError,
     r"block_mask was made for \(seqlen_q, seqlen_k\) = \(32, 48\)"),
    (dict(return_lse=True, return_aux=flex.AuxRequest(lse=True)) if hasattr(flex, "AuxRequest") else
     dict(return_lse="yes"), ValueError if hasattr(flex, "AuxRequest") else TypeError, "return_"),
])
def test_errors_name_flex_attentions_own_arguments(change, error, message):
    q, k, v = inputs(batch=1)
    args = dict(query=q, key=k, value=v)
    for name, value in change.items():
        args[name] = value(args[name]) if callable(value) else value
    with pytest.raises(error, match=message) as raised:
        fagen.flex_attention(**args)
    assert not {"q", "k", "v", "softmax_scale", "mask_mod"} & set(str(raised.value).replace(",", " ").split())


@pytest.mark.skipif(not hasattr(flex, "AuxRequest"), reason="torch without return_aux")
def test_return_aux_gives_lse():
    q, k, v = inputs(batch=1)
    out, aux = fagen.flex_attention(q, k, v, return_aux=flex.AuxRequest(lse=True))
    plain, lse = fagen.flex_attention(q, k, v, return_lse=True)
    assert torch.equal(out, plain) and torch.equal(aux.lse, lse) and aux.max_scores is None
    out, aux = fagen.flex_attention(q, k, v, return_aux=flex.AuxRequest())
    assert torch.equal(out, plain) and aux.lse is None
    with pytest.raises(ValueError, match="max_scores"):
        fagen.flex_attention(q, k, v, return_aux=flex.AuxRequest(max_scores=True))
