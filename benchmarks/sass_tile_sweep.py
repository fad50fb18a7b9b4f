"""Forward tiles by machine code: non-HMMA instructions per useful HMMA for each candidate tile,
the measurement the fallback table (fagen/spec.py `default_tiles`, fagen/tuning/fallback.py)
is derived from.

    python benchmarks/sass_tile_sweep.py [--d 64 128] [--arch sm_80 sm_90]

A candidate qualifies when it compiles with 0 spills for every flag set below (plain,
causal + key padding + dropout, bf16) and keeps 8 warps per SM resident (FlashAttention-2's
occupancy); qualifying ones are ranked by the plain fp16 variant's figure. Instruction
counts are not timings: the GPU check decides between close candidates when a GPU is lent.
"""

from __future__ import annotations

import argparse
import itertools

from fagen.sass.report import report_for_spec
from fagen.spec import Spec

FLAG_SETS = ({}, {"mask": "causal", "key_padding": True, "dropout": True}, {"dtype": "bf16", "mask": "causal"})
MIN_WARPS_PER_SM = 8


def candidates(head_dim: int):
    for block_m, block_n, warps in itertools.product((64, 128), (32, 64, 128), (4, 8)):
        try:
            yield Spec(head_dim, block_m=block_m, block_n=block_n, num_warps=warps)
        except ValueError:
            continue


def measure(spec: Spec, arch: str) -> tuple[float, int, int, bool]:
    """(non-HMMA per useful HMMA, registers, warps per SM, spill-free over the flag sets)."""
    spill_free = True
    for flags in FLAG_SETS:
        variant = spec.replace(**flags)
        try:
            report = report_for_spec(variant, arch)[variant.name + "_fwd"]
        except ValueError:   # the tiles do not fit this arch
            return float("inf"), 0, 0, False
        spill_free &= report.spill_bytes == 0
        if not flags:
            plain = report
    return plain.non_hmma_per_useful_hmma, plain.registers, plain.warps_per_sm, spill_free


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    args = parser.parse_args()
    for arch in args.arch:
        for head_dim in args.d:
            print(f"\n{arch} d={head_dim}: block_m x block_n, warps -> non-HMMA/useful HMMA, registers, warps/SM")
            rows = [(spec, *measure(spec, arch)) for spec in candidates(head_dim)]
            rows.sort(key=lambda row: (not (row[4] and row[3] >= MIN_WARPS_PER_SM), row[1]))
            for spec, figure, registers, warps, spill_free in rows:
                ok = spill_free and warps >= MIN_WARPS_PER_SM
                note = "" if ok else ("  (spills)" if not spill_free else "  (occupancy)")
                print(f"  {spec.block_m:>3} x {spec.block_n:<3} {spec.num_warps} warps  {figure:6.2f}  "
                      f"{registers:>3}  {warps:>2}{note}")


if __name__ == "__main__":
    main()
