"""The mbarrier twins (fagen/emulate/src/mbarrier.cpp) against a second reading of the PTX ISA,
their protocol faults, and a warp-specialised pipeline (kernels/mbarrier_pipeline.cu) under every
schedule, with planted bugs the emulator must catch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import mbarrier_pipeline_case as case
import twin_mutants
from fagen.emulate import EmulationError, load_module

KERNELS = Path(__file__).parent / "kernels"
RULES = (KERNELS / "mbarrier_rules.cu").read_text()
I32 = np.int32
SCHEDULES = list(twin_mutants.SCHEDULES)


@pytest.fixture(scope="module")
def rules():
    return load_module(RULES)


@pytest.fixture(scope="module")
def pipeline():
    return case.pipeline()


def line_of(source: str, text: str) -> int:
    for number, line in enumerate(source.splitlines(), start=1):
        if text in line:
            return number
    raise AssertionError(text)


# -- the second reading: the ISA's mbarrier rules, transcribed --------------------------------
#
# From the PTX ISA (8.x), "Parallel Synchronization and Communication Instructions: mbarrier":
# - "Contents of the mbarrier object": the current phase, the count of pending arrivals,
#   the expected arrival count (of the next phase), the tx-count; its table of valid ranges:
#   expected arrival count [1, 2^20 - 1], pending arrival count [0, 2^20 - 1], tx-count
#   [-(2^20 - 1), 2^20 - 1].
# - "mbarrier.init": phase 0, pending = expected = count, tx-count 0.
# - "expect-tx operation": tx-count += txCount; "complete-tx operation": tx-count -= txCount;
#   "mbarrier.arrive": .expect_tx performs an expect-tx before the arrive-on; arrive-on
#   decrements the pending count.
# - "Phase Completion of the mbarrier object": when the pending count is zero and the
#   tx-count is zero, the phase completes: the phase advances, the pending count is
#   reinitialised to the expected count (and the tx-count starts at zero).
# - "mbarrier.test_wait/mbarrier.try_wait": with .parity, phaseParity names the current phase
#   or the immediately preceding one by its parity (even phase 0, odd phase 1); the wait is
#   complete when that phase has completed.

TX_MAX = 2**20 - 1
INIT, ARRIVE, EXPECT_TX, COMPLETE_TX, ARRIVE_EXPECT_TX = range(5)


class IsaViolation(Exception):
    """An operation the ISA's ranges do not allow; `words` must appear in the twin's message."""

    def __init__(self, words: str):
        super().__init__(words)
        self.words = words


class IsaMbarrier:
    def __init__(self):
        self.phase = None  # None: not initialised

    def apply(self, op: int, n: int) -> None:
        if op == INIT:
            if not 1 <= n <= TX_MAX:
                raise IsaViolation("the expected arrival count must be in [1, 2^20-1]")
            self.phase, self.expected, self.pending, self.tx = 0, n, n, 0
            return
        if op in (EXPECT_TX, ARRIVE_EXPECT_TX):
            self._tx(self.tx + n)
        if op == COMPLETE_TX:
            self._tx(self.tx - n)
        if op in (ARRIVE, ARRIVE_EXPECT_TX):
            if self.pending == 0:
                raise IsaViolation("an arrival beyond the expected count")
            self.pending -= 1
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.expected

    def _tx(self, value: int) -> None:
        if not -TX_MAX <= value <= TX_MAX:
            raise IsaViolation("outside the ISA's range [-(2^20-1), 2^20-1]")
        self.tx = value

    def completed(self, parity: int) -> bool:
        """try_wait.parity: the phase of this parity is the current one (not complete) or the
        one before it (complete)."""
        return self.phase % 2 != parity

    def probe(self) -> int:
        return int(self.completed(0)) | int(self.completed(1)) << 1


def isa_probes(script):
    """What the ISA says the script's probes return, or the violation it stops at (and where)."""
    model, probes = IsaMbarrier(), []
    for index, (op, n) in enumerate(script):
        try:
            model.apply(op, n)
        except IsaViolation as violation:
            return probes, (index, violation.words)
        probes.append(model.probe())
    return probes, None


def run_script(rules, script):
    ops = torch.tensor([v for pair in script for v in pair], dtype=torch.int32)
    results = torch.full((len(script),), -1, dtype=torch.int32)
    rules.get_function("mbarrier_script")((1,), (1,), (ops, I32(len(script)), results))
    return results.tolist()


def check_against_isa(rules, script):
    probes, violation = isa_probes(script)
    if violation is None:
        assert run_script(rules, script) == probes, script
        return
    index, words = violation
    with pytest.raises(EmulationError, match=r"\(at .*:\d+\)") as info:
        run_script(rules, script[:index + 1])
    assert words in str(info.value), (script, str(info.value))


# Probe bits: 1 = parity 0 completed, 2 = parity 1 completed.
ISA_TABLE = {
    "init: phase 0 pending, the preceding phase (parity 1) complete": ([(INIT, 1)], [2]),
    "the last of the expected arrivals completes the phase": ([(INIT, 2), (ARRIVE, 0), (ARRIVE, 0)], [2, 2, 1]),
    "each phase flips the parity": ([(INIT, 1), (ARRIVE, 0), (ARRIVE, 0), (ARRIVE, 0)], [2, 1, 2, 1]),
    "a pending tx-count holds the phase until complete-tx": (
        [(INIT, 1), (ARRIVE_EXPECT_TX, 64), (COMPLETE_TX, 32), (COMPLETE_TX, 32)], [2, 2, 2, 1]),
    "complete-tx before expect-tx: the tx-count goes negative, the phase waits for it": (
        [(INIT, 1), (COMPLETE_TX, 48), (ARRIVE, 0), (EXPECT_TX, 48)], [2, 2, 2, 1]),
    "arrive.expect_tx is expect-tx, then arrive-on": (
        [(INIT, 1), (COMPLETE_TX, 16), (ARRIVE_EXPECT_TX, 16)], [2, 2, 1]),
    "the expected count is reloaded for the next phase": (
        [(INIT, 2), (ARRIVE, 0), (ARRIVE, 0), (ARRIVE, 0), (ARRIVE, 0)], [2, 2, 1, 1, 2]),
    "the largest expected count and tx-count are allowed": (
        [(INIT, TX_MAX), (EXPECT_TX, TX_MAX), (COMPLETE_TX, 2 * TX_MAX)], [2, 2, 2]),
    "init with count 0": ([(INIT, 0)], None),
    "init with count 2^20": ([(INIT, 2**20)], None),
    "tx-count overflow": ([(INIT, 1), (EXPECT_TX, TX_MAX), (EXPECT_TX, 1)], None),
    "tx-count underflow": ([(INIT, 1), (COMPLETE_TX, TX_MAX), (COMPLETE_TX, 1)], None),
    "an arrival beyond the expected count": ([(INIT, 2), (EXPECT_TX, 8), (ARRIVE, 0), (ARRIVE, 0), (ARRIVE, 0)],
                                             None),
}


@pytest.mark.parametrize("name", list(ISA_TABLE))
def test_mbarrier_follows_the_isa_table(rules, name):
    script, expected = ISA_TABLE[name]
    probes, violation = isa_probes(script)
    assert (violation is None) == (expected is not None)  # the table and the transcribed rules agree
    if expected is not None:
        assert probes == expected
    check_against_isa(rules, script)


def test_mbarrier_random_scripts_follow_the_isa_rules(rules):
    rng = np.random.default_rng(28)
    ops = [ARRIVE, EXPECT_TX, COMPLETE_TX, ARRIVE_EXPECT_TX]
    for _ in range(60):
        script = [(INIT, int(rng.integers(1, 4)))]
        for _ in range(int(rng.integers(1, 14))):
            op = int(rng.choice(ops))
            script.append((op, int(rng.choice([0, 8, 16, 128])) if op != ARRIVE else 0))
        check_against_isa(rules, script)


# -- protocol faults ----------------------------------------------------------------------------

PROTOCOL_FAULTS = {
    1: r"thread 32 .*mbarrier.try_wait.parity on the mbarrier at static __shared__ \+ 0x8, which was never "
       r"initialised .*uninitialised memory used as an mbarrier",
    2: r"thread 32 .*mbarrier.arrive on the mbarrier at static __shared__ \+ 0x0, which thread 0 initialised at "
       r".*, before its init is visible to this thread \(no __syncthreads since the fence\)",
    3: r"thread 32 .*mbarrier.try_wait.parity\(0\) .*phase 2 \(parity 0\).*completed 2 phases since this thread's "
       r"last wait on it \(phase 0 then\).*the ABA problem.*block for a phase after the one meant",
    4: r"deadlock: no thread can make progress. Threads 32 wait in mbarrier.try_wait.parity at .*:{wait} for "
       r"parity 0 of the mbarrier at static __shared__ \+ 0x0 \(phase 0 \(parity 0\), 1 of 1 arrivals pending, "
       r"tx-count 0\), a phase that cannot complete",
    5: r"mbarrier.try_wait.parity\(2\): the phase parity must be 0 or 1",
    6: r"mbarrier.try_wait.parity on 0x[0-9a-f]+: an mbarrier must be 8-byte aligned",
    8: r"thread 32 .*livelock: threads keep spinning",
}


def test_mbarrier_protocol_kept(rules, monkeypatch):
    for schedule in SCHEDULES:
        monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
        out = torch.zeros(64, dtype=torch.int32)
        for which in (0, 7):  # a blocking wait, and a try_wait loop that spins until thread 0 arrives
            rules.get_function("mbarrier_protocol")((2,), (64,), (out, I32(which)))
            assert (out == 1).all(), (schedule, which)


@pytest.mark.parametrize("which", list(PROTOCOL_FAULTS))
def test_mbarrier_protocol_faults(rules, monkeypatch, which):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "forward")
    wait = line_of(RULES, "fagen::mbarrier_wait_parity(bar, which == 5")
    with pytest.raises(EmulationError, match=PROTOCOL_FAULTS[which].format(wait=wait)):
        rules.get_function("mbarrier_protocol")((1,), (64,), (torch.zeros(64, dtype=torch.int32), I32(which)))


# -- the pipeline -------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_passes_every_tile_intact(pipeline, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    for seed in (["1", "2"] if schedule == "random" else ["0"]):
        monkeypatch.setenv("FAGEN_EMULATE_SEED", seed)
        for tiles in (1, 2, 7):  # within one round of the ring, and several phases past it
            y, x = case.run(pipeline, bug=0, tiles=tiles)
            assert torch.equal(y, x), (schedule, seed, tiles)


@pytest.mark.parametrize("planted", case.PLANTED, ids=[p.name for p in case.PLANTED])
def test_pipeline_planted_bug_is_caught(planted):
    assert twin_mutants.verdict(planted, case.outputs_correct) is None
