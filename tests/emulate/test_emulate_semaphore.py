"""Global semaphores (fagen/semaphore.cuh; twins in fagen/emulate/src/semaphore.cpp) and blocks that
wait on each other (src/block_residency.cpp): a waiting block parks and lets the others run, blocks
that can never be released are a deadlock (promptly, never a hang), and
FAGEN_EMULATE_BLOCK_INTERLEAVE=serial fixes the order of the blocks' global writes.

kernels/semaphore_order.cu: block b's thread 0 waits for the counter to be b's turn while the
block's other threads wait at __syncthreads, every thread adds into `acc`, thread 0 logs b at the
counter's value and, after a barrier, arrives."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fagen.emulate import EmulationError, RaceError, load_module

KERNEL = (Path(__file__).parent / "kernels" / "semaphore_order.cu").read_text()
GRID, THREADS = 6, 64
ORDERED, FLIPPED, NO_WAIT = 0, 1, 2
I32 = np.int32
# What every block adds into acc[t]: staged[(t + 1) % 64] = 100 b + (t + 1) % 64.
ACC = torch.tensor([sum(100.0 * b + (t + 1) % THREADS for b in range(GRID)) for t in range(THREADS)])


@pytest.fixture(scope="module")
def module():
    return load_module(KERNEL)


def settings(monkeypatch, threads: int, order: str, interleave: str, schedule: str = "forward") -> None:
    monkeypatch.setenv("FAGEN_EMULATE_THREADS", str(threads))
    monkeypatch.setenv("FAGEN_EMULATE_BLOCK_ORDER", order)
    monkeypatch.setenv("FAGEN_EMULATE_BLOCK_INTERLEAVE", interleave)
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)


# A hang guard, not a timing check: these launches take well under a second; only a launch that
# never returns (a deadlock the runtime failed to report) comes near it, on however busy a machine.
HANG_S = 300


def within_seconds(seconds: float, call):
    """call(), failing the test (instead of hanging the suite) if it has not returned in time."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as error:   # noqa: BLE001 - handed back to the test
            outcome["error"] = error

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        pytest.fail(f"the launch did not return within {seconds} s: a hang, not a reported deadlock")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def run_log(module, mode: int = ORDERED, grid: int = GRID):
    counter = torch.zeros(1, dtype=torch.int32)
    log = torch.full((grid,), -1, dtype=torch.int32)
    acc = torch.zeros(THREADS)
    within_seconds(HANG_S, lambda: module.get_function("ordered_log")((grid,), (THREADS,), (counter, log, acc, I32(mode))))
    assert counter.item() == grid
    return log.tolist(), acc


# Forward order with 1, 3 or 6 resident blocks; reverse order with every block resident, where
# block 5 is dispatched first, parks (thread 0 in the wait, the others at __syncthreads) and
# resumes, its whole block with it, once the blocks before it have arrived.
@pytest.mark.parametrize("interleave", ["parallel", "serial"])
@pytest.mark.parametrize("threads, order", [(1, "forward"), (3, "forward"), (6, "forward"), (GRID, "reverse")])
def test_blocks_take_turns_in_grid_order(module, monkeypatch, threads, order, interleave):
    settings(monkeypatch, threads, order, interleave)
    log, acc = run_log(module)
    assert log == list(range(GRID))
    assert torch.equal(acc, ACC)


@pytest.mark.parametrize("interleave", ["parallel", "serial"])
def test_a_parked_block_resumes_when_another_block_arrives(module, monkeypatch, interleave):
    settings(monkeypatch, 2, "reverse", interleave)   # block 1 parks, block 0 takes the other slot
    log, acc = run_log(module, grid=2)
    assert log == [0, 1]
    assert torch.equal(acc, torch.tensor([100.0 * 1 + 2 * ((t + 1) % THREADS) for t in range(THREADS)]))


@pytest.mark.parametrize("interleave", ["parallel", "serial"])
def test_a_block_that_can_never_become_resident_is_a_deadlock(module, monkeypatch, interleave):
    settings(monkeypatch, 1, "reverse", interleave)   # block 5 holds the only slot, waiting for block 0
    with pytest.raises(EmulationError) as error:
        run_log(module)
    message = str(error.value)
    assert "deadlock" in message and "semaphore" in message
    assert "block (5,0,0)" in message and "to equal 5 (it is 0)" in message
    assert "argument 0 + 0 bytes" in message and "5 blocks not yet started" in message
    assert "Threads 1-63 wait at __syncthreads" in message


@pytest.mark.parametrize("interleave", ["parallel", "serial"])
def test_blocks_waiting_for_each_other_in_the_wrong_order_are_a_deadlock(module, monkeypatch, interleave):
    settings(monkeypatch, 2, "forward", interleave)   # blocks 0 and 1 wait for turns 5 and 4
    with pytest.raises(EmulationError) as error:
        run_log(module, FLIPPED)
    message = str(error.value)
    assert "deadlock" in message
    assert "block (0,0,0): Thread 0 waits in semaphore wait" in message and "to equal 5 (it is 0)" in message
    assert "block (1,0,0): Thread 0 waits in semaphore wait" in message and "to equal 4 (it is 0)" in message


@pytest.mark.parametrize("threads, order, expected", [(1, "forward", list(range(GRID))),
                                                      (3, "forward", list(range(GRID))),
                                                      (GRID, "reverse", list(reversed(range(GRID))))])
def test_serial_interleave_follows_the_block_order(module, monkeypatch, threads, order, expected):
    # Without the wait nothing orders the blocks but the interleave: serial runs each block to its
    # end before dispatching the next, so the log is the dispatch order, every time.
    settings(monkeypatch, threads, order, "serial")
    first, acc = run_log(module, NO_WAIT)
    second, _ = run_log(module, NO_WAIT)
    assert first == second == expected
    assert torch.equal(acc, ACC)


@pytest.mark.parametrize("schedule", ["forward", "warp-serial", "producer-first", "consumer-first", "random"])
def test_serial_interleave_gives_one_log_under_every_thread_schedule(module, monkeypatch, schedule):
    settings(monkeypatch, GRID, "reverse", "serial", schedule)
    assert run_log(module)[0] == list(range(GRID))
    assert run_log(module, NO_WAIT)[0] == list(reversed(range(GRID)))


@pytest.mark.parametrize("interleave", ["parallel", "serial"])
def test_a_counter_past_the_awaited_value_is_reported(module, monkeypatch, interleave):
    settings(monkeypatch, 2, "forward", interleave)
    overshoot = module.get_function("overshoot")
    counter = torch.zeros(1, dtype=torch.int32)
    within_seconds(HANG_S, lambda: overshoot((2,), (32,), (counter, I32(1))))   # one arrive: block 0's turn comes
    assert counter.item() == 1
    if interleave == "serial":
        # Block 0 parks at 0, then block 1 arrives twice: 2 can never come back to 1. (In parallel,
        # block 0 may see the 1 between the two arrives, as a GPU's spinning thread may.)
        counter.zero_()
        with pytest.raises(EmulationError, match=r"semaphore at argument 0 \+ 0 bytes .* is 2, past the awaited 1"):
            within_seconds(HANG_S, lambda: overshoot((2,), (32,), (counter, I32(2))))
    counter.fill_(5)   # past it at the wait itself
    with pytest.raises(EmulationError, match=r"block \(0,0,0\): thread 0 .*is 5, past the awaited 1"):
        within_seconds(HANG_S, lambda: overshoot((2,), (32,), (counter, I32(0))))


def test_block_interleave_setting_is_checked(module, monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_BLOCK_INTERLEAVE", "sometimes")
    with pytest.raises(EmulationError, match="FAGEN_EMULATE_BLOCK_INTERLEAVE='sometimes'"):
        run_log(module)


@pytest.mark.parametrize("interleave", ["parallel", "serial"])
def test_racecheck_sees_the_semaphore_order_the_blocks_writes(monkeypatch, interleave):
    # acc[t] += ... is a plain read-modify-write by every block: ordered by the semaphore it is clean
    # (an arrive releases the block's global writes, the wait acquires them); without the wait it is
    # a write-after-write hazard between blocks.
    settings(monkeypatch, 3, "forward", interleave)
    checked = load_module(KERNEL, racecheck=True)
    log, acc = run_log(checked)
    assert log == list(range(GRID)) and torch.equal(acc, ACC)
    monkeypatch.setenv("FAGEN_EMULATE_THREADS", "1")
    with pytest.raises(RaceError, match="write-after-write hazard in global memory"):
        run_log(checked, NO_WAIT)


def test_checked_build_runs_the_ordered_blocks(monkeypatch):
    settings(monkeypatch, GRID, "reverse", "serial")
    log, acc = run_log(load_module(KERNEL, checked=True))
    assert log == list(range(GRID)) and torch.equal(acc, ACC)


def test_the_wrappers_compile_for_sm_90a_with_nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    from fagen.kernels.compile import nvrtc_compile
    from nvrtc_ptx import nvrtc_ptx

    ptx = nvrtc_ptx(KERNEL, "compute_90a")
    for instruction in ("ld.acquire.gpu.global.b32", "fence.proxy.async.global;", "red.release.gpu.global.add.s32"):
        assert instruction in ptx, instruction
    # The arrive's proxy fence comes right before its release.
    lines = [line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith("//")]
    for i, line in enumerate(lines):
        if line.startswith("red.release"):
            assert lines[i - 1] == "fence.proxy.async.global;" or lines[i - 2] == "fence.proxy.async.global;"
    cubin, _ = nvrtc_compile(KERNEL, "sm_90a")
    assert len(cubin) > 1000
