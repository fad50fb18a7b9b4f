"""`python -m fagen.bench gpu-check --dry-run`: the plan, and on any machine (no GPU) every check
that can be made before a GPU is lent.

It prints the versions found (python, torch, CuPy, cuda-bindings, NVRTC, transformers: the GPU
machine runs the check under its own python3 and packages), the plan with its reserves and its
forecast, then checks that what the run needs imports, that the reserves fit the budget, that
NVRTC compiles the kernels precompile will build for an H200 (recorded from the sections' and the
gpu tests' own calls), that the self-test step has a case for every template of both families,
each loading kernels of its family there (recorded as the self-test's child records them; the
last sm90 one compiled for sm_90a), that fagen.distributed gives the ring's chunk pairs, and that
transformers builds the models section's Llama (on the meta device) with the parameters the plan
counts. Its last line is the time estimate against the budget, with and without
compute-sanitizer's runs.
"""

from __future__ import annotations

import importlib
import platform
import sys
from pathlib import Path
from typing import Callable

from ..arch_families import SM90
from .correctness import child_env, find_compute_sanitizer, run_capped
from .plan import Plan
from .plan_text import describe
from .schedule import caps, estimate_line, fits
from .versions import found_versions, versions_line

REPO_ROOT = Path(__file__).resolve().parents[2]
DRY_RUN_ARCH = "sm_90"   # the H200's: the tiles a call there looks up


class _Checks:
    """Runs named checks, printing each as it ends; required ones decide the exit status."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.missing = log, []

    def __call__(self, name: str, required: bool, fn: Callable[[], str]) -> None:
        try:
            detail, ok = fn() or "", True
        except Exception as exc:  # noqa: BLE001 - the point is to list what fails
            detail, ok = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}", False
        if required and not ok:
            self.missing.append(name)
        mark = "ok" if ok else ("MISSING" if required else "absent")
        self.log(f"  [{mark:>7}] {name}: {detail}")


def dry_run(plan: Plan, *, log: Callable[[str], None] = print, collect_tests: bool = True) -> int:
    """Print the versions, the plan and the checks; 0 when every required piece is here."""
    log("versions found: " + versions_line(found_versions()))
    log(describe(plan))
    log("")
    log("checks (required pieces first):")
    check = _Checks(log)
    _required_checks(check, plan)
    _optional_checks(check, plan, collect_tests)
    log("")
    if check.missing:
        log("dry run: MISSING required pieces: " + ", ".join(check.missing))
        return 1
    log("dry run: ok, everything the GPU check needs is here ("
        + estimate_line(plan, sanitizer_found=find_compute_sanitizer() is not None) + ")")
    return 0


def _required_checks(check: _Checks, plan: Plan) -> None:
    check("python >= 3.10", True, _python_version)
    check("torch", True, _torch)
    for name in ("numpy", "jinja2", "sympy"):
        check(name, True, _module(name))
    for name in ("fagen", "fagen.spec", "fagen.kernels.render", "fagen.kernels.compile", "fagen.kernels.launch", "fagen.ops",
                 "fagen.reference"):
        check(name, True, _module(name))
    check("the sections' reserves fit the budget (with compute-sanitizer's runs)", True, lambda: _fits(plan))
    check("fagen flash_attn_func", True, _attention_func)
    check("fagen flash_attn_with_kvcache and flash_attn_varlen_func", True, _decode_functions)
    check("NVRTC (cuda.bindings)", True, _nvrtc)
    recorded = {}
    check(f"precompile's kernels for {DRY_RUN_ARCH} (recorded from the calls)", True,
          lambda: _record(plan, recorded))
    for title, prefix in (("the speed sweep's", "speed "), ("the speed sweep's sm90 family (sm_90a)", "speed fagen_sm90"),
                          ("the variants section's", "variants "),
                          ("the variants section's sm90 family (sm_90a)", "variants fagen_sm90"),
                          ("the decode section's", "decode "),
                          ("the decode section's sm90 family (sm_90a)", "decode fagen_sm90"),
                          ("the models section's", "models "),
                          ("the ring section's", "ring")):
        check(f"{title} fagen kernels compile for {DRY_RUN_ARCH}", True, lambda p=prefix: _compile_last(recorded, p))
    selftest = {}
    check(f"the self-test's cases for {DRY_RUN_ARCH} (recorded as its child records them)", True,
          lambda: _selftest_cases(selftest))
    check(f"the self-test's last sm90 kernel compiles for {DRY_RUN_ARCH}", True, lambda: _selftest_compile(selftest))
    check("fagen.distributed and the ring section's chunk pairs (step_blocks)", True, lambda: _ring_pieces(plan))


def _optional_checks(check: _Checks, plan: Plan, collect_tests: bool) -> None:
    # The models section skips itself without transformers (the `test` extra installs it).
    check("transformers and the models section's Llama (models section)", False, lambda: _models_pieces(plan))
    check("cupy (launches fagen on the GPU)", False, _module("cupy"))
    check("matplotlib (plots)", False, _module("matplotlib"))
    check("pytest (correctness section)", False, _module("pytest"))
    check("pytest-timeout (per-test cap)", False, _module("pytest_timeout"))
    check("torch.nn.attention.sdpa_kernel (SDPA peers)", False,
          lambda: str(importlib.import_module("torch.nn.attention").sdpa_kernel.__name__))
    check("FlexAttention", False, lambda: importlib.import_module(
        "torch.nn.attention.flex_attention").flex_attention.__name__)
    check("triton (torch.compile for Flex)", False, _module("triton"))
    check("compute-sanitizer", False, _sanitizer)
    if collect_tests:
        check("gpu tests collected", False, _collect_gpu_tests)


def _module(name):
    return lambda: f"{getattr(importlib.import_module(name), '__version__', 'imported')}"


def _python_version() -> str:
    if sys.version_info < (3, 10):
        raise RuntimeError(f"{platform.python_version()} is too old")
    return platform.python_version()


def _torch() -> str:
    import torch

    gpu = "CUDA GPU visible" if torch.cuda.is_available() else "no GPU here (fine for a dry run)"
    return f"{torch.__version__}, {gpu}"


def _fits(plan: Plan) -> str:
    problem = fits(plan, sanitizers=True)
    if problem:
        raise ValueError(problem)
    return f"{sum(caps(plan, sanitizers=True).values()):.0f} s of {plan.budget_s:.0f} s"


def _attention_func() -> str:
    from .peers import fagen_attention_func

    func = fagen_attention_func()
    return f"{func.__module__}.{func.__name__}"


def _decode_functions() -> str:
    from .decode.step import fagen_decode_functions

    return ", ".join(f"{f.__module__}.{f.__name__}" for f in fagen_decode_functions())


def _nvrtc() -> str:
    from fagen.kernels.compile import cuda_header_dir, nvrtc_version

    return f"NVRTC {nvrtc_version()}, headers {cuda_header_dir()}"


def _record(plan: Plan, into: dict) -> str:
    """Record the kernels in this process (nothing here launches a kernel afterwards)."""
    from .kernel_calls import gpu_test_calls, section_calls
    from ..kernel_record import identity_for, record

    identity = identity_for(DRY_RUN_ARCH)
    sections, tests = record(section_calls(plan), identity), record(gpu_test_calls(), identity)
    into["sections"] = sections
    errors = sections.errors + tests.errors
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    together = set(sections.names) | set(tests.names)
    return f"{len(together)} kernels: {len(sections.specs)} for the sections, {len(tests.specs)} for the gpu tests"


def _compile_last(recorded: dict, prefix: str) -> str:
    """The names of one section's kernels; the last of them compiled for the H200's arch."""
    from .precompile import compile_spec

    if "sections" not in recorded:
        raise RuntimeError("no kernels recorded (see above)")
    names = recorded["sections"].names_of(prefix)
    if not names:
        return "none in this plan (or the section skips itself here)"
    spec = next(s for s in recorded["sections"].specs if s.name == names[-1])
    info = compile_spec(spec, DRY_RUN_ARCH, use_cache=False)
    registers = max(v["registers"] for v in info["resources"].values())
    spilled = sum(v["spill_bytes"] for v in info["resources"].values())
    return (f"{', '.join(names)}; {info['name']} compiles in {info['seconds']:.2f} s ({len(info['resources'])} "
            f"kernels, at most {registers} registers, {spilled} B spilled)")


def _selftest_cases(into: dict) -> str:
    """Every template of both families has a case, and each case's calls load kernels of its
    family for the H200 (the child's own recording, so the step finds no missing case there)."""
    from fagen.selftest_cases.cases import CASES
    from fagen.selftest_cases.child import record_cases

    from ..kernel_record import identity_for
    from .selftest_step import HOPPER_FAMILIES, expected_templates

    templates = expected_templates(HOPPER_FAMILIES)
    missing = [t for t in templates if t not in CASES]
    if missing:
        raise ValueError(f"no case for the templates {', '.join(missing)}")
    recorded = record_cases([CASES[t] for t in templates], identity_for(DRY_RUN_ARCH))
    if recorded.errors:
        raise RuntimeError("; ".join(recorded.errors[:3]))
    family = {spec.name: spec.arch_family for spec in recorded.specs}
    strays = [t for t in templates if CASES[t].family not in {family[n] for n in recorded.by_call.get(t, [])}]
    if strays:
        raise ValueError(f"the cases of {', '.join(strays)} load no kernel of their family")
    into["recorded"] = recorded
    counts = {f: sum(1 for s in recorded.specs if s.arch_family == f) for f in HOPPER_FAMILIES}
    return (f"{len(templates)} templates, each case loading kernels of its family: "
            + ", ".join(f"{f} {n} kernels" for f, n in counts.items()))


def _selftest_compile(recorded: dict) -> str:
    from .precompile import compile_spec

    if "recorded" not in recorded:
        raise RuntimeError("no kernels recorded (see above)")
    spec = [s for s in recorded["recorded"].specs if s.arch_family == SM90.name][-1]
    info = compile_spec(spec, DRY_RUN_ARCH, use_cache=False)
    spilled = sum(v["spill_bytes"] for v in info["resources"].values())
    return (f"{info['name']} for {info['arch']} in {info['seconds']:.2f} s ({len(info['resources'])} kernels, "
            f"{spilled} B spilled)")


def _ring_pieces(plan: Plan) -> str:
    from .ring.run import check_pair_counts

    _module("fagen.distributed")()
    return check_pair_counts(plan.ring) if plan.ring.enabled else "no ring section in this plan"


def _models_pieces(plan: Plan) -> str:
    import torch

    from .models.markdown import model_label
    from .models.run import build_model, import_transformers

    version = import_transformers()
    # The plan's model on the meta device: its architecture, without memory or weights.
    model = build_model(plan.models, "meta", torch.bfloat16, implementation="fagen")
    count = sum(p.numel() for p in model.parameters())
    if count != plan.models.parameter_count():
        raise ValueError(f"the model has {count:,} parameters, the plan counts {plan.models.parameter_count():,}")
    return (f"transformers {version}, attn_implementation 'fagen' registered; {model_label(plan.models)}: "
            f"{count:,} parameters (as counted)")


def _sanitizer() -> str:
    path = find_compute_sanitizer()
    if path is None:
        raise FileNotFoundError("not found; the sanitizer section will be skipped")
    return path


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
