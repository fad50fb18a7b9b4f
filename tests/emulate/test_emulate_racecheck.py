"""Racecheck, warp-serial schedules and the counters (tests/emulate/kernels/races.cu).

Each planted race is caught, and its correct twin is clean; the reports name
the hazard, both threads and both source lines. The counters count what the
hardware would: bank conflicts of padded and unpadded ldmatrix tiles, sectors
of coalesced and strided loads.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from fagen.emulate import RaceError, collect_counters, load_module

SOURCE = (Path(__file__).parent / "kernels" / "races.cu").read_text()
i32 = np.int32


@pytest.fixture(scope="module")
def module():
    return load_module(SOURCE, racecheck=True)


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(SOURCE.splitlines(), 1) if text in line)


# -- planted races -----------------------------------------------------------------------------

def test_a_missing_barrier_before_a_refill_is_caught(module):
    x = torch.randn(4 * 128)
    y = torch.zeros(128)
    module.get_function("refill_without_barrier")((1,), (128,), (x, y, i32(3), i32(1)))
    with pytest.raises(RaceError) as caught:
        module.get_function("refill_without_barrier")((1,), (128,), (x, y, i32(3), i32(0)))
    message = str(caught.value)
    assert "hazard on static __shared__ byte" in message
    assert f".cu:{line_of('tile[i] = x[(step + 1) * 128 + i]')}" in message      # the refill
    assert f".cu:{line_of('sum += tile[(t * 7 + step) % 128]')}" in message       # the read it races with
    assert message.count("(warp ") == 2 and "block (0,0,0)" in message


def test_a_missing_syncwarp_in_a_lane_exchange_is_caught(module):
    x, y = torch.randn(64), torch.zeros(64)
    module.get_function("lane_exchange")((1,), (64,), (x, y, i32(1)))
    assert torch.equal(y, x.view(32, 2).flip(1).reshape(64))
    with pytest.raises(RaceError, match="lanes of one warp, and no __syncwarp between them"):
        module.get_function("lane_exchange")((1,), (64,), (x, y, i32(0)))


def test_a_shuffle_orders_no_memory_unless_lenient(module, monkeypatch):
    x, y = torch.randn(64), torch.zeros(64)
    with pytest.raises(RaceError, match="no __syncwarp"):
        module.get_function("lane_exchange")((1,), (64,), (x, y, i32(2)))
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "lenient")
    lenient = load_module(SOURCE)
    lenient.get_function("lane_exchange")((1,), (64,), (x, y, i32(2)))


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_bar_sync_acquires_the_arrivals_and_bar_arrive_does_not(module, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    x, y = torch.randn(32), torch.zeros(32)
    module.get_function("named_handoff")((1,), (64,), (x, y, i32(1)))
    assert torch.equal(y, x.flip(0))
    with pytest.raises(RaceError) as caught:
        module.get_function("named_handoff")((1,), (64,), (x, y, i32(0)))
    message = str(caught.value)
    # forward: warp 0 writes first (read-after-write); reverse: warp 1 reads first (write-after-read).
    kind = "read-after-write" if schedule == "forward" else "write-after-read"
    assert f"racecheck: {kind} hazard on static __shared__ byte" in message
    assert f".cu:{line_of('tile[lane] = x[lane];')}" in message
    assert f".cu:{line_of('y[lane] = tile[31 - lane];')}" in message
    assert "no named barrier or mbarrier phase orders them" in message


def test_a_cp_async_destination_read_before_its_wait_is_caught():
    bugs = (Path(__file__).parent / "kernels" / "planted_bugs.cu").read_text()
    module = load_module(bugs, racecheck=True)
    x, y = torch.randn(4 * 64), torch.zeros(4 * 64)
    module.get_function("copy_without_wait")((1,), (64,), (x, y, i32(1)), shared_mem=1024)
    assert torch.equal(y.view(64, 4), x.view(64, 4).roll(-1, 0))
    with pytest.raises(RaceError) as caught:
        module.get_function("copy_without_wait")((1,), (64,), (x, y, i32(0)), shared_mem=1024)
    message = str(caught.value)
    assert "cp.async in flight" in message and "has not landed" in message
    issue_line = next(i for i, line in enumerate(bugs.splitlines(), 1) if "fagen::cp_async_16(tile + 4 * t" in line)
    assert f".cu:{issue_line}" in message


def test_two_blocks_storing_one_element_is_caught_but_atomics_are_not(module):
    y = torch.zeros(32)
    module.get_function("blocks_share_outputs")((3,), (32,), (y, i32(1)))
    assert torch.equal(y, torch.full((32,), 3.0))
    with pytest.raises(RaceError, match=r"global memory: tensor argument 0 element \d+ .* of block \(\d,0,0\)"):
        module.get_function("blocks_share_outputs")((3,), (32,), (y, i32(0)))


def test_the_uninstrumented_build_sees_no_race(monkeypatch):
    monkeypatch.delenv("FAGEN_EMULATE_RACECHECK", raising=False)
    plain = load_module(SOURCE)
    x, y = torch.randn(64), torch.zeros(64)
    plain.get_function("lane_exchange")((1,), (64,), (x, y, i32(0)))   # positive control for the above


@pytest.mark.parametrize("schedule", ["forward", "reverse", "warp-serial", "warp-serial-reverse"])
def test_every_schedule_runs_the_correct_kernels_clean(module, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    x, y = torch.randn(4 * 128), torch.zeros(2 * 128)
    module.get_function("refill_without_barrier")((2,), (128,), (x, y, i32(3), i32(1)))
    expected = torch.stack([x.view(4, 128)[s][(torch.arange(128) * 7 + s) % 128] for s in range(3)]).sum(0)
    torch.testing.assert_close(y.view(2, 128), expected.expand(2, 128))


def test_warp_serial_exposes_a_missing_barrier_the_lockstep_schedules_hide(monkeypatch):
    """Without racecheck: the refill's data reaches warps that should read the old tile."""
    monkeypatch.delenv("FAGEN_EMULATE_RACECHECK", raising=False)
    plain = load_module(SOURCE)
    x = torch.randn(4 * 128)
    results = {}
    for schedule in ("warp-serial", "warp-serial-reverse"):
        monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
        for correct in (1, 0):
            y = torch.zeros(128)
            plain.get_function("refill_without_barrier")((1,), (128,), (x, y, i32(3), i32(correct)))
            results[schedule, correct] = y
        assert not torch.equal(results[schedule, 1], results[schedule, 0]), schedule


# -- counters ----------------------------------------------------------------------------------

def counted(function, *args, **kwargs):
    with collect_counters() as reports:
        function(*args, **kwargs)
    assert len(reports) == 1
    return reports[0]


def test_padded_ldmatrix_rows_have_no_bank_conflicts_and_unpadded_ones_do():
    counting = load_module(SOURCE, counters=True)
    x, y = torch.randn(16 * 64).half(), torch.zeros(32)
    fn = counting.get_function("ldmatrix_rows")
    padded = counted(fn, (1,), (32,), (x, y, i32(72)), shared_mem=16 * 72 * 2)
    assert padded.counters["ldmatrix_requests"] == 1
    assert padded.counters["ldmatrix_wavefronts"] == 4 and padded.counters["ldmatrix_conflicts"] == 0
    unpadded = counted(fn, (1,), (32,), (x, y, i32(64)), shared_mem=16 * 64 * 2)
    assert unpadded.counters["ldmatrix_wavefronts"] == 4 * 8 and unpadded.counters["ldmatrix_conflicts"] == 4 * 7


def test_strided_loads_touch_more_sectors_per_request():
    counting = load_module(SOURCE, counters=True)
    x, y = torch.randn(32 * 32), torch.zeros(32)
    fn = counting.get_function("strided_load")
    coalesced = counted(fn, (1,), (32,), (x, y, i32(1)))
    strided = counted(fn, (1,), (32,), (x, y, i32(32)))
    assert coalesced.counters["global_load_requests"] == strided.counters["global_load_requests"] == 1
    assert coalesced.counters["global_load_sectors"] == 4 and strided.counters["global_load_sectors"] == 32
    assert coalesced.tensors["arg0"]["read_bytes"] == strided.tensors["arg0"]["read_bytes"] == 128
    assert coalesced.tensors["arg1"]["unique_written_bytes"] == 128
    assert strided.sectors_per_request > coalesced.sectors_per_request


@pytest.mark.parametrize("causal, seqlen_q, seqlen_k", [(False, 200, 150), (True, 200, 150), (True, 97, 301)])
def test_fa2_forward_reads_exactly_what_its_tiles_load(causal, seqlen_q, seqlen_k):
    """HBM read bytes, measured: Q once, and K and V once per visited tile (causal tiles past
    the diagonal skipped, ragged tails read only up to the last row), for every block."""
    from fagen.kernels import attention_kernels
    from fagen.kernels.render import render
    from fagen.spec import Spec

    spec = Spec(64, mask="causal" if causal else "none", block_m=64, block_n=32)
    batch, heads, kv_heads, d = 2, 4, 2, 64
    q = torch.randn(batch, seqlen_q, heads, d).half()
    k = torch.randn(batch, seqlen_k, kv_heads, d).half()
    v = torch.randn(batch, seqlen_k, kv_heads, d).half()
    with collect_counters() as reports:
        attention_kernels.forward(render(spec), q, k, v)
    (report,) = reports
    row_bytes = d * 2
    kv_rows = 0   # per (batch, head): the key rows its blocks load
    for block in range(-(-seqlen_q // 64)):
        # Keys the block visits: bottom-right causal cuts at its last row's diagonal.
        limit = min(seqlen_k, max(0, (block + 1) * 64 + seqlen_k - seqlen_q)) if causal else seqlen_k
        # A visited tile loads its rows that exist (a ragged tail zero-fills the rest, reading nothing).
        kv_rows += sum(min(32, seqlen_k - 32 * j) for j in range(-(-limit // 32)))
    assert report.tensors["q"]["read_bytes"] == batch * heads * seqlen_q * row_bytes
    assert report.tensors["q"]["unique_read_bytes"] == q.numel() * 2
    for name in ("k", "v"):
        assert report.tensors[name]["read_bytes"] == batch * heads * kv_rows * row_bytes, name
    assert report.tensors["out"]["written_bytes"] == report.tensors["out"]["unique_written_bytes"] == q.numel() * 2
    assert report.tensors["lse"]["written_bytes"] == batch * heads * seqlen_q * 4
    assert report.counters["mma"] > 0 and report.counters["ldmatrix_conflicts"] == 0
    assert report.counters["barriers"] > 0
