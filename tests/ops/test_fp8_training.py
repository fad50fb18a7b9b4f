"""fp8 training (issue 45, part 3) as users call it: fagen.fp8_attention_backward (Transformer Engine's
contract: e4m3 q, k, v, O; dO in e4m3, e5m2 or bf16; descales) and fagen.fp8_attention_func (bf16 q,
k, v quantised inside, gradients from the fp8 backward), eagerly and under torch.compile."""

import pytest
import torch

import fagen
from fagen.errors import InputError
from fagen.ops.fp8_inputs import dequantize, quantize
from fagen.reference import attention_forward, attention_gradients
from fagen.reference.same_fp8_backward import RECOMMENDED_FP8_GEMMS, attention_backward_same_fp8
from fp8_backward_cases import FP8_GRAD_FACTOR
from kernel_cases import ABS_FLOOR, max_error

E4M3 = torch.float8_e4m3fn
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])   # ALiBi's, one per query head of `inputs`


def inputs(seed=0, b=2, nq=96, nk=96, h=4, hk=2, d=64, dtype=torch.bfloat16, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, heads, d, generator=g).to(dtype).requires_grad_(grad)
            for n, heads in ((nq, h), (nk, hk), (nk, hk))]


@pytest.mark.parametrize("dout_dtype, chain", [(torch.bfloat16, {}), (torch.float8_e5m2, {}),
                                               (torch.float8_e5m2, {"softcap": 20.0, "alibi_slopes": SLOPES})],
                         ids=["bf16", "e5m2", "e5m2-softcap-alibi"])
def test_fp8_attention_backward_with_the_forward_s_outputs_is_within_the_rule(dout_dtype, chain):
    """The functional backward on the forward's own O (bf16) and L, against the float64 oracle on
    the dequantised inputs: within FP8_GRAD_FACTOR times the rounding model's error
    (tests/support/fp8_backward_cases.py's rule). An e5m2 dO (N(0, 1) needs no descale there) takes
    S and dP by 8-bit wgmma (Spec.dout_dtype); a softcap with ALiBi, both passes' score chain."""
    q, k, v = inputs(grad=False)
    q8, k8, v8, qd, kd, vd = fagen.quantize_qkv(q, k, v)
    out, lse = fagen.flash_attn_func(q8, k8, v8, causal=True, return_lse=True, q_descale=qd, k_descale=kd,
                                     v_descale=vd, **chain)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dout_dtype)
    scales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    dq, dk, dv = fagen.fp8_attention_backward(dout, q8, k8, v8, out, lse, **scales, causal=True, **chain)
    qx, kx, vx = dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd)
    exact, _ = attention_forward(qx, kx, vx, causal=True, **chain)
    dlse = ((dout.double() * exact).sum(-1) - (dout.double() * out.double()).sum(-1)).transpose(1, 2)
    oracle = attention_gradients(qx, kx, vx, dout.double(), dlse=dlse, causal=True, **chain)
    model = attention_backward_same_fp8(q8, k8, v8, out, dout, lse, **scales, causal=True,
                                        fp8_gemms=RECOMMENDED_FP8_GEMMS, **chain)
    for name, got, modelled in zip(("dq", "dk", "dv"), (dq, dk, dv), model):
        assert got.dtype == torch.bfloat16 and got.shape == oracle[name].shape
        assert max_error(got, oracle[name]) <= FP8_GRAD_FACTOR * max_error(modelled, oracle[name]) + ABS_FLOOR, name


def test_a_training_step_s_gradients_are_the_fp8_backward_s_on_the_quantised_inputs():
    """fp8_attention_func: O and the gradients in q's dtype, equal (bit for bit) to the forward and
    backward called by hand on the same quantised tensors, with a window, a softcap and ALiBi; the
    gradient passes straight through the quantisation."""
    q, k, v = inputs(seed=1)
    chain = dict(window_size=(40, 0), softcap=20.0, alibi_slopes=SLOPES)
    out = fagen.fp8_attention_func(q, k, v, causal=True, **chain)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    out.backward(dout)
    q8, k8, v8, qd, kd, vd = fagen.quantize_qkv(q.detach(), k.detach(), v.detach())
    by_hand, lse = fagen.flash_attn_func(q8, k8, v8, causal=True, return_lse=True, q_descale=qd, k_descale=kd,
                                         v_descale=vd, **chain)
    grads = fagen.fp8_attention_backward(dout, q8, k8, v8, by_hand, lse, q_descale=qd, k_descale=kd,
                                         v_descale=vd, causal=True, **chain)
    assert torch.equal(out, by_hand)
    for tensor, expected in zip((q, k, v), grads):
        assert tensor.grad.dtype == tensor.dtype and torch.equal(tensor.grad, expected)


def test_a_training_step_compiles_without_graph_breaks_and_equals_eager():
    torch._dynamo.reset()

    def step(q, k, v):   # ALiBi's slopes: an optional tensor argument of the custom ops
        out = fagen.fp8_attention_func(q, k, v, causal=True, alibi_slopes=SLOPES)
        return out.float().square().sum()

    eager_inputs, compiled_inputs = inputs(seed=2, d=128), inputs(seed=2, d=128)
    explained = torch._dynamo.explain(step)(*inputs(seed=2, d=128))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    step(*eager_inputs).backward()
    torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_inputs).backward()
    for eager, compiled in zip(eager_inputs, compiled_inputs):
        assert torch.equal(eager.grad, compiled.grad)


def test_deterministic_training_repeats_its_gradients_bit_for_bit():
    grads = []
    for _ in range(2):
        q, k, v = inputs(seed=6, nq=200, nk=200)
        fagen.fp8_attention_func(q, k, v, causal=True, deterministic=True).float().sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_fp8_attention_func_names_a_bad_softcap_or_alibi_slopes():
    q, k, v = inputs(nq=40, nk=50)
    with pytest.raises(InputError, match="softcap must be a float >= 0"):
        fagen.fp8_attention_func(q, k, v, softcap="x")
    with pytest.raises(InputError, match="alibi_slopes must have shape"):
        fagen.fp8_attention_func(q, k, v, alibi_slopes=torch.ones(3))


def test_fp32_inputs_get_fp32_gradients():
    q, k, v = inputs(seed=5, dtype=torch.float32, nq=40, nk=50)
    fagen.fp8_attention_func(q, k, v).sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def _bad_backward_calls():
    q, k, v = inputs(grad=False)
    q8, k8, v8, qd, kd, vd = fagen.quantize_qkv(q, k, v)
    out = torch.zeros(*q.shape, dtype=torch.bfloat16)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    base = dict(dout=out, q=q8, k=k8, v=v8, out=out, lse=lse)
    return [
        ({**base, "q": q}, "q is float8_e4m3fn|must be float8_e4m3fn"),
        ({**base, "out": out.half()}, "out must be float8_e4m3fn or bfloat16"),
        ({**base, "dout": out[:, :5]}, "dout must be \\(batch, seqlen_q, heads, head_dim_v\\)"),
        ({**base, "lse": lse[..., :5]}, "lse must be float32 \\(batch, heads, seqlen_q\\)"),
        ({**base, "o_descale": torch.ones(2, 3)}, "o_descale must be float32 of shape \\(batch, kv_heads\\)"),
        ({**base, "grad_dtype": torch.float16}, "grad_dtype must be torch.bfloat16, torch.float8_e4m3fn"),
        ({**base, "dq_scale": 2.0}, "dq_scale: only fp8 gradients take a scale; pass grad_dtype"),
        ({**base, "grad_dtype": E4M3, "dk_scale": torch.ones(2)}, "dk_scale must be one floating-point value"),
        ({**base, "grad_dtype": E4M3, "dv_scale": "2"}, "dv_scale must be a float or a one-element tensor"),
        ({**base, "softcap": -1.0}, "softcap must be a float >= 0"),
        ({**base, "alibi_slopes": torch.ones(3)}, "alibi_slopes must have shape"),
    ]


@pytest.mark.parametrize("call, message", _bad_backward_calls())
def test_bad_backward_calls_name_the_argument(call, message):
    with pytest.raises((InputError, TypeError), match=message):
        fagen.fp8_attention_backward(**call)


def test_fp8_gradients_for_delayed_scaling_are_the_bf16_ones_scaled_saturated_with_their_amax():
    """grad_dtype e4m3 / e5m2: each gradient is the bf16 call's times its scale, cast with saturation
    (dq's scale puts its largest values past 448), byte for byte, and its amax the bf16 one's."""
    q, k, v = inputs(seed=7, nq=64, nk=80, grad=False)
    q8, k8, v8, qd, kd, vd = fagen.quantize_qkv(q, k, v)
    out, lse = fagen.flash_attn_func(q8, k8, v8, causal=True, return_lse=True, q_descale=qd, k_descale=kd,
                                     v_descale=vd)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).bfloat16()
    call = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    bf16 = fagen.fp8_attention_backward(dout, q8, k8, v8, out, lse, **call)
    amaxes = [g.float().abs().amax() for g in bf16]
    for dtype in (E4M3, torch.float8_e5m2):
        largest = torch.finfo(dtype).max
        scales = [2 * largest / amaxes[0], torch.tensor([0.5]), None]   # a tensor, a one-element tensor, 1
        got = fagen.fp8_attention_backward(dout, q8, k8, v8, out, lse, **call, grad_dtype=dtype,
                                           dq_scale=scales[0], dk_scale=scales[1], dv_scale=scales[2])
        assert isinstance(got, fagen.FP8Gradients)
        for grad, scale, fp8, amax in zip(bf16, scales, got[:3], got[3:]):
            scale = 1.0 if scale is None else scale.reshape(())
            expected = (grad.float() * scale).clamp(-largest, largest).to(dtype)
            assert fp8.dtype == dtype and torch.equal(fp8.view(torch.uint8), expected.view(torch.uint8))
            assert amax.dtype == torch.float32 and amax.dim() == 0 and torch.equal(amax, grad.float().abs().amax())
        assert got.dq.float().abs().max() == largest   # saturated, not inf or NaN


def test_the_fp8_forward_s_own_gradient_refusal_points_to_the_training_entry():
    q8, k8, v8 = (x.to(E4M3).requires_grad_() for x in inputs(grad=False))
    with pytest.raises(InputError, match="fagen.fp8_attention_func"):
        fagen.flash_attn_func(q8, k8, v8)


def test_a_per_head_quantisation_round_trips_within_e4m3():
    """The training entry's quantiser: each (batch, K/V head) scaled to 448, so dequantising errs by
    e4m3's half ulp at most (2^-4 relative)."""
    x = inputs(grad=False, dtype=torch.float32)[0]
    x8, descale = quantize(x, 2)
    err = (dequantize(x8, descale) - x.double()).abs()
    assert bool((err <= 2.0 ** -4 * x.double().abs() + 2.0 ** -9 * descale.max().item()).all())
