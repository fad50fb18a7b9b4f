"""`fagen.sdpa` against `torch.nn.functional.scaled_dot_product_attention`, on the emulator.

The same call in both, FlashAttention-2's rule against SDPA in float64 (fagen's error at most 2x
that of SDPA in the inputs' dtype; 3x for gradients): is_causal top-left with Nq != Nk, boolean
masks that are key padding and ones that are not, float (additive) masks with a gradient,
enable_gqa, scale, SDPA's other shapes ((..., H, N, d) with any leading dims, (H, N, d), (N, d)),
and the errors SDPA's signature implies.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fagen

ABS_FLOOR = 1e-5


def inputs(batch=2, heads=4, kv_heads=4, nq=40, nk=56, d=32, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, nq, d, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, nk, d, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, nk, d, generator=gen).to(dtype)
    return q, k, v


def check(q, k, v, grads=True, **kwargs):
    """fagen.sdpa and SDPA (float64, and in q's dtype) on the same call; outputs and gradients."""
    leaves = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    exact_in = [t.detach().double().requires_grad_(grads) for t in (q, k, v)]
    same_in = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    double_kwargs = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
                     for n, x in kwargs.items()}
    mine, exact, same = fagen.sdpa(*leaves, **kwargs), F.scaled_dot_product_attention(*exact_in, **double_kwargs), \
        F.scaled_dot_product_attention(*same_in, **kwargs)
    err = lambda a, b: (a.double() - b.double()).nan_to_num().abs().max().item()  # noqa: E731
    assert mine.shape == exact.shape and mine.dtype == q.dtype
    assert err(mine, exact) <= 2 * err(same, exact) + ABS_FLOOR
    if grads:
        dout = torch.randn_like(exact)
        for outs, ins in ((mine, leaves), (exact, exact_in), (same, same_in)):
            outs.backward(dout.to(outs.dtype))
        for a, b, c in zip(leaves, exact_in, same_in):
            assert err(a.grad, b.grad) <= 3 * err(c.grad, b.grad) + ABS_FLOOR
    return mine


@pytest.mark.parametrize("nq, nk", [(40, 56), (56, 40), (48, 48)])
def test_is_causal_is_top_left(nq, nk):
    q, k, v = inputs(nq=nq, nk=nk)
    check(q, k, v, is_causal=True)


def test_rows_that_see_no_key_are_zero_not_nan():
    """Top-left causal with Nq > Nk sees every key from row Nk - 1 on; rows never lack a key
    there. A mask that hides a whole row does: SDPA gives NaN, fagen 0."""
    q, k, v = inputs(batch=1, nq=8, nk=8)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[3] = False
    out = fagen.sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3])) and torch.isfinite(out).all()


def test_enable_gqa_and_scale():
    q, k, v = inputs(heads=4, kv_heads=2)
    check(q, k, v, enable_gqa=True, scale=0.3, is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fagen.sdpa(q, k, v)


def test_boolean_key_padding_mask():
    q, k, v = inputs(dtype=torch.bfloat16)
    lengths = torch.tensor([56, 23])
    mask = (torch.arange(56)[None] < lengths[:, None])[:, None, None, :]   # (B, 1, 1, Nk)
    check(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("shape", [(40, 56), (2, 1, 40, 56), (1, 4, 1, 56), (2, 1, 1, 56), (1, 56)])
def test_boolean_masks_that_are_not_padding_become_a_mask_mod(shape):
    q, k, v = inputs()
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(shape, generator=gen) > 0.3
    mask[..., 0] = True   # every row keeps a key: SDPA's NaN rows stay out of the comparison
    check(q, k, v, attn_mask=mask)


def test_float_mask_is_added_to_the_scores_with_its_gradient():
    q, k, v = inputs(batch=1, heads=2, kv_heads=2)
    bias = torch.randn(1, 2, 40, 56, dtype=torch.float32, requires_grad=True)
    out = fagen.sdpa(q, k, v, attn_mask=bias)
    ref_bias = bias.detach().double().requires_grad_(True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=ref_bias)
    assert (out.double() - ref).abs().max() < 3e-3
    dout = torch.randn_like(ref)
    out.backward(dout.to(out.dtype))
    ref.backward(dout)
    assert (bias.grad.double() - ref_bias.grad).abs().max() < 3e-3


def test_dropout_runs_and_is_seeded_by_torch():
    q, k, v = inputs(batch=1)
    torch.manual_seed(5)
    a = fagen.sdpa(q, k, v, dropout_p=0.2)
    torch.manual_seed(5)
    b = fagen.sdpa(q, k, v, dropout_p=0.2)
    assert torch.equal(a, b) and not torch.equal(a, fagen.sdpa(q, k, v))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(attn_mask=torch.ones(3, 40, 56, dtype=torch.bool)), ValueError, "does not broadcast"),
    (dict(attn_mask=torch.ones(40, 56, dtype=torch.int32)), TypeError, "boolean"),
    (dict(attn_mask=torch.ones(40, 56, dtype=torch.bool), is_causal=True), ValueError, "not both"),
    (dict(is_causal=1), TypeError, "is_causal"),
])
def test_bad_arguments(kwargs, error, message):
    q, k, v = inputs()
    with pytest.raises(error, match=message):
        fagen.sdpa(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="query must have at least 2 dims"):
        fagen.sdpa(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])


@pytest.mark.parametrize("change, error, message", [
    (dict(query=lambda q: q.float()), TypeError, "query must be float16 or bfloat16"),
    (dict(key=lambda k: k.bfloat16()), TypeError, "query, key and value must share a dtype"),
    (dict(value=lambda v: v[:, :, :40]), ValueError,
     r"key and value must have the same shape but for the head dim, got key \(2, 4, 56, 32\)"),
    (dict(value=lambda v: torch.cat([v, v], -1)), ValueError,
     r"value's head dim \(value.shape\[-1\] = 64\) must be from 1 to query's \(32\)"),
    (dict(key=lambda k: k[:1], value=lambda v: v[:1]), ValueError, "query and key must have the same batch size"),
    (dict(query=lambda q: q[..., ::2]), ValueError, "query must have a contiguous last dimension"),
    (dict(key=lambda k: k.to_sparse()), TypeError, r"key must be a dense \(torch.strided\) tensor"),
    (dict(scale=-1.0), ValueError, "scale must be a positive finite float"),
    (dict(scale="big"), TypeError, "scale must be a float or None"),
    (dict(enable_gqa="yes"), TypeError, "enable_gqa must be True or False"),
    (dict(attn_mask=torch.ones(40, 56, dtype=torch.bool).to_sparse()), TypeError, "attn_mask must be a dense"),
])
def test_errors_name_sdpas_own_arguments(change, error, message):
    """SDPA's names (query, key, value, scale...) and its layout's shapes, never flash_attn_func's."""
    q, k, v = inputs()
    args = dict(query=q, key=k, value=v)
    for name, value in change.items():
        args[name] = value(args[name]) if callable(value) else value
    with pytest.raises(error, match=message) as raised:
        fagen.sdpa(**args)
    assert not {"q", "k", "v", "softmax_scale"} & set(str(raised.value).replace(",", " ").split())


def test_numpy_bool_flags():
    np = pytest.importorskip("numpy")
    q, k, v = inputs(batch=1, heads=2, kv_heads=2, nq=16, nk=16)
    assert torch.equal(fagen.sdpa(q, k, v, is_causal=np.True_), fagen.sdpa(q, k, v, is_causal=True))


def test_three_and_two_dim_inputs():
    q, k, v = inputs(batch=1)
    check(q[0], k[0], v[0], is_causal=True)                        # (H, N, d): H plays batch and heads
    check(q[0, 1], k[0, 1], v[0, 1], attn_mask=torch.rand(40, 56, generator=torch.Generator().manual_seed(1)) > 0.3)


def test_leading_batch_dims_flatten_into_views(monkeypatch):
    """(2, 3, H, N, d): the kernels read query, key and value where they are (no copy), and a
    mask that varies along one leading dim broadcasts over the other, as SDPA's does."""
    from fagen.kernels import attention_kernels
    q, k, v = (t.reshape(2, 3, *t.shape[1:]) for t in inputs(batch=6, heads=4, kv_heads=2, nq=24, nk=32))
    seen, forward = [], attention_kernels.forward
    monkeypatch.setattr(attention_kernels, "forward",
                        lambda source, *qkv, **kw: seen.append(qkv) or forward(source, *qkv, **kw))
    mask = torch.rand(3, 1, 24, 32, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[..., 0] = True
    assert check(q, k, v, attn_mask=mask, enable_gqa=True).shape == (2, 3, 4, 24, 32)
    fagen.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert [t.untyped_storage().data_ptr() for t in seen[-1]] == [t.untyped_storage().data_ptr() for t in (q, k, v)]


@pytest.mark.parametrize("change, message", [
    (dict(key=lambda k: k[:, :2], value=lambda v: v[:, :2]), r"key's leading \(batch\) dims \(2, 2\) must equal q"),
    (dict(key=lambda k: k[0], value=lambda v: v[0]), "the same number of dims"),
    (dict(attn_mask=lambda _: torch.ones(2, 2, 3, 4, 24, 32, dtype=torch.bool)), "must broadcast to"),
    (dict(attn_mask=lambda _: torch.ones(2, 2, 1, 24, 32, dtype=torch.bool)), "does not broadcast"),
])
def test_leading_dims_errors(change, message):
    q, k, v = (t.reshape(2, 3, *t.shape[1:]) for t in inputs(batch=6, nq=24, nk=32))
    args = dict(query=q, key=k, value=v, attn_mask=None)
    for name, value in change.items():
        args[name] = value(args[name])
    with pytest.raises(ValueError, match=message):
        fagen.sdpa(**args)
