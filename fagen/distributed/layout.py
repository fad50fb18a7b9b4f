"""How a sequence is split across the ranks of a context-parallel group.

The sequence (dim 1 of a (B, N, H, d) tensor, flash-attn's layout) is cut into chunks:

  contiguous   W chunks; rank r holds chunk r
  zigzag       2W chunks; rank r holds chunks r and 2W - 1 - r, in that order: under a causal
               mask every rank then has the same amount of work (an early chunk that sees
               few keys and a late one that sees many)

`chunks_of(layout, world, rank)` is the global index of each chunk a rank holds, in the order
of its local tensor; `shard` and `unshard` move between the global tensor and a rank's shard.
"""

from __future__ import annotations

import torch

from ..errors import InputError

LAYOUTS = ("contiguous", "zigzag")


def chunk_count(layout: str, world: int) -> int:
    check_layout(layout)
    return world if layout == "contiguous" else 2 * world


def check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks_of(layout: str, world: int, rank: int) -> tuple[int, ...]:
    """The global chunks rank `rank` holds, in local order."""
    check_layout(layout)
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def check_divisible(seqlen: int, layout: str, world: int, what: str = "the sequence") -> int:
    """The chunk length; raises unless `seqlen` splits evenly into the layout's chunks."""
    count = chunk_count(layout, world)
    if seqlen % count:
        raise InputError(f"{what} of {seqlen} tokens does not split into the {count} equal chunks the "
                         f"{layout} layout needs over {world} ranks ({'2 x world' if layout == 'zigzag' else 'world'});"
                         f" pad it to a multiple of {count}")
    return seqlen // count


def _group_info(group):
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def shard(x: torch.Tensor, layout: str = "zigzag", group=None) -> torch.Tensor:
    """This rank's shard of the global (B, N, ...) tensor `x` (every rank passes the same x)."""
    world, rank = _group_info(group)
    chunk = check_divisible(x.shape[1], layout, world)
    parts = [x[:, c * chunk:(c + 1) * chunk] for c in chunks_of(layout, world, rank)]
    return torch.cat(parts, dim=1).contiguous()


def unshard(x: torch.Tensor, layout: str = "zigzag", group=None) -> torch.Tensor:
    """The global (B, N, ...) tensor from every rank's shard `x` (an all-gather; every rank gets it)."""
    import torch.distributed as dist

    world, _ = _group_info(group)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    per_rank = len(chunks_of(layout, world, 0))
    chunk = x.shape[1] // per_rank
    pieces: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(gathered):
        for slot, index in enumerate(chunks_of(layout, world, rank)):
            pieces[index] = part[:, slot * chunk:(slot + 1) * chunk]
    return torch.cat([pieces[i] for i in range(len(pieces))], dim=1)
