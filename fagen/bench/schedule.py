"""The time guard's arithmetic: what each section may take, what is kept back for it, and the
forecast replayed under the guard.

Every section but the speed sweep has a cap: the most it may take, and so the time each earlier
section keeps back for it (its reserve). The sweep has a floor instead (`min_speed_s`, kept back
for it like a cap) and takes whatever the sections before it leave: it is the elastic one.
A section's deadline is min(its start + its cap, the budget's end - the reserves of every later
section) (`deadline_s`, as `timing.Budget.deadline` computes it for the run). So when the
reserves add up to at most the budget (`fits`), every section gets its whole cap as long as the
ones before it kept to theirs (setup and peak, which run unguarded, included), and the run ends
inside the budget. tests/test_gpu_check_plan.py replays the forecast with a fake clock through
the run's own deadlines.

Pure arithmetic on a Plan (no torch, no clock), so --dry-run and CPU tests use the same numbers
as the run on the GPU.
"""

from __future__ import annotations

from .plan import GPU_TEST_KERNELS, SECTIONS

# Sections with no deadline of their own: setup runs before the first deadline is asked for,
# peak is a fixed pair of measurements, report writes files after the last section.
UNGUARDED = ("setup", "peak", "report")
# The GPU machine's cores, less one for the parent (precompile's compile workers).
GPU_MACHINE_WORKERS = 15


def caps(plan, *, sanitizers: bool, skip=()) -> dict[str, float]:
    """Seconds each section may take (the speed sweep: its floor), in section order; a section
    that will not run (skipped, or empty in this plan) gets 0. `sanitizers`: compute-sanitizer
    was found, so its two runs (memcheck, racecheck) are kept time for."""
    enabled = {"sanitizers": sanitizers, "variants": bool(plan.variants.cases), "decode": plan.decode.enabled,
               "models": plan.models.enabled, "ring": plan.ring.enabled}
    full = {"setup": plan.setup_reserve_s, "precompile": plan.precompile_cap_s, "peak": plan.peak_reserve_s,
            "correctness": plan.correctness_cap_s, "sanitizers": 2 * plan.sanitizer_cap_s,
            "speed": plan.min_speed_s, "variants": plan.variants.cap_s, "decode": plan.decode.cap_s,
            "models": plan.models.cap_s, "ring": plan.ring.cap_s, "memory": plan.memory_cap_s,
            "report": plan.report_reserve_s}
    return {name: 0.0 if name in skip or not enabled.get(name, True) else full[name] for name in SECTIONS}


def reserve_after(section: str, section_caps: dict[str, float]) -> float:
    """The time kept back, while `section` runs, for the sections after it."""
    later = SECTIONS[SECTIONS.index(section) + 1:]
    return sum(section_caps[name] for name in later)


def deadline_s(section: str, start_s: float, budget_s: float, section_caps: dict[str, float]) -> float:
    """Seconds `section` may run from `start_s` (seconds into the budget): its cap (none for the
    speed sweep), and never into the time kept back for the sections after it."""
    end = budget_s - reserve_after(section, section_caps)
    if section != "speed":
        end = min(end, start_s + section_caps[section])
    return end - start_s


def forecast(plan, *, sanitizers: bool) -> dict[str, float]:
    """What each section would take with no guard (a rough forecast; each within its cap but the
    sweep's). Speed: about 0.12 s per measurement (warm-up, 3-20 repeats of up to ~30 ms,
    synchronisation), plus FlexAttention's compiles (about 20 s per panel, within its allowance).
    Precompile: about 6 s to spawn the recorder and record the calls' kernels, then 1.5 s per
    NVRTC compile on each of the GPU machine's workers."""
    flex_panels = len(plan.configs()) if "flex" in plan.systems else 0
    kernels = (plan.fagen_variants() + plan.variant_kernels() + plan.decode_kernels() + plan.models_kernels()
               + GPU_TEST_KERNELS)
    return {
        "setup": plan.setup_reserve_s,
        "precompile": min(plan.precompile_cap_s, 6.0 + 1.5 * kernels / GPU_MACHINE_WORKERS),
        "peak": plan.peak_reserve_s,
        "correctness": min(plan.correctness_cap_s, 60.0),
        "sanitizers": 2 * plan.sanitizer_cap_s * 0.7 if sanitizers else 0.0,
        "speed": 0.12 * plan.timed_runs() + min(plan.flex_allowance_s, 20.0 * flex_panels),
        "variants": plan.variants.estimate_seconds(),
        "decode": plan.decode.estimate_seconds(),
        "models": plan.models.estimate_seconds(),
        "ring": plan.ring.estimate_seconds(),
        "memory": min(plan.memory_cap_s, 3.0 * len(plan.memory.seqlens) * len(plan.memory.systems)),
        "report": 5.0,
    }


def replay(plan, *, sanitizers: bool, skip=()) -> dict[str, float]:
    """The forecast as the guard lets it run: each section from where the one before it ended,
    for min(its forecast, its deadline there). Keys: the sections, "total", and "speed_forecast"
    (the sweep's unguarded forecast, which its deadline may cut)."""
    section_caps = caps(plan, sanitizers=sanitizers, skip=skip)
    wanted = forecast(plan, sanitizers=sanitizers)
    taken, now = {}, 0.0
    for name in SECTIONS:
        seconds = 0.0 if name in skip else wanted[name]
        if name not in UNGUARDED:
            seconds = max(0.0, min(seconds, deadline_s(name, now, plan.budget_s, section_caps)))
        taken[name] = seconds
        now += seconds
    taken["total"] = now
    taken["speed_forecast"] = wanted["speed"]
    return taken


def fits(plan, *, sanitizers: bool = True) -> str | None:
    """None when the reserves add up to at most the budget; else why not."""
    total = sum(caps(plan, sanitizers=sanitizers).values())
    if total <= plan.budget_s:
        return None
    return (f"the sections' reserves add up to {total:.0f} s, over the {plan.budget_s:.0f} s budget: the first "
            "sections' deadlines would fall before their caps")


def estimate_line(plan, *, sanitizer_found: bool) -> str:
    """The dry run's last word on time: the replayed total with and without the sanitizer's
    runs, against the budget."""
    with_runs = replay(plan, sanitizers=True)["total"]
    without = replay(plan, sanitizers=False)["total"]
    here = "found here" if sanitizer_found else "not found here"
    return (f"estimated {with_runs:.0f} s with compute-sanitizer's two runs ({here}), {without:.0f} s without, "
            f"of a {plan.budget_s:.0f} s budget")
