"""The self-test's watchdog (fagen.selftest.watchdog) against planted cases
(tests/support/selftest_planted.py): a hang is ended and only its template fails, a child that
dies or raises fails only its case, a wrong result fails only its template, and a budget that
runs out leaves the rest "not_run". The child runs on the CPU: these cases build no kernel."""

from __future__ import annotations

import time

import pytest

from fagen.selftest.watchdog import RunPlan, run_selftest

from selftest_planted import CHILD_ENV

TEMPLATES = ("sm90.d64", "sm90.d128")


def plan(tmp_path, table: str, **fields) -> RunPlan:
    return RunPlan("cpu", fields.pop("templates", TEMPLATES), tmp_path / "selftest.log",
                   cases=f"selftest_planted:{table}", env=dict(CHILD_ENV), **fields)


def statuses(results: dict) -> dict:
    return {template: result.status for template, result in results.items()}


def test_each_way_a_case_ends_fails_that_template_alone(tmp_path):
    """A hang (ended after its 3 s), a death, an error and a wrong result, then a pass and a
    template without a case: one child after each of the first two."""
    lines = []
    start = time.monotonic()
    templates = ("sm90.d64", "sm90.d128", "sm90.d192", "sm90.d256", "sm90.d320", "sm90.mla")
    results = run_selftest(plan(tmp_path, "MIXED", templates=templates, case_timeout_s=3.0, budget_s=120.0),
                           lines.append)
    assert statuses(results) == {"sm90.d64": "timed_out", "sm90.d128": "failed", "sm90.d192": "failed",
                                 "sm90.d256": "failed", "sm90.d320": "passed", "sm90.mla": "not_run"}
    assert time.monotonic() - start < 90, "the watchdog did not end the hung child"
    assert "no result after 3 s" in results["sm90.d64"].detail
    assert "the child process died (exit status 3)" in results["sm90.d128"].detail
    assert "RuntimeError: planted: the kernel raised" in results["sm90.d192"].detail
    assert "O: max error" in results["sm90.d256"].detail and "same-dtype torch" in results["sm90.d256"].detail
    assert results["sm90.mla"].detail == "no case for this template"
    assert lines[0].startswith("[1/6] sm90.d64: timed_out") and lines[-1] == "[6/6] sm90.mla: not_run (no case for this template)"
    log = (tmp_path / "selftest.log").read_text()
    assert log.count("== sm90.d") == 5   # three children, one log


@pytest.mark.slow
@pytest.mark.parametrize("table, detail", [("HANG", "no result after 3 s"),
                                           ("DEATH", "the child process died (exit status 3)"),
                                           ("ERROR", "RuntimeError: planted: the kernel raised")])
def test_a_case_that_hangs_dies_or_raises_fails_alone(tmp_path, table, detail):
    results = run_selftest(plan(tmp_path, table, case_timeout_s=3.0, budget_s=120.0))
    assert statuses(results) == {"sm90.d64": "timed_out" if table == "HANG" else "failed", "sm90.d128": "passed"}
    assert detail in results["sm90.d64"].detail


def test_the_budget_ends_the_run_and_leaves_the_rest_unrun(tmp_path):
    """Whether the first (hanging) case had started when the budget ran out depends on how fast
    the child imports: "timed_out" if it had, "not_run" if not; either way the budget ends it."""
    start = time.monotonic()
    results = run_selftest(plan(tmp_path, "SLOW", case_timeout_s=600.0, budget_s=6.0))
    assert time.monotonic() - start < 20
    assert statuses(results)["sm90.d64"] in ("timed_out", "not_run") and results["sm90.d128"].status == "not_run"
    assert all("budget of 6 s" in result.detail for result in results.values()), results


def test_a_child_that_cannot_start_leaves_its_templates_unproven_not_failed(tmp_path):
    """No kernel ran, so none failed: an environment that cannot start the child (here a case
    list that does not import) must not make every sm80 call refuse to run."""
    results = run_selftest(RunPlan("cpu", TEMPLATES, tmp_path / "selftest.log", cases="no_such_module:CASES",
                                   env=dict(CHILD_ENV)))
    assert statuses(results) == {"sm90.d64": "not_run", "sm90.d128": "not_run"}
    assert all("ended (exit status 1) before this case" in r.detail for r in results.values())
    assert "No module named 'no_such_module'" in (tmp_path / "selftest.log").read_text()
