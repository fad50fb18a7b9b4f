"""Correctness on the hardware: the `gpu` pytest run, and compute-sanitizer.

Both run as subprocesses with a hard time cap: a hung kernel or a slow
sanitizer cannot take the rest of the GPU check with it. Each subprocess gets
its own process session so that, on timeout, we end exactly the processes we
started (its process group), and nothing else.

The two sections' caps are the Plan's own fields (correctness_cap_s, sanitizer_cap_s); their
lines in the plan, their forecasts, their summary lines and their results.md tables are here too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .markdown import md as _md

SUMMARY_RE = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)")
PER_TEST_TIMEOUT_S = 120
TWINS_CAP_S = 60.0   # the twins' micro-kernels (`pytest -m twins`), run before the other gpu tests


def run_capped(cmd: list[str], *, timeout_s: float, env: dict | None = None,
               cwd: str | None = None) -> dict:
    """Run `cmd`, killing its process group after `timeout_s`. Returns
    returncode (None on timeout), combined output, seconds, timed_out."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(1.0, timeout_s))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created above, and only it
        output, _ = proc.communicate()
        timed_out = True
    except BaseException:
        # We are being stopped (the wrapper's timeout, Ctrl-C): take our child along.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return {"returncode": None if timed_out else proc.returncode, "output": output or "",
            "seconds": time.monotonic() - start, "timed_out": timed_out}


def child_env(repo_root: Path) -> dict:
    """The environment for subprocesses: fagen importable from the tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo_root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    return env


# What the gpu tests and the sanitizer's workload mean by a call's family: the one they name
# (FAGEN_ARCH_FAMILY, set by a test around its calls), else sm80 on every GPU. They were written
# for that default, before the self-test's (fagen.selftest.gate: the sm90 family by default on
# compute capability 9.0 where its templates passed), which would switch their plain calls to
# sm90 on an H100 unasked, and run the self-test inside a test when no verdict is stored.
# FAGEN_SELFTEST=0 keeps the old default; the self-test step proves the new one.
PINNED_ENV = {"FAGEN_SELFTEST": "0"}
UNPINNED = ("FAGEN_ARCH_FAMILY",)   # a family the check's caller left set: each test sets its own


def pinned_env(env: dict) -> dict:
    """`env` with the families pinned as the gpu tests mean them (PINNED_ENV, less UNPINNED)."""
    env = {name: value for name, value in env.items() if name not in UNPINNED}
    return {**env, **PINNED_ENV}


def gpu_test_env(repo_root: Path) -> dict:
    """The pytest subprocesses' environment: fagen from the tree, the families pinned."""
    return pinned_env(child_env(repo_root))


# -- pytest -m gpu ----------------------------------------------------------------

def parse_pytest_summary(output: str) -> dict:
    """Counts from pytest's last summary line ("2 failed, 10 passed in 3.1s")."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0,
              "xfailed": 0, "xpassed": 0}
    line = ""
    for candidate in reversed(output.strip().splitlines()):
        if SUMMARY_RE.search(candidate) and (" in " in candidate or "no tests ran" in candidate):
            line = candidate.strip("= ").strip()
            break
    for number, word in SUMMARY_RE.findall(line):
        key = {"error": "errors", "warning": "warnings", "warnings": "warnings"}.get(word, word)
        if key in counts:
            counts[key] = int(number)
    return {"summary": line, "counts": counts}


def parse_junit(path: Path) -> dict:
    """Failed tests with their first message line, skip reasons with counts, and what tests
    measured (`record_property`: {test: {name: value}}, e.g. the tanh twin's error on the GPU)."""
    failures, skips, measurements = [], {}, {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {"failures": failures, "skips": skips, "measurements": measurements}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        measured = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        if measured:
            measurements[name] = measured
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                failures.append({"test": name, "kind": tag, "message": (message[0] if message else "")[:400]})
        node = case.find("skipped")
        if node is not None:
            reason = (node.get("message") or "").strip()[:200]
            skips[reason] = skips.get(reason, 0) + 1
    return {"failures": failures, "skips": skips, "measurements": measurements}


def run_gpu_tests(repo_root: Path, timeout_s: float, *, marker: str = "gpu",
                  max_failures: int = 25) -> dict:
    """`python -m pytest -m gpu tests/` with a time cap; counts and failures.

    Not `-x`: a lease is too short to rerun, so one run should report every
    failing case (up to `max_failures`), not just the first. The environment pins the families
    as the tests mean them (gpu_test_env). JUnit's xunit1 flavour keeps what tests record
    (record_property) without a warning.
    """
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", marker, "-q", f"--maxfail={max_failures}",
               "-rfEs", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={junit}",
               str(repo_root / "tests")]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append(f"--timeout={PER_TEST_TIMEOUT_S}")
        run = run_capped(cmd, timeout_s=timeout_s, env=gpu_test_env(repo_root), cwd=str(repo_root))
        details = parse_junit(junit)
    parsed = parse_pytest_summary(run["output"])
    counts = parsed["counts"]
    if run["timed_out"]:
        status = "timed out"
    elif run["returncode"] == 0:
        status = "passed"
    elif run["returncode"] == 5:
        status = "no tests"
    else:
        status = "failed"
    return {"status": status, "command": " ".join(cmd), "returncode": run["returncode"],
            "seconds": run["seconds"], "summary": parsed["summary"] or f"(no summary; {status})",
            "counts": counts, "failures": details["failures"], "skips": details["skips"],
            "measurements": details["measurements"], "output_tail": run["output"][-6000:]}


# -- compute-sanitizer ----------------------------------------------------------------

# The workload is kernel_calls.sanitizer_workload, whose kernels the precompile section builds.
SANITIZER_SCRIPT = """\
import sys
sys.path.insert(0, {root!r})
import torch
from fagen.bench.kernel_calls import sanitizer_workload

for line in sanitizer_workload("cuda"):
    print(line)
torch.cuda.synchronize()
print("FAGEN SANITIZER SCRIPT DONE")
"""

MEMCHECK_RE = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACECHECK_RE = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def find_compute_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/compute-sanitizer",
                      "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def parse_sanitizer(tool: str, output: str) -> dict:
    """Error count from compute-sanitizer's summary line (None if absent)."""
    if tool == "racecheck":
        m = RACECHECK_RE.search(output)
        if m:
            return {"errors": int(m.group(2)), "warnings": int(m.group(3)), "summary": m.group(0)}
    m = MEMCHECK_RE.search(output)
    if m:
        return {"errors": int(m.group(1)), "summary": m.group(0)}
    return {"errors": None, "summary": ""}


def run_sanitizers(repo_root: Path, *, timeout_s: float, tools=("memcheck", "racecheck"),
                   deadline=None) -> dict:
    tool_path = find_compute_sanitizer()
    if tool_path is None:
        return {"status": "skipped", "note": "compute-sanitizer not found on PATH or in /usr/local/cuda"}
    section: dict = {"status": "ok", "note": "", "path": tool_path, "runs": {}}
    env = gpu_test_env(repo_root)   # the workload as the tests mean it; no self-test under the sanitizer
    # Without torch's caching allocator every tensor is its own cudaMalloc, so
    # memcheck sees an out-of-bounds access instead of a hit in pooled memory.
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "sanitize_fagen.py"
        script.write_text(SANITIZER_SCRIPT.format(root=str(repo_root)))
        for tool in tools:
            cap = timeout_s if deadline is None else min(timeout_s, deadline.remaining())
            if cap < 10:
                section["runs"][tool] = {"status": "skipped", "note": "time guard"}
                continue
            cmd = [tool_path, "--tool", tool, "--print-limit", "20", sys.executable, str(script)]
            run = run_capped(cmd, timeout_s=cap, env=env, cwd=str(repo_root))
            parsed = parse_sanitizer(tool, run["output"])
            finished = "FAGEN SANITIZER SCRIPT DONE" in run["output"]
            if run["timed_out"]:
                status = "timed out"
            elif parsed["errors"] == 0 and finished and run["returncode"] == 0:
                status = "clean"
            elif parsed["errors"]:
                status = "errors"
            else:
                status = "failed"
            section["runs"][tool] = {"status": status, "returncode": run["returncode"],
                                     "seconds": run["seconds"], **parsed,
                                     "script_finished": finished,
                                     "output_tail": run["output"][-3000:]}
    if any(r["status"] not in ("clean",) for r in section["runs"].values()):
        section["status"] = "problems"
        section["note"] = ", ".join(f"{t}: {r['status']}" for t, r in section["runs"].items())
    return section


# -- the plan -------------------------------------------------------------------------------

def plan_lines(plan) -> list[str]:
    return [f"  correctness: python -m pytest -m twins tests/ (the twins' micro-kernels, cap {TWINS_CAP_S:.0f} s), "
            f"then -m 'gpu and not twins' (cap {plan.correctness_cap_s:.0f} s together)",
            f"  sanitizers: compute-sanitizer memcheck and racecheck on one small forward + "
            f"backward if installed (cap {plan.sanitizer_cap_s:.0f} s each)"]


def correctness_estimate(plan) -> float:
    """The gpu tests: about a minute, within the cap."""
    return min(plan.correctness_cap_s, 60.0)


def sanitizers_estimate(plan, *, sanitizers: bool) -> float:
    """memcheck and racecheck, each about 70% of its cap; nothing without compute-sanitizer."""
    return 2 * plan.sanitizer_cap_s * 0.7 if sanitizers else 0.0


# -- the summary and results.md ---------------------------------------------------------------

def summary_lines(results: dict) -> list[str]:
    """The gpu tests' summary with the first failures, and each sanitizer run's verdict."""
    lines = []
    correctness = results.get("correctness") or {}
    for label, run in (("twins against the hardware", correctness.get("twins") or {}), ("gpu tests", correctness)):
        if run.get("summary"):
            lines.append(f"{label}: {run['summary']}")
        for failure in (run.get("failures") or [])[:8]:
            lines.append(f"  FAILED {failure['test']}: {failure['message'][:160]}")
    lines += [f"measured: {line}" for line in measurement_lines(results)]
    sanitizers = results.get("sanitizers") or {}
    for tool, run in (sanitizers.get("runs") or {}).items():
        lines.append(f"compute-sanitizer {tool}: {run.get('status')} {run.get('summary', '')}".rstrip())
    return lines


def measurement_lines(results: dict) -> list[str]:
    """What the gpu tests measured (record_property), a line per test, the twins' first:
    `file::test: name value, ...`."""
    correctness = results.get("correctness") or {}
    lines = []
    for run in (correctness.get("twins") or {}, correctness):
        for test, measured in (run.get("measurements") or {}).items():
            lines.append(f"{_short_test(test)}: " + ", ".join(f"{name} {value}" for name, value in measured.items()))
    return lines


def short_lines(results: dict) -> list[str]:
    """The short table's rows: what the gpu tests measured, a line per test, for a later session
    to copy."""
    return [f"-- measured by {line}" for line in measurement_lines(results)]


def _short_test(test: str) -> str:
    """"tests.gpu.test_gpu_tanh::test_x" (JUnit's classname::name) as "test_gpu_tanh::test_x"."""
    classname, _, name = test.partition("::")
    return f"{classname.rsplit('.', 1)[-1]}::{name}"


def markdown_lines(results: dict) -> list[str]:
    c = results.get("correctness")
    if not c:
        return []
    out = ["", "## Correctness (`pytest -m gpu`)", ""]
    twins = c.get("twins")
    if twins:
        out += [f"Twins first (`{twins.get('command', '')}`): **{twins.get('status')}**: {twins.get('summary')}"]
        out += [f"- FAILED `{f['test']}`: {_md(f['message'])}" for f in twins.get("failures", [])]
        out.append("")
    out += [f"`{c.get('command', '')}`", "", f"**{c.get('status')}**: {c.get('summary')}"]
    for failure in c.get("failures", []):
        out.append(f"- FAILED `{failure['test']}`: {_md(failure['message'])}")
    measured = measurement_lines(results)
    if measured:
        out += ["", "Measured by the tests (record_property):"] + [f"- {_md(line)}" for line in measured]
    if c.get("skips"):
        out += ["", "Skipped, by reason:"]
        out += [f"- {count} × {_md(reason)}" for reason, count in c["skips"].items()]
    return out


def sanitizer_markdown_lines(results: dict) -> list[str]:
    s = results.get("sanitizers")
    if not s:
        return []
    out = ["", "## compute-sanitizer", ""]
    if not s.get("runs"):
        return out + [f"{s.get('status')}: {_md(s.get('note', ''))}"]
    for tool, run in s["runs"].items():
        out.append(f"- {tool}: **{run.get('status')}** {run.get('summary', '')} "
                   f"({run.get('seconds', 0):.0f} s)")
    return out
