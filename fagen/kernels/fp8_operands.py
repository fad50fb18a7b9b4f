"""The fp8 kernels' operands as the op prepares them (templates/include/fagen/fp8.cuh).

An 8-bit wgmma reads both operands K-major, so the B operand of O += P V, V, goes in transposed:
V^T, a row per column of V with the keys along it. And `pack_p` turns the S accumulator into P's
A fragments without moving data by taking each 16 keys in its own order, so V^T's keys must be in
that order too: key k of a group of 16 at slot SLOT_OF_KEY[k] (fp8.cuh's slot_of_key).
"""

from __future__ import annotations

import torch

from ..arch_families import sm90_backward_tiles, sm90_tiles
from ..dtypes import FP8_TORCH_DTYPE
from ..errors import InputTypeError
from ..spec import Spec

DESCALES = ("q_descale", "k_descale", "v_descale")   # the kernel's parameters (params._fp8_descales)
# The backward's (params.FP8_BACKWARD_DESCALES and the row kernels'): O's and dO's too.
BACKWARD_DESCALES = (*DESCALES, "o_descale", "do_descale")
EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2)
GROUP = 16   # the keys pack_p orders among themselves
SLOT_OF_KEY = tuple(4 * (k % 8 // 2) + k % 2 + 2 * (k // 8) for k in range(GROUP))   # fp8.cuh's slot_of_key


def v_in_slot_order(v: torch.Tensor, multiple: int = GROUP) -> torch.Tensor:
    """V (B, Nk, Hk, d_v) as the fp8 forward's B operand of P V: (B, Hk, d_v, Nk rounded up to
    `multiple`, a multiple of 16), key k of each group of 16 at slot SLOT_OF_KEY[k % 16] of its group,
    zeros past Nk. One pass over V, in its dtype."""
    if v.dim() != 4:
        raise ValueError(f"v must be (batch, seqlen_k, kv_heads, head_dim_v), got shape {tuple(v.shape)}")
    batch, keys, heads, columns = v.shape
    if multiple % GROUP:
        raise ValueError(f"V^T's keys are padded to whole groups of {GROUP}, not {multiple}")
    padded = -(-keys // multiple) * multiple
    vt = torch.zeros(batch, heads, columns, padded, dtype=v.dtype, device=v.device)
    order = torch.tensor(SLOT_OF_KEY, device=v.device).repeat(padded // GROUP)[:keys]
    slots = torch.arange(keys, device=v.device) // GROUP * GROUP + order
    raw = (lambda t: t.view(torch.uint8)) if v.element_size() == 1 else (lambda t: t)   # float8 has no index_put
    raw(vt)[..., slots] = raw(v.permute(0, 2, 3, 1))
    return vt


def packed_v_in_slot_order(v: torch.Tensor, cu_seqlens_k: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences' V (total_k, Hk, d_v) as (V^T, starts): V^T (1, Hk, d_v, keys) holding each
    sequence's keys from starts[b] on, in `v_in_slot_order`'s order counted from the sequence's own
    first key, and zeros up to a whole number of `tile` keys (a tile's boxes never reach the next
    sequence's keys, whose groups of 16 start elsewhere); starts int32 (B,). One pass over V, and no
    host sync: V^T's width is the bound total_k + B (tile - 1) in whole tiles, not the exact sum,
    and v's rows are the sequences' (cu_seqlens_k[-1] = total_k, as the varlen ops take it)."""
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    padded = (lengths + tile - 1) // tile * tile
    starts = torch.cumsum(padded, 0) - padded
    keys, heads, columns = v.shape
    width = -(-(keys + lengths.numel() * (tile - 1)) // tile) * tile
    vt = torch.zeros(1, heads, columns, max(width, tile), dtype=v.dtype, device=v.device)
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=v.device), lengths, output_size=keys)
    local = torch.arange(keys, device=v.device) - cu_seqlens_k[:-1].long()[sequence]
    order = torch.tensor(SLOT_OF_KEY, device=v.device)
    slots = starts[sequence] + local // GROUP * GROUP + order[local % GROUP]
    raw = (lambda t: t.view(torch.uint8)) if v.element_size() == 1 else (lambda t: t)   # float8 has no index_put
    raw(vt)[0, :, :, slots] = raw(v.permute(1, 2, 0))
    return vt, starts.to(torch.int32)


def kernel_tensors(spec: Spec, k: torch.Tensor, v: torch.Tensor, descales: dict | None, varlen=None) -> dict:
    """An 8-bit forward call's tensors beyond q, k and v, by kernel parameter name: V^T
    (`v_in_slot_order`, made per call: one pass over V) and the three descales, each (B, Hk) fp32
    (`descales` by name; one missing is 1, as FlashAttention-3 takes None); packed sequences'
    (`varlen`) V^T and each one's start there (`packed_v_in_slot_order`). V^T's keys are padded
    to whole key tiles: the producer loads a tile's every box, and a box wholly outside the tensor
    is one whose zero fill (and its bytes' count on the barrier) TMA does not document."""
    tile = sm90_tiles(spec).block_n
    if varlen is None:
        return {"vt": v_in_slot_order(v, tile), **_descales(DESCALES, k.shape[0], k.shape[2], k.device, descales)}
    vt, starts = packed_v_in_slot_order(v, varlen[1], tile)   # k (total_k, Hk, d): a descale per sequence
    return {"vt": vt, "vt_starts": starts, **_descales(DESCALES, starts.numel(), k.shape[1], k.device, descales)}


def _descales(names: tuple, batch: int, kv_heads: int, device, descales: dict | None) -> dict:
    """`descales` by name, each (batch, kv_heads) fp32; one missing is ones."""
    descales = descales or {}
    ones = None
    tensors = {}
    for name in names:
        given = descales.get(name)
        if given is None:
            if ones is None:
                ones = torch.ones(batch, kv_heads, dtype=torch.float32, device=device)
            given = ones
        tensors[name] = given
    return tensors


def widened(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor (e4m3 or e5m2) as bf16, exactly (3 or 2 mantissa bits, exponents inside
    bf16's): what the fp8 backward's bf16 GEMMs read (fagen/reference/same_fp8_backward.py measured
    fp8 in dV's, dK's and dQ's GEMMs past the accuracy rule, and S's and dP's the same values in
    either). Others pass as they are (a bf16 O or dO)."""
    return t.to(torch.bfloat16) if t.dtype in EIGHT_BIT else t


def eight_bit_scores(spec: Spec, q, k, v, dout) -> dict:
    """The 8-bit tensors that S^T's and dP^T's 8-bit wgmmas read (Sm90BackwardTiles.fp8_scores), by
    kernel parameter name (q8, k8, v8, dout8: as the caller passed them, beside the widened ones the
    other GEMMs read); none where the spec's backward reads bf16 alone. dout must be in the spec's
    dout_dtype (the kernel's wgmma reads its bytes as that type)."""
    if not (spec.fp8 and spec.dout_dtype is not None and sm90_backward_tiles(spec).fp8_scores):
        return {}
    expected = FP8_TORCH_DTYPE[spec.dout_dtype]
    if dout.dtype != expected:
        raise InputTypeError(f"dout must be {str(expected).removeprefix('torch.')} for {spec.name} (its "
                             f"dout_dtype={spec.dout_dtype!r}: S and dP by 8-bit wgmma), got {dout.dtype}")
    return {"q8": q, "k8": k, "v8": v, "dout8": dout}


def backward_tensors(k: torch.Tensor, descales: dict | None, varlen=None) -> dict:
    """An 8-bit backward call's descales by kernel parameter name (`BACKWARD_DESCALES`): q's, k's,
    v's, O's and dO's, each (B, Hk) fp32 (packed sequences': a row per sequence); one missing is 1
    (a bf16 O or dO passes with none)."""
    batch = k.shape[0] if varlen is None else varlen[1].numel() - 1
    return _descales(BACKWARD_DESCALES, batch, k.shape[-2], k.device, descales)
