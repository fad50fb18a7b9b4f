"""The fp8 backward's math with its roundings and nothing more: the yardstick of its accuracy rule.

`same_fp8`'s counterpart for the backward of FlashAttention-3's sm90 design, fed as Transformer
Engine feeds cuDNN's fp8 attention: q, k, v and O in e4m3, dO in e4m3 or e5m2, each with an fp32
descale per batch entry and K/V head (the real tensors are q * q_descale, and so on), the forward's
lse (fp32), and dQ, dK, dV returned in bf16. Five GEMMs, each of exact products summed in fp32:

    S  = q k^T     times q_descale k_descale tau;  P = exp(S - L), 0 where masked
    dP = dO v^T    times do_descale v_descale;  D = rowsum(dO o O) of the dequantised values (fp32)
                   dS = P o (dP - D)  (fp32)
    dV = P^T dO    times do_descale
    dK = dS^T q    times q_descale tau   (tau after the sum, as FlashAttention-3 applies it)
    dQ = dS k      times k_descale tau

S and dP read 8-bit operands only; widened to bf16 they are the same values with the same exact
products, so naming them in `fp8_gemms` changes nothing here (only the kernel's speed). dV, dK and
dQ read P or dS, which the kernel holds in fp32 and must round to an operand type:
  bf16 (a GEMM not in fp8_gemms): P and dS rounded to bf16, the other operand widened.
  fp8, P: P~ = 2^p_exponent P to e4m3. P <= 1 (L normalises it), so 2^8 puts the largest possible
      P at 256 as the forward does (the largest power of two below 448) and keeps P >= 2^-17.
  fp8, dS: dS 2^e to ds_dtype, one e per ds_block tile (block_m x block_n, the kernel's tile):
      the largest e with amax(|dS| of the tile) 2^e <= the format's largest value, so the tile's
      largest |dS| lands in (max / 2, max]. dS has no a-priori bound (it scales with dO and v), so
      the scale must come from its amax; a tile's is the finest one operand serves both dK (a sum
      over the tile's rows) and dQ (over its columns). A power of two, so scaling is exact: dQ's
      per-tile partial takes 2^-e before its fp32 atomic add, and dK's register accumulator is
      multiplied by 2^(e_new - e_old) where a tile's e changes (as the forward rescales O); either
      way the sum is the fp32 sum of the exact products modelled here.
Under GQA each query head's dK and dV are summed over its group in fp32, then rounded to bf16.

The verdict of benchmarks/fp8_backward_accuracy.py (RECOMMENDED_FP8_GEMMS): S and dP in fp8, which
costs nothing; dV, dK and dQ in bf16. Each of those three in fp8 multiplies its gradient's RMSE by
7 to 11 over the all-bf16 model's, past the rule's 2x: e4m3's 4 significant bits round P or dS 16
times coarser than bf16's 8, and no scale buys significant bits. dS in e5m2 doubles e4m3's error
again. A per-head dS scale measures the same as the per-tile one (e4m3's 18 binades hold every dS
there), but it would need dS's amax before the GEMMs: a second pass. O in e4m3 is the largest error
of dQ and dK in the all-bf16 model on causal or peaked rows: D = rowsum(dO o O) carries O's
rounding (up to 2^-4 of each term), and dP - D is a small difference there.

What this leaves out, as `same_fp8` does: the kernel's summation order; and Hopper's fp8 wgmma is
reported to keep fewer bits than fp32 in its accumulator (DeepSeek-V3, section 3.3.2), which only
a GPU run can measure.
"""

from __future__ import annotations

import math

import torch

from .problem import make_problem, to_query_layout
from .same_fp8 import P_EXPONENT, descale_of

CALLER = "attention_backward_same_fp8"   # its errors' prefix
GEMMS = ("s", "dp", "dv", "dk", "dq")
FORMAT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
DS_DTYPE = torch.float8_e4m3fn   # measured: at the same tile scale e5m2 (2 mantissa bits) errs 2x more
DS_BLOCK = (64, 128)             # the sm90 backward's tile at d <= 128 (block_m queries, block_n keys)
RECOMMENDED_FP8_GEMMS = ("s", "dp")   # the rule's verdict (above)


def fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` (e4m3 or e5m2) as cvt.rn.satfinite does, in x's float type (float32 or
    float64): nearest even, clamped to the format's largest value, NaN kept."""
    top = FORMAT_MAX[dtype]
    return torch.clamp(x, -top, top).to(dtype).to(x.dtype)


def attention_backward_same_fp8(q, k, v, out, dout, lse, *, q_descale=None, k_descale=None, v_descale=None,
                                o_descale=None, do_descale=None, softmax_scale=None, causal=False,
                                seqlens_k=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, fp8_gemms=GEMMS,
                                ds_dtype=DS_DTYPE, ds_block=DS_BLOCK, p_exponent: int = P_EXPONENT):
    """(dq, dk, dv) in bf16, shaped like q, k, v, from e4m3 q (B, Nq, H, d), k, v (B, Nk, Hk, d / d_v),
    out (B, Nq, H, d_v) in e4m3 or bf16, dout like out in e4m3, e5m2 or bf16, lse (B, H, Nq) (natural
    log, taken as fp32); descales (B, Hk) fp32 or None (1); key padding, a window, a softcap and
    ALiBi as the oracle takes them (the score chain in fp32 on the scaled scores, dS through its
    derivative). `fp8_gemms` names the GEMMs (GEMMS) whose operands are 8-bit; the rest take bf16 ones."""
    gemms = _check_inputs(q, k, v, out, dout, lse, fp8_gemms, ds_dtype)
    prob = make_problem(q.float(), k.float(), v.float(), softmax_scale=softmax_scale, causal=causal,
                        seqlens_k=seqlens_k, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    batch, kv_heads, group = prob.batch, prob.kv_heads, prob.group
    qd, kd, vd, od, dod = (descale_of(d, batch, kv_heads, name, CALLER).repeat_interleave(group, 1)[:, :, None, None]
                           for d, name in ((q_descale, "q_descale"), (k_descale, "k_descale"),
                                           (v_descale, "v_descale"), (o_descale, "o_descale"),
                                           (do_descale, "do_descale")))   # (B, H, 1, 1)
    qh, oh, doh = (t.float().transpose(1, 2) for t in (q, out, dout))
    kh, vh = (t.float().transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
    scores, chain = _score_chain(prob, (qh @ kh.transpose(-1, -2)) * (qd * kd * prob.scale))
    probs = torch.exp(scores - lse.float()[..., None]).masked_fill(~prob.visible_all(), 0.0)
    dp = (doh @ vh.transpose(-1, -2)) * (dod * vd)
    delta = (doh * oh).sum(-1, keepdim=True) * (dod * od)
    ds = probs * (dp - delta) * chain
    p_operand = _p_operand(probs, "dv" in gemms, p_exponent)
    ds_for_k, ds_for_q = (_ds_operand(ds, name in gemms, ds_dtype, ds_block) for name in ("dk", "dq"))
    dv = _sum_group((p_operand.transpose(-1, -2) @ doh) * dod, group)
    dk = _sum_group((ds_for_k.transpose(-1, -2) @ qh) * (qd * prob.scale), group)
    dq = (ds_for_q @ kh) * (kd * prob.scale)
    return tuple(to_query_layout(t).to(torch.bfloat16) for t in (dq, dk, dv))


def _score_chain(prob, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
    """The scaled scores through the problem's chain (softcap, then ALiBi), and ds'/dx elementwise
    (1. without one), both fp32."""
    if not prob.has_score_mods:
        return scores, 1.0
    with torch.enable_grad():
        x = scores.detach().requires_grad_()
        modified = prob.modify_scores(x)
        (grad,) = torch.autograd.grad(modified.sum(), x)
    return modified.detach().float(), grad.float()


def _p_operand(probs: torch.Tensor, in_fp8: bool, p_exponent: int) -> torch.Tensor:
    """P as the dV GEMM reads it, in P's units: 2^-p e4m3(2^p P) (exact scalings) or bf16(P)."""
    if not in_fp8:
        return probs.bfloat16().float()
    return fp8(probs * 2.0 ** p_exponent, torch.float8_e4m3fn) * 2.0 ** -p_exponent


def _ds_operand(ds: torch.Tensor, in_fp8: bool, dtype: torch.dtype, block) -> torch.Tensor:
    """dS as the dK or dQ GEMM reads it, in dS's units: 2^-e fp8(2^e dS) with e per tile, or bf16(dS).
    The scaling runs in float64 so that no 2^e, however large, leaves the exponent range."""
    if not in_fp8:
        return ds.bfloat16().float()
    scale = _tile_scales(ds, block, FORMAT_MAX[dtype])
    return (fp8(ds.double() * scale, dtype) / scale).float()


def _tile_scales(ds: torch.Tensor, block, top: float) -> torch.Tensor:
    """2^e per (block_m x block_n) tile of ds (B, H, Nq, Nk), float64 and broadcast to ds's shape:
    the largest e with amax 2^e <= top, from the exponents alone (no rounded log2 to misjudge a
    power of two). With amax = m 2^a (m in [0.5, 1)) and top = t 2^b, e = b - a, less 1 if m > t."""
    block_m, block_n = block
    batch, heads, nq, nk = ds.shape
    padded = torch.nn.functional.pad(ds.abs().double(), (0, -nk % block_n, 0, -nq % block_m))
    tiles = padded.view(batch, heads, padded.shape[2] // block_m, block_m, padded.shape[3] // block_n, block_n)
    amax = tiles.amax(dim=(3, 5))
    mantissa, exponent = torch.frexp(amax)
    top_mantissa, top_exponent = math.frexp(top)
    e = top_exponent - exponent - (mantissa > top_mantissa).int()
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e), 1.0)   # an all-zero tile: any
    return scale.repeat_interleave(block_m, 2).repeat_interleave(block_n, 3)[:, :, :nq, :nk]


def _sum_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H, N, d) -> (B, Hk, N, d): the query heads of a K/V head summed (fp32, FA3's dK/dV accumulators)."""
    batch, heads, n, d = x.shape
    return x.view(batch, heads // group, group, n, d).sum(2)


def _check_inputs(q, k, v, out, dout, lse, fp8_gemms, ds_dtype) -> frozenset:
    """TypeError for a wrong dtype, ValueError for a wrong shape or GEMM name; the GEMMs in fp8."""
    for name, t, allowed in (("q", q, (torch.float8_e4m3fn,)), ("k", k, (torch.float8_e4m3fn,)),
                             ("v", v, (torch.float8_e4m3fn,)), ("out", out, (torch.float8_e4m3fn, torch.bfloat16)),
                             ("dout", dout, (*FORMAT_MAX, torch.bfloat16)), ("ds_dtype", ds_dtype, tuple(FORMAT_MAX))):
        dtype = t if name == "ds_dtype" else getattr(t, "dtype", type(t).__name__)
        if dtype not in allowed:
            raise TypeError(f"attention_backward_same_fp8: {name} must be "
                            f"{' or '.join(map(str, allowed))}, got {dtype}")
    expected = (*q.shape[:3], v.shape[-1])
    for name, t, shape in (("out", out, expected), ("dout", dout, expected),
                           ("lse", lse, (q.shape[0], q.shape[2], q.shape[1]))):
        if tuple(t.shape) != shape:
            raise ValueError(f"attention_backward_same_fp8: {name} must have shape {shape}, got {tuple(t.shape)}")
    unknown = set(fp8_gemms) - set(GEMMS)
    if unknown or isinstance(fp8_gemms, str):
        raise ValueError(f"attention_backward_same_fp8: fp8_gemms must name GEMMs of {GEMMS}, got {fp8_gemms!r}")
    return frozenset(fp8_gemms)

