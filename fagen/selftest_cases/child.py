"""The self-test's child process: runs the cases of the templates it is given, reporting each on
its event pipe as a JSON line, for the watchdog (fagen.selftest.watchdog) in the parent.

    python -m fagen.selftest_cases.child --device cuda:0 --events-fd N --templates sm90.d64,sm90.causal

Events: {"event": "compiled", "kernels": n, "seconds": s}, then per template {"event": "start",
"template": t} and {"event": "result", "template": t, "status": "passed" | "failed" | "not_run",
"detail": ..., "seconds": s}; {"event": "restart"} before it exits early because its CUDA
context may be broken (a fresh child goes on with the rest).

On a GPU it first compiles every case's kernels, in threads (NVRTC releases the GIL), so that the
watchdog's clock times runs and not compiles: which kernels, it learns by making the calls on
CPU tensors with kernel loads recorded and stubbed (fagen.kernel_record, as the GPU
check's precompile does). On the CPU (the emulator) it builds each kernel as the case runs.
FAGEN_SELFTEST=0 inside: the cases' own calls never start another self-test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

SELFTEST_ENV = "FAGEN_SELFTEST"
ARCH_FAMILY_ENV = "FAGEN_ARCH_FAMILY"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fagen.selftest_cases.child")
    parser.add_argument("--device", required=True)
    parser.add_argument("--events-fd", type=int, required=True)
    parser.add_argument("--templates", required=True, help="comma-separated, in order")
    parser.add_argument("--cases", default="fagen.selftest_cases.cases:CASES",
                        help="module:attribute of {template: Case}")
    parser.add_argument("--no-compile", action="store_true", help="do not compile every kernel first")
    args = parser.parse_args(argv)
    os.environ[SELFTEST_ENV] = "0"
    events = os.fdopen(args.events_fd, "w", buffering=1)
    import torch

    device = torch.device(args.device)
    cases = _load(args.cases)
    templates = [t for t in args.templates.split(",") if t]
    if device.type == "cuda" and not args.no_compile:
        _emit(events, "compiled", **_compile_kernels([cases[t] for t in templates if t in cases], device))
    loaded = _watch_loads()
    for template in templates:
        case = cases.get(template)
        if case is None:
            _emit(events, "result", template=template, status="not_run", detail="no case for this template")
            continue
        _emit(events, "start", template=template)
        loaded.clear()
        status, detail, seconds, healthy = _run_case(case, device)
        if status == "passed" and case.runs_kernels and case.family not in {spec.arch_family for spec in loaded}:
            status, detail = "failed", f"the case ran no kernel of the {case.family} family ({_names(loaded)})"
        _emit(events, "result", template=template, status=status, detail=detail, seconds=seconds)
        if not healthy:
            _emit(events, "restart")
            return 0
    return 0


def _run_case(case, device) -> tuple[str, str, float, bool]:
    """(status, detail, seconds, whether this process can go on) for one case, in its family."""
    import torch

    os.environ[ARCH_FAMILY_ENV] = case.family
    print(f"== {case.template} on {device}", flush=True)
    start = time.perf_counter()
    try:
        problems = case.run(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any error fails this template, and only it
        traceback.print_exc()
        sys.stdout.flush()
        return "failed", f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}", \
            time.perf_counter() - start, _context_usable(device)
    seconds = time.perf_counter() - start
    for line in problems:
        print(f"   {line}", flush=True)
    return ("failed", "; ".join(problems)[:400], seconds, True) if problems else ("passed", "", seconds, True)


def _watch_loads() -> list:
    """The Specs of the kernels loaded from now on, in this process (a case's, once cleared): a
    case proves its template only if its calls ran that template's family."""
    from ..kernels import launch

    loaded, real_load = [], launch.load

    def load(source, device):
        loaded.append(source.spec)
        return real_load(source, device)

    launch.load = load
    return loaded


def _names(specs) -> str:
    return ", ".join(dict.fromkeys(spec.name for spec in specs)) or "none"


def _context_usable(device) -> bool:
    """After an error: can this process still run kernels? A CUDA fault is sticky: every later
    call in this context would fail with it."""
    if device.type != "cuda":
        return True
    import torch

    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False


def _compile_kernels(cases, device) -> dict:
    """Compile, in threads, every kernel `cases` will load on `device`; counts and seconds."""
    from ..kernels.compile import compile_source, spec_target
    from ..kernels.render import source_for
    from ..tuning import DeviceIdentity

    start = time.perf_counter()
    identity = DeviceIdentity.from_device(device)
    recorded = record_cases(cases, identity)

    def build(spec):
        compile_source(source_for(spec), spec_target(spec, identity.arch))

    with ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1))) as pool:
        failures = [str(exc) for exc in _each_error(pool.map(_guarded(build), recorded.specs))]
    for line in failures:
        print(f"compile: {line}", flush=True)
    return {"kernels": len(recorded.specs), "seconds": time.perf_counter() - start, "errors": len(failures)}


def record_cases(cases, identity):
    """The kernels `cases` load on the GPU of `identity` (a DeviceIdentity), each case in its
    family: recorded by making its calls on CPU tensors (fagen.kernel_record; the GPU
    check's dry run lists them the same way). FAGEN_ARCH_FAMILY is as it was afterwards."""
    import torch

    from ..kernel_record import record

    before = os.environ.get(ARCH_FAMILY_ENV)
    try:
        return record([(case.template, _in_family(case, torch.device("cpu"))) for case in cases], identity)
    finally:
        os.environ.pop(ARCH_FAMILY_ENV, None)
        if before is not None:
            os.environ[ARCH_FAMILY_ENV] = before


def _in_family(case, device):
    def call():
        os.environ[ARCH_FAMILY_ENV] = case.family
        case.run(device)
    return call


def _guarded(fn):
    def run(arg):
        try:
            fn(arg)
            return None
        except Exception as exc:  # noqa: BLE001 - the case that loads it fails, with its own error
            return exc
    return run


def _each_error(results):
    return [r for r in results if r is not None]


def _load(reference: str) -> dict:
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _emit(events, kind: str, **fields) -> None:
    events.write(json.dumps({"event": kind, **fields}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
