"""The self-test's parent: runs the cases in a child process under a wall-clock watchdog.

A kernel that hangs on hardware never returns, and a CUDA fault poisons its process's context.
So the cases run in a child (`python -m fagen.selftest_cases.child`) that reports each case's start and
result as JSON lines on a pipe of its own; this parent reads them against two clocks:

  - each case's run has `case_timeout_s` from its "start" event (the child compiles every
    kernel first, so the clock times runs only);
  - the whole self-test has `budget_s`.

When a case overruns, the child's process group is killed, that template is "timed_out", and a
fresh child goes on with the templates left (it reads the kernels compiled so far from the disk
cache). A child that dies mid-case fails that template the same way. Templates left when the
budget ends are "not_run". Everything the children print goes to the run's log file.

Imports nothing of the ops: the gate (fagen.selftest.gate) runs this from a call.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .verdicts import TemplateResult

DEFAULT_CASES = "fagen.selftest_cases.cases:CASES"
CASE_TIMEOUT_S = 20.0    # one case's kernels on small shapes take milliseconds on a GPU


@dataclass
class RunPlan:
    """What one self-test runs, where, and within what time."""

    device: str                   # "cuda:0", or "cpu" (the emulator: the tests' stand-in)
    templates: tuple              # in order (templates.all_templates)
    log: Path
    budget_s: float = 60.0
    case_timeout_s: float = CASE_TIMEOUT_S
    cases: str = DEFAULT_CASES    # module:attribute of the case list (tests plant their own)
    compile_first: bool = True    # compile every case's kernels before the first run (GPU only)
    env: dict = field(default_factory=dict)   # extra environment for the child


def run_selftest(plan: RunPlan, progress: Callable[[str], None] = lambda line: None) -> dict:
    """Run `plan` to the end or its budget; {template: TemplateResult} for every template."""
    start = time.monotonic()
    deadline = start + plan.budget_s
    remaining = list(plan.templates)
    results: dict = {}
    plan.log.parent.mkdir(parents=True, exist_ok=True)
    with open(plan.log, "w") as log:
        log.write(f"fagen self-test on {plan.device}: {len(remaining)} templates, budget {plan.budget_s:.0f} s\n")
        log.flush()
        compile_first = plan.compile_first
        while remaining and time.monotonic() < deadline:
            _run_child(plan, remaining, results, log, deadline, compile_first, progress)
            compile_first = False   # a fresh child reads the first one's kernels from the disk cache
    for template in remaining:
        results[template] = TemplateResult("not_run", f"the self-test's budget of {plan.budget_s:.0f} s ran out first")
    return {t: results[t] for t in plan.templates}


def _run_child(plan, remaining: list, results: dict, log, deadline: float, compile_first: bool, progress) -> None:
    """One child over `remaining`, until it finishes, dies or overruns; records what it reported."""
    read_fd, write_fd = os.pipe()
    command = [sys.executable, "-m", "fagen.selftest_cases.child", "--device", plan.device, "--cases", plan.cases,
               "--events-fd", str(write_fd), "--templates", ",".join(remaining)]
    command += [] if compile_first else ["--no-compile"]
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
                             env=_child_env(plan.env), start_new_session=True)
    os.close(write_fd)
    events = _Events(read_fd)
    current, case_deadline, restart, started = None, None, False, 0.0
    try:
        while True:
            limit = deadline if case_deadline is None else min(deadline, case_deadline)
            event = events.next(limit)
            if event is _Events.TIMEOUT:
                _kill(child)
                if current is not None:
                    overran = "case" if case_deadline is not None and case_deadline <= deadline else "budget"
                    _record(results, remaining, current, TemplateResult(
                        "timed_out", f"no result after {plan.case_timeout_s:.0f} s" if overran == "case" else
                        f"still running when the self-test's budget of {plan.budget_s:.0f} s ran out",
                        time.monotonic() - started), progress)
                return
            if event is _Events.END:
                code = child.wait()
                if current is not None:   # died mid-case: a crash, or a CUDA fault it could not survive
                    _record(results, remaining, current, TemplateResult(
                        "failed", f"the child process died ({_exit_text(code)}) during this case",
                        time.monotonic() - started), progress)
                elif not restart:   # ended outside any case, unasked: another child would end so too
                    # Not a kernel's failure (it never ran): the templates are unproven, not failed.
                    for template in list(remaining):
                        _record(results, remaining, template, TemplateResult(
                            "not_run", f"the self-test's child process ended ({_exit_text(code)}) before this "
                                       f"case; its log says why"), progress)
                return
            kind = event.get("event")
            if kind == "compiled":
                progress(f"compiled {event.get('kernels', 0)} kernels in {event.get('seconds', 0.0):.1f} s")
            elif kind == "start":
                current, started = event["template"], time.monotonic()
                case_deadline = started + plan.case_timeout_s
            elif kind == "restart":   # its CUDA context may be broken: a fresh child goes on
                restart = True
            elif kind == "result":
                _record(results, remaining, event["template"], TemplateResult(
                    event["status"], event.get("detail", ""), float(event.get("seconds", 0.0))), progress)
                current, case_deadline = None, None
    finally:
        events.close()
        if child.poll() is None:
            _kill(child)


def _child_env(extra: dict) -> dict:
    """The parent's environment, with this fagen first on the child's path (the parent may have
    found it through its own sys.path, which a child does not inherit), then `extra`."""
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    for name, value in extra.items():
        env[name] = os.pathsep.join((value, path)) if name == "PYTHONPATH" else value
    return env


def _record(results: dict, remaining: list, template: str, result: TemplateResult, progress) -> None:
    results[template] = result
    if template in remaining:
        remaining.remove(template)
    done = len(results)
    progress(f"[{done}/{done + len(remaining)}] {template}: {result.status}"
             + (f" ({result.detail})" if result.status != "passed" and result.detail else ""))


def _kill(child: subprocess.Popen) -> None:
    """End the child's process group (the one it leads: start_new_session) and reap it."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class _Events:
    """JSON lines from the child's event pipe, each awaited until a monotonic deadline."""

    TIMEOUT = object()
    END = object()

    def __init__(self, fd: int):
        self.fd, self.buffer, self.ended = fd, b"", False

    def next(self, deadline: float):
        while b"\n" not in self.buffer:
            if self.ended:
                return self.END
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self.fd], [], [], wait)[0]:
                return self.TIMEOUT
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.ended = True
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {"event": "garbled", "line": line.decode(errors="replace")}

    def close(self) -> None:
        os.close(self.fd)
