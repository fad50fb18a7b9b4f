"""Ring attention: exact attention over a sequence sharded across a torch.distributed group.

Each rank holds its shard of q, k and v (fagen.distributed.layout). K/V blocks travel around
the ring, rank r sending to r + 1 and receiving from r - 1 (`batch_isend_irecv`, the next
step's transfer in flight while this step's kernels run): at step s rank r holds the block of
rank r - s. Each step attends the local queries to the block held, chunk pair by chunk pair
(`step_blocks`): under a causal mask a pair whose keys all come after its queries is skipped,
a pair on the diagonal runs the causal kernel and the others the plain one. The partial
(O, L) of each pair merge into the running result with `fagen.merge_attention`.

The backward sends the blocks around again with their dK/dV accumulators (fp32), which reach
their owners after the last step; every pair's backward uses the merged O and L (its P is
exp(S - L) of the whole row), so the sum over pairs is the exact gradient.

Dropout keys on global coordinates: each pair's kernels take the chunk's first row and column
in the whole sequence (Spec.coord_offsets), so the mask is the single-device mask, bit for bit,
whatever the layout or world size. The Philox pair is drawn on the group's first rank and
broadcast, so every rank uses the same one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..dtypes import DTYPE_NAME
from ..errors import InputError
from ..ops import merge_attention
from ..ops.common import check_flag, check_inputs, check_scale
from ..spec import check_dropout_p
from ..variants.builtins import window_pair
from .layout import check_divisible, check_layout, chunks_of
from .ring_ops import pair_backward, pair_forward, pair_kernels

METHODS = ("ring", "allgather")   # K/V passed around the ring, or gathered once (short K/V)


class Block(NamedTuple):   # a NamedTuple: torch.compile builds these in the traced step
    """One kernel call of a step: local query chunk `q_slot` against chunk `k_slot` of the
    block held; `q_chunk` / `k_chunk` are their global indices."""

    q_slot: int
    k_slot: int
    q_chunk: int
    k_chunk: int
    causal: bool


def step_blocks(layout: str, world: int, rank: int, source: int, causal: bool) -> list[Block]:
    """The chunk pairs rank `rank` computes against the block of rank `source`."""
    blocks = []
    for q_slot, q_chunk in enumerate(chunks_of(layout, world, rank)):
        for k_slot, k_chunk in enumerate(chunks_of(layout, world, source)):
            if causal and k_chunk > q_chunk:
                continue   # every key after every query: nothing to compute
            blocks.append(Block(q_slot, k_slot, q_chunk, k_chunk, causal and k_chunk == q_chunk))
    return blocks


def window_bounds(block: Block, chunk: int, window) -> tuple[int, int] | None:
    """The pair's window in its own coordinates, or None when the pair needs none. Over the
    whole (square) sequence key j is seen from query i iff i - left <= j <= i + right; in the
    pair (Nq = Nk = chunk, i and j counted from the chunks' starts) that is the band
    i - left' <= j <= i + right' with left' = left - (q_chunk - k_chunk) chunk and
    right' = right + (q_chunk - k_chunk) chunk."""
    if window is None:
        return None
    shift = (block.q_chunk - block.k_chunk) * chunk
    return window[0] - shift, window[1] + shift


def _band_meets_pair(bounds, chunk: int) -> bool:
    """Whether some (i, j) in [0, chunk)^2 has i - left <= j <= i + right."""
    left, right = bounds
    return right >= -(chunk - 1) and left >= -(chunk - 1) and -left <= right


def blocks_of(call, source: int) -> list[Block]:
    """`step_blocks` of the call, less the pairs that no query's window reaches."""
    blocks = step_blocks(call.layout, call.world, call.rank, source, call.causal)
    if call.window is None:
        return blocks
    return [b for b in blocks if _band_meets_pair(window_bounds(b, call.chunk, call.window), call.chunk)]


@dataclass
class RingCall:
    group: object
    world: int
    rank: int
    layout: str
    causal: bool
    dropout_p: float
    scale: float
    deterministic: bool
    chunk: int
    rng: tuple[int, int]
    method: str = "ring"
    window: tuple[int, int] | None = None   # (left, right) over the whole sequence, causal's right = 0


def _pair_ints(call: RingCall, block: Block) -> list[int]:
    """A pair's integer values for its ops (ring_ops): Philox pair, global first row and
    column, and the window's bounds in the pair's coordinates (0, 0 when none)."""
    bounds = window_bounds(block, call.chunk, call.window) or (0, 0)
    return [*call.rng, *_offsets(call, block), *bounds]


def _pair_kernels(q, call: RingCall, block: Block) -> str:
    return pair_kernels(q.shape[-1], DTYPE_NAME[q.dtype], block.causal, call.dropout_p > 0, call.deterministic,
                        call.window is not None)


def _offsets(call: RingCall, block: Block) -> tuple[int, int]:
    """The pair's first row and column in the whole sequence (its dropout coordinates)."""
    return block.q_chunk * call.chunk, block.k_chunk * call.chunk


def _rows(t: torch.Tensor, slot: int, chunk: int) -> torch.Tensor:
    return t[:, slot * chunk:(slot + 1) * chunk]


def _exchange(call: RingCall, tensors: list[torch.Tensor]):
    """Send `tensors` to the next rank and receive the previous rank's (started, not waited)."""
    import torch.distributed as dist

    if call.world == 1:   # the ring is this rank: what it sends is what it receives
        return [], tensors
    # gloo and NCCL send and receive contiguous memory only, and user shards are often views
    # (k, v = kv.unbind(2)); a copy here also makes the receive buffers contiguous.
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    after, before = (call.rank + 1) % call.world, (call.rank - 1) % call.world
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(call.group, after) if call.group else after,
                      call.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(call.group, before) if call.group else before,
                       call.group) for t in received]
    return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _forward(q, k, v, call: RingCall):
    """(out, lse) of the local queries against every block, merged; out in q's dtype."""
    chunk, slots = call.chunk, q.shape[1] // call.chunk
    parts: list[list] = [[] for _ in range(slots)]
    gathered = _gather(call, [k, v]) if call.method == "allgather" else None
    held = [k, v]
    for step in range(call.world):
        source = (call.rank - step) % call.world
        if gathered is not None:
            requests, incoming, held = [], None, [g[source] for g in gathered]
        else:
            requests, incoming = _exchange(call, held) if step + 1 < call.world else ([], None)
        for block in blocks_of(call, source):
            out, lse = pair_forward(_rows(q, block.q_slot, chunk), _rows(held[0], block.k_slot, chunk),
                                    _rows(held[1], block.k_slot, chunk), _pair_ints(call, block),
                                    [call.scale, call.dropout_p], _pair_kernels(q, call, block))
            parts[block.q_slot].append((out, lse))
        _wait(requests)
        if incoming is not None:
            held = incoming
    outs, lses = [], []
    for slot in range(slots):
        if parts[slot]:
            out, lse = merge_attention([o for o, _ in parts[slot]], [s for _, s in parts[slot]])
        else:   # no key at all (cannot happen causally: the diagonal is always there)
            out = torch.zeros_like(_rows(q, slot, chunk))
            lse = torch.full((q.shape[0], q.shape[2], chunk), math.inf, device=q.device)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _backward(q, k, v, out, lse, dout, call: RingCall):
    """dQ here; dK/dV accumulated in fp32 on the block as it travels: the next K/V block is in
    flight while this step's kernels run, and the accumulators move on once they are done
    (after the last step they reach their owners)."""
    if call.method == "allgather":
        return _backward_gathered(q, k, v, out, lse, dout, call)
    chunk = call.chunk
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
    for step in range(call.world):
        source = (call.rank - step) % call.world
        kv_requests, kv_next = _exchange(call, kv) if step + 1 < call.world else ([], None)
        for block in blocks_of(call, source):
            dq_b, dk_b, dv_b = _pair_backward(q, out, lse, dout, kv[0], kv[1], block, call)
            _rows(dq, block.q_slot, chunk).add_(dq_b.float())
            _rows(dkv[0], block.k_slot, chunk).add_(dk_b.float())
            _rows(dkv[1], block.k_slot, chunk).add_(dv_b.float())
        dkv_requests, dkv = _exchange(call, dkv)
        _wait(kv_requests + dkv_requests)
        kv = kv_next if kv_next is not None else kv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _pair_backward(q, out, lse, dout, keys, values, block, call):
    chunk = call.chunk
    rows = lambda t: _rows(t, block.q_slot, chunk)  # noqa: E731
    return pair_backward(rows(q), _rows(keys, block.k_slot, chunk), _rows(values, block.k_slot, chunk), rows(out),
                         lse[:, :, block.q_slot * chunk:(block.q_slot + 1) * chunk], rows(dout),
                         _pair_ints(call, block), [call.scale, call.dropout_p], _pair_kernels(q, call, block))


def _backward_gathered(q, k, v, out, lse, dout, call):
    """method="allgather": every block is here; dK/dV of every block summed over the ranks and
    each rank keeps its own (an all-reduce: gloo has no reduce-scatter)."""
    import torch.distributed as dist

    chunk = call.chunk
    keys, values = _gather(call, [k, v])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((2, call.world, *k.shape), dtype=torch.float32, device=k.device)
    for source in range(call.world):
        for block in blocks_of(call, source):
            dq_b, dk_b, dv_b = _pair_backward(q, out, lse, dout, keys[source], values[source], block, call)
            _rows(dq, block.q_slot, chunk).add_(dq_b.float())
            _rows(dkv[0, source], block.k_slot, chunk).add_(dk_b.float())
            _rows(dkv[1, source], block.k_slot, chunk).add_(dv_b.float())
    if call.world > 1:
        dist.all_reduce(dkv, group=call.group)
    return dq.to(q.dtype), dkv[0, call.rank].to(k.dtype), dkv[1, call.rank].to(v.dtype)


def _gather(call: RingCall, tensors):
    """Every rank's copy of each tensor: [per tensor: a list indexed by rank]."""
    import torch.distributed as dist

    if call.world == 1:
        return [[t] for t in tensors]
    gathered = []
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(call.world)]
        dist.all_gather(parts, t.contiguous(), group=call.group)
        gathered.append(parts)
    return gathered


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call):
        out, lse = _forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None and bool(dlse.any()):
            raise NotImplementedError("ring_attention: a gradient through the returned lse is not supported yet")
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, dout.contiguous(), ctx.call)
        return dq, dk, dv, None


def _philox_pair(dropout_p: float, device, group) -> tuple[int, int]:
    """The Philox (seed, offset), drawn from torch's generator on the group's first rank and
    broadcast: every rank must draw the same mask's words."""
    if dropout_p == 0:
        return 0, 0
    import torch.distributed as dist

    pair = torch.stack([torch.randint(0, 2**62, (), dtype=torch.int64),
                        torch.randint(0, 2**32, (), dtype=torch.int64)]).to(device)   # NCCL needs it on the GPU
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(pair, src=source, group=group)
    return int(pair[0]), int(pair[1])


def _window(window_size, causal: bool, seqlen: int) -> tuple[int, int] | None:
    """flash-attn's (left, right) over the whole sequence, -1 unbounded, causal's right = 0;
    None when nothing is cut. The argument is checked as every call's is (builtins.window_pair)."""
    left, right = (seqlen if w == -1 else min(w, seqlen) for w in window_pair(window_size))
    if causal:
        right = 0
    return None if left >= seqlen and right >= seqlen or (causal and left >= seqlen) else (left, right)


# (group, world, rank, q's shape, k's shape) whose agreement across the ranks has been checked:
# later calls with them skip the all-gather and its device sync.
_agreed_shapes: set = set()
MAX_AGREED_SHAPES = 256


def _check_shapes(q, k, v, call: RingCall, shape_check: bool) -> None:
    """Local shapes; and, on the first call with these shapes and group, that every rank holds
    the same ones (one tiny all-gather, read on the host). Every rank skips it on a later call
    with shapes it has checked: a rank whose shapes then differ from the others' (and that has
    seen its own before) is not told, and the ring's transfers fail or hang instead."""
    if q.shape[1] != k.shape[1]:
        raise InputError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be shards of one "
                         "sequence: the same local length")
    per_rank = len(chunks_of(call.layout, call.world, 0))
    check_divisible(q.shape[1] * call.world, call.layout, call.world, "the global sequence")
    if call.dropout_p > 0 and (q.shape[1] // per_rank) % 16:
        raise InputError(f"dropout under ring attention needs chunks of a multiple of 16 tokens (the Philox "
                         f"groups), got {q.shape[1] // per_rank}")
    key = (call.group, call.world, call.rank, tuple(q.shape), tuple(k.shape))
    if shape_check and key not in _agreed_shapes:
        import torch.distributed as dist

        mine = torch.tensor([*q.shape, *k.shape], dtype=torch.int64, device=q.device)
        every = [torch.empty_like(mine) for _ in range(call.world)]
        dist.all_gather(every, mine, group=call.group)
        if any(not torch.equal(other, mine) for other in every):
            raise InputError(f"ring_attention: ranks hold different shapes (q and k per rank: "
                             f"{[tuple(t.tolist()) for t in every]}); every rank needs an equal shard")
        if len(_agreed_shapes) >= MAX_AGREED_SHAPES:
            _agreed_shapes.clear()
        _agreed_shapes.add(key)


def ring_attention(q, k, v, group=None, *, causal=False, dropout_p=0.0, softmax_scale=None, window_size=(-1, -1),
                   layout="zigzag", return_lse=False, deterministic=False, method="ring"):
    """Exact attention over a sequence sharded across `group` (every rank calls it).

    q (B, N / world, H, d), k and v (B, N / world, Hk, d): this rank's shard in `layout`
    ("contiguous" or "zigzag", fagen.distributed.shard). Returns this rank's shard of the output
    (and with return_lse its L (B, H, N / world)). Causal is over the whole sequence; dropout
    draws the single-device mask (global coordinates); GQA/MQA as in flash_attn_func.
    `method="allgather"` gathers K/V once instead of passing blocks around the ring (for short
    K/V, e.g. few KV heads). Forward and backward (dK, dV return to their owners in fp32).
    """
    import torch.distributed as dist

    check_layout(layout)
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    check_inputs(q, k, v)   # dtypes, devices, layout, batch, head_dim, GQA: as flash_attn_func
    scale = check_scale("softmax_scale", softmax_scale, q.shape[-1])
    causal, deterministic, return_lse = (check_flag(name, x) for name, x in (
        ("causal", causal), ("deterministic", deterministic), ("return_lse", return_lse)))
    call = RingCall(group, world, rank, layout, causal, check_dropout_p(dropout_p), scale, deterministic,
                    0, (0, 0), method, _window(window_size, causal, q.shape[1] * world))
    _check_shapes(q, k, v, call, shape_check=True)
    call.chunk = q.shape[1] // len(chunks_of(layout, world, rank))
    call.rng = _philox_pair(call.dropout_p, q.device, group)
    out, lse = _RingAttention.apply(q, k, v, call)
    return (out, lse) if return_lse else out

