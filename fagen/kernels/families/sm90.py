"""The sm90 family's passes (templates/sm90/): Hopper's wgmma, TMA and mbarriers, FlashAttention-3's
warp-specialised forward and backward (one producer warpgroup, two consumer warpgroups). Its own
backward takes what `sm90_backward_refusal` lets through (d = 64 to 256: d = 64 and 128 in one form,
d = 192 and 256, d_v < d and d = 128's dropout and mods in its paired form; a deterministic dQ by
reductions in a fixed order); the sm80 family's backward computes the others' gradients (d past 256)."""

from __future__ import annotations

from ...arch_families import SM90, sm90_backward_refusal, sm90_backward_tiles, sm90_tiles
from ..params import backward_params, sm90_backward_params, sm90_forward_params
from ..passes import KernelFamily, Pass, entry
from . import sm80
from .shared import COMBINE

# The static headers of its wrappers (templates/include/fagen/), beyond the ones every family includes.
HEADERS = ("elect.cuh", "mbarrier.cuh", "named_barrier.cuh", "proxy_fence.cuh", "smem_desc.cuh", "tma.cuh",
           "warpgroup_control.cuh", "wgmma.cuh")


def _forward_entries(spec, debug: bool) -> dict:
    tiles = sm90_tiles(spec)
    return {"forward": entry(spec, "fwd", sm90_forward_params(spec), tiles.threads, tiles.block_m, "q",
                             tiles.shared_bytes, tiles.slices)}


def _backward_entries(spec, debug: bool) -> dict:
    """The row kernels the sm80 backward launches too (the preprocess, dQ's conversion) around its
    own main kernel: a block per key block, dQ summed into the fp32 accumulator by bulk reductions
    (deterministic: in the order of the key blocks, `params.dq_order`)."""
    tiles = sm90_backward_tiles(spec)   # its block_m is the preprocess's padding (the template asserts it)
    return {**sm80.row_entries(spec, backward_params(spec, blocked_dq=True), tiles.block_m),
            "bwd_main": entry(spec, "bwd", sm90_backward_params(spec), tiles.threads, tiles.block_n, "k",
                              tiles.shared_bytes)}


def _context(spec) -> dict:
    """What its templates read beyond the Spec: the forward's geometry (`sm90.block_n`, ...) and the
    backward's (`sm90_bwd`, read only where its backward takes the spec)."""
    return dict(sm90=sm90_tiles(spec), sm90_bwd=sm90_backward_tiles(spec))


FORWARD = Pass(("sm90/hopper_fwd.cu.j2",), _forward_entries,
               includes=tuple(f"sm90/hopper_{part}.j2" for part in ("kv_cache", "mask", "epilogue", "variant_steps",
                                                                     "producer", "softmax", "tile_span", "pv")))


def _refusal(paired: bool):
    """A form's refusal: the family's own (`sm90_backward_refusal`), then the specs of the other
    form (`sm90_backward_tiles(spec).paired` picks it)."""
    template = "sm90/hopper_bwd_paired.cu.j2" if paired else "sm90/hopper_bwd.cu.j2"

    def refusal(spec):
        found = sm90_backward_refusal(spec)
        if found is None and sm90_backward_tiles(spec).paired != paired:
            return f"sm90_backward_tiles gives this spec the other form than {template}"
        return found
    return refusal


_PARTS = ("sm90/hopper_bwd_flags.j2", "sm90/hopper_bwd_scores.j2", "sm90/hopper_bwd_dropout.j2", "sm90/hopper_bwd_dq_order.j2",
          "sm90/hopper_bwd_dq_writer.j2", "sm90/hopper_bwd_walk.j2")
BACKWARD = Pass(("sm90/hopper_bwd.cu.j2",), _backward_entries, includes=_PARTS, refusal=_refusal(paired=False))
# Sm90BackwardTiles.paired (d > 128, d_v != d, and what spilled in the other form): two consumer
# warpgroups share a key block, one accumulating dK, the other dV.
PAIRED_BACKWARD = Pass(("sm90/hopper_bwd_paired.cu.j2",), _backward_entries, includes=_PARTS,
                       refusal=_refusal(paired=True))

FAMILY = KernelFamily(SM90, forward={2: FORWARD}, backward=(BACKWARD, PAIRED_BACKWARD, sm80.BACKWARD),
                      decoding={2: FORWARD}, combine=COMBINE, headers=HEADERS, context=_context)
