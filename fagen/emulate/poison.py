"""Poison kernel outputs before a run, then check that every element was written.

    poison_(out)             # fill with a sentinel bit pattern
    kernel(...)              # writes out
    assert_written(out)      # AssertionError naming unwritten elements

Floats get a quiet NaN with a distinctive payload, so an unwritten element
also fails any numeric comparison; integers get 0xA5 bytes. The check
compares bits, so a kernel that computes a (differently encoded) NaN is not
mistaken for one that never wrote.
"""

from __future__ import annotations

import torch

# Same-size integer view of each dtype, and the sentinel in that view.
POISON_BITS = {
    torch.float16: (torch.int16, 0x7E5A),          # quiet NaN, payload 0x25A
    torch.bfloat16: (torch.int16, 0x7FDA),         # quiet NaN, payload 0x5A
    torch.float32: (torch.int32, 0x7FD5A5A5),      # quiet NaN, payload 0x15A5A5
    torch.float64: (torch.int64, 0x7FFA5A5A5A5A5A5A),
    torch.int8: (torch.int8, 0xA5),
    torch.uint8: (torch.uint8, 0xA5),
    torch.int16: (torch.int16, 0xA5A5),
    torch.int32: (torch.int32, 0xA5A5A5A5),
    torch.int64: (torch.int64, 0xA5A5A5A5A5A5A5A5),
}


def _signed(bits: int, dtype: torch.dtype) -> int:
    width = torch.iinfo(dtype).bits
    if dtype == torch.uint8:
        return bits
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def _bits_view(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    if tensor.dtype not in POISON_BITS:
        raise TypeError(f"cannot poison a {tensor.dtype} tensor")
    view_dtype, bits = POISON_BITS[tensor.dtype]
    view = tensor if view_dtype == tensor.dtype else tensor.view(view_dtype)
    return view, _signed(bits, view_dtype)


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill `tensor` (in place, any strides) with its dtype's sentinel; returns it."""
    view, bits = _bits_view(tensor)
    view.fill_(bits)
    return tensor


def unwritten_mask(tensor: torch.Tensor) -> torch.Tensor:
    """True where `tensor` still holds the sentinel bits."""
    view, bits = _bits_view(tensor)
    return view == bits


def assert_written(tensor: torch.Tensor, name: str = "output") -> None:
    """Raise AssertionError if any element still holds the poison sentinel."""
    mask = unwritten_mask(tensor)
    count = int(mask.sum())
    if count:
        first = [tuple(int(i) for i in idx) for idx in mask.nonzero()[:5]]
        raise AssertionError(f"{count} of {tensor.numel()} elements of {name} were never written by the "
                             f"kernel (first at {first})")
