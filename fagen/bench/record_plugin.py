"""A pytest plugin: which kernels a test run loads on a GPU of a given arch, found on any machine.

    FAGEN_RECORD_KERNELS=kernels.json FAGEN_RECORD_ARCH=sm_90 FAGEN_GPU_TESTS_DEVICE=cpu \\
        python -m pytest -p fagen.bench.record_plugin -m gpu -q --tb=no tests/

Every test runs under kernel_record's recording: tiles looked up for the arch, kernels that do
nothing. So the tests fail after their first kernel (their outputs are garbage), and that is
expected: what the run leaves is the JSON file, {"names": [...], "by_test": {nodeid: [...]}}, the
kernels each test loaded. The gpu tests read FAGEN_RECORD_KERNELS too, to run their CUDA-only
tests as far as their first (eager) call. tests/bench/test_gpu_check_plan.py holds what precompile
builds against this record.
"""

from __future__ import annotations

import json
import os

OUT_ENV, ARCH_ENV = "FAGEN_RECORD_KERNELS", "FAGEN_RECORD_ARCH"
_state: dict = {}


def pytest_configure(config):
    from ..kernel_record import Recorded, identity_for, recording

    recorded = Recorded()
    context = recording(identity_for(os.environ.get(ARCH_ENV, "sm_90")), recorded)
    context.__enter__()
    _state.update(recorded=recorded, context=context)


def pytest_runtest_setup(item):
    if "recorded" in _state:
        _state["recorded"].label = item.nodeid


def pytest_unconfigure(config):
    if "context" not in _state:
        return
    _state.pop("context").__exit__(None, None, None)
    recorded = _state.pop("recorded")
    path = os.environ.get(OUT_ENV)
    if path:
        with open(path, "w") as out:
            json.dump({"names": recorded.names, "by_test": recorded.by_call}, out, indent=1)
