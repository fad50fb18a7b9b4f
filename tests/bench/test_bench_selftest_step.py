"""The GPU check's self-test step (fagen/bench/selftest_step.py) and the families it pins, on any
machine: its place and cap in the plan, its verdicts read off `fagen selftest`'s own output (made
here by the command's own formatters), its rows in results.md and the short table, its exit
status, and the environments the check gives its sections and subprocesses."""

import os
import sys

import pytest
import torch

from fagen.bench import correctness, gpu_check, report, schedule, selftest_step
from fagen.bench.plan import OPTIONAL_SECTIONS, SECTIONS, full_plan, quick_plan
from fagen.bench.plan_text import describe
from fagen.selftest import command, watchdog
from fagen.selftest.templates import all_templates
from fagen.selftest.verdicts import TemplateResult, Verdict, VerdictKey

from bench_stand_ins import REPO, FakeClock, reserving_run
from bench_synthetic import synthetic_results

TEMPLATES = all_templates("sm80") + all_templates("sm90")
N80, N90 = len(all_templates("sm80")), len(all_templates("sm90"))   # what the tables count


# -- the plan ----------------------------------------------------------------------------------

@pytest.mark.parametrize("plan", [full_plan(), quick_plan()], ids=["full", "quick"])
def test_the_plan_runs_the_self_test_before_anything_launches_the_sm90_family(plan, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "find_compute_sanitizer", lambda: "/usr/local/cuda/bin/compute-sanitizer")
    assert SECTIONS.index("precompile") < SECTIONS.index("selftest") < SECTIONS.index("correctness")
    assert "selftest" in OPTIONAL_SECTIONS
    caps = schedule.caps(plan, sanitizers=True)
    assert caps["selftest"] == plan.selftest_cap_s == 40.0 and sum(caps.values()) <= plan.budget_s
    assert 0 < schedule.forecast(plan, sanitizers=True)["selftest"] <= plan.selftest_cap_s
    assert "a failed or hung template fails the check (cap 40 s)" in describe(plan)
    # While peak runs, the self-test's cap is kept back with every later section's: one second
    # short of them, peak has one second left; skipped, the self-test keeps nothing back.
    later = sum(caps[name] for name in SECTIONS[SECTIONS.index("selftest"):])
    clock = FakeClock()
    run, skipped = reserving_run(plan, tmp_path, clock=clock), reserving_run(plan, tmp_path, {"selftest"}, clock=clock)
    clock.now += plan.budget_s - later - 1.0
    assert run.deadline("peak").remaining() == 1.0
    assert schedule.reserve_after("peak", skipped.needs()) == later - plan.selftest_cap_s


def test_the_watchdog_gets_its_budget_inside_the_steps_cap():
    cmd = selftest_step.command(40.0)
    assert cmd[:5] == [sys.executable, "-m", "fagen", "selftest", "--verbose"]
    budget = float(cmd[cmd.index("--budget") + 1])
    assert budget == 40.0 - selftest_step.COMMAND_MARGIN_S
    assert cmd[cmd.index("--case-timeout") + 1] == "10"
    assert selftest_step.expected_templates(selftest_step.families_of("sm_90")) == TEMPLATES
    assert selftest_step.families_of("sm_80") == ("sm80",)


# -- the verdicts, from the command's own output -----------------------------------------------

def command_output(capsys, results: dict, *, table: bool = True) -> str:
    """What `fagen selftest --verbose` prints for `results` ({template: TemplateResult}, in the
    order they finished): the watchdog's progress line per template through the command's
    progress printer, and the command's table last (unless cut off)."""
    progress = command._progress(True)
    progress("compiled 44 kernels in 7.1 s")
    remaining, done = list(TEMPLATES), {}
    for template, result in results.items():
        watchdog._record(done, remaining, template, result, progress)
    if table:
        verdicts = {}
        for family in ("sm80", "sm90"):
            key = VerdictKey(family, "NVIDIA H100 80GB HBM3", "580.0", "13.0", "13.0", "0.1.0", "abc")
            mine = {t: r for t, r in results.items() if t.startswith(family + ".")}
            verdicts[family] = Verdict(key, mine, "/cache/tune/selftest/x.log", 30.0, "now")
        print(command.verdict_table(verdicts))
    captured = capsys.readouterr()
    return captured.err + captured.out


def capped_run(output: str, returncode=0, timed_out=False) -> dict:
    return {"returncode": returncode, "output": output, "seconds": 31.0, "timed_out": timed_out}


def test_every_template_passing_is_read_back_from_the_table(capsys):
    output = command_output(capsys, {t: TemplateResult("passed", "", 0.25) for t in TEMPLATES})
    section = selftest_step.summarise(capped_run(output), TEMPLATES, "fagen selftest --verbose")
    assert section["status"] == "passed" and list(section["templates"]) == list(TEMPLATES)
    assert all(row == {"status": "passed", "seconds": 0.25, "detail": ""} for row in section["templates"].values())
    assert section["summary"].startswith(f"{N80 + N90} of {N80 + N90} templates passed (sm80 {N80}/{N80}, sm90 "
                                         f"{N90}/{N90}); 44 kernels compiled in 7.1 s")
    assert section["log"] == "/cache/tune/selftest/x.log"
    assert gpu_check.exit_status({"selftest": section, "sections": {"selftest": section}}) == 0


def test_a_failed_template_fails_the_check_and_is_shown_last_in_the_short_table(capsys):
    results = {t: TemplateResult("passed", "", 0.2) for t in TEMPLATES}
    results["sm90.mla"] = TemplateResult("failed", "O: max error 0.5 against the float64 oracle (x 2 rule)", 0.3)
    results["sm90.paged"] = TemplateResult("timed_out", "no result after 10 s", 10.0)
    section = selftest_step.summarise(capped_run(command_output(capsys, results), returncode=1), TEMPLATES, "c")
    assert section["status"] == "failed" and section["counts"]["failed"] == section["counts"]["timed_out"] == 1
    assert section["templates"]["sm90.mla"]["detail"] == "O: max error 0.5 against the float64 oracle (x 2 rule)"
    assert gpu_check.exit_status({"selftest": section, "sections": {"selftest": {"status": section["status"]}}}) == 1
    results = {**synthetic_results(), "selftest": section}
    table = report.short_table(results).splitlines()
    assert table[-3].startswith(f"-- self-test failed: {N80 + N90 - 2} of {N80 + N90} templates passed (sm80 {N80}/{N80}, "
                                f"sm90 {N90 - 2}/{N90}), 1 failed, 1 timed out; 44 kernels compiled in 7.1 s")
    assert table[-2:] == ["  TIMED OUT sm90.paged: no result after 10 s",
                          "  FAILED sm90.mla: O: max error 0.5 against the float64 oracle (x 2 rule)"]
    md = report.markdown(results)
    assert "## Self-test (`fagen selftest`)" in md and "| sm90.mla | failed | 0.30 | O: max error 0.5" in md
    assert md.index("## Self-test") < md.index("## Correctness") and md.count("| sm80.") == N80


def test_a_step_stopped_at_its_cap_keeps_what_it_printed_and_fails_the_check(capsys):
    first = {t: TemplateResult("passed", "", 0.2) for t in TEMPLATES[:10]}
    output = command_output(capsys, first, table=False)
    section = selftest_step.summarise(capped_run(output, returncode=None, timed_out=True), TEMPLATES, "c")
    assert section["status"] == "timed out" and section["counts"] == {"passed": 10, "failed": 0, "timed_out": 0,
                                                                      "not_run": len(TEMPLATES) - 10}
    assert section["templates"][TEMPLATES[10]]["detail"] == "the step was stopped at its cap first"
    assert gpu_check.exit_status({"selftest": section, "sections": {"selftest": {"status": "timed out"}}}) == 1


def test_templates_the_budget_did_not_reach_are_a_note(capsys):
    results = {t: TemplateResult("passed", "", 0.2) for t in TEMPLATES[:-2]}
    results.update({t: TemplateResult("not_run", "the self-test's budget of 32 s ran out first") for t in TEMPLATES[-2:]})
    section = selftest_step.summarise(capped_run(command_output(capsys, results), returncode=1), TEMPLATES, "c")
    assert section["status"] == "partial" and section["counts"]["not_run"] == 2
    assert gpu_check.exit_status({"selftest": section, "sections": {"selftest": {"status": "partial"}}}) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_the_real_command_runs_under_the_cap_and_says_why_it_cannot_run_here():
    """`fagen selftest` with the step's own arguments (accepted: no usage error) on this GPU-less
    machine: it exits 2, and the step is an error whose short-table lines say why."""
    section = selftest_step.run_selftest_step(REPO, 120, TEMPLATES)
    assert section["status"] == "error" and section["returncode"] == 2, section["output_tail"]
    assert "no CUDA GPU is visible" in section["output_tail"] and "usage:" not in section["output_tail"]
    assert "no CUDA GPU is visible" in "\n".join(selftest_step.short_lines({"selftest": section}))
    assert gpu_check.exit_status({"selftest": section, "sections": {"selftest": {"status": "error"}}}) == 1


@pytest.mark.slow
def test_the_step_reads_a_real_run_on_the_emulator(tmp_path, monkeypatch):
    """The whole step on one template through the emulator (`--device cpu`, which builds the
    kernel inside the case: a longer case timeout than a GPU's): the table it reads is the
    command's, as printed."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    section = selftest_step.run_selftest_step(REPO, 500, ("sm80.d64",), ("--device", "cpu", "--template", "sm80.d64",
                                                                        "--case-timeout", "400"))
    assert section["status"] == "passed", section["output_tail"]
    row = section["templates"]["sm80.d64"]
    assert row["status"] == "passed" and row["seconds"] > 0 and section["log"].endswith(".log")


# -- the families the check pins -----------------------------------------------------------------

def test_the_gpu_tests_and_the_sanitizer_run_with_the_families_pinned(monkeypatch, tmp_path):
    """The old default, whatever the caller left set: FAGEN_SELFTEST=0 (no switch to sm90, no
    self-test inside a test), and no FAGEN_ARCH_FAMILY (each test sets its own)."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    monkeypatch.delenv("FAGEN_SELFTEST", raising=False)
    seen = []

    def fake_run(cmd, *, timeout_s, env=None, cwd=None):
        seen.append((cmd, env))
        return {"returncode": 0, "output": "1 passed in 0.1s", "seconds": 0.1, "timed_out": False}

    monkeypatch.setattr(correctness, "run_capped", fake_run)
    monkeypatch.setattr(correctness, "find_compute_sanitizer", lambda: "/usr/local/cuda/bin/compute-sanitizer")
    correctness.run_gpu_tests(REPO, 10.0, marker="twins")
    correctness.run_sanitizers(REPO, timeout_s=10.0, tools=("memcheck",))
    assert len(seen) == 2
    for cmd, env in seen:
        assert env["FAGEN_SELFTEST"] == "0" and "FAGEN_ARCH_FAMILY" not in env, cmd
    assert "junit_family=xunit1" in seen[0][0]   # keeps the tests' record_property without a warning
    # The self-test step itself runs unpinned: it sets each case's family.
    monkeypatch.setenv("FAGEN_SELFTEST", "0")
    assert "FAGEN_SELFTEST" not in selftest_step.step_env(REPO)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_the_checks_own_process_is_pinned_while_it_runs_and_restored_after(monkeypatch, tmp_path):
    """The in-process sections (the sweep's fagen v2 rows, the models section) run with the
    pins too; the caller's environment is as it was afterwards."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    monkeypatch.delenv("FAGEN_SELFTEST", raising=False)
    during = {}

    def versions():
        during.update(selftest=os.environ.get("FAGEN_SELFTEST"), family=os.environ.get("FAGEN_ARCH_FAMILY"))
        return {}

    monkeypatch.setattr(gpu_check, "found_versions", versions)
    assert gpu_check.run_gpu_check(quick_plan(), tmp_path, log=lambda line: None) == 2
    assert during == {"selftest": "0", "family": None}
    assert os.environ["FAGEN_ARCH_FAMILY"] == "sm90" and "FAGEN_SELFTEST" not in os.environ


# -- what the gpu tests measured ---------------------------------------------------------------

def test_what_a_test_records_comes_back_in_the_short_table(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_gpu_tanh" name="test_t">'
        '<properties><property name="max_rel" value="1.113e-05" /><property name="at_x" value="0.53" />'
        '</properties></testcase><testcase classname="tests.gpu.test_gpu_tma" name="test_u" /></testsuite>'
        '</testsuites>')
    measured = correctness.parse_junit(junit)["measurements"]
    assert measured == {"tests.gpu.test_gpu_tanh::test_t": {"max_rel": "1.113e-05", "at_x": "0.53"}}
    results = {**synthetic_results(), "correctness": {"status": "passed", "summary": "1 passed",
                                                      "twins": {"summary": "1 passed", "measurements": measured}}}
    assert report.short_table(results).endswith("\n-- measured by test_gpu_tanh::test_t: max_rel 1.113e-05, at_x 0.53")
    assert "measured: test_gpu_tanh::test_t: max_rel 1.113e-05, at_x 0.53" in report.summary_lines(results)
    assert "- test_gpu_tanh::test_t: max_rel 1.113e-05, at_x 0.53" in report.markdown(results)


def test_the_short_table_with_the_self_test_and_the_measurement_still_fits_the_returned_output(capsys):
    """The full plan's table with every section (test_bench_report's worst case), a self-test
    that passed and the tanh measurement's line: its last lines, the two added, still come back
    in the device tool's last 12,000 characters with room for the rest."""
    from bench_synthetic import synthetic_decode, synthetic_models, synthetic_ring, synthetic_variants

    plan = full_plan()
    points = [{"pass": p, "dtype": c.dtype, "head_dim": c.head_dim, "causal": c.causal, "seqlen": n,
               "batch": plan.batch(n), "heads": plan.heads(c.head_dim), "flops": 1.0,
               "results": {s: {"tflops": 555.5} for s in plan.systems}}
              for c in plan.configs() for n in plan.seqlens for p in plan.passes]
    output = command_output(capsys, {t: TemplateResult("passed", "", 0.25) for t in TEMPLATES})
    measured = {"inputs": "6864994", "max_rel": "1.113e-05", "at_x": "-0.589561", "max_abs": "1.05e-05",
                "abs_at_x": "-0.823451", "subnormal_max_rel": "0", "isa_bound": "0.0004927"}
    results = {"speed": {"points": points}, "variants": synthetic_variants(), "decode": synthetic_decode(),
               "models": synthetic_models(), "ring": synthetic_ring(), "meta": {"device": "NVIDIA H200"},
               "selftest": selftest_step.summarise(capped_run(output), TEMPLATES, "c"),
               "correctness": {"twins": {"measurements": {
                   "tests.gpu.test_gpu_tanh::test_tanh_approx_errs_within_the_isa_bound": measured}}}}
    table = report.short_table(results).splitlines()
    assert table[-2].startswith(f"-- self-test passed: {N80 + N90} of {N80 + N90} templates passed")
    assert table[-1].startswith("-- measured by test_gpu_tanh::test_tanh_approx_errs_within_the_isa_bound: "
                                "inputs 6864994, max_rel 1.113e-05, at_x -0.589561")
    assert len("\n".join(table)) < 11_750
