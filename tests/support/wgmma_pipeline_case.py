"""The wgmma pipeline with planted bugs (tests/emulate/kernels/wgmma_bugs.cu): its operands, its
launch and results in matrix form, and the planted bugs that count in the mutation score
(twin_mutants.py); tests/emulate/test_emulate_wgmma_faults.py checks each bug's exact fault."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import isa_wgmma
import wgmma_tiles as tiles
from fagen.emulate import load_module
from twin_mutants import SCHEDULES, PlantedBug

SOURCE = (Path(__file__).parents[1] / "emulate" / "kernels" / "wgmma_bugs.cu").read_text()
N = 16
I32 = np.int32


def operands(rng):
    """Two (A, B) pairs placed K-major with the 128B swizzle, their params and the image."""
    pairs = [(rng.integers(-4, 5, (64, 16)).astype(np.float64), rng.integers(-4, 5, (N, 16)).astype(np.float64))
             for _ in range(2)]
    image = np.zeros(2 * (8192 + 2048), dtype=np.uint8)
    params, offset = [], 0
    for tile in (x for pair in pairs for x in pair):
        placement = tiles.canonical(tile.shape[0], False, 1, offset)
        offset += placement.span  # spans are multiples of 1024: every tile starts on the swizzle pattern
        tiles.place(image, torch.from_numpy(tile).half().view(torch.int16).numpy().astype(np.uint16), placement)
        params += [placement.offset, placement.lbo, placement.sbo, placement.mode]
    return pairs, image, params


def launch(pipeline, bug: int, seed: int = 0):
    pairs, image, params = operands(np.random.default_rng(seed))
    out = torch.full((3, 128, N // 2), float("nan"))
    pipeline((1, 1, 1), (128, 1, 1), (torch.from_numpy(image), I32(image.size), torch.tensor(params, dtype=torch.int32),
                                      out, I32(bug)), shared_mem=image.size + 1024)
    where = isa_wgmma.accumulator(N)
    results = np.full((3, 64, N), np.nan)
    for (thread, register), (row, col) in where.items():
        results[:, row, col] = out[:, thread, register].numpy()
    (a0, b0), (a1, b1) = pairs
    d1 = a0 @ b0.T + a1 @ b1.T
    return results, (d1, a1 @ b1.T, 2 * d1 + a0 @ b0.T)


def kernel():
    """The kernel, loaded as FAGEN_EMULATE_RACECHECK says (load_module keeps each build loaded)."""
    return load_module(SOURCE).get_function("wgmma_pipeline")


def outputs_correct(bug: int) -> bool:
    results, expected = launch(kernel(), bug)
    return all(np.array_equal(got, want) for got, want in zip(results, expected))


PLANTED = [
    PlantedBug("wgmma pipeline", "no wgmma.fence before the first wgmma", 1, SCHEDULES,
               r"no wgmma\.fence has ordered"),
    PlantedBug("wgmma pipeline", "the B tile overwritten before the wait", 2, SCHEDULES,
               "changed between its issue and the wgmma.wait_group"),
    PlantedBug("wgmma pipeline", "wait_group 1 where 0 is needed", 3, SCHEDULES),
    PlantedBug("wgmma pipeline", "accumulators rescaled with no wgmma.fence after", 4, SCHEDULES, "no wgmma\\.fence"),
    PlantedBug("wgmma pipeline", "one warp skips the wgmma", 5, SCHEDULES, "warpgroup"),
    PlantedBug("wgmma pipeline", "one thread passes another B descriptor", 8, SCHEDULES,
               "must agree across the warpgroup"),
    PlantedBug("wgmma pipeline", "no fence.proxy.async between the threads' copy and the wgmmas", 10,
               ("forward", "warp-serial"), "missing fence.proxy.async", racecheck=True),
]
