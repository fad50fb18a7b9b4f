"""Planted bugs in the twins' micro-kernels (the mbarrier and TMA pipelines, and the wgmma
kernels): each names the micro-kernel, the bug it plants (the kernel's `bug` argument), the
schedules that must catch it and what the fault must say. They count in the slow tier's mutation
score (tests/support/kernel_mutants.mutation_score) beside the kernel mutants and the barrier
deletions; each micro-kernel's own test runs them too.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable
from unittest import mock

from fagen.emulate import EmulationError, launch_args

SCHEDULES = tuple(launch_args.SCHEDULES)   # every schedule the emulator has


@dataclass(frozen=True)
class PlantedBug:
    kernel: str                  # the micro-kernel, e.g. "TMA pipeline"
    name: str
    bug: int                     # what the kernel's `bug` argument plants
    schedules: tuple[str, ...]   # each must catch it
    fault: str | None = None     # a regex its fault must match; None: wrong data or any fault
    racecheck: bool = False      # run under racecheck (an ordering bug the data cannot show)

    @property
    def label(self) -> str:
        return f"{self.kernel}: {self.name}"


def verdict(planted: PlantedBug, outputs_correct: Callable[[int], bool]) -> str | None:
    """None when every schedule of `planted` catches it, else why not. `outputs_correct(bug)` runs
    the micro-kernel with the bug planted (loading it as FAGEN_EMULATE_RACECHECK says, which this
    sets) and says whether its outputs came out right (it raises EmulationError on a fault). The random schedule runs with its default seed, 0, so that a
    verdict is reproducible."""
    for schedule in planted.schedules:
        environment = {"FAGEN_EMULATE_SCHEDULE": schedule, "FAGEN_EMULATE_SEED": "0",
                       "FAGEN_EMULATE_RACECHECK": "1" if planted.racecheck else ""}
        with mock.patch.dict(os.environ, environment):
            try:
                correct = outputs_correct(planted.bug)
            except EmulationError as error:
                if planted.fault is not None and not re.search(planted.fault, str(error)):
                    return f"under {schedule} the fault does not say {planted.fault!r}: {error}"
                continue
        if planted.fault is not None:
            return f"under {schedule} no fault (expected {planted.fault!r})"
        if correct:
            return f"under {schedule} the outputs come out right"
    return None


def all_planted() -> list[tuple[PlantedBug, Callable[[int], bool]]]:
    """Every micro-kernel's planted bugs, each with the runner that checks it."""
    import mbarrier_pipeline_case
    import tma_pipeline_case
    import tma_wgmma_case
    import wgmma_pipeline_case

    found = []
    for case in (mbarrier_pipeline_case, tma_pipeline_case, wgmma_pipeline_case, tma_wgmma_case):
        found += [(planted, case.outputs_correct) for planted in case.PLANTED]
    return found
