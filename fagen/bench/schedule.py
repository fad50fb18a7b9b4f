"""The time guard's arithmetic: what each section may take, what is kept back for it, and the
forecast replayed under the guard.

Every section but the speed sweep has a cap: the most it may take, and so the time each earlier
section keeps back for it (its reserve). The sweep has a floor instead (`min_speed_s`, kept back
for it like a cap) and takes whatever the sections before it leave: it is the elastic one.
A section's deadline is min(its start + its cap, the budget's end - the reserves of every later
section) (`deadline_s`, as `timing.Budget.deadline` computes it for the run). So when the
reserves add up to at most the budget (`fits`), every section gets its whole cap as long as the
ones before it kept to theirs (setup and peak, which run unguarded, included), and the run ends
inside the budget. tests/bench/test_gpu_check_plan.py replays the forecast with a fake clock through
the run's own deadlines.

Pure arithmetic on a Plan (no torch, no clock), so --dry-run and CPU tests use the same numbers
as the run on the GPU.
"""

from __future__ import annotations

from . import correctness, precompile, selftest_step
from .plan import SECTIONS
from .speed import config as speed_config

# Sections with no deadline of their own: setup runs before the first deadline is asked for,
# peak is a fixed pair of measurements, report writes files after the last section.
UNGUARDED = ("setup", "peak", "report")


def caps(plan, *, sanitizers: bool, skip=()) -> dict[str, float]:
    """Seconds each section may take (the speed sweep: its floor), in section order; a section
    that will not run (skipped, or empty in this plan) gets 0. `sanitizers`: compute-sanitizer
    was found, so its two runs (memcheck, racecheck) are kept time for."""
    enabled = {"sanitizers": sanitizers, "variants": bool(plan.variants.cases), "decode": plan.decode.enabled,
               "models": plan.models.enabled, "ring": plan.ring.enabled}
    full = {"setup": plan.setup_reserve_s, "precompile": plan.precompile_cap_s, "peak": plan.peak_reserve_s,
            "selftest": plan.selftest_cap_s, "correctness": plan.correctness_cap_s, "sanitizers": 2 * plan.sanitizer_cap_s,
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
    sweep's): each section's own estimate, from its config."""
    return {
        "setup": plan.setup_reserve_s,
        "precompile": precompile.estimate_seconds(plan),
        "peak": plan.peak_reserve_s,
        "selftest": selftest_step.estimate_seconds(plan),
        "correctness": correctness.correctness_estimate(plan),
        "sanitizers": correctness.sanitizers_estimate(plan, sanitizers=sanitizers),
        "speed": speed_config.estimate_seconds(plan),
        "variants": plan.variants.estimate_seconds(),
        "decode": plan.decode.estimate_seconds(),
        "models": plan.models.estimate_seconds(),
        "ring": plan.ring.estimate_seconds(),
        "memory": plan.memory.estimate_seconds(plan.memory_cap_s),
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
