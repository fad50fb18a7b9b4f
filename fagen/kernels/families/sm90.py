"""The sm90 family's passes (templates/sm90/): Hopper's wgmma, TMA and mbarriers, FlashAttention-3's
warp-specialised forward (one producer warpgroup, two consumer warpgroups). Its backward is the
sm80 family's until one of its own lands here: a template in templates/sm90/ and its line below."""

from __future__ import annotations

from ...arch_families import SM90, sm90_tiles
from ..params import sm90_forward_params
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


def _context(spec) -> dict:
    """What its templates read beyond the Spec: the forward's geometry (`sm90.block_n`, ...)."""
    return dict(sm90=sm90_tiles(spec))


FORWARD = Pass(("sm90/hopper_fwd.cu.j2",), _forward_entries,
               includes=tuple(f"sm90/hopper_{part}.j2" for part in ("kv_cache", "mask", "epilogue", "variant_steps",
                                                                     "producer", "softmax", "tile_span")))

FAMILY = KernelFamily(SM90, forward={2: FORWARD}, backward=sm80.BACKWARD, decoding={2: FORWARD}, combine=COMBINE,
                      headers=HEADERS, context=_context)
