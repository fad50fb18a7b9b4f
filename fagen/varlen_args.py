"""Packed sequences' arguments, checked: flash-attn 2.8's `flash_attn_varlen_func` layout.

q (total_q, H, d) and k, v (total_k, Hk, d) hold B sequences back to back; cu_seqlens_q and
cu_seqlens_k (int32, (B + 1,)) give where each starts, from 0, non-decreasing, ending at the
totals; max_seqlen_q / max_seqlen_k bound every length (they size the grid). Every error names
the argument. Value checks read the tensors (one device sync) and are skipped where values
cannot be read: under torch.compile and CUDA graph capture.
"""

from __future__ import annotations

import torch

TORCH_DTYPES = (torch.float16, torch.bfloat16)


def values_checkable(t: torch.Tensor) -> bool:
    """Whether reading a tensor's values is allowed here: not while torch.compile traces
    (they are data) and not during CUDA graph capture (the device sync would fail it)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _check_packed(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must have 3 dims (total tokens, heads, head_dim) for packed sequences, "
                         f"got shape {tuple(t.shape)}")
    if t.dtype not in TORCH_DTYPES:
        raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}")


def _check_cu(name: str, cu, total: int, max_name: str, max_seqlen, device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
        got = cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TypeError(f"{name} must be an int32 tensor of shape (batch + 1,), got {got}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{max_name} must be an int >= 0, got {max_seqlen!r}")
    if values_checkable(cu):
        values = cu.tolist()   # one device sync
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if any(n < 0 for n in lengths):
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if values[-1] != total:
            raise ValueError(f"{name}[-1] must equal the {total} tokens packed, got {values[-1]}")
        if lengths and max(lengths) > max_seqlen:
            raise ValueError(f"{max_name} = {max_seqlen} is smaller than a sequence of {max(lengths)} tokens")
    return cu.contiguous()


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=None):
    """Validate a packed call; returns (cu_seqlens_q, cu_seqlens_k) ready for the kernels."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_packed(name, t)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's number of heads ({q.shape[1]}) must be a multiple of k's ({k.shape[1]})")
    if block_table is not None:
        raise ValueError("block_table (a paged K/V cache) is not supported by flash_attn_varlen_func yet; "
                         "pass k and v packed like q")
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q, q.device)
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k, q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got {cu_q.numel() - 1} "
                         f"and {cu_k.numel() - 1}")
    return cu_q, cu_k


def packed_lse(slots: torch.Tensor, cu_seqlens_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """(H, total_q), flash-attn's varlen lse, from the kernels' (B, H, max_seqlen_q) slots (no sync;
    differentiable: a gradient on it reaches each sequence's rows of its slot)."""
    batch = cu_seqlens_q.numel() - 1
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(batch, device=slots.device), lengths, output_size=total_q)
    row = torch.arange(total_q, device=slots.device) - cu_seqlens_q.long()[sequence]
    return slots[sequence, :, row].transpose(0, 1)
