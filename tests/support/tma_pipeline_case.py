"""The TMA pipeline micro-kernel's case (tests/emulate/kernels/tma_pipeline.cu), shared by the
emulator's test (tests/emulate/test_emulate_tma.py) and the GPU's (tests/gpu/test_gpu_tma.py), so the
twin and the hardware run the same kernel on the same inputs against the same expectations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fagen.emulate import load_module, poison_
from fagen.kernels.tensor_map import Swizzle, TensorMapSpec
from twin_mutants import SCHEDULES, PlantedBug

KERNEL = Path(__file__).parents[1] / "emulate" / "kernels" / "tma_pipeline.cu"
ROWS, COLS, BLOCKS, THREADS = 32, 64, 2, 256
SHARED = 2 * 4096 + 4096 + 512   # two stages, the output tile, 128 floats


def inputs(tiles: int, device: str = "cpu", short_rows: int = 8):
    """(x, y, sums): x (fp16, small integers so that fp32 sums are exact) ends `short_rows` rows
    inside its last tile; y poisoned; sums zero."""
    rows = BLOCKS * tiles * ROWS - short_rows
    generator = torch.Generator().manual_seed(tiles)
    x = torch.randint(-8, 9, (rows, COLS), generator=generator).to(torch.float16)
    y = poison_(torch.empty(rows, COLS, dtype=torch.float16))
    return x.to(device), y.to(device), torch.zeros(128, device=device)


def expected(x: torch.Tensor, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sums): y = 2 x; consumer thread t sums elements t, t + 128, ... of every tile (zeros past x)."""
    padded = torch.zeros(BLOCKS * tiles * ROWS, COLS)
    padded[:x.shape[0]] = x.float().cpu()
    return 2 * x.cpu(), padded.view(-1, ROWS * COLS // 128, 128).sum(dim=(0, 1))


def pipeline():
    """The kernel, loaded as FAGEN_EMULATE_RACECHECK says (load_module keeps each build loaded)."""
    return load_module(KERNEL.read_text()).get_function("tma_pipeline")


def run(kernel, bug: int, tiles: int, short_rows: int = 8):
    """(y, expected y, sums, expected sums) of an emulated run, x `short_rows` short of whole tiles;
    raises EmulationError on a fault."""
    x, y, sums = inputs(tiles, short_rows=short_rows)
    maps = [TensorMapSpec.of_tensor(t, (ROWS, COLS), swizzle=Swizzle.B128).emulated_bytes(t)
            for t in (x, y)]
    kernel((BLOCKS,), (THREADS,), (*maps, sums, np.int32(tiles), np.int32(bug)), shared_mem=SHARED)
    expected_y, expected_sums = expected(x, tiles)
    return y, expected_y, sums, expected_sums


def outputs_correct(bug: int) -> bool:
    y, expected_y, sums, expected_sums = run(pipeline(), bug, tiles=3)
    return torch.equal(y, expected_y) and torch.equal(sums, expected_sums)


# None for a fault: wrong data or any fault catches it (the flipped parity, say, lets the producer
# arrive twice in one phase).
PLANTED = [
    PlantedBug("TMA pipeline", "consumers wait with the flipped parity", 1, SCHEDULES),
    PlantedBug("TMA pipeline", "a consumer warp releases its stage before reading it", 2, ("producer-first",)),
    PlantedBug("TMA pipeline", "expect_tx announces 16 bytes too few", 3, SCHEDULES, r"deadlock|tx-count"),
    PlantedBug("TMA pipeline", "the output tile is rewritten before the store's wait_group.read", 4, SCHEDULES,
               r"shared source of a bulk tensor store issued here changed before the bulk wait_group"),
    PlantedBug("TMA pipeline", "no bulk wait before the block exits", 5, SCHEDULES,
               r"exited with a bulk operation issued at .* still reading"),
    PlantedBug("TMA pipeline", "the store's coordinates swap rows and columns", 6, ("forward",)),
    PlantedBug("TMA pipeline", "no fence.proxy.async before the output tile's TMA store", 7, ("forward", "reverse"),
               "missing fence.proxy.async", racecheck=True),
]
