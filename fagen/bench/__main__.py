"""python -m fagen.bench gpu-check [--out DIR] [--dry-run] [--quick] [--budget S] [--skip ...]

Runs from the working tree with no install step: when fagen is not
importable (e.g. this file is run by path), the repository root is put on
sys.path first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fagen.bench.gpu_check import OPTIONAL_SECTIONS, default_out_dir, dry_run, run_gpu_check  # noqa: E402
from fagen.bench.plan import plan_named  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fagen.bench",
                                     description="fagen's benchmarks and the one-command GPU check")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("gpu-check", help="correctness, speed vs PyTorch, memory and sanitizers "
                                             "on one GPU, in under 8 minutes")
    check.add_argument("--out", type=Path, default=None,
                       help="output folder (default: $OUT if set, else ./gpu-check-results)")
    check.add_argument("--dry-run", action="store_true",
                       help="print the versions found, the plan and its time estimate, and check imports and NVRTC; "
                            "needs no GPU")
    check.add_argument("--quick", action="store_true",
                       help="a ~5 minute subset (bf16, d=128, N = 1k, 4k, 16k; the softcap and "
                            "document-mask variants)")
    check.add_argument("--budget", type=float, default=None,
                       help="total seconds for the run (default: the plan's, 420 full / 290 quick)")
    check.add_argument("--skip", default="",
                       help=f"comma-separated sections to skip: {', '.join(OPTIONAL_SECTIONS)}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = plan_named("quick" if args.quick else "full")
    if args.budget is not None:
        import dataclasses

        plan = dataclasses.replace(plan, budget_s=args.budget)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(OPTIONAL_SECTIONS)
    if unknown:
        print(f"unknown sections to skip: {', '.join(sorted(unknown))}; choose from "
              f"{', '.join(OPTIONAL_SECTIONS)}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(plan)
    return run_gpu_check(plan, args.out or default_out_dir(), skip=skip)


if __name__ == "__main__":
    sys.exit(main())
