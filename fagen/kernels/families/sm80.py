"""The sm80 family's passes (templates/sm80/): mma.sync and cp.async, every warp alike. Its
forward is FlashAttention-1's or -2's; its backward (FlashAttention-2's) serves every family
that has none of its own."""

from __future__ import annotations

from ...arch_families import SM80
from ..params import backward_params, forward_params
from ..passes import KernelFamily, Pass, entry
from .shared import COMBINE


def _forward_entries(spec, debug: bool) -> dict:
    # Version 1 runs one block per batch * head, over every query row; version 2 a block per query tile.
    rows = spec.block_m if spec.version == 2 else None
    return {"forward": entry(spec, "fwd", forward_params(spec, debug), spec.threads, rows, "q",
                             spec.shared_layout.total_bytes)}


def _backward_entries(spec, debug: bool) -> dict:
    """The preprocess (D and L in log2 units), the main kernel (dK, dV and dQ's atomics) and dQ's
    pass: without atomics where the spec is deterministic, else the fp32 accumulator's conversion."""
    bwd, params = spec.backward_tiles, backward_params(spec, debug)
    kernels = {**row_entries(spec, params),
               "bwd_main": entry(spec, "bwd", params["bwd_main"], bwd.threads, bwd.block_n, "k",
                                 spec.backward_layout.total_bytes)}
    if spec.deterministic:
        kernels["bwd_dq"] = entry(spec, "bwd_dq", params["bwd_dq"], 2 * bwd.block_m * spec.column_split,
                                  bwd.block_m, "q", spec.dq_layout.total_bytes)
    return kernels


def row_entries(spec, params: dict, block_m: int | None = None) -> dict:
    """The backward's row kernels (templates/bwd_rows.j2), which every family's backward launches
    around its main kernel: the preprocess, and dQ's conversion where dQ is summed in the fp32
    accumulator (not where a deterministic spec's dQ has a pass of its own). `block_m`: the main
    kernel's query block, to which L's and D's rows are padded (default: this family's)."""
    block_m = block_m or spec.backward_tiles.block_m
    kernels = {"bwd_preprocess": entry(spec, "bwd_preprocess", params["bwd_preprocess"], 128, block_m, "q", 0)}
    if "bwd_dq_convert" in params:
        kernels["bwd_dq_convert"] = entry(spec, "bwd_dq_convert", params["bwd_dq_convert"], 128, block_m, "q", 0)
    return kernels


FORWARD_V1 = Pass(("sm80/fwd_v1.cu.j2",), _forward_entries)
FORWARD_V2 = Pass(("sm80/fwd_v2.cu.j2",), _forward_entries)
BACKWARD = Pass(("sm80/bwd.cu.j2",), _backward_entries, includes=("sm80/bwd_dq.cu.j2",))   # takes every spec

FAMILY = KernelFamily(SM80, forward={1: FORWARD_V1, 2: FORWARD_V2}, backward=(BACKWARD,),
                      decoding={2: FORWARD_V2}, combine=COMBINE)
