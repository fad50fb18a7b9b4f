"""The TMA pipeline micro-kernel's case (tests/emulate/kernels/tma_pipeline.cu), shared by the
emulator's test (tests/emulate/test_emulate_tma.py) and the GPU's (tests/gpu/test_gpu_tma.py), so the
twin and the hardware run the same kernel on the same inputs against the same expectations."""

from __future__ import annotations

from pathlib import Path

import torch

from fagen.emulate import poison_

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
