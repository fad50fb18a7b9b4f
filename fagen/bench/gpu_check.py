"""The GPU check: every section in order under one budget, and --dry-run.

Sections run in the order of `plan.SECTIONS`. Each gets a deadline from the
budget that keeps back time for the sections after it (the time guard), and
results.json is rewritten after every section (and after every panel of the
speed sweep), so a run killed from outside still leaves what it measured.

Exit status: 0 when every section ran and the gpu tests passed (peers that
are not available are notes, not failures); 1 when a gpu test failed or a
section raised; 2 when no CUDA GPU is visible.
"""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from . import report
from .correctness import find_compute_sanitizer, run_capped, run_gpu_tests, run_sanitizers, child_env
from .plan import OPTIONAL_SECTIONS, SECTIONS, Plan
from .timing import Budget

REPO_ROOT = Path(__file__).resolve().parents[2]
DRY_RUN_VARIANT = {"head_dim": 128, "dtype": "bf16", "version": 2, "mask": "causal"}


def _versions() -> dict:
    """Versions of what the run depends on (each optional)."""
    found = {"python": platform.python_version()}
    for module in ("torch", "cupy", "triton", "numpy", "matplotlib", "fagen"):
        try:
            found[module] = getattr(importlib.import_module(module), "__version__", "?")
        except Exception:  # noqa: BLE001 - absent is a fact to record
            found[module] = None
    try:
        from fagen.compiler import nvrtc_version

        found["nvrtc"] = nvrtc_version()
    except Exception:  # noqa: BLE001
        found["nvrtc"] = None
    return found


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
    from fagen.compiler import describe_target, nvrtc_target, nvrtc_version
    from fagen.tuning.device import driver_version

    target = nvrtc_target(capability)
    return {"driver": driver_version(), "nvrtc": nvrtc_version(), "nvrtc_target": target,
            "nvrtc_target_note": describe_target(capability, target)}


def toolchain_line(meta: dict) -> str:
    return (f"driver {meta.get('driver')}, CUDA runtime {meta.get('cuda')}, NVRTC {meta.get('nvrtc')}, "
            f"target {meta.get('nvrtc_target_note', meta.get('nvrtc_target'))}")


class _Run:
    """The state of one GPU check: results, budget, and writing as it goes."""

    def __init__(self, plan: Plan, out_dir: Path, skip: set[str], log: Callable[[str], None]):
        self.plan, self.out_dir, self.skip, self.log = plan, Path(out_dir), skip, log
        self.budget = Budget(plan.budget_s)
        self.results: dict = {
            "meta": {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                     "commit": _git_commit(), "plan": plan.name},
            "plan": plan.to_dict(), "plan_text": plan.describe(), "sections": {}}

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = round(self.budget.elapsed(), 1)
        report.write_json(self.results, self.out_dir)

    def section(self, name: str, fn: Callable[[], object]):
        if name in self.skip:
            self.results["sections"][name] = {"status": "skipped", "seconds": 0.0, "note": "--skip"}
            return None
        self.log(f"== {name} (at {self.budget.elapsed():.0f} s, {self.budget.remaining():.0f} s left)")
        start = time.monotonic()
        try:
            value = fn()
            info = value if isinstance(value, dict) else {}
            status, note = info.get("status", "ok"), info.get("note", "")
        except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others
            value, status = None, "error"
            note = f"{type(exc).__name__}: {exc}"
            self.log(traceback.format_exc(limit=6))
        self.results["sections"][name] = {"status": status, "seconds": round(time.monotonic() - start, 1),
                                          "note": str(note)[:500]}
        self.log(f"   {name}: {status}" + (f" ({note})" if note else ""))
        self.save()
        return value

    def needs(self) -> dict[str, float]:
        """Seconds each section may take, as kept back for it by earlier ones."""
        sanitizers = 0.0
        if find_compute_sanitizer() is not None:
            sanitizers = 2 * self.plan.sanitizer_cap_s
        variants = self.plan.variants.cap_s if self.plan.variants.cases else 0.0
        decode = self.plan.decode.cap_s if self.plan.decode.enabled else 0.0
        models = self.plan.models.cap_s if self.plan.models.enabled else 0.0
        ring = self.plan.ring.cap_s if self.plan.ring.enabled else 0.0
        needs = {"precompile": 0.0, "peak": 5.0, "correctness": self.plan.correctness_cap_s,
                 "sanitizers": sanitizers, "speed": self.plan.min_speed_s, "variants": variants,
                 "decode": decode, "models": models, "ring": ring, "memory": self.plan.memory_cap_s,
                 "report": self.plan.report_reserve_s}
        return {name: (0.0 if name in self.skip else need) for name, need in needs.items()}

    def deadline(self, section: str, cap_s: float | None = None):
        """The time guard: `section` may run until `cap_s` from now, and never
        into the time kept back for the sections after it."""
        later = SECTIONS[SECTIONS.index(section) + 1:]
        reserve = sum(need for name, need in self.needs().items() if name in later)
        return self.budget.deadline(reserve_s=reserve, cap_s=cap_s)


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
        return _run_sections(run)
    except (Stopped, KeyboardInterrupt) as exc:
        run.results["stopped"] = f"stopped from outside ({exc or 'interrupt'}) after {run.budget.elapsed():.0f} s"
        log(f"\n== {run.results['stopped']}; writing what was measured")
        _finish(run)
        return 124
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


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
    log(plan.describe())

    def setup():
        import torch

        results["meta"].update(_versions())
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

        deadline = run.deadline("precompile", cap_s=plan.precompile_cap_s)
        return precompile(plan, results["meta"]["capability"], deadline.remaining())

    results["precompile"] = run.section("precompile", precompile_section)

    def peak_section():
        from .timing import measure_copy_bandwidth, measure_matmul_peak

        peak = {"matmul": measure_matmul_peak(), "copy": measure_copy_bandwidth()}
        return {**peak, "note": f"{peak['matmul']['tflops']:.0f} TFLOP/s, {peak['copy']['tb_per_s']:.2f} TB/s"}

    results["peak"] = run.section("peak", peak_section)

    def correctness_section():
        deadline = run.deadline("correctness", cap_s=plan.correctness_cap_s)
        outcome = run_gpu_tests(REPO_ROOT, deadline.remaining())
        outcome["note"] = outcome["summary"]
        log("   " + outcome["summary"])
        return outcome

    results["correctness"] = run.section("correctness", correctness_section)

    def sanitizer_section():
        return run_sanitizers(REPO_ROOT, timeout_s=plan.sanitizer_cap_s,
                              deadline=run.deadline("sanitizers"))

    results["sanitizers"] = run.section("sanitizers", sanitizer_section)

    from .peers import make_system

    systems = {name: make_system(name) for name in dict.fromkeys(plan.systems + plan.memory.systems)}

    def checkpointed(name: str):
        """A section's checkpoint: its partial results saved to results.json as they grow."""
        def checkpoint(partial):
            results[name] = partial
            run.save()
        return checkpoint

    def speed_section():
        from .sweep import run_speed_sweep

        return run_speed_sweep(plan, [systems[n] for n in plan.systems], run.deadline("speed"), log=log,
                               checkpoint=checkpointed("speed"))

    results["speed"] = run.section("speed", speed_section)

    def variants_section():
        from .variants import run_variant_sweep

        return run_variant_sweep(plan, run.deadline("variants", cap_s=plan.variants.cap_s), log=log,
                                 checkpoint=checkpointed("variants"))

    results["variants"] = run.section("variants", variants_section)

    def decode_section():
        from .decode import run_decode_section

        copy = ((results.get("peak") or {}).get("copy") or {}).get("tb_per_s")
        return run_decode_section(plan, run.deadline("decode", cap_s=plan.decode.cap_s), log=log,
                                  checkpoint=checkpointed("decode"), copy_tb_per_s=copy)

    results["decode"] = run.section("decode", decode_section)

    def models_section():
        from .models import run_models_section

        return run_models_section(plan, run.deadline("models", cap_s=plan.models.cap_s), log=log,
                                  checkpoint=checkpointed("models"))

    results["models"] = run.section("models", models_section)

    def ring_section():
        from .ring import run_ring_section

        return run_ring_section(plan, run.deadline("ring", cap_s=plan.ring.cap_s), log=log)

    results["ring"] = run.section("ring", ring_section)

    def memory_section():
        from .memory import run_memory_sweep

        return run_memory_sweep(plan, systems, run.deadline("memory", cap_s=plan.memory_cap_s), log=log)

    results["memory"] = run.section("memory", memory_section)

    results["sections"]["report"] = {"status": "ok", "seconds": 0.0,
                                     "note": f"written to {run.out_dir} at {budget.elapsed():.0f} s"}
    _finish(run)
    correctness = results.get("correctness") or {}
    failed = correctness.get("status") in ("failed", "timed out") or results["sections"].get("ring", {}).get(
        "status") == "failed"   # the world-1 ring differs from the plain op
    broken = any(info["status"] == "error" for info in results["sections"].values())
    return 1 if failed or broken else 0


# -- dry run ---------------------------------------------------------------------------

def dry_run(plan: Plan, *, log: Callable[[str], None] = print, collect_tests: bool = True) -> int:
    """Print the plan and check, on any machine, that everything the GPU run
    needs imports, that NVRTC compiles a fagen variant for sm_90, that the variants
    section's mods trace into the kernels the precompile section will build, that fagen.distributed
    gives the ring section's chunk pairs, that one
    of the decode section's kernels renders and compiles, and that transformers builds the
    models section's Llama (on the meta device) with the parameters the plan counts."""
    log(plan.describe())
    log("")
    log("checks (required pieces first):")
    checks: list[tuple[str, bool, bool, str]] = []

    def check(name: str, required: bool, fn: Callable[[], str]) -> None:
        try:
            detail, ok = fn() or "", True
        except Exception as exc:  # noqa: BLE001 - the point is to list what fails
            detail, ok = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}", False
        checks.append((name, required, ok, detail))
        mark = "ok" if ok else ("MISSING" if required else "absent")
        log(f"  [{mark:>7}] {name}: {detail}")

    def module(name):
        return lambda: f"{getattr(importlib.import_module(name), '__version__', 'imported')}"

    def torch_check():
        import torch

        gpu = "CUDA GPU visible" if torch.cuda.is_available() else "no GPU here (fine for a dry run)"
        return f"{torch.__version__}, {gpu}"

    def attention_func():
        from .peers import fagen_attention_func

        func = fagen_attention_func()
        return f"{func.__module__}.{func.__name__}"

    def decode_functions():
        from .decode import fagen_decode_functions

        return ", ".join(f"{f.__module__}.{f.__name__}" for f in fagen_decode_functions())

    def nvrtc():
        from fagen.compiler import cuda_header_dir, nvrtc_version

        return f"NVRTC {nvrtc_version()}, headers {cuda_header_dir()}"

    def compile_one():
        from .precompile import compile_variant

        info = compile_variant(DRY_RUN_VARIANT, "sm_90", use_cache=False)
        regs = ", ".join(f"{k}: {v['registers']} regs, {v['spill_bytes']} B spill"
                         for k, v in info["resources"].items())
        return f"{info['name']} for sm_90 in {info['seconds']:.2f} s ({regs})"

    def variant_kernels():
        from fagen.spec import Spec

        from .precompile import compile_variant, variant_case_kwargs

        kwargs = variant_case_kwargs(plan)
        if not kwargs:
            return "no variants in this plan"
        last = compile_variant(kwargs[-1], "sm_90", use_cache=False)   # a mask_mod's, in the plans
        return (", ".join(Spec(**kw).name for kw in kwargs)
                + f"; {last['name']} compiles for sm_90 in {last['seconds']:.2f} s")

    def decode_kernels():
        from .precompile import compile_variant, decode_kernel_kwargs, spec_name

        kwargs = decode_kernel_kwargs(plan)
        if not kwargs:
            return "no decode section in this plan"
        paged = next((kw for kw in kwargs if kw.get("kv_cache") == "paged"), kwargs[0])
        info = compile_variant(paged, "sm_90", use_cache=False)
        return (", ".join(spec_name(kw) for kw in kwargs)
                + f"; {info['name']} compiles for sm_90 in {info['seconds']:.2f} s")

    def models_kernels():
        from .precompile import compile_variant, models_kernel_kwargs, spec_name

        kwargs = models_kernel_kwargs(plan)
        if not kwargs:
            return "no fagen in this plan's models section"
        info = compile_variant(kwargs[-1], "sm_90", use_cache=False)   # generate's varlen one, in the plans
        return (", ".join(spec_name(kw) for kw in kwargs)
                + f"; {info['name']} compiles for sm_90 in {info['seconds']:.2f} s")

    def models_section_pieces():
        import torch

        from .models import build_model, import_transformers
        from .models_report import model_label

        version = import_transformers()
        # The plan's model on the meta device: its architecture, without memory or weights.
        model = build_model(plan.models, "meta", torch.bfloat16, implementation="fagen")
        count = sum(p.numel() for p in model.parameters())
        if count != plan.models.parameter_count():
            raise ValueError(f"the model has {count:,} parameters, the plan counts {plan.models.parameter_count():,}")
        return f"transformers {version}, attn_implementation 'fagen' registered; {model_label(plan.models)}: " \
               f"{count:,} parameters (as counted)"

    def ring_pieces():
        from .ring import check_pair_counts

        module("fagen.distributed")()
        return check_pair_counts(plan.ring) if plan.ring.enabled else "no ring section in this plan"

    def python_version():
        if sys.version_info < (3, 10):
            raise RuntimeError(f"{platform.python_version()} is too old")
        return platform.python_version()

    def sanitizer():
        path = find_compute_sanitizer()
        if path is None:
            raise FileNotFoundError("not found; the sanitizer section will be skipped")
        return path

    check("python >= 3.10", True, python_version)
    check("torch", True, torch_check)
    for name in ("numpy", "jinja2", "sympy"):
        check(name, True, module(name))
    for name in ("fagen", "fagen.spec", "fagen.codegen", "fagen.compiler", "fagen.launch", "fagen.ops",
                 "fagen.reference"):
        check(name, True, module(name))
    check("fagen flash_attn_func", True, attention_func)
    check("NVRTC (cuda.bindings)", True, nvrtc)
    check("compile one fagen variant", True, compile_one)
    check("variants section's fagen kernels (traced as the calls trace them)", True, variant_kernels)
    check("decode section's fagen kernels (decode step, paged, varlen, padded)", True, decode_kernels)
    check("fagen flash_attn_with_kvcache and flash_attn_varlen_func", True, decode_functions)
    check("models section's fagen kernels (training step, generate's padded batch)", True, models_kernels)
    check("fagen.distributed and the ring section's chunk pairs (step_blocks)", True, ring_pieces)
    # The models section skips itself without transformers (the `test` extra installs it).
    check("transformers and the models section's Llama (models section)", False, models_section_pieces)
    check("cupy (launches fagen on the GPU)", False, module("cupy"))
    check("matplotlib (plots)", False, module("matplotlib"))
    check("pytest (correctness section)", False, module("pytest"))
    check("pytest-timeout (per-test cap)", False, module("pytest_timeout"))
    check("torch.nn.attention.sdpa_kernel (SDPA peers)", False,
          lambda: str(importlib.import_module("torch.nn.attention").sdpa_kernel.__name__))
    check("FlexAttention", False, lambda: importlib.import_module(
        "torch.nn.attention.flex_attention").flex_attention.__name__)
    check("triton (torch.compile for Flex)", False, module("triton"))
    check("compute-sanitizer", False, sanitizer)
    if collect_tests:
        check("gpu tests collected", False, _collect_gpu_tests)
    missing = [name for name, required, ok, _ in checks if required and not ok]
    log("")
    if missing:
        log("dry run: MISSING required pieces: " + ", ".join(missing))
        return 1
    total = plan.estimate_seconds()["total"]
    fit = "of" if total <= plan.budget_s else "against (the time guard keeps the run inside)"
    log("dry run: ok, everything the GPU check needs is here "
        f"(estimated {total:.0f} s {fit} a {plan.budget_s:.0f} s budget)")
    return 0


def _collect_gpu_tests() -> str:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           str(REPO_ROOT / "tests")]
    run = run_capped(cmd, timeout_s=120, env=child_env(REPO_ROOT), cwd=str(REPO_ROOT))
    lines = [line for line in run["output"].splitlines() if "::" in line]
    if run["returncode"] not in (0, 5):
        tail = " | ".join(run["output"].strip().splitlines()[-3:])
        raise RuntimeError(f"collection failed (rc {run['returncode']}): {tail}")
    files = sorted({line.split("::")[0] for line in lines})
    return f"{len(lines)} tests in {', '.join(files) or 'no files'}"


def default_out_dir() -> Path:
    """$OUT when the device tool runs us, else ./gpu-check-results."""
    return Path(os.environ.get("OUT") or "gpu-check-results")


__all__ = ["dry_run", "run_gpu_check", "default_out_dir", "OPTIONAL_SECTIONS"]
