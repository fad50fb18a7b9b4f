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
