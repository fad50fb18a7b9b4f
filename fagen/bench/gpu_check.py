"""The GPU check: every section in order under one budget, and --dry-run.

Sections run in the order of `plan.SECTIONS`. Each gets a deadline from the
budget that keeps back time for the sections after it (the time guard, schedule.py), and
results.json is rewritten after every section (and after every panel of the
speed sweep), so a run killed from outside still leaves what it measured.

Exit status: 0 when every section ran and the gpu tests passed (peers that
are not available are notes, not failures); 1 when a gpu test failed, a
self-test template failed or hung (or the step was stopped at its cap), a
section found a wrong result (the world-1 ring differs from the plain op, a
decoding step's CUDA-graph replay differs from the eager step) or a section
raised; 2 when no CUDA GPU is visible.

Families. Every fagen row names the family it measures ("fagen v2": sm80, "fagen sm90": the
sm90 family) and the gpu tests mean sm80 unless a test asks for sm90; so the run pins
FAGEN_SELFTEST=0 for itself and every subprocess (correctness.PINNED_ENV, `_pinned_families`):
the self-test's default (sm90 on compute capability 9.0 where it passed) never switches a row
or a test, and no call starts a self-test of its own. The self-test step is where that default
is proven.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import signal
import subprocess
import time
import traceback
from pathlib import Path
from typing import Callable

from . import report
from .correctness import PINNED_ENV, TWINS_CAP_S, UNPINNED, find_compute_sanitizer, run_gpu_tests, run_sanitizers
from .dry_run import dry_run
from .plan import OPTIONAL_SECTIONS, Plan
from .plan_text import describe
from .schedule import caps, reserve_after
from .timing import Budget, Deadline
from .versions import found_versions, versions_line

REPO_ROOT = Path(__file__).resolve().parents[2]


def _git_commit() -> str | None:
    try:
        run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        return run.stdout.strip() or None
    except Exception:  # noqa: BLE001 - the device machine's copy may have no .git
        return None


def _device_meta() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    meta = {"device": props.name, "capability": f"sm_{props.major}{props.minor}",
            "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        meta["nvidia_smi"] = smi.stdout.strip() or None
    except Exception:  # noqa: BLE001 - informative only
        meta["nvidia_smi"] = None
    return meta


def _toolchain_meta(capability: str) -> dict:
    """The driver and the NVRTC the kernels are compiled with, and the arch they target."""
    from fagen.kernels.compile import describe_target, nvrtc_target, nvrtc_version
    from fagen.tuning.device import driver_version

    target = nvrtc_target(capability)
    return {"driver": driver_version(), "nvrtc": nvrtc_version(), "nvrtc_target": target,
            "nvrtc_target_note": describe_target(capability, target)}


def _device_identity():
    """This GPU's tuning identity (the tiles a call looks up are its tuned ones, if any are cached),
    or None for any GPU of its arch (the fallback table's tiles) if it cannot be read."""
    try:
        from fagen.tuning import DeviceIdentity

        return DeviceIdentity.from_device(0)
    except Exception:  # noqa: BLE001 - the arch alone still names the fallback tiles
        return None


def toolchain_line(meta: dict) -> str:
    return (f"driver {meta.get('driver')}, CUDA runtime {meta.get('cuda')}, NVRTC {meta.get('nvrtc')}, "
            f"target {meta.get('nvrtc_target_note', meta.get('nvrtc_target'))}")


class _Run:
    """The state of one GPU check: results, budget, and writing as it goes."""

    def __init__(self, plan: Plan, out_dir: Path, skip: set[str], log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.plan, self.out_dir, self.skip, self.log = plan, Path(out_dir), skip, log
        self.budget = Budget(plan.budget_s, clock=clock)
        self.results: dict = {
            "meta": {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                     "commit": _git_commit(), "plan": plan.name},
            "plan": plan.to_dict(), "plan_text": describe(plan), "sections": {}}

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = round(self.budget.elapsed(), 1)
        report.write_json(self.results, self.out_dir)

    def section(self, name: str, fn: Callable[[], object]):
        if name in self.skip:
            self.results["sections"][name] = {"status": "skipped", "seconds": 0.0, "note": "--skip"}
            return None
        self.log(f"== {name} (at {self.budget.elapsed():.0f} s, {self.budget.remaining():.0f} s left)")
        start = self.budget.now()
        try:
            value = fn()
            info = value if isinstance(value, dict) else {}
            status, note = info.get("status", "ok"), info.get("note", "")
        except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others
            value, status = None, "error"
            note = f"{type(exc).__name__}: {exc}"
            self.log(traceback.format_exc(limit=6))
        self.results["sections"][name] = {"status": status, "seconds": round(self.budget.now() - start, 1),
                                          "note": str(note)[:500]}
        self.log(f"   {name}: {status}" + (f" ({note})" if note else ""))
        self.save()
        return value

    def measure(self, name: str, module: str, function: str, *args, **kwargs) -> None:
        """A measuring section: `function` of `module` (imported as the section starts, since it
        imports torch) run on the plan, `args`, the section's deadline and `kwargs`; what it
        returns goes in results[name]."""
        def body():
            runner = getattr(importlib.import_module(module, __package__), function)
            return runner(self.plan, *args, self.deadline(name), log=self.log, **kwargs)

        self.results[name] = self.section(name, body)

    def checkpoint(self, name: str) -> Callable[[dict], None]:
        """A section's checkpoint: its partial results saved to results.json as they grow."""
        def save_partial(partial):
            self.results[name] = partial
            self.save()
        return save_partial

    def needs(self) -> dict[str, float]:
        """Seconds each section may take (the speed sweep: its floor), as kept back for it by the
        earlier ones; 0 for a section that will not run. The sanitizers' two runs only when
        compute-sanitizer is here."""
        return caps(self.plan, sanitizers=find_compute_sanitizer() is not None, skip=self.skip)

    def deadline(self, section: str) -> Deadline:
        """The time guard: `section` may run for its cap from now (the speed sweep: with no cap),
        and never into the time kept back for the sections after it."""
        needs = self.needs()
        cap = None if section == "speed" else needs[section]
        return self.budget.deadline(reserve_s=reserve_after(section, needs), cap_s=cap)


class Stopped(BaseException):
    """SIGTERM (the wrapper's hard timeout) or Ctrl-C: stop measuring, write
    what we have. A BaseException, so sections' `except Exception` let it by."""


def _raise_stopped(signum, frame):
    raise Stopped(f"signal {signum}")


def run_gpu_check(plan: Plan, out_dir, *, skip=(), log: Callable[[str], None] = print) -> int:
    """Every section, then the report. On SIGTERM or Ctrl-C the sections stop
    and the report is still written (exit status 124, like `timeout`)."""
    run = _Run(plan, Path(out_dir), set(skip), log)
    try:
        previous = signal.signal(signal.SIGTERM, _raise_stopped)
    except ValueError:  # not the main thread: no handler, the JSON is still written as we go
        previous = None
    try:
        with _pinned_families():
            return _run_sections(run)
    except (Stopped, KeyboardInterrupt) as exc:
        run.results["stopped"] = f"stopped from outside ({exc or 'interrupt'}) after {run.budget.elapsed():.0f} s"
        log(f"\n== {run.results['stopped']}; writing what was measured")
        _finish(run)
        return 124
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _pinned_families():
    """The process's environment with the families pinned (see the module doc) for the run,
    then as it was (a test may run the check in its own process)."""
    names = (*PINNED_ENV, *UNPINNED)
    saved = {name: os.environ.get(name) for name in names}
    for name in UNPINNED:
        os.environ.pop(name, None)
    os.environ.update(PINNED_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _finish(run: "_Run") -> None:
    """Write every output file and print the summary and the short table last."""
    try:
        report.write_report(run.results, run.out_dir)
    except Exception as exc:  # noqa: BLE001 - fall back to the JSON alone
        run.log(f"report not written: {type(exc).__name__}: {exc}")
        run.save()
    run.log("")
    run.log("\n".join(report.summary_lines(run.results)))
    run.log(report.short_table(run.results))


def _run_sections(run: "_Run") -> int:
    plan, log = run.plan, run.log
    results, budget = run.results, run.budget
    log(describe(plan))

    def setup():
        import torch

        found = found_versions()
        results["meta"].update(found, versions_line=versions_line(found))
        if not torch.cuda.is_available():
            return {"status": "error", "note": "no CUDA GPU visible to torch"}
        results["meta"].update(_device_meta())
        results["meta"].update(_toolchain_meta(results["meta"]["capability"]))
        torch.backends.cuda.matmul.allow_tf32 = False
        meta = results["meta"]
        return {"status": "ok", "note": f"{meta['device']} ({meta['capability']}); {toolchain_line(meta)}"}

    run.section("setup", setup)
    if results["sections"]["setup"]["status"] != "ok":
        _finish(run)
        return 2

    def precompile_section():
        from .precompile import precompile

        return precompile(plan, results["meta"]["capability"], run.deadline("precompile").remaining(),
                          identity=_device_identity())

    results["precompile"] = run.section("precompile", precompile_section)

    def peak_section():
        from .peak import run_peak

        return run_peak()

    results["peak"] = run.section("peak", peak_section)

    def selftest_section():
        from .selftest_step import expected_templates, families_of, run_selftest_step

        families = families_of(results["meta"]["capability"])
        outcome = run_selftest_step(REPO_ROOT, run.deadline("selftest").remaining(), expected_templates(families))
        log("   self-test: " + outcome["summary"])
        return outcome

    results["selftest"] = run.section("selftest", selftest_section)

    def correctness_section():
        # The twins' micro-kernels first: whether each emulated twin reads the ISA as the
        # hardware does is the first thing a rare GPU run must tell, whatever comes after.
        twins = run_gpu_tests(REPO_ROOT, min(TWINS_CAP_S, run.deadline("correctness").remaining()), marker="twins")
        log("   twins: " + twins["summary"])
        outcome = run_gpu_tests(REPO_ROOT, run.deadline("correctness").remaining(), marker="gpu and not twins")
        outcome["twins"] = twins
        outcome["note"] = f"twins: {twins['summary']}; {outcome['summary']}"
        log("   " + outcome["summary"])
        return outcome

    results["correctness"] = run.section("correctness", correctness_section)

    def sanitizer_section():
        return run_sanitizers(REPO_ROOT, timeout_s=plan.sanitizer_cap_s,
                              deadline=run.deadline("sanitizers"))

    results["sanitizers"] = run.section("sanitizers", sanitizer_section)

    from .peers import make_system

    systems = {name: make_system(name) for name in dict.fromkeys(plan.systems + plan.memory.systems)}

    run.measure("speed", ".speed.run", "run_speed_sweep", [systems[n] for n in plan.systems],
                checkpoint=run.checkpoint("speed"))
    run.measure("variants", ".variants.run", "run_variant_sweep", checkpoint=run.checkpoint("variants"))
    copy = ((results.get("peak") or {}).get("copy") or {}).get("tb_per_s")
    run.measure("decode", ".decode.run", "run_decode_section", checkpoint=run.checkpoint("decode"),
                copy_tb_per_s=copy)
    run.measure("models", ".models.run", "run_models_section", checkpoint=run.checkpoint("models"))
    run.measure("ring", ".ring.run", "run_ring_section")
    run.measure("memory", ".memory", "run_memory_sweep", systems)

    results["sections"]["report"] = {"status": "ok", "seconds": 0.0,
                                     "note": f"written to {run.out_dir} at {budget.elapsed():.0f} s"}
    _finish(run)
    return exit_status(results)


def exit_status(results: dict) -> int:
    """1 when the gpu tests failed or timed out, the self-test step was stopped at its cap, a
    section found a wrong result (status "failed": a self-test template, the ring against the
    plain op, the decode step's graph replay against the eager step) or a section raised (or
    the self-test could not run: "error"); else 0."""
    correctness = results.get("correctness") or {}
    sections = results.get("sections") or {}
    failed = correctness.get("status") in ("failed", "timed out") or any(
        info.get("status") == "failed" for info in sections.values()) or (
        (results.get("selftest") or {}).get("status") == "timed out")
    broken = any(info.get("status") == "error" for info in sections.values())
    return 1 if failed or broken else 0


def default_out_dir() -> Path:
    """$OUT when the device tool runs us, else ./gpu-check-results."""
    return Path(os.environ.get("OUT") or "gpu-check-results")


__all__ = ["dry_run", "run_gpu_check", "default_out_dir", "OPTIONAL_SECTIONS"]
