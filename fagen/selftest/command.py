"""`fagen selftest`: run the self-test of this GPU's kernel families now, store the verdicts, and
print a table of them. cli.py registers it with `add_selftest_parser(subparsers)`.

    fagen selftest                    every template of the families this GPU takes
    fagen selftest --verbose          and each template's line, with its failed checks
    fagen selftest --template sm90.mla --template sm90.paged
    fagen selftest --device cpu       on the emulator (slow: each kernel is built for the host)

The verdicts it stores are those the first call would otherwise make (fagen.selftest.gate), so
rerunning it after a failure is how a fixed driver or release is picked up. Exit status 0 when
every template run passed, 1 when one did not, 2 when it cannot run (no GPU).
"""

from __future__ import annotations

import argparse
import sys

from ..arch_families import ARCH_FAMILIES
from .templates import all_templates

DEFAULT_BUDGET_S = 600.0


def add_selftest_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "selftest", help="prove fagen's kernels on this GPU (the first call does it once by itself)",
        description="Run one small case per kernel template of each family this GPU takes (sm80 everywhere, "
                    "sm90 on compute capability 9.0) in a child process under a watchdog, compare each result "
                    "with the float64 oracle by flash-attn's tolerance rule, and store the verdicts that decide "
                    "which family serves each call.")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the emulator; slow) (default cuda)")
    parser.add_argument("--family", choices=ARCH_FAMILIES, action="append",
                        help="only this family (repeatable; default: every family the device takes)")
    parser.add_argument("--template", action="append", help="only this template, e.g. sm90.softcap (repeatable)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--case-timeout", type=float, default=None,
                        help="seconds one case may run (default 20 on a GPU, the whole budget on the CPU)")
    parser.add_argument("--verbose", "-v", action="store_true", help="a line per template as it finishes")
    parser.set_defaults(func=cmd_selftest)
    return parser


def cmd_selftest(args) -> int:
    import torch

    from . import gate

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fagen selftest: no CUDA GPU is visible (torch.cuda.is_available() is False); "
              "`fagen selftest --device cpu` runs the cases on the emulator", file=sys.stderr)
        return 2
    facts = gate.device_facts(device) or _emulator_facts()
    families = tuple(f for f in facts.families if not args.family or f in args.family)
    if not families:
        print(f"fagen selftest: this device takes the {' and '.join(facts.families)} family, not "
              f"{' or '.join(args.family)}", file=sys.stderr)
        return 2
    unknown = [t for t in args.template or () if not any(t in all_templates(f) for f in families)]
    if unknown:
        print(f"fagen selftest: no template {', '.join(unknown)} in the {' and '.join(families)} "
              f"famil{'ies' if len(families) > 1 else 'y'}; they have: "
              f"{', '.join(t for f in families for t in all_templates(f))}", file=sys.stderr)
        return 2
    keys = {family: key for family, key in gate.verdict_keys(facts).items() if family in families}
    # On the CPU a case's kernels are built for the host as it runs (10-20 s each, cold): its clock
    # is the whole budget there; on a GPU they were compiled before the clock starts.
    case_timeout = args.case_timeout or (args.budget if facts.device == "cpu" else gate.FIRST_USE.case_timeout_s)
    settings = gate.with_first_use(budget_s=args.budget, case_timeout_s=case_timeout)
    print(f"fagen selftest: {facts.gpu} ({facts.device}), {' and '.join(families)}", file=sys.stderr, flush=True)
    verdicts = gate.run_and_store(facts, keys, settings, _progress(args.verbose), templates=args.template)
    gate.forget()
    print(verdict_table(verdicts))
    return 0 if all(r.status == "passed" for v in verdicts.values() for r in v.results.values()) else 1


def _emulator_facts():
    """The emulator as a device: it runs both families (compute capability 9.0 stands in)."""
    from . import gate
    from ..kernels.compile import nvrtc_version

    return gate.DeviceFacts(gate.HOPPER, "the SIMT emulator (CPU)", "-", "-", nvrtc_version(), "cpu")


def _progress(verbose: bool):
    def progress(line: str) -> None:
        if verbose or not line.startswith("[") or not line.endswith("passed"):
            print(f"fagen selftest: {line}", file=sys.stderr, flush=True)
    return progress


def verdict_table(verdicts: dict) -> str:
    """One row per template: family, template, status, seconds, detail."""
    lines = [f"{'template':<22} {'status':<10} {'s':>6}  detail"]
    for verdict in verdicts.values():
        for template, result in verdict.results.items():
            lines.append(f"{template:<22} {result.status:<10} {result.seconds:6.2f}  {result.detail[:200]}")
    logs = sorted({v.log for v in verdicts.values()})
    return "\n".join(lines + [f"log: {log}" for log in logs])
