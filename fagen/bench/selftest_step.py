"""The self-test step: `fagen selftest --verbose` on the check's GPU, before anything else runs a
kernel of the sm90 family (the gpu tests, the sweep's "fagen sm90" rows).

It is what a user's first call on this GPU runs by itself (fagen.selftest): one small case per
kernel template of every family the GPU takes (sm80 everywhere, sm90 on compute capability 9.0),
in a child process under a watchdog, each held to flash-attn's tolerance rule. The check runs the
command as a subprocess with a hard cap (correctness.run_capped), the watchdog's own budget a few
seconds inside it so that the command still prints its table when the budget runs out, and
reads the per-template verdicts off its output: the table it prints last, else (cut off at the
cap) the progress lines it printed per template as they finished.

Its kernels are not precompiled: the self-test's child compiles every case's kernels first, in
16 threads (NVRTC releases the GIL), about what the precompile section's 15 workers would take
for them, and compiling them here keeps the step's time the time a user's first call pays.

A template that failed or hung fails the check (exit 1), as a failed gpu test does; one the
budget did not reach is a note. Its cap is the Plan's own field (selftest_cap_s); its line in
the plan, its forecast, its summary line, its short-table rows and its results.md table are here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from ..arch_families import FAMILIES
from .correctness import child_env, run_capped
from .markdown import md as _md

# The watchdog's clock for one case's run (the child compiles every kernel before the first):
# a case's kernels take milliseconds on small shapes, its float64 oracle a fraction of a second.
CASE_TIMEOUT_S = 10.0
# The command's own start (Python, torch, the CUDA context, the sources' hash) and its table,
# outside the watchdog's budget.
COMMAND_MARGIN_S = 8.0
# The forecast's parts (a guess until a GPU run measures them; results.json records the
# compile time and each template's run): two Python processes with torch and a CUDA context,
# recording each case's kernels on CPU tensors, NVRTC at 1.5 s a kernel (one a template) on
# 16 threads, and one case's run with its oracle.
STARTUP_S, RECORD_S_PER_TEMPLATE, COMPILE_S_PER_KERNEL, RUN_S_PER_TEMPLATE = 7.0, 0.15, 1.5, 0.3
COMPILE_THREADS = 16
# The families a compute capability 9.0 GPU takes, as the check's GPUs (H100, H200) are.
HOPPER_FAMILIES = tuple(family.name for family in FAMILIES.values() if family.capability in (None, (9, 0)))

STATUSES = ("passed", "failed", "timed_out", "not_run")
_TEMPLATE = r"(sm\d+\.\w+)"
_STATUS = r"(passed|failed|timed_out|not_run)"
TABLE_RE = re.compile(rf"^{_TEMPLATE} +{_STATUS} +(\d+\.\d+)(?:  (.*))?$")
PROGRESS_RE = re.compile(rf"^fagen selftest: \[\d+/\d+\] {_TEMPLATE}: {_STATUS}(?: \((.*)\))?$")
COMPILED_RE = re.compile(r"compiled (\d+) kernels in ([\d.]+) s")
DONE_RE = re.compile(r"done in ([\d.]+) s: (\d+) of (\d+) templates passed")
LOG_RE = re.compile(r"^log: (.+)$")


def families_of(capability: str | None) -> tuple[str, ...]:
    """The families `fagen selftest` proves on a GPU of `capability` ("sm_90")."""
    return HOPPER_FAMILIES if capability == "sm_90" else ("sm80",)


def expected_templates(families) -> tuple[str, ...]:
    from fagen.selftest.templates import all_templates

    return tuple(t for family in families for t in all_templates(family))


# -- the plan ---------------------------------------------------------------------------------

def estimate_seconds(plan) -> float:
    """The self-test of both families (the check's GPUs are 9.0), within its cap."""
    templates = len(expected_templates(HOPPER_FAMILIES))
    compile_s = COMPILE_S_PER_KERNEL * templates / COMPILE_THREADS
    return min(plan.selftest_cap_s, STARTUP_S + (RECORD_S_PER_TEMPLATE + RUN_S_PER_TEMPLATE) * templates + compile_s)


def plan_lines(plan) -> list[str]:
    counts = ", ".join(f"{family} {len(expected_templates((family,)))}" for family in HOPPER_FAMILIES)
    return [(f"  selftest: python -m fagen selftest --verbose, before anything else runs the sm90 family: one small "
             f"case per kernel template ({counts}; sm90 on compute capability 9.0 only) in a child under a watchdog "
             f"({CASE_TIMEOUT_S:.0f} s a case), its kernels compiled first in {COMPILE_THREADS} threads; a failed or "
             f"hung template fails the check (cap {plan.selftest_cap_s:.0f} s)")]


# -- the run ----------------------------------------------------------------------------------

def command(timeout_s: float, extra_args=()) -> list[str]:
    """`fagen selftest --verbose`, its watchdog's budget `COMMAND_MARGIN_S` inside `timeout_s`."""
    budget = max(5.0, timeout_s - COMMAND_MARGIN_S)
    return [sys.executable, "-m", "fagen", "selftest", "--verbose", "--budget", f"{budget:.0f}",
            "--case-timeout", f"{CASE_TIMEOUT_S:.0f}", *extra_args]


def step_env(repo_root: Path) -> dict:
    """The subprocesses' environment (fagen from the tree), without the check's own pins: the
    self-test sets each case's family itself, and runs whatever FAGEN_SELFTEST says."""
    env = child_env(repo_root)
    for name in ("FAGEN_SELFTEST", "FAGEN_ARCH_FAMILY"):
        env.pop(name, None)
    return env


def run_selftest_step(repo_root: Path, timeout_s: float, templates, extra_args=()) -> dict:
    """Run the self-test within `timeout_s`; the section's result with a row per template of
    `templates` (the ones the command will run, in order)."""
    cmd = command(timeout_s, extra_args)
    run = run_capped(cmd, timeout_s=timeout_s, env=step_env(repo_root), cwd=str(repo_root))
    return summarise(run, tuple(templates), " ".join(cmd[1:]))


def parse_output(output: str) -> dict:
    """The command's output read back: {"templates": {template: row}, "from_table": whether its
    last table was there, "compiled", "done", "log"}. Table rows win over progress lines."""
    table, progress, found = {}, {}, {"compiled": None, "done": None, "log": ""}
    for line in output.splitlines():
        line = line.rstrip()
        if m := TABLE_RE.match(line):
            table[m[1]] = {"status": m[2], "seconds": float(m[3]), "detail": (m[4] or "").strip()}
        elif m := PROGRESS_RE.match(line):
            progress[m[1]] = {"status": m[2], "seconds": None, "detail": (m[3] or "").strip()}
        elif m := LOG_RE.match(line):
            found["log"] = m[1]
        if m := COMPILED_RE.search(line):
            found["compiled"] = {"kernels": int(m[1]), "seconds": float(m[2])}
        if m := DONE_RE.search(line):
            found["done"] = {"seconds": float(m[1]), "passed": int(m[2]), "templates": int(m[3])}
    return {"templates": {**progress, **table}, "from_table": bool(table), **found}


def summarise(run: dict, templates: tuple, command_text: str) -> dict:
    """The section's result from one capped run (correctness.run_capped's dict)."""
    parsed = parse_output(run["output"])
    rows = parsed["templates"]
    missing = ("the step was stopped at its cap first" if run["timed_out"] else "the command did not report it")
    for template in templates:
        rows.setdefault(template, {"status": "not_run", "seconds": None, "detail": missing})
    counts = {status: sum(r["status"] == status for r in rows.values()) for status in STATUSES}
    status = _status(run, parsed, counts)
    result = {"status": status, "command": command_text, "returncode": run["returncode"],
              "seconds": run["seconds"], "templates": rows, "counts": counts, "compiled": parsed["compiled"],
              "log": parsed["log"], "output_tail": run["output"][-6000:]}
    result["summary"] = summary_text(result)
    result["note"] = result["summary"]
    return result


def _status(run: dict, parsed: dict, counts: dict) -> str:
    if counts["failed"] or counts["timed_out"]:
        return "failed"
    if run["timed_out"]:
        return "timed out"
    if run["returncode"] not in (0, 1) or not parsed["from_table"]:
        return "error"      # it could not run (rc 2) or crashed: the tail of its output says why
    return "partial" if counts["not_run"] else "passed"


def summary_text(section: dict) -> str:
    counts, rows = section.get("counts") or {}, section.get("templates") or {}
    families = {}
    for template, row in rows.items():
        family = families.setdefault(template.split(".")[0], [0, 0])
        family[0] += row["status"] == "passed"
        family[1] += 1
    text = (f"{counts.get('passed', 0)} of {len(rows)} templates passed ("
            + ", ".join(f"{f} {p}/{n}" for f, (p, n) in families.items()) + ")")
    text += "".join(f", {counts[s]} {s.replace('_', ' ')}" for s in STATUSES[1:] if counts.get(s))
    compiled = section.get("compiled")
    if compiled:
        text += f"; {compiled['kernels']} kernels compiled in {compiled['seconds']:.1f} s"
    text += f"; {section.get('seconds', 0.0):.1f} s in all"
    if section.get("status") in ("timed out", "error"):
        text += f" ({section['status']}: rc {section.get('returncode')})"
    return text


# -- the summary, the short table and results.md ----------------------------------------------

def summary_lines(results: dict) -> list[str]:
    section = results.get("selftest")
    if not section:
        return []
    lines = [f"self-test: {section.get('summary', '')}"]
    return lines + [f"  {_label(row)} {template}: {row.get('detail', '')[:160]}"
                    for template, row in (section.get("templates") or {}).items() if row["status"] != "passed"]


def short_lines(results: dict) -> list[str]:
    """A line for the step (its counts per family), then one per template that did not pass,
    with its status and detail: the templates that passed are in results.md, one row each."""
    section = results.get("selftest")
    if not section:
        return []
    lines = [f"-- self-test {section.get('status')}: {section.get('summary', '')}"]
    for template, row in (section.get("templates") or {}).items():
        if row["status"] != "passed":
            lines.append(f"  {_label(row)} {template}: {row.get('detail', '')[:110]}")
    if section.get("status") == "error":
        tail = [line for line in (section.get("output_tail") or "").strip().splitlines() if line.strip()][-2:]
        lines += [f"  | {line[:150]}" for line in tail]
    return lines


def markdown_lines(results: dict) -> list[str]:
    section = results.get("selftest")
    if not section:
        return []
    out = ["", "## Self-test (`fagen selftest`)", "", f"`{section.get('command', '')}`", "",
           f"**{section.get('status')}**: {_md(section.get('summary', ''))}"]
    if section.get("log"):
        out += ["", f"Its child's log (on the GPU machine): `{section['log']}`"]
    out += ["", "| template | status | s | detail |", "|---|---|---:|---|"]
    for template, row in (section.get("templates") or {}).items():
        seconds = "-" if row.get("seconds") is None else f"{row['seconds']:.2f}"
        out.append(f"| {template} | {row['status']} | {seconds} | {_md(row.get('detail', ''))} |")
    return out


def _label(row: dict) -> str:
    return {"failed": "FAILED", "timed_out": "TIMED OUT", "not_run": "not run"}.get(row["status"], row["status"])
