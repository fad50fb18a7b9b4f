"""Named barriers, elect.sync, setmaxnreg and fence.proxy.async twins (kernels/warp_specialize.cu);
the producer-first, consumer-first and random schedules on today's kernels; and the Hopper wrappers'
GPU side, compiled by NVRTC for sm_90a."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fagen.emulate import EmulationError, collect_counters, launch_args, load_module
from nvrtc_ptx import nvrtc_ptx

KERNELS = Path(__file__).parent / "kernels"
SOURCE = (KERNELS / "warp_specialize.cu").read_text()
I32 = np.int32
SCHEDULES = list(launch_args.SCHEDULES)
NEW_SCHEDULES = SCHEDULES[SCHEDULES.index("producer-first"):]


@pytest.fixture(scope="module")
def module():
    return load_module(SOURCE)


def line_of(text: str) -> int:
    for number, line in enumerate(SOURCE.splitlines(), start=1):
        if text in line:
            return number
    raise AssertionError(text)


# -- named barriers -------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("sync0", [0, 1], ids=["syncthreads", "bar.sync 0"])
def test_named_barriers_hand_tiles_over(module, monkeypatch, schedule, sync0):
    """bar.arrive / bar.sync between two warp pairs, reused over rounds (a barrier completes,
    resets, and completes again); bar.sync 0 with the whole block is __syncthreads."""
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    rounds = 5
    x = torch.randn(rounds * 64)
    y = torch.full_like(x, float("nan"))
    module.get_function("named_handoff")((2,), (128,), (x, y, I32(rounds), I32(1), I32(2), I32(sync0)))
    assert torch.equal(y, 2 * x)


NAMED_FAULTS = {
    1: ("forward", r"thread 0 .*bar.sync 1, 48: the thread count must be a nonzero multiple of the warp size"),
    2: ("forward", r"thread 64 .*bar.sync 1, 64 while barrier 1 is in use with count 128 \(bar.sync at .*\): "
                   r"mismatched thread counts on one barrier"),
    3: ("forward", r"deadlock: .*Named barrier 1 \(count 128, first bar.sync at .*\): threads 0-95 arrived, "
                   r"threads 0-95 wait in bar.sync, 96 of 128 threads counted"),
    4: ("forward", r"bar.sync 16, 128: the barrier id must be in \[0, 15\]"),
    # __syncthreads meets barrier 0 in use by warp 0 with 64 threads, and the other way round.
    5: ("forward", r"thread 32 .*__syncthreads \(barrier 0 with all 128 threads\) while barrier 0 is in use with "
                   r"count 64 .*mismatched thread counts on barrier 0"),
    6: ("forward", r"deadlock: .*Named barrier 2 \(count 64.*threads 64-95 wait in bar.sync, 32 of 64"),
    7: ("forward", r"thread 0 .*bar.arrive 3, 128: this thread already arrived at barrier 3 \(bar.arrive at .*\), "
                   r"which has not completed since \(0 of 128 threads counted\): an arrival twice"),
}


@pytest.mark.parametrize("which", list(NAMED_FAULTS))
def test_named_barrier_faults(module, monkeypatch, which):
    schedule, message = NAMED_FAULTS[which]
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    with pytest.raises(EmulationError, match=message):
        module.get_function("named_faults")((1,), (128,), (torch.zeros(128, dtype=torch.int32), I32(which)))


# PTX ISA, "bar, barrier": the barrier operand names one of 16 barriers (0-15); the thread
# count is a multiple of the warp size (and not zero: a use with no threads). (id, count) -> valid.
NAMED_OPERANDS = {(0, 32): True, (0, 128): True, (1, 64): True, (15, 96): True, (16, 32): False, (31, 64): False,
                  (1, 0): False, (1, 16): False, (2, 48): False, (3, 100): False}


@pytest.mark.parametrize("id_count", list(NAMED_OPERANDS), ids=str)
def test_named_barrier_operands_follow_the_isa(module, id_count):
    barrier, count = id_count
    out = torch.zeros(128, dtype=torch.int32)
    kernel = module.get_function("named_count")
    if NAMED_OPERANDS[id_count]:
        kernel((1,), (128,), (out, I32(barrier), I32(count)))
        assert (out == 1).all()
    else:
        with pytest.raises(EmulationError, match=rf"bar.sync {barrier}, {count}: the (barrier id must be in \[0, 15\]"
                                                 r"|thread count must be a nonzero multiple of the warp size)"):
            kernel((1,), (128,), (out, I32(barrier), I32(count)))


def test_named_barrier_zero_meets_syncthreads_either_way(module, monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "reverse")  # warps 1-3 wait at __syncthreads first
    with pytest.raises(EmulationError, match=r"thread 31 .*bar.sync 0, 64 while threads wait at __syncthreads "
                                             r"\(barrier 0 with all 128 threads\)"):
        module.get_function("named_faults")((1,), (128,), (torch.zeros(128, dtype=torch.int32), I32(5)))


def test_named_barrier_kept(module):
    out = torch.zeros(128, dtype=torch.int32)
    module.get_function("named_faults")((1,), (128,), (out, I32(0)))
    assert (out == 1).all()


# -- elect.sync -------------------------------------------------------------------------------

# PTX ISA, "elect.sync": one leader thread is elected from the threads of membermask, and
# "the same leader thread is elected for the same membermask every time". Which lane it is, the
# ISA does not say; the twin's choice, the lowest lane of the mask, is the last column
# (mask -> lane), for the GPU check to compare with the hardware's.
ELECTED = {0xFFFFFFFF: 0, 0xF0F0F0F0: 4, 0x80000000: 31, 0x00010000: 16, 0x0000FF00: 8, 0xAAAAAAAA: 1}


@pytest.mark.parametrize("mask", list(ELECTED), ids=hex)
def test_elect_sync_elects_one_lane_of_the_mask(module, mask):
    kernel = module.get_function("elect_lanes")
    elected = set()
    for _ in range(2):  # two launches of two warps: the same leader each time
        out = torch.zeros(64, dtype=torch.int32)
        kernel((1,), (64,), (out, np.uint32(mask)))
        for warp in range(2):
            lanes = out[32 * warp:32 * (warp + 1)].tolist()
            assert all((value == -1) == (not mask >> lane & 1) for lane, value in enumerate(lanes))
            leaders = [lane for lane, value in enumerate(lanes) if value == 1]
            assert len(leaders) == 1 and mask >> leaders[0] & 1, (hex(mask), lanes)
            elected.add(leaders[0])
    assert elected == {ELECTED[mask]}


def test_lanes_that_arrive_and_exit_still_count(module):
    """bar.arrive counts a warp as a whole: its lanes may exit after arriving, before the rest of the
    warp arrives, and the barrier still completes, under every schedule."""
    for schedule in SCHEDULES:
        out = torch.zeros(32, dtype=torch.int32)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
            module.get_function("arrive_then_exit")((1,), (64,), (out,))
        assert (out == 1).all(), schedule


# -- setmaxnreg -------------------------------------------------------------------------------

# PTX ISA, "setmaxnreg": imm-reg-count must be in the range 24 to 256 (inclusive) and a
# multiple of 8.
SETMAXNREG_COUNTS = {16: False, 20: False, 24: True, 28: False, 32: True, 100: False, 104: True, 240: True,
                     248: True, 256: True, 260: False, 264: False}


@pytest.mark.parametrize("registers", list(SETMAXNREG_COUNTS))
def test_setmaxnreg_register_counts_follow_the_isa(module, registers):
    out = torch.zeros(128, dtype=torch.int32)
    kernel = module.get_function("setmaxnreg_count")
    if SETMAXNREG_COUNTS[registers]:
        kernel((1,), (128,), (out, I32(registers), I32(1)))
        assert (out == registers).all()
    else:
        with pytest.raises(EmulationError, match=rf"setmaxnreg.inc.sync.aligned.u32 {registers}: the register count "
                                                 r"must be in \[24, 256\] and a multiple of 8"):
            kernel((1,), (128,), (out, I32(registers), I32(1)))


SETMAXNREG_FAULTS = {
    1: (256, r"thread 96 .*exited, but threads 0-95 of warpgroup 0 wait for it in setmaxnreg.dec.sync.aligned.u32 "
             r"at .*called by part of the warpgroup"),
    2: (256, r"thread 64 .*setmaxnreg.dec.sync.aligned.u32 called while threads 0-63 of warpgroup 0 wait in "
             r"setmaxnreg.dec.sync.aligned.u32 at .*the warpgroup diverged"),
    3: (256, r"setmaxnreg.inc.sync.aligned.u32 232 in warpgroup \d, whose register count is 240: .inc must not "
             r"lower it"),
    4: (256, r"setmaxnreg.dec.sync.aligned.u32 20: the register count must be in \[24, 256\]"),
    5: (256, r"setmaxnreg.inc.sync.aligned.u32 100: the register count must be in \[24, 256\] and a multiple of 8"),
    6: (96, r"setmaxnreg.dec.sync.aligned.u32 in warpgroup 0 \(warps 0-3\), but the block has only 96 threads"),
    7: (512, r"the warpgroups' setmaxnreg counts \(24, 240, 240, 240\) need 95232 registers, more than the SM's "
             r"register file of 65536"),
}


def test_setmaxnreg_by_whole_warpgroups_passes(module):
    for schedule in SCHEDULES:
        out = torch.zeros(256, dtype=torch.int32)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
            module.get_function("setmaxnreg_rules")((1,), (256,), (out, I32(0)))
        assert (out == 1).all(), schedule


@pytest.mark.parametrize("which", list(SETMAXNREG_FAULTS))
def test_setmaxnreg_faults(module, which):
    threads, message = SETMAXNREG_FAULTS[which]
    with pytest.raises(EmulationError, match=message):
        module.get_function("setmaxnreg_rules")((1,), (threads,), (torch.zeros(threads, dtype=torch.int32),
                                                                    I32(which)))


# -- fence.proxy.async --------------------------------------------------------------------------

def test_proxy_fences_are_counted():
    counted = load_module(SOURCE, counters=True)
    out = torch.zeros(96, dtype=torch.int32)
    with collect_counters() as reports:
        counted.get_function("proxy_fences")((3,), (96,), (out,))
    assert (out == 1).all()
    assert reports[0].counters["proxy_fences"] == 2 * 3 * 96


# -- the schedules ----------------------------------------------------------------------------

def test_random_schedule_is_seeded(module, monkeypatch):
    """The order threads run in follows FAGEN_EMULATE_SEED, and one seed replays it."""
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "random")

    def order(seed: str) -> list[int]:
        monkeypatch.setenv("FAGEN_EMULATE_SEED", seed)
        out = torch.full((128,), -1, dtype=torch.int32)
        module.get_function("arrival_order")((1,), (128,), (out,))
        assert sorted(out.tolist()) == list(range(128))
        return out.tolist()

    assert order("7") == order("7")
    assert order("7") != order("8")
    assert order("7") != list(range(128))
    monkeypatch.setenv("FAGEN_EMULATE_SEED", "-1")
    with pytest.raises(EmulationError, match=r"FAGEN_EMULATE_SEED='-1'"):
        order("-1")


@pytest.mark.parametrize("schedule, first", [("producer-first", range(0, 128)), ("consumer-first", range(128, 256))])
def test_priority_schedules_run_their_warpgroup_first(module, monkeypatch, schedule, first):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    out = torch.full((256,), -1, dtype=torch.int32)
    module.get_function("arrival_order")((1,), (256,), (out,))
    assert sorted(out[list(first)].tolist()) == list(range(128))


@pytest.mark.parametrize("schedule", NEW_SCHEDULES)
def test_todays_kernels_pass_under_the_new_schedules(monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    gemm = load_module((KERNELS / "tiled_gemm.cu").read_text()).get_function("gemm_abt")
    M, N, K = 100, 70, 96
    gen = torch.Generator().manual_seed(5)
    A, B = torch.randn(M, K, generator=gen).half(), torch.randn(N, K, generator=gen).half()
    C = torch.full((M, N), float("nan"))
    gemm(((N + 63) // 64, (M + 63) // 64, 1), (128, 1, 1), (A, B, C, I32(M), I32(N), I32(K)),
         shared_mem=2 * 2 * 64 * 40 * 2)
    torch.testing.assert_close(C.double(), A.double() @ B.double().T, rtol=1e-5, atol=1e-4)
    bugs = load_module((KERNELS / "planted_bugs.cu").read_text()).get_function("neighbour_exchange")
    x = torch.arange(2 * 128, dtype=torch.float32)
    expected = torch.roll(x.view(2, 128), -1, 1).reshape(-1)
    y = torch.zeros_like(x)
    bugs((2,), (128,), (x, y, I32(1)))
    assert torch.equal(y, expected)
    bugs((2,), (128,), (x, y, I32(0)))  # the missing barrier still shows as wrong data
    assert not torch.equal(y, expected)


# -- the GPU side: NVRTC for sm_90a -----------------------------------------------------------

HOPPER_PTX = [
    "mbarrier.init.shared.b64", "fence.mbarrier_init.release.cluster", "mbarrier.arrive.shared.b64",
    "mbarrier.arrive.expect_tx.shared.b64", "mbarrier.expect_tx.relaxed.cta.shared::cta.b64",
    "mbarrier.complete_tx.relaxed.cta.shared::cta.b64", "mbarrier.try_wait.parity.shared.b64", "bar.sync",
    "bar.arrive", "elect.sync", "setmaxnreg.inc.sync.aligned.u32 240", "setmaxnreg.dec.sync.aligned.u32 24",
    "fence.proxy.async;", "fence.proxy.async.shared::cta",
]


def test_hopper_wrappers_compile_for_sm_90a_with_nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    from fagen.kernels.compile import nvrtc_compile

    sources = [(KERNELS / name).read_text() for name in ("mbarrier_pipeline.cu", "mbarrier_rules.cu",
                                                         "warp_specialize.cu")]
    ptx = "".join(nvrtc_ptx(source, "compute_90a") for source in sources)
    for instruction in HOPPER_PTX:
        assert instruction in ptx, instruction
    for source in sources:
        cubin, _ = nvrtc_compile(source, "sm_90a")
        assert len(cubin) > 1000
