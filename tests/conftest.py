"""Suite-wide settings: the helpers' folder (tests/support) on sys.path, and the fuzz seed
(tests/kernels/test_kernels_fuzz.py).

Each run draws a fresh seed unless FAGEN_FUZZ_SEED gives one; pytest prints it in its
header, and FAGEN_FUZZ_SEED=<that seed> replays the run's draws exactly.
"""

import os
import secrets
import sys
from pathlib import Path

# The tests import their shared helpers (kernel_cases, bench_stand_ins, ...) as top-level modules
# from tests/support/, whatever pytest's import mode and whichever test folder runs.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

os.environ.setdefault("FAGEN_FUZZ_SEED", str(secrets.randbits(32)))


def pytest_report_header(config):
    return f"fagen fuzz seed: FAGEN_FUZZ_SEED={os.environ['FAGEN_FUZZ_SEED']}"


def pytest_terminal_summary(terminalreporter):
    # The header is hidden under -q (the README's command): say it at the end as well.
    terminalreporter.write_line(pytest_report_header(None))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def cpython_one_byte_objects_stay_intact():
    """A native call that writes into a `b" " * 1` buffer overwrites CPython's one shared b" "
    object (NVRTC's log does), and every later b" " in the process, print's separator among
    them, is then b"\\x00". Name the test that does it, not some later victim."""
    yield
    assert b"a" + b" " + b"b" == bytes([97, 32, 98]), "this test overwrote CPython's shared b' ' object"


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every buffer fagen's kernels write starts as the sentinel NaN (fagen.emulate.poison_, where
    attention_kernels allocates through `_empty`), so an element the kernel never wrote fails the
    test (assert_written names it) instead of passing on whatever memory held. A module takes it
    with `pytestmark = pytest.mark.usefixtures("poisoned_outputs")`."""
    from fagen.kernels import attention_kernels
    from kernel_cases import poisoned_empty

    monkeypatch.setattr(attention_kernels, "_empty", poisoned_empty)
