"""The GPU test modules that take FAGEN_GPU_TESTS_DEVICE, run on the CPU through the emulator.

tests/gpu/test_gpu_kernels.py is what a GPU session runs first (and
test_gpu_sm90_backward_rows.py, test_gpu_fp8_forward.py, test_gpu_fp8_backward.py and test_gpu_fp8_decode.py
measure issues 44's and 45's rows), and GPU time is
scarce: its own logic (inputs, the PyTorch baselines, the one-hot dropout mask
readout, the deterministic repeats) must not fail there for a reason a CPU
could have caught. FAGEN_GPU_TESTS_DEVICE=cpu points it at CPU tensors, which
fagen runs in the emulator; everything but the CUDA-graph test runs.

It takes minutes (the whole GPU suite, emulated), so it is in the slow tier: run
`python -m pytest -q -m slow tests/gpu/test_gpu_suite_emulated.py` after changing the GPU tests
and before a GPU session.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["test_gpu_kernels.py", "test_gpu_sm90_backward_rows.py", "test_gpu_fp8_forward.py",
                                    "test_gpu_fp8_backward.py", "test_gpu_fp8_decode.py"])
def test_gpu_kernel_tests_pass_on_the_emulator(module):
    env = {**os.environ, "FAGEN_GPU_TESTS_DEVICE": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / module)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
