"""The fp8 kernels' operands as the op prepares them (templates/include/fagen/fp8.cuh).

An 8-bit wgmma reads both operands K-major, so the B operand of O += P V, V, goes in transposed:
V^T, a row per column of V with the keys along it. And `pack_p` turns the S accumulator into P's
A fragments without moving data by taking each 16 keys in its own order, so V^T's keys must be in
that order too: key k of a group of 16 at slot SLOT_OF_KEY[k] (fp8.cuh's slot_of_key).
"""

from __future__ import annotations

import torch

from ..arch_families import sm90_tiles
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


def kernel_tensors(spec: Spec, k: torch.Tensor, v: torch.Tensor, descales: dict | None) -> dict:
    """An 8-bit forward call's tensors beyond q, k and v, by kernel parameter name: V^T
    (`v_in_slot_order`, made per call: one pass over V) and the three descales, each (B, Hk) fp32
    (`descales` by name; one missing is 1, as FlashAttention-3 takes None). V^T's keys are padded
    to whole key tiles: the producer loads a tile's every box, and a box wholly outside the tensor
    is one whose zero fill (and its bytes' count on the barrier) TMA does not document."""
    return {"vt": v_in_slot_order(v, sm90_tiles(spec).block_n), **_descales(DESCALES, k, descales)}


def _descales(names: tuple, k: torch.Tensor, descales: dict | None) -> dict:
    """`descales` by name, each (B, Hk) fp32; one missing is ones."""
    descales = descales or {}
    ones = None
    tensors = {}
    for name in names:
        given = descales.get(name)
        if given is None:
            if ones is None:
                ones = torch.ones(k.shape[0], k.shape[2], dtype=torch.float32, device=k.device)
            given = ones
        tensors[name] = given
    return tensors


def widened(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor (e4m3 or e5m2) as bf16, exactly (3 or 2 mantissa bits, exponents inside
    bf16's): what the fp8 backward's bf16 GEMMs read (fagen/reference/same_fp8_backward.py measured
    fp8 in dV's, dK's and dQ's GEMMs past the accuracy rule, and S's and dP's the same values in
    either). Others pass as they are (a bf16 O or dO)."""
    return t.to(torch.bfloat16) if t.dtype in EIGHT_BIT else t


def backward_tensors(k: torch.Tensor, descales: dict | None) -> dict:
    """An 8-bit backward call's descales by kernel parameter name (`BACKWARD_DESCALES`): q's, k's,
    v's, O's and dO's, each (B, Hk) fp32; one missing is 1 (a bf16 O or dO passes with none)."""
    return _descales(BACKWARD_DESCALES, k, descales)
