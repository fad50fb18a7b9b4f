"""Planted bugs (tests/emulate/kernels/planted_bugs.cu): the emulator catches each one.

Faults in the synchronisation structure raise EmulationError naming the
block, the threads and the source line; out-of-bounds accesses are caught by
the checked (AddressSanitizer + UBSan) build; unwritten outputs by poisoning;
data races from a missing barrier or cp.async wait give wrong results.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fagen.emulate import EmulationError, assert_written, load_module, poison_, unwritten_mask

SOURCE = (Path(__file__).parent / "kernels" / "planted_bugs.cu").read_text()
I32 = np.int32


@pytest.fixture(scope="module")
def bugs():
    return load_module(SOURCE)


@pytest.fixture(scope="module")
def checked_bugs():
    return load_module(SOURCE, checked=True)


def line_of(text: str) -> int:
    """1-based line in planted_bugs.cu of the first line containing `text`."""
    for number, line in enumerate(SOURCE.splitlines(), start=1):
        if text in line:
            return number
    raise AssertionError(text)


# -- races: wrong results in both schedules, right ones with the fix ------------------

@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_missing_barrier_gives_wrong_result(bugs, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    kernel = bugs.get_function("neighbour_exchange")
    x = torch.arange(2 * 128, dtype=torch.float32)
    expected = torch.roll(x.view(2, 128), -1, 1).reshape(-1)
    y = torch.zeros_like(x)
    kernel((2, 1, 1), (128, 1, 1), (x, y, I32(1)))
    assert torch.equal(y, expected)
    y = torch.zeros_like(x)
    kernel((2, 1, 1), (128, 1, 1), (x, y, I32(0)))
    wrong = ~(y == expected)
    # Forward: each thread reads its neighbour before the neighbour has run;
    # reverse: only the wrap-around read is early. Either way: not silent.
    assert wrong.any()
    assert torch.isnan(y[wrong]).all(), "unwritten shared memory reads as NaN"


def test_missing_cp_async_wait_gives_wrong_result(bugs, monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "forward")
    kernel = bugs.get_function("copy_without_wait")
    x = torch.randn(64 * 4)
    expected = torch.roll(x.view(64, 4), -1, 0).reshape(-1)
    y = torch.zeros_like(x)
    kernel((1, 1, 1), (64, 1, 1), (x, y, I32(1)), shared_mem=64 * 16)
    assert torch.equal(y, expected)
    y = torch.zeros_like(x)
    kernel((1, 1, 1), (64, 1, 1), (x, y, I32(0)), shared_mem=64 * 16)
    # Copies land when their thread waits, or at the latest when it exits (as
    # on the GPU, where in-flight copies complete). Thread 63 completes the
    # barrier, runs on and exits first, so only thread 62 sees real data.
    nan_rows = torch.isnan(y.view(64, 4)).all(1)
    assert int(nan_rows.sum()) == 63, "data of a copy never waited for must not be visible"
    assert torch.equal(y.view(64, 4)[62], expected.view(64, 4)[62])


# -- synchronisation faults ------------------------------------------------------------

def test_partial_warp_shuffle_raises(bugs):
    with pytest.raises(EmulationError) as info:
        bugs.get_function("half_warp_shuffle")((1, 1, 1), (64, 1, 1), (torch.zeros(64, dtype=torch.int32),))
    message = str(info.value)
    assert "block (0,0,0)" in message and "part of the warp" in message
    assert "__shfl_xor_sync" in message
    assert f":{line_of('v = __shfl_xor_sync(0xffffffffu, v, 1);')}" in message
    # lanes 16-31 never come: the first of them exits while lanes 0-15 wait
    assert re.search(r"lane 16 of warp 0 exited, but lanes 0-15 wait", message), message


def test_partial_warp_mma_raises(bugs):
    with pytest.raises(EmulationError) as info:
        bugs.get_function("half_warp_mma")((1, 1, 1), (32, 1, 1), (torch.zeros(32),))
    message = str(info.value)
    # Lanes 0-15 skip the mma and exit before lane 16 gets to run.
    assert "mma.m16n8k16.f16" in message and "part of the warp" in message
    assert "thread 16 " in message and "names lanes 0-15 of warp 0, which have exited" in message


def test_shuffle_from_lane_outside_mask_raises(bugs):
    with pytest.raises(EmulationError, match=r"lane 0 reads lane 20, which is not in the mask 0x0000ffff"):
        bugs.get_function("shuffle_outside_mask")((1, 1, 1), (32, 1, 1), (torch.zeros(32, dtype=torch.int32),))


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_barrier_not_reached_by_all_threads_names_block_and_threads(bugs, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    monkeypatch.setenv("FAGEN_EMULATE_THREADS", "1")
    out = torch.zeros(3 * 128, dtype=torch.int32)
    with pytest.raises(EmulationError) as info:
        bugs.get_function("barrier_in_branch")((3, 1, 1), (128, 1, 1), (out, I32(64)))
    message = str(info.value)
    assert message.startswith("barrier_in_branch: block (0,0,0): ")
    site = f":{line_of('< reaching) __syncthreads();')}"
    assert site in message
    if schedule == "forward":
        assert "thread 64 (threadIdx (64,0,0)" in message
        assert "where threads 0-63 wait" in message
    else:
        assert "after threads 64-127 exited" in message


def test_barrier_reached_by_all_threads_passes(bugs):
    out = torch.zeros(3 * 128, dtype=torch.int32)
    bugs.get_function("barrier_in_branch")((3, 1, 1), (128, 1, 1), (out, I32(128)))
    assert (out == 1).all()


def test_divergent_barriers_raise(bugs):
    with pytest.raises(EmulationError) as info:
        bugs.get_function("divergent_barriers")((1, 1, 1), (128, 1, 1), (torch.zeros(128, dtype=torch.int32),))
    message = str(info.value)
    assert "divergent barriers" in message and "threads 0-63 wait" in message
    assert "thread 64 " in message


def test_shuffle_against_barrier_raises(bugs):
    with pytest.raises(EmulationError) as info:
        bugs.get_function("shuffle_against_barrier")((1, 1, 1), (64, 1, 1), (torch.zeros(64, dtype=torch.int32),))
    assert "part of the warp" in str(info.value)


def test_device_assert_raises(bugs):
    kernel = bugs.get_function("asserts_positive")
    kernel((1, 1, 1), (32, 1, 1), (torch.arange(1, 33, dtype=torch.int32),))
    x = torch.arange(1, 33, dtype=torch.int32)
    x[17] = -5
    with pytest.raises(EmulationError, match=r"thread 17 .*assertion `x\[threadIdx.x\] > 0` failed"):
        kernel((1, 1, 1), (32, 1, 1), (x,))


def test_ldmatrix_misaligned_row_raises(bugs):
    with pytest.raises(EmulationError, match=r"ldmatrix.x1: lane 3's row address .* is not 16-byte aligned"):
        bugs.get_function("ldmatrix_misaligned")((1, 1, 1), (32, 1, 1), (torch.zeros(32, dtype=torch.int32),))


def test_ldmatrix_past_dynamic_shared_memory_raises(bugs):
    kernel = bugs.get_function("ldmatrix_past_launch_size")
    out = torch.zeros(32, dtype=torch.int32)
    kernel((1, 1, 1), (32, 1, 1), (out,), shared_mem=512)
    with pytest.raises(EmulationError, match=r"touches dynamic shared memory bytes \[256, 272\), past the 256"):
        kernel((1, 1, 1), (32, 1, 1), (out,), shared_mem=256)


def test_emulator_keeps_working_after_a_fault(bugs):
    with pytest.raises(EmulationError):
        bugs.get_function("half_warp_shuffle")((4, 1, 1), (64, 1, 1), (torch.zeros(64, dtype=torch.int32),))
    test_barrier_reached_by_all_threads_passes(bugs)


# -- unwritten outputs -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_poison_marks_every_element(dtype):
    t = poison_(torch.zeros(3, 5, dtype=dtype)[:, 1:4])  # a strided view
    assert unwritten_mask(t).all()
    if dtype.is_floating_point:
        assert torch.isnan(t).all()
    t[1, 2] = 0
    assert int(unwritten_mask(t).sum()) == 8
    with pytest.raises(AssertionError, match=r"8 of 9 elements of out were never written by the kernel"):
        assert_written(t, "out")


def test_unwritten_output_is_caught(bugs):
    kernel = bugs.get_function("skips_last_element")
    y = poison_(torch.empty(256))
    kernel((2, 1, 1), (128, 1, 1), (y, I32(256)))
    with pytest.raises(AssertionError, match=r"1 of 256 elements of y were never written by the kernel \(first at \[\(255,\)\]\)"):
        assert_written(y, "y")
    assert (y[:255] == 2).all()


# -- out of bounds: the checked build -----------------------------------------------------

def test_checked_build_catches_read_past_end(checked_bugs):
    kernel = checked_bugs.get_function("read_past_end")
    y = poison_(torch.empty(256))
    with pytest.raises(EmulationError) as info:
        kernel((2, 1, 1), (128, 1, 1), (torch.randn(256), y, I32(256)))
    message = str(info.value)
    assert "heap-buffer-overflow" in message
    assert "READ of size 4" in message
    assert "block (1,0,0), thread 127" in message
    assert f".cu:{line_of('y[i] = x[i + 1];')}" in message
    # the same launch with one spare element is clean, and writes back
    x = torch.randn(257)
    kernel((2, 1, 1), (128, 1, 1), (x, y, I32(256)))
    assert torch.equal(y, x[1:])


def test_checked_build_catches_write_past_end(checked_bugs):
    with pytest.raises(EmulationError, match=r"(?s)heap-buffer-overflow.*WRITE of size 4"):
        checked_bugs.get_function("write_past_end")((2, 1, 1), (128, 1, 1), (torch.zeros(255), I32(255)))


def test_checked_build_catches_cp_async_past_end(checked_bugs):
    kernel = checked_bugs.get_function("cp_async_past_end")
    src = torch.randint(0, 256, (40,), dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    kernel((1, 1, 1), (4, 1, 1), (src, dst, I32(40), I32(1)), shared_mem=64)  # src-size clamped: clean
    assert torch.equal(dst[:40], src) and (dst[40:] == 0).all()
    with pytest.raises(EmulationError, match=r"(?s)heap-buffer-overflow.*READ of size 16.*cp_async_16"):
        kernel((1, 1, 1), (4, 1, 1), (src, dst, I32(40), I32(0)), shared_mem=64)


def test_checked_build_catches_shared_memory_past_launch_size(checked_bugs):
    kernel = checked_bugs.get_function("shared_past_launch_size")
    y = torch.zeros(32)
    kernel((1, 1, 1), (32, 1, 1), (y, I32(64)), shared_mem=256)
    with pytest.raises(EmulationError, match=r"(?s)AddressSanitizer.*WRITE of size 4.*shared_past_launch_size"):
        kernel((1, 1, 1), (32, 1, 1), (y, I32(65)), shared_mem=256)


def test_checked_build_catches_local_array_overflow(checked_bugs):
    kernel = checked_bugs.get_function("local_array_overflow")
    out = torch.zeros(32, dtype=torch.int32)
    kernel((1, 1, 1), (32, 1, 1), (out, I32(7)))
    assert torch.equal(out, 7 * torch.arange(32, dtype=torch.int32))
    # UBSan's bounds check sees the array type and reports first; ASan's
    # stack redzones would catch the same access through a pointer.
    with pytest.raises(EmulationError) as info:
        kernel((1, 1, 1), (32, 1, 1), (out, I32(8)))
    message = str(info.value)
    assert "index 8 out of bounds for type 'int [8]'" in message or "stack-buffer-overflow" in message
    assert "while running kernel local_array_overflow, block (0,0,0), thread 0 " in message


def test_checked_build_catches_int_overflow(checked_bugs):
    kernel = checked_bugs.get_function("index_overflow")
    out = torch.zeros(32, dtype=torch.int32)
    kernel((1, 1, 1), (32, 1, 1), (out, I32(1000), I32(1000)))
    assert out[5] == 1_000_005
    with pytest.raises(EmulationError, match="signed integer overflow"):
        kernel((1, 1, 1), (32, 1, 1), (out, I32(65536), I32(65536)))


def test_checked_build_reports_synchronisation_faults_too(checked_bugs):
    with pytest.raises(EmulationError, match="part of the warp"):
        checked_bugs.get_function("half_warp_shuffle")((1, 1, 1), (64, 1, 1), (torch.zeros(64, dtype=torch.int32),))


def test_spinning_forever_is_reported_not_hung(bugs):
    start = time.perf_counter()
    with pytest.raises(EmulationError, match=r"thread 0 .*livelock: threads keep spinning in __nanosleep"):
        bugs.get_function("spin_on_flag")((1, 1, 1), (32, 1, 1), (torch.zeros(32, dtype=torch.int32),))
    assert time.perf_counter() - start < 30
