"""benchmarks/call_overhead.py's contract (a benchmark, not a test: its speed is never asserted):
the four ratios issue 26 targets, against the trivial SDPA call, with one intra-op thread."""

import os
import subprocess
import sys

from bench_stand_ins import REPO, load_benchmark

SCRIPT = REPO / "benchmarks" / "call_overhead.py"


def test_it_reports_the_four_targeted_ratios_to_the_trivial_sdpa_call():
    script = load_benchmark("call_overhead")
    assert [(label, target) for _, label, target in script.TARGETS] == [
        ("forward", 1.5), ("forward + backward", 4.0), ("decode step", 2.0), ("paged decode step", 2.5)]
    lines = script.report_lines(20.0, {"forward": 30.0, "forward_backward": 80.2, "decode": 39.0,
                                       "paged_decode": 51.0})
    assert lines[0].startswith("trivial torch SDPA call (1x1x1x64, CPU):     20.0 us")
    assert "OMP_NUM_THREADS=1" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [row[-3:] for row in rows] == [["1.50x", "1.50x", "within"], ["4.01x", "4.00x", "OVER"],
                                          ["1.95x", "2.00x", "within"], ["2.55x", "2.50x", "OVER"]]
    assert len(lines) == 2 + 4


def test_it_runs_with_one_intra_op_thread_or_not_at_all():
    script = load_benchmark("call_overhead")
    unset = {}
    assert script.one_thread_problem(unset) is None and unset == {"OMP_NUM_THREADS": "1"}
    assert script.one_thread_problem({"OMP_NUM_THREADS": "1"}) is None
    assert "OMP_NUM_THREADS='4'" in script.one_thread_problem({"OMP_NUM_THREADS": "4"})
    # Refused before torch is imported (so in well under a second of work), with the reason.
    env = dict(os.environ, OMP_NUM_THREADS="4")
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert "measured with OMP_NUM_THREADS=1" in run.stderr and "unset it or set it to 1" in run.stderr
