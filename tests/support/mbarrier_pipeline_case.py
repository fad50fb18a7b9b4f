"""The mbarrier pipeline micro-kernel (tests/emulate/kernels/mbarrier_pipeline.cu): its runner and
its planted bugs, shared by tests/emulate/test_emulate_mbarrier.py and the mutation score
(tests/support/twin_mutants.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fagen.emulate import load_module, poison_
from twin_mutants import SCHEDULES, PlantedBug

KERNEL = Path(__file__).parents[1] / "emulate" / "kernels" / "mbarrier_pipeline.cu"


def pipeline():
    """The kernel, loaded as FAGEN_EMULATE_RACECHECK says (load_module keeps each build loaded)."""
    return load_module(KERNEL.read_text()).get_function("mbarrier_pipeline")


def run(kernel, bug: int, tiles: int = 7, blocks: int = 2, device: str = "cpu"):
    """(y, x): y should equal x; raises EmulationError on a fault (on the CPU)."""
    x = torch.randn(tiles * 128, generator=torch.Generator().manual_seed(tiles)).to(device)
    y = poison_(torch.empty(tiles * 128)).to(device)
    kernel((blocks,), (256,), (x, y, np.int32(tiles), np.int32(bug)))
    return y, x


def outputs_correct(bug: int) -> bool:
    y, x = run(pipeline(), bug)
    return torch.equal(y, x)


# Where a bug is data-dependent, the schedules that expose it are the ones that run the
# offending side first.
PLANTED = [
    PlantedBug("mbarrier pipeline", "consumers wait with the flipped parity", 1, SCHEDULES),
    PlantedBug("mbarrier pipeline", "a consumer warp releases its stage before reading it", 2, ("producer-first",)),
    PlantedBug("mbarrier pipeline", "expect_tx announces 16 bytes more than arrive", 3, SCHEDULES,
               r"deadlock: .*wait in mbarrier.try_wait.parity .*0 of 1 arrivals pending, tx-count 16\)"),
    PlantedBug("mbarrier pipeline", "empty[s] expects one arrival too many", 4, SCHEDULES,
               r"deadlock: .*Threads 0-31 wait in mbarrier.try_wait.parity .*1 of 5 arrivals pending"),
    PlantedBug("mbarrier pipeline", "empty[s] expects one arrival too few", 5,
               ("forward", "reverse", "producer-first", "consumer-first", "random")),
    PlantedBug("mbarrier pipeline", "no fence.mbarrier_init", 6, SCHEDULES,
               r"before its init is visible to this thread \(no fence.mbarrier_init since the init\)"),
    PlantedBug("mbarrier pipeline", "the bytes are delivered before they are written", 7,
               ("forward", "reverse", "consumer-first", "random")),
]
