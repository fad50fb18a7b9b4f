"""The fp8 forward's math with its roundings and nothing more: the yardstick of its accuracy rule.

FlashAttention-2's rule measures a kernel's error against the float64 oracle as a multiple of
plain PyTorch's in the same dtype (`same_dtype`). In e4m3 there is no plain PyTorch attention,
so this is its stand-in: what any fp8 kernel of this design must round, done once, in order.

    q, k, v    e4m3 values (exact), with their descales (fp32, per batch and K/V head):
               the real tensors are q * q_descale, and so on
    S          (q k^T) q_descale k_descale tau, summed in fp32 (wgmma's e4m3 products are
               exact, its sums fp32); then the variants (`problem`)
    P~         2^p_exponent exp(S - rowmax S): P scaled into e4m3's range. Its largest
               value per row is 2^p_exponent, so p_exponent = 8 puts it at 256, the largest
               power of two below e4m3's 448 (a power of two, so the scaling itself is exact),
               and keeps every P >= 2^-17 representable (e4m3's smallest subnormal is 2^-9)
    l          the row sum of P~ before rounding (fp32), with a sink's term where the variant has
               sinks (a logit per head, in the softmax's units, with no value row)
    O          e4m3(P~) v, summed in fp32, times v_descale / l; returned in bf16

The online softmax's running maximum rescales P~ by factors that are not powers of two, so a
kernel rounds slightly different values: this is a yardstick of the error's size, not the
kernel's bits. Rows that see no key give 0.
"""

from __future__ import annotations

import torch

from .problem import make_problem

E4M3_MAX = 448.0
P_EXPONENT = 8   # log2 of P~'s largest value: 2^8 = 256 <= 448 < 2^9


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 as cvt.rn.satfinite does (nearest even, clamped to +-448, NaN kept),
    returned as float32."""
    return torch.clamp(x.float(), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def attention_same_fp8(q, k, v, *, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                       causal=False, seqlens_k=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       score_mod=None, mask_mod=None, sinks=None, p_exponent: int = P_EXPONENT) -> torch.Tensor:
    """O (B, Nq, H, d_v) in bf16 from e4m3 q (B, Nq, H, d), k, v (B, Nk, Hk, d / d_v); descales
    (B, Hk) fp32 or None (1)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"attention_same_fp8: {name} must be torch.float8_e4m3fn, got {t.dtype}")
    batch, kv_heads = k.shape[0], k.shape[2]
    scales = [descale_of(d, batch, kv_heads, name)
              for d, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))]
    prob = make_problem(q.float(), k.float(), v.float(), softmax_scale=softmax_scale, causal=causal,
                        seqlens_k=seqlens_k, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        score_mod=score_mod, mask_mod=mask_mod)
    group = prob.group
    qd, kd, vd = (s.repeat_interleave(group, dim=1)[:, :, None, None] for s in scales)   # (B, H, 1, 1)
    qh = q.float().transpose(1, 2)
    kh = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * (qd * kd * prob.scale)
    if prob.has_score_mods:
        scores = prob.modify_scores(scores)
    visible = prob.visible_all()
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:   # a last column of the head's logit, which no value row multiplies
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], -1)
        vh = torch.cat([vh, torch.zeros_like(vh[..., :1, :])], -2)
    row_max = scores.amax(-1, keepdim=True)
    empty = torch.isinf(row_max)
    scaled = torch.exp2(torch.tensor(float(p_exponent))) * torch.exp(scores - row_max.masked_fill(empty, 0.0))
    row_sum = scaled.sum(-1, keepdim=True)
    out = (e4m3(scaled) @ vh) * vd / row_sum.masked_fill(empty, 1.0)
    return out.masked_fill(empty, 0.0).transpose(1, 2).to(torch.bfloat16)


def descale_of(descale, batch: int, kv_heads: int, name: str, caller: str = "attention_same_fp8") -> torch.Tensor:
    """A model's descale as fp32 (batch, kv_heads): ones for None; ValueError naming `name` for another shape."""
    if descale is None:
        return torch.ones(batch, kv_heads)
    if tuple(descale.shape) != (batch, kv_heads):
        raise ValueError(f"{caller}: {name} must be (batch, kv heads) = ({batch}, {kv_heads}), "
                         f"got {tuple(descale.shape)}")
    return descale.float()
