"""Context parallelism (`fagen.distributed.ring_attention`) on CPU: the gloo backend with 2 and 4
processes (torch.multiprocessing spawn), each running the emulator on its shard.

Every rank checks its gathered results against the float64 oracle on the unsharded tensors,
within FlashAttention-2's rule (yardstick: the same-dtype PyTorch implementation): forward
and gradients, both layouts, causal and not, GQA 4/2; with dropout, against the single-device
kernel with the same Philox pair (so against the same global mask). Uneven and mismatched
shapes are errors on every rank. Each run is bounded in time and always shuts its process
group down.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from fagen.distributed.layout import chunks_of
from fagen.distributed.ring import step_blocks

RUN_LIMIT_S = 240
B, N, H, HK, D = 1, 128, 4, 2, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, H, D, generator=gen).half()
    k, v = (torch.randn(B, N, HK, D, generator=gen).half() for _ in range(2))
    return q, k, v, torch.randn(B, N, H, D, generator=gen).half()


def _ring_case(layout, causal, dropout_p=0.0, packed_kv=False, **options):
    """This rank's ring attention on its shards; every result gathered to the whole sequence.
    packed_kv: k and v are views of one (B, N / world, 2, Hk, d) tensor (`kv.unbind(2)`), not
    contiguous, which gloo and NCCL refuse to send as they are."""
    from fagen.distributed import ring_attention, shard, unshard

    q, k, v, dout = _inputs()
    leaves = [shard(t, layout).requires_grad_() for t in (q, k, v)]
    if packed_kv:
        kv = torch.stack(leaves[1:], dim=2).detach().requires_grad_()
        inputs = [leaves[0], *kv.unbind(2)]
        assert not inputs[1].is_contiguous()
    out, lse = ring_attention(*(inputs if packed_kv else leaves), causal=causal, layout=layout, dropout_p=dropout_p,
                              return_lse=True, **options)
    out.backward(shard(dout, layout))
    grads = [leaves[0].grad, *kv.grad.unbind(2)] if packed_kv else [x.grad for x in leaves]
    return [unshard(t, layout) for t in (out.detach(), lse.transpose(1, 2), *grads)]


def _check_against_oracle(got, causal, window_size=(-1, -1)):
    from fagen.reference import attention_gradients, attention_same_dtype

    q, k, v, dout = _inputs()
    exact = attention_gradients(q, k, v, dout, causal=causal, window_size=window_size)
    same = attention_same_dtype(q, k, v, dout, causal=causal, window_size=window_size)
    out, lse, dq, dk, dv = got
    err = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    assert err(lse.transpose(1, 2), exact["lse"]) < 1e-3
    for name, mine, yard, factor in (("out", out, same[0], 2), ("dq", dq, same[1], 3), ("dk", dk, same[2], 3),
                                     ("dv", dv, same[3], 3)):
        assert err(mine, exact[name]) <= factor * err(yard, exact[name]) + 1e-5, name


def _check_dropout(layout, monkeypatch_pair):
    """Ring dropout against the single-device kernels with the same Philox pair."""
    from fagen.kernels import attention_kernels
    from fagen.kernels.render import render
    from fagen.distributed import ring
    from fagen.spec import Spec

    seed, offset, p = 977, 3, 0.25
    monkeypatch_pair(ring, lambda *args: (seed, offset))
    got = _ring_case(layout, True, dropout_p=p)
    q, k, v, dout = _inputs()
    source = render(Spec(D, mask="causal", dropout=True))
    out, stats = attention_kernels.forward(source, q, k, v, dropout_p=p, seed=seed, philox_offset=offset)
    dq, dk, dv = attention_kernels.backward(source, q, k, v, out, stats, dout,
                                            dropout_args=attention_kernels.dropout_args(p, seed, offset))
    for mine, single in zip((got[0], *got[2:]), (out, dq, dk, dv)):
        # One mask: a rounding apart (block partials merged in fp32); another mask would be O(1) off.
        assert (mine.float() - single.float()).abs().max().item() < 2e-2


def _check_errors(world, rank):
    from fagen.distributed import ring_attention

    bad = torch.zeros(B, 7, H, D).half()   # 7 * world tokens: not 2 * world chunks for zigzag
    with pytest.raises(ValueError, match="does not split"):
        ring_attention(bad, bad[:, :, :HK], bad[:, :, :HK], layout="zigzag")
    # Shapes no rank has used before: a rank that has seen its shapes skips the agreement check
    # (no all-gather on a warm call), so a mismatch is only caught on a first call.
    mine = torch.zeros(B, 40 if rank == 0 else 48, H, D).half()
    with pytest.raises(ValueError, match="ranks hold different shapes"):
        ring_attention(mine, mine[:, :, :HK], mine[:, :, :HK], layout="contiguous")


def _check_warm_call_has_no_syncs(layout):
    """A second call with the same shapes and group skips the ranks' shape all-gather (whose
    comparison torch.equal reads on the host) and reads nothing else there (tests/support/host_reads.py):
    it runs, and gives the first call's result."""
    from unittest import mock

    import torch.distributed as dist

    from fagen.distributed import ring_attention, shard
    from host_reads import no_host_reads

    def refuse(*args, **kwargs):
        raise AssertionError("an all-gather of the shapes in a warm ring_attention call")

    q, k, v = (shard(t, layout) for t in _inputs()[:3])
    with torch.no_grad():
        first = ring_attention(q, k, v, causal=True, layout=layout)
        with no_host_reads(), mock.patch.object(dist, "all_gather", refuse):
            second = ring_attention(q, k, v, causal=True, layout=layout)
    assert torch.equal(first, second)


def _worker(rank, world, port, cases):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FAGEN_EMULATE_THREADS="1")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for layout, causal, options in cases:
            got = _ring_case(layout, causal, **options)
            _check_against_oracle(got, causal, options.get("window_size", (-1, -1)))
        if world == 2:
            _check_dropout("zigzag", lambda module, fn: setattr(module, "_philox_pair", fn))
            _check_warm_call_has_no_syncs("zigzag")
        if world > 1:
            _check_errors(world, rank)
    finally:
        dist.destroy_process_group()


def _run(world: int, cases) -> None:
    context = mp.spawn(_worker, args=(world, _free_port(), cases), nprocs=world, join=False)
    deadline = time.monotonic() + RUN_LIMIT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"the {world}-process run took more than {RUN_LIMIT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def test_two_ranks_both_layouts_causal_and_not_dropout_and_errors():
    # The non-causal case passes k and v as views of one packed tensor (not contiguous).
    _run(2, [("zigzag", True, {}), ("contiguous", True, {}), ("zigzag", False, {"packed_kv": True}),
             ("zigzag", True, {"method": "allgather"})])


@pytest.mark.slow   # four spawned ranks (about 35 s on two cores); two ranks stay in the default tier
def test_four_ranks_windows_that_span_ranks_and_allgather():
    # Chunks of 16 tokens: a window of 20 reaches back over one or two chunks, so some ring
    # steps are cut by the band and others skipped outright.
    _run(4, [("zigzag", True, {}), ("contiguous", False, {}), ("zigzag", True, {"window_size": (20, 0)}),
             ("contiguous", False, {"window_size": (9, 30)}), ("zigzag", False, {"method": "allgather"})])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_balances_causal_work(world):
    """Under zigzag every rank computes the same number of chunk pairs over a ring pass (the
    point of the layout); contiguous gives rank r r + 1 of them."""
    for layout in ("zigzag", "contiguous"):
        work = [sum(len(step_blocks(layout, world, r, (r - s) % world, True)) for s in range(world))
                for r in range(world)]
        assert work == ([2 * world + 1] * world if layout == "zigzag" else list(range(1, world + 1)))
    assert sorted(c for r in range(world) for c in chunks_of("zigzag", world, r)) == list(range(2 * world))


def test_a_single_rank_ring_is_the_plain_op():
    """world = 1 (what the GPU check runs): contiguous is one causal call on the whole sequence."""
    assert [b.causal for b in step_blocks("contiguous", 1, 0, 0, True)] == [True]
    _run(1, [("contiguous", True, {}), ("zigzag", True, {})])


@pytest.mark.parametrize("layout, causal, window", [("zigzag", True, (20, 0)), ("contiguous", False, (9, 30))])
def test_pairs_outside_every_window_are_skipped(layout, causal, window):
    """blocks_of keeps exactly the chunk pairs in which some query sees some key (brute force
    over the whole sequence's mask)."""
    from fagen.distributed.ring import RingCall, blocks_of

    world, chunk = 4, 16
    seqlen = 2 * world * chunk if layout == "zigzag" else world * chunk
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    seen = (j >= i - window[0]) & (j <= i + window[1]) & ((j <= i) if causal else True)
    dropped = 0
    for rank in range(world):
        call = RingCall(None, world, rank, layout, causal, 0.0, 1.0, False, chunk, (0, 0), "ring", window)
        for source in range(world):
            kept = {(b.q_chunk, b.k_chunk) for b in blocks_of(call, source)}
            for b in step_blocks(layout, world, rank, source, causal):
                block_seen = bool(seen[b.q_chunk * chunk:(b.q_chunk + 1) * chunk,
                                       b.k_chunk * chunk:(b.k_chunk + 1) * chunk].any())
                assert ((b.q_chunk, b.k_chunk) in kept) == block_seen
                dropped += not block_seen
    assert dropped > 0


@pytest.mark.parametrize("layout, world", [("zigzag", 2), pytest.param("contiguous", 4, marks=pytest.mark.slow),
                                           pytest.param("zigzag", 4, marks=pytest.mark.slow)])
def test_the_sharded_dropout_mask_is_the_single_device_mask(layout, world):
    """Every chunk pair a ring computes, run with its global coordinates (Spec.coord_offsets) and
    its keep mask recorded, forward and backward: put together they are the single-device mask
    (fagen.reference's NumPy Philox, which the unsharded kernels match), bit for bit."""
    from fagen.kernels import attention_kernels
    from fagen.kernels.render import render
    from fagen.reference import dropout_keep_mask
    from fagen.spec import Spec

    seed, offset, p, chunk = 4242, 9, 0.3, 16
    q, k, v, dout = (t[:, :2 * world * chunk if layout == "zigzag" else world * chunk] for t in _inputs())
    total = q.shape[1]
    expected = dropout_keep_mask(seed, offset, B, H, total, total, p).to(torch.uint8)
    for direction in ("forward", "backward"):
        gathered = torch.full((B, H, total, total), 7, dtype=torch.uint8)
        for rank in range(world):
            for source in range(world):
                for b in step_blocks(layout, world, rank, source, True):
                    source_code = render(Spec(D, mask="causal" if b.causal else "none", dropout=True,
                                              coord_offsets=True), debug=True)
                    rows, cols = slice(b.q_chunk * chunk, (b.q_chunk + 1) * chunk), \
                        slice(b.k_chunk * chunk, (b.k_chunk + 1) * chunk)
                    mask = torch.full((B, H, chunk, chunk), 7, dtype=torch.uint8)
                    args = dict(dropout_p=p, seed=seed, philox_offset=offset,
                                coord_offsets=(b.q_chunk * chunk, b.k_chunk * chunk))
                    debug = {"tiles_visited": torch.zeros(64, dtype=torch.int32), "keep_mask": mask}
                    out, stats = attention_kernels.forward(source_code, q[:, rows], k[:, cols], v[:, cols],
                                                           debug=debug if direction == "forward" else
                                                           {"tiles_visited": torch.zeros(64, dtype=torch.int32),
                                                            "keep_mask": torch.empty_like(mask)}, **args)
                    if direction == "backward":
                        attention_kernels.backward(source_code, q[:, rows], k[:, cols], v[:, cols], out, stats,
                                                   dout[:, rows],
                                                   dropout_args=attention_kernels.dropout_args(p, seed, offset),
                                                   debug={"keep_mask": mask},
                                                   coord_offsets=args["coord_offsets"])
                    gathered[:, :, rows, cols] = mask
        visible = torch.ones(total, total, dtype=torch.bool).tril()
        assert torch.equal(gathered[..., visible], expected[..., visible]), direction


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("head_dim, causal, window", [(64, True, False), (128, False, True)])
def test_sharded_dropout_kernels_compile_without_spills(head_dim, causal, window, arch):
    from fagen.kernels.render import render
    from fagen.kernels.compile import compile_source
    from fagen.spec import Spec

    spec = Spec(head_dim, mask="causal" if causal else "none", dropout=True, coord_offsets=True, window=window,
                dtype="bf16")
    assert "coords" in spec.name and Spec.from_name(spec.name) == spec
    for name, report in compile_source(render(spec), arch).resources.items():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, f"{name} on {arch}: {report}"


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_a_pairs_family_comes_from_the_gate_every_call_asks(family, monkeypatch):
    """The ring's pairs take their kernel family where every call of fagen.ops does
    (selftest.gate.serving_spec): FAGEN_ARCH_FAMILY chooses it on the emulator."""
    from fagen.distributed.ring_ops import pair_kernels, pair_source

    monkeypatch.setenv("FAGEN_ARCH_FAMILY", family)
    source = pair_source(pair_kernels(64, "fp16", True, True, False, True), torch.device("cpu"))
    assert source.spec.arch_family == family
    assert source.spec.causal and source.spec.coord_offsets and source.spec.window


def test_the_ring_checks_window_size_as_every_call_does():
    from fagen.distributed.ring import _window

    assert _window((-1, -1), False, 64) is None and _window((8, -1), True, 64) == (8, 0)
    for bad in [(1,), (-2, 0), (True, 1), (1.0, 2)]:
        with pytest.raises(ValueError, match=r"window_size must be a pair \(left, right\) of ints >= -1"):
            _window(bad, False, 64)
