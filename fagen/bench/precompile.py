"""Compile fagen's benchmark variants ahead of time, in parallel processes.

NVRTC takes about a second per variant; the sweep would otherwise pay it
serially inside its first timed point of each panel, and the `gpu` tests would
pay it again. Compiling every variant once up front, on several cores, fills
fagen's disk cache (shared by the pytest subprocess and the sweep). Workers
are spawned, not forked: the parent has CUDA initialised, and a forked CUDA
context is unusable. Workers import only fagen's renderer and compiler (and,
through the variants' tracer, torch), never CUDA.

What is compiled is what a call on this GPU will look up on a machine with no
tuning cache: each Spec with the fallback table's tiles for the device's arch
(`fagen.tuning.fallback_spec`, as `fagen.tuning.lookup` does), for the NVRTC
target `fagen.launch` uses (`compiler.nvrtc_target`). The variants section's
kernels (window, softcap, ALiBi, a document mask_mod) are compiled too; their
Spec fields come from fagen's own argument checking (`variants.case_spec_fields`). So are
the decode section's: the decode step's kernels (contiguous and paged cache) as
`fagen.decode.kvcache.decode_spec` builds them (fixed tiles, no tuning lookup), and the
varlen and padded training kernels as `fagen.ops` builds them (then the fallback tiles). And
the models section's (a Llama through fagen.integrations.transformers): plain causal for its
training step (flash_attn_func), varlen causal for `generate` on a padded batch
(flash_attn_varlen_func), as `fagen.ops` builds them.
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


def variant_case_kwargs(plan: Plan) -> list[dict]:
    """Spec arguments of the variants section's fagen kernels (one per case)."""
    config = plan.variants
    if "fagen_v2" not in config.systems or not config.cases:
        return []
    from .variants import case_spec_fields

    base = {"head_dim": config.head_dim, "dtype": config.dtype, "version": 2,
            "mask": "causal" if config.causal else "none"}
    return [{**base, **case_spec_fields(case, config)} for case in config.cases]


def spec_kwargs(spec) -> dict:
    """The arguments that rebuild `spec` exactly (Spec(**spec_kwargs(spec)) == spec)."""
    import dataclasses

    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def decode_kernel_kwargs(plan: Plan) -> list[dict]:
    """Spec arguments of the decode section's fagen kernels: the decode step's (full caches,
    Nq = 1, so never causal), as flash_attn_with_kvcache builds them, with their own tiles;
    the varlen and padded training kernels as flash_attn_varlen_func and flash_attn_func
    build them (tiles from the fallback table, like the sweep's; the padded one is often the
    sweep's own, and `precompile` compiles each distinct kernel once)."""
    config = plan.decode
    kwargs = []
    if {"fagen", "fagen_paged"} & set(config.decode_systems):
        from fagen.spec import Spec

        pages = {"fagen": None, "fagen_paged": config.page_size}
        kwargs += [spec_kwargs(Spec.for_kv_cache(config.head_dim, config.dtype, causal=False,
                                                 page_size=pages[name]))
                   for name in ("fagen", "fagen_paged") if name in config.decode_systems]
    base = {"head_dim": config.head_dim, "dtype": config.dtype, "version": 2, "mask": "causal"}
    if "fagen_varlen" in config.varlen_systems:
        kwargs.append({**base, "varlen": True})
    if "fagen_padded" in config.varlen_systems:   # plain causal (decode.FagenPadded)
        kwargs.append(base)
    return kwargs


def models_kernel_kwargs(plan: Plan) -> list[dict]:
    """Spec arguments of the models section's fagen kernels. The transformers integration calls
    flash_attn_func(causal=True) when nothing is padded (the training step; GQA needs no field of
    its own) and flash_attn_varlen_func(causal=True) on the unpadded rows of a padded batch
    (generate's prefill and every decoding step: bottom-right causal, the same kernel)."""
    config = plan.models
    base = {"head_dim": config.head_dim, "dtype": config.dtype, "version": 2, "mask": "causal"}
    kwargs = []
    if "fagen" in config.train_systems:
        kwargs.append(base)
    if "fagen" in config.decode_systems:
        kwargs.append({**base, "varlen": True})
    return kwargs


def spec_name(kwargs: dict) -> str:
    from fagen.spec import Spec

    return Spec(**kwargs).name


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


TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "bwd_stages", "bwd_block_n")


def resolved_spec(kwargs: dict, device_arch: str | None = None):
    """The Spec of `kwargs`; with `device_arch`, the one a call on such a GPU runs when no
    tuning is cached (the fallback table's tiles for that arch), unless `kwargs` set tiles."""
    from fagen.spec import Spec

    spec = Spec(**kwargs)
    if device_arch is None or any(kwargs.get(f) is not None for f in TILE_FIELDS):
        return spec
    from fagen.tuning.fallback import fallback_spec

    return fallback_spec(spec, device_arch)


def compile_variant(kwargs: dict, arch: str, use_cache: bool = True, device_arch: str | None = None) -> dict:
    """Render and NVRTC-compile one variant for `arch` (through fagen's cache unless
    `use_cache` is False); a summary. With `device_arch`, the Spec takes that GPU's
    fallback tiles first (`resolved_spec`)."""
    from fagen.codegen import render
    from fagen.compiler import compile_source

    spec = resolved_spec(kwargs, device_arch)
    start = time.perf_counter()
    compiled = compile_source(render(spec), arch, use_cache=use_cache)
    resources = {name: {"registers": r.registers, "spill_bytes": r.spill_bytes,
                        "static_shared_bytes": r.static_shared_bytes}
                 for name, r in compiled.resources.items()}
    return {"name": spec.name, "arch": arch, "cache": compiled.cache,
            "seconds": time.perf_counter() - start, "resources": resources}


def precompile(plan: Plan, arch: str, timeout_s: float, workers: int | None = None,
               include_tests: bool = True) -> dict:
    """Compile every variant for the GPU of capability `arch` (its NVRTC target, its
    fallback tiles) within `timeout_s`; unfinished ones compile on first use instead
    (noted, not an error)."""
    from fagen.compiler import nvrtc_target

    # The sweep's and the variants section's kernels run through flash_attn_func, so they
    # get this GPU's fallback tiles; the gpu tests' extra variants are mostly explicit Specs
    # (default tiles), compiled as given.
    try:
        cases, case_error = variant_case_kwargs(plan), ""
    except Exception as exc:  # noqa: BLE001 - the variants section will meet (and report) it again
        cases, case_error = [], f"the variants section's kernels: {type(exc).__name__}: {_first_lines(exc, 2)}"
    try:
        decode, decode_error = decode_kernel_kwargs(plan), ""
    except Exception as exc:  # noqa: BLE001 - the decode section will meet (and report) it again
        decode, decode_error = [], f"the decode section's kernels: {type(exc).__name__}: {_first_lines(exc, 2)}"
    jobs = []
    for kw in variant_kwargs(plan) + cases + decode + models_kernel_kwargs(plan):
        if kw not in [job for job, _ in jobs]:
            jobs.append((kw, arch))
    jobs += [(kw, None) for kw in (test_variant_kwargs() if include_tests else [])]
    target = nvrtc_target(arch)
    workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1, len(jobs)))
    section: dict = {"arch": arch, "target": target, "workers": workers, "variants": {}, "status": "ok",
                     "note": ""}
    if case_error or decode_error:
        section["status"], section["note"] = "partial", "; ".join(filter(None, [case_error, decode_error]))
    if not jobs:
        section["note"] = "no fagen system in the plan"
        return section
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {pool.submit(compile_variant, kw, target, True, tiles_for): kw for kw, tiles_for in jobs}
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
        section["note"] = "; ".join(filter(None, [section["note"], f"{len(errors)} of {len(jobs)} variants did "
                                                  "not compile: " + ", ".join(errors[:6])]))
    return section


def _key(kw: dict) -> str:
    flags = "".join(f" {flag}" for flag in ("dropout", "deterministic", "window", "softcap", "alibi", "sinks",
                                            "key_padding", "varlen") if kw.get(flag))
    flags += f" {kw['kv_cache']} cache" if kw.get("kv_cache") else ""
    flags += "".join(f" {prefix}{kw[field].digest}" for field, prefix in (("score_mod", "smod"), ("mask_mod", "mmod"))
                     if kw.get(field) is not None)
    return f"v{kw.get('version', 2)} {kw['dtype']} d{kw['head_dim']} {kw.get('mask', 'none')}{flags}"


def _first_lines(exc: BaseException, lines: int = 6) -> str:
    text = str(exc).strip().splitlines()
    return " | ".join(text[:lines])[:600]
