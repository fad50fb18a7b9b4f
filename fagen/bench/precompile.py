"""Compile fagen's benchmark variants ahead of time, in parallel processes.

NVRTC takes about a second per variant; the sweep would otherwise pay it
serially inside its first timed point of each panel, and the `gpu` tests would
pay it again. Compiling every variant once up front, on several cores, fills
fagen's disk cache (shared by the pytest subprocess and the sweep). Workers
are spawned, not forked: the parent has CUDA initialised, and a forked CUDA
context is unusable. Workers import only the compiler side of fagen (no
torch), so they start fast.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ALL_COMPLETED, ProcessPoolExecutor, wait

from .plan import FAGEN_SYSTEMS, Plan


def variant_kwargs(plan: Plan) -> list[dict]:
    """Spec arguments of every forward/backward variant the sweep runs, as
    fagen.ops builds them (default tiles, no padding or dropout)."""
    versions = [int(s[-1]) for s in plan.systems if s in FAGEN_SYSTEMS]
    return [{"head_dim": d, "dtype": dtype, "version": version, "mask": "causal" if causal else "none"}
            for version in versions for dtype in plan.dtypes for d in plan.head_dims
            for causal in plan.causal]


def test_variant_kwargs() -> list[dict]:
    """Variants the `gpu` tests use beyond the sweep's (tests/test_gpu_kernels.py:
    dropout, deterministic backward), compiled here too so the correctness
    section does not compile them one by one. A guess at how fagen.ops maps
    its flags to a Spec; a wrong guess only costs an idle compile."""
    dropout = [{"head_dim": d, "dtype": dtype, "version": version, "mask": "none", "dropout": True}
               for version in (2, 1) for dtype in ("fp16", "bf16") for d in (64, 128)]
    deterministic = [{"head_dim": d, "dtype": "bf16", "version": version,
                      "mask": "causal" if causal else "none", "deterministic": True}
                     for version in (2, 1) for causal in (False, True) for d in (64, 128)]
    # The one-stage backward of 99 KB parts (test_single_stage_backward_of_99kb_parts_on_the_gpu).
    single_stage = [{"head_dim": 128, "dtype": "bf16", "version": version, "mask": "causal", "dropout": True,
                     "block_n": 32, "bwd_stages": 1, **flags}
                    for version in (2, 1) for flags in ({"key_padding": True}, {"deterministic": True})]
    return dropout + deterministic + single_stage


def compile_variant(kwargs: dict, arch: str, use_cache: bool = True) -> dict:
    """Render and NVRTC-compile one variant (through fagen's cache unless
    `use_cache` is False); a summary."""
    from fagen.codegen import render
    from fagen.compiler import compile_source
    from fagen.spec import Spec

    spec = Spec(**kwargs)
    start = time.perf_counter()
    compiled = compile_source(render(spec), arch, use_cache=use_cache)
    resources = {name: {"registers": r.registers, "spill_bytes": r.spill_bytes,
                        "static_shared_bytes": r.static_shared_bytes}
                 for name, r in compiled.resources.items()}
    return {"name": spec.name, "arch": arch, "cache": compiled.cache,
            "seconds": time.perf_counter() - start, "resources": resources}


def precompile(plan: Plan, arch: str, timeout_s: float, workers: int | None = None,
               include_tests: bool = True) -> dict:
    """Compile every variant for `arch` within `timeout_s`; unfinished ones
    compile on first use instead (noted, not an error)."""
    kwargs_list = variant_kwargs(plan) + (test_variant_kwargs() if include_tests else [])
    workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1, len(kwargs_list)))
    section: dict = {"arch": arch, "workers": workers, "variants": {}, "status": "ok", "note": ""}
    if not kwargs_list:
        section["note"] = "no fagen system in the plan"
        return section
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {pool.submit(compile_variant, kw, arch): kw for kw in kwargs_list}
    try:
        done, pending = wait(futures, timeout=max(1.0, timeout_s), return_when=ALL_COMPLETED)
        for future in done:
            kw = futures[future]
            key = _key(kw)
            try:
                section["variants"][key] = future.result()
            except Exception as exc:  # noqa: BLE001 - the sweep will report the same error per point
                section["variants"][key] = {"error": f"{type(exc).__name__}: {_first_lines(exc)}"}
        for future in pending:
            future.cancel()
            section["variants"][_key(futures[future])] = {"error": "not finished in time; compiles on first use"}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    errors = [k for k, v in section["variants"].items() if "error" in v]
    if errors:
        section["status"] = "partial"
        section["note"] = f"{len(errors)} of {len(kwargs_list)} variants did not compile: " + ", ".join(errors[:6])
    return section


def _key(kw: dict) -> str:
    flags = "".join(f" {flag}" for flag in ("dropout", "deterministic") if kw.get(flag))
    return f"v{kw['version']} {kw['dtype']} d{kw['head_dim']} {kw['mask']}{flags}"


def _first_lines(exc: BaseException, lines: int = 6) -> str:
    text = str(exc).strip().splitlines()
    return " | ".join(text[:lines])[:600]
