"""The GPU test module, run on the CPU through the emulator.

tests/test_gpu_kernels.py is what a GPU session runs first, and GPU time is
scarce: its own logic (inputs, the PyTorch baselines, the one-hot dropout mask
readout, the deterministic repeats) must not fail there for a reason a CPU
could have caught. FAGEN_GPU_TESTS_DEVICE=cpu points it at CPU tensors, which
fagen runs in the emulator; everything but the CUDA-graph test runs.
"""

import os
import subprocess
import sys
from pathlib import Path


TESTS = Path(__file__).resolve().parent


def test_gpu_kernel_tests_pass_on_the_emulator():
    env = {**os.environ, "FAGEN_GPU_TESTS_DEVICE": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_gpu_kernels.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1500)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
