"""q, k and v as the fp8 kernels take them: e4m3 with an fp32 descale per (batch, K/V head), as
FlashAttention-3's fp8 `flash_attn_func` (q_descale, k_descale, v_descale); optionally rotated first.

The rotation is FlashAttention-3's incoherent processing: q and k times one random orthogonal
matrix per head, H = (a Hadamard matrix) diag(random signs) / sqrt(d). Since H H^T = I,
(q H)(k H)^T = q k^T, so attention is unchanged; but a few large channels (outliers) are spread
over all of them, so one descale per head wastes less of e4m3's range on them. v is not rotated
(its rotation would have to be undone on O).

Hadamard matrices by Sylvester's construction exist at powers of two; a head dim that is not one
(d = 192) is rotated by a block-diagonal of its largest power-of-two blocks (64 x 3), still orthogonal.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0   # e4m3's largest finite value: a head's largest magnitude is scaled to it


def hadamard_rotation(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """An orthogonal (head_dim x head_dim) fp32 matrix: Sylvester's Hadamard matrix on each
    power-of-two block of the diagonal, its columns' signs drawn from `seed`, scaled to unit norm."""
    if head_dim <= 0 or head_dim % 8:
        raise ValueError(f"head_dim must be a positive multiple of 8 to rotate, got {head_dim}")
    block = head_dim & -head_dim   # the largest power of two dividing head_dim
    sylvester = torch.ones(1, 1)
    while sylvester.shape[0] < block:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    blocks = torch.block_diag(*[sylvester] * (head_dim // block)) / block ** 0.5
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (blocks * signs).to(device=device, dtype=torch.float32)


def quantize(x: torch.Tensor, group: int = 1, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, heads, d) as e4m3 and its descale (B, heads / group), fp32: each group of `group`
    consecutive heads (a K/V head's query heads) shares one, its largest magnitude at 448."""
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point (batch, seqlen, heads, head_dim) tensor, "
                         f"got {tuple(x.shape)} {x.dtype}")
    batch, _, heads, _ = x.shape
    if heads % group:
        raise ValueError(f"{name} has {heads} heads, not a multiple of the group of {group}")
    amax = x.detach().abs().float().amax(dim=(1, 3)).view(batch, heads // group, group).amax(-1)
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = x.float() / descale.repeat_interleave(group, 1)[:, None, :, None]
    return saturated(scaled), descale


def saturated(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """x in the fp8 `dtype`, clamped first to its largest finite value as cvt's .satfinite and
    cuDNN's fp8 outputs are (torch's cast alone would give NaN or inf past it); NaN stays NaN."""
    largest = torch.finfo(dtype).max
    return x.clamp(-largest, largest).to(dtype)


def dequantize(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """`quantize`'s inverse, exactly, in float64: x8 (B, N, heads, d) times its (B, heads / group)
    descale, each descale shared by its group of consecutive heads."""
    group = x8.shape[2] // descale.shape[1]
    return x8.double() * descale.double().repeat_interleave(group, 1)[:, None, :, None]


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotate: bool = False, seed: int = 0):
    """(q8, k8, v8, q_descale, k_descale, v_descale) for flash-attn's layout q (B, Nq, H, d),
    k, v (B, Nk, Hk, d / d_v): descales (B, Hk) fp32, q's shared by each K/V head's query heads.
    `rotate`: q and k times `hadamard_rotation(d, seed)` first (attention unchanged)."""
    if k.dim() != 4 or q.dim() != 4 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q (B, Nq, H, d) and k (B, Nk, Hk, d) need H a multiple of Hk, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if rotate:
        rotation = hadamard_rotation(q.shape[-1], seed, q.device)
        q, k = q.float() @ rotation, k.float() @ rotation
    (q8, qd), (k8, kd), (v8, vd) = (quantize(q, q.shape[2] // k.shape[2], "q"), quantize(k, 1, "k"),
                                    quantize(v, 1, "v"))
    return q8, k8, v8, qd, kd, vd
