"""The plan as text: what --dry-run prints and results.json records (`describe`).

Torch-free like plan.py: each section writes its own lines (its `plan_lines`), and this module
puts them in the sections' order, with the reserves and the forecast replayed under the guard.
"""

from __future__ import annotations

from . import correctness, memory, precompile, selftest_step
from .decode import markdown as decode_md
from .models import markdown as models_md
from .plan import SECTIONS
from .ring import markdown as ring
from .schedule import caps, fits, replay
from .speed import markdown as speed_md
from .variants import markdown as variants_md


def describe(plan) -> str:
    """The plan as text: what --dry-run prints and results.json records."""
    lines = [f"plan {plan.name!r}: budget {plan.budget_s:.0f} s (time guard per section)"]
    lines.append("sections, in order: " + ", ".join(SECTIONS))
    lines += precompile.plan_lines(plan)
    lines += selftest_step.plan_lines(plan)
    lines += correctness.plan_lines(plan)
    lines += speed_md.plan_lines(plan, precompile.GPU_TEST_KERNELS)
    lines += variants_md.plan_lines(plan.variants)
    lines += decode_md.plan_lines(plan.decode, plan.decode_kernels())
    lines += models_md.plan_lines(plan.models, plan.models_kernels())
    lines += ring.plan_lines(plan.ring)
    lines += memory.plan_lines(plan.memory)
    lines.append("  output: results.json, results.md, speed_fwd.png, speed_bwd.png, "
                 "speed_fwd_bwd.png, memory.png")
    lines += estimate_lines(plan)
    return "\n".join(lines)


def estimate_lines(plan) -> list[str]:
    """The reserves and the forecast replayed under the guard (schedule.replay), with the
    sanitizer's runs (the longer case): seconds per section and the total."""
    reserved = caps(plan, sanitizers=True)
    lines = ["reserved seconds (each section's cap; the sweep's floor): "
             + ", ".join(f"{k} {v:.0f}" for k, v in reserved.items()) + f"; sum {sum(reserved.values()):.0f}"]
    problem = fits(plan)
    if problem:
        lines.append(f"  {problem}")
    estimate = replay(plan, sanitizers=True)
    shown = {k: v for k, v in estimate.items() if k != "speed_forecast"}
    lines.append("estimated seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in shown.items()))
    cut = estimate["speed_forecast"] - estimate["speed"]
    if cut > 0.5:
        last = plan.configs()[-1].label if plan.configs() else "-"
        lines.append(f"  the speed sweep's forecast is {estimate['speed_forecast']:.0f} s; its time guard gives it "
                     f"{estimate['speed']:.0f} s here, dropping its last points (from the {last} panel back)")
    return lines
