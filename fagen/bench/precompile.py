"""Compile, ahead of time and in parallel processes, the kernels the GPU check will launch.

NVRTC takes a second or two per kernel. Compiled once up front on the GPU machine's cores,
they fill fagen's disk cache, which the correctness section's pytest subprocess and every later
section read; otherwise each would compile serially inside its first call.

Which kernels: the ones the calls will load on this GPU, learned by making the calls
(kernel_record, over kernel_calls' small versions of the sections' and the gpu tests' calls)
with tiles looked up for this GPU's identity, so a name here is the name the op computes, tiles
included. Two spawned workers record (sections, gpu tests) while the others wait; each recorded
kernel is compiled as soon as its recorder reports it, for the NVRTC target `fagen.kernels.launch` uses
(`compiler.nvrtc_target`). Workers are spawned, not forked: the parent has CUDA initialised, and
a forked CUDA context is unusable. Workers touch no GPU.

Its cap is the Plan's own field (precompile_cap_s); its line in the plan and its forecast are here.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

# Distinct kernels the gpu tests launch on an H200 (the precompile forecast counts them;
# tests/bench/test_gpu_check_plan.py checks the number against the kernels recorded from the tests).
GPU_TEST_KERNELS = 100
# The GPU machine's cores, less one for the parent (precompile's compile workers).
GPU_MACHINE_WORKERS = 15


def plan_lines(plan) -> list[str]:
    return [f"  precompile: the kernels the sections and the gpu tests call, recorded by making their calls "
            f"on CPU tensors for this GPU's arch, then NVRTC in parallel (cap {plan.precompile_cap_s:.0f} s)"]


def estimate_seconds(plan) -> float:
    """About 6 s to spawn the recorder and record the calls' kernels, then 1.5 s per NVRTC compile
    on each of the GPU machine's workers, within the cap."""
    kernels = (plan.sweep_kernels() + plan.variant_kernels() + plan.decode_kernels() + plan.models_kernels()
               + GPU_TEST_KERNELS)
    return min(plan.precompile_cap_s, 6.0 + 1.5 * kernels / GPU_MACHINE_WORKERS)


def record_section_kernels(plan, identity):
    """The sections' kernels for the GPU of `identity` (run in a spawned worker)."""
    from .kernel_calls import section_calls
    from ..kernel_record import identity_for, record

    return record(section_calls(plan), identity_for(identity) if isinstance(identity, str) else identity)


def record_test_kernels(identity):
    """The gpu tests' kernels for the GPU of `identity` (run in a spawned worker)."""
    from .kernel_calls import gpu_test_calls
    from ..kernel_record import identity_for, record

    return record(gpu_test_calls(), identity_for(identity) if isinstance(identity, str) else identity)


def compile_spec(spec, arch: str, use_cache: bool = True) -> dict:
    """Render and NVRTC-compile one kernel for a GPU of `arch`, for the target its family loads
    there (`spec_target`: sm_90a for the sm90 family), through fagen's cache unless `use_cache`
    is False; a summary."""
    from fagen.kernels.render import render
    from fagen.kernels.compile import compile_source, spec_target

    start = time.perf_counter()
    target = spec_target(spec, arch)
    compiled = compile_source(render(spec), target, use_cache=use_cache)
    resources = {name: {"registers": r.registers, "spill_bytes": r.spill_bytes,
                        "static_shared_bytes": r.static_shared_bytes}
                 for name, r in compiled.resources.items()}
    return {"name": spec.name, "arch": target, "cache": compiled.cache,
            "seconds": time.perf_counter() - start, "resources": resources}


def default_workers() -> int:
    """Every core but one (the parent waits); NVRTC is single-threaded."""
    return max(1, min(15, (os.cpu_count() or 2) - 1))


def precompile(plan, arch: str, timeout_s: float, workers: int | None = None,
               include_tests: bool = True, identity=None) -> dict:
    """Record and compile, within `timeout_s`, every kernel the plan's sections (and the gpu
    tests) will launch on a GPU of capability `arch`; `identity` (a DeviceIdentity) is that
    GPU's, for its tuned tiles, else any GPU of `arch`'s. Unfinished kernels compile on first use
    instead (noted, not an error)."""
    from fagen.kernels.compile import nvrtc_target

    target, end = nvrtc_target(arch), time.monotonic() + max(1.0, timeout_s)   # the sm80 family's
    workers = workers or default_workers()
    section: dict = {"arch": arch, "target": target, "workers": workers, "kernels": {}, "status": "ok", "note": ""}
    pool = ProcessPoolExecutor(max_workers=max(2, workers), mp_context=multiprocessing.get_context("spawn"))
    who = identity or arch
    recorders = {pool.submit(record_section_kernels, plan, who): "the sections"}
    if include_tests:
        recorders[pool.submit(record_test_kernels, who)] = "the gpu tests"
    compiles: dict = {}
    problems: list[str] = []
    try:
        pending = set(recorders)
        while pending and time.monotonic() < end:
            done, pending = wait(pending, timeout=max(0.0, end - time.monotonic()), return_when=FIRST_COMPLETED)
            for future in done:
                problems += _submit_recorded(pool, future, recorders, compiles, arch)
        if pending:
            problems.append("recording " + " and ".join(recorders[f] for f in pending) + " did not finish in time")
        _collect(section, compiles, max(0.0, end - time.monotonic()))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    _summarise(section, problems)
    return section


def _submit_recorded(pool, future, recorders: dict, compiles: dict, arch: str) -> list[str]:
    """Compile jobs for a finished recorder's new kernels, for a GPU of `arch`; its problems, as
    notes."""
    try:
        recorded = future.result()
    except Exception as exc:  # noqa: BLE001 - the sections meet (and report) their own errors again
        return [f"recording {recorders[future]}: {type(exc).__name__}: {_first_lines(exc, 2)}"]
    known = {spec.name for spec in compiles.values()}
    for spec in recorded.specs:
        if spec.name not in known:
            known.add(spec.name)
            compiles[pool.submit(compile_spec, spec, arch)] = spec
    return [f"{recorders[future]}: {error}" for error in recorded.errors[:3]]


def _collect(section: dict, compiles: dict, timeout_s: float) -> None:
    done, pending = wait(compiles, timeout=timeout_s) if compiles else (set(), set())
    for future in done:
        try:
            section["kernels"][compiles[future].name] = future.result()
        except Exception as exc:  # noqa: BLE001 - the call will report the same error
            section["kernels"][compiles[future].name] = {"error": f"{type(exc).__name__}: {_first_lines(exc)}"}
    for future in pending:
        future.cancel()
        section["kernels"][compiles[future].name] = {"error": "not finished in time; compiles on first use"}


def _summarise(section: dict, problems: list[str]) -> None:
    kernels = section["kernels"]
    errors = [name for name, info in kernels.items() if "error" in info]
    notes = list(problems)
    if errors:
        notes.append(f"{len(errors)} of {len(kernels)} kernels did not compile: " + ", ".join(errors[:6]))
    if notes:
        section["status"] = "partial"
    section["note"] = "; ".join(notes) or f"{len(kernels)} kernels for {section['target']}"


def _first_lines(exc: BaseException, lines: int = 6) -> str:
    text = str(exc).strip().splitlines()
    return " | ".join(text[:lines])[:600]
