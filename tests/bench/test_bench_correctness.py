"""The correctness and sanitizer sections' parsing and their runs recorded whatever happens."""

import os

import torch

from fagen.bench.correctness import parse_pytest_summary, parse_sanitizer

from bench_stand_ins import REPO


def test_summary_parsers():
    parsed = parse_pytest_summary("....F\n=== 1 failed, 10 passed, 2 skipped, 1 error in 3.21s ===\n")
    assert parsed["counts"]["failed"] == 1 and parsed["counts"]["passed"] == 10
    assert parsed["counts"]["skipped"] == 2 and parsed["counts"]["errors"] == 1
    assert parse_pytest_summary("no summary here")["summary"] == ""
    assert parse_sanitizer("memcheck", "========= ERROR SUMMARY: 0 errors")["errors"] == 0
    race = parse_sanitizer("racecheck", "RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)")
    assert (race["errors"], race["warnings"]) == (2, 1)


def test_sanitizer_runs_are_recorded_whatever_happens(tmp_path, monkeypatch):
    """With a stand-in compute-sanitizer that runs the script and prints a
    summary: on this GPU-less machine the script cannot finish, and the run is
    recorded as failed (not clean), with the summary parsed."""
    from fagen.bench.correctness import run_sanitizers

    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nshift 4\n\"$@\"\nstatus=$?\necho '========= ERROR SUMMARY: 0 errors'\nexit $status\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    section = run_sanitizers(REPO, timeout_s=60, tools=("memcheck",))
    run = section["runs"]["memcheck"]
    assert section["path"] == str(fake)
    assert run["summary"] == "ERROR SUMMARY: 0 errors" and run["errors"] == 0
    if torch.cuda.is_available():
        assert run["status"] == "clean"
    else:
        assert run["status"] == "failed" and not run["script_finished"]
        assert section["status"] == "problems"


def test_the_twins_are_reported_first():
    """The twins' micro-kernels run before the other gpu tests; the summary and results.md name
    them, and their failures, first."""
    from fagen.bench.correctness import markdown_lines, summary_lines

    twins = {"status": "failed", "summary": "1 failed, 3 passed in 4.0s", "command": "pytest -m twins",
             "failures": [{"test": "tests/gpu/test_gpu_tma.py::test_x", "kind": "failure", "message": "y differs"}]}
    results = {"correctness": {"status": "passed", "summary": "40 passed in 30.0s", "command": "pytest -m gpu",
                               "failures": [], "twins": twins}}
    lines = summary_lines(results)
    assert lines[0] == "twins against the hardware: 1 failed, 3 passed in 4.0s"
    assert lines[1].startswith("  FAILED tests/gpu/test_gpu_tma.py::test_x: y differs")
    assert lines[2] == "gpu tests: 40 passed in 30.0s"
    text = "\n".join(markdown_lines(results))
    assert text.index("Twins first") < text.index("40 passed")
    assert "FAILED `tests/gpu/test_gpu_tma.py::test_x`" in text


def test_the_twins_marker_selects_only_twins():
    """`-m twins` collects the twins' gpu tests and nothing else that is gpu-marked."""
    import subprocess
    import sys

    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "twins",
                                "-p", "no:cacheprovider", "tests/gpu"], cwd=REPO, capture_output=True, text=True)
    names = [line for line in collected.stdout.splitlines() if "::" in line]
    heavy = ("test_gpu_kernels.py", "test_gpu_decode.py", "test_gpu_distributed.py", "test_gpu_suite_emulated.py")
    assert any("test_gpu_tensor_map.py" in n for n in names), collected.stdout
    assert not any(file in n for n in names for file in heavy), collected.stdout
