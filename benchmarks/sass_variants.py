"""The variants' main loops against the plain kernel's, from machine code, in one run.

    python benchmarks/sass_variants.py [--arch sm_80 sm_90] [--d 64 128] [--json FILE]

For each built-in variant (window, softcap, ALiBi, sinks), a document mask over a captured
tensor (FlexAttention's document-masking example) and a relative-bias table that gets a gradient
(by float atomics, and deterministic: into an exact sum, fagen/exact_sum.cuh, against the
deterministic plain kernel), forward and backward: the main loop's
non-HMMA instructions per useful HMMA (`fagen.sass`, FlashAttention-2's measure), the plain
spec's with the same tiles beside it, their ratio, and the spill bytes. Issue 27's target is a
ratio of at most 1.3 with 0 spills; rows above it are marked. The sibling of
`benchmarks/sass_vs_fa2.py` (which sets fagen's plain loops against FlashAttention-2's); no peer
is fetched here. A benchmark, not a test: log the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from fagen.sass.report import report_for_spec
from fagen.spec import Spec
from fagen.variants import custom_mod, trace_mask_mod, trace_score_mod

TARGET = 1.3
DOCUMENTS = torch.zeros(2, 4096, dtype=torch.int32)   # a document id per (batch, token): captured
BIAS = torch.zeros(8, 8192, requires_grad=True)         # a bias per (head, distance): it gets a gradient


def _same_document(b, h, q_idx, kv_idx):
    return DOCUMENTS[b, q_idx] == DOCUMENTS[b, kv_idx]


def _relative_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + 4096]


def variants() -> dict[str, dict]:
    """Spec fields per variant, as a call sets them (causal where the variant is used so)."""
    return {
        "window": {"mask": "causal", "window": True},
        "softcap": {"softcap": True},
        "alibi": {"mask": "causal", "alibi": True},
        "sinks": {"mask": "causal", "sinks": True},
        "document mask": {"mask_mod": custom_mod(trace_mask_mod(_same_document))},
        "relative bias": {"mask": "causal", "score_mod": custom_mod(trace_score_mod(_relative_bias))},
        "relative bias, deterministic": {"mask": "causal", "deterministic": True,
                                         "score_mod": custom_mod(trace_score_mod(_relative_bias))},
    }


def loop_ratio(spec: Spec, arch: str) -> dict[str, tuple[float, int]]:
    """Per role ("fwd", "bwd"): (non-HMMA per useful HMMA, spill bytes) of the spec's main kernel."""
    reports = report_for_spec(spec, arch)
    found = {}
    for role, suffix in (("fwd", "_fwd"), ("bwd", "_bwd")):
        report = reports[spec.name + suffix]
        found[role] = (report.non_hmma_per_useful_hmma, report.spill_bytes)
    return found


def rows(archs: list[str], head_dims: list[int]) -> list[dict]:
    table = []
    for arch in archs:
        for d in head_dims:
            for name, fields in variants().items():
                spec = Spec(d, **fields)
                plain = Spec(d, mask=fields.get("mask", "none"), deterministic=spec.deterministic, **spec.tiles)
                ours, base = loop_ratio(spec, arch), loop_ratio(plain, arch)
                for role in ("fwd", "bwd"):
                    table.append({"arch": arch, "d": d, "variant": name, "pass": role, "spec": spec.name,
                                  "variant_per_hmma": ours[role][0], "plain_per_hmma": base[role][0],
                                  "ratio": ours[role][0] / base[role][0], "spill_bytes": ours[role][1]})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| arch | d | variant | pass | variant | plain | ratio | spills |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        over = " (over 1.3)" if r["ratio"] > TARGET else ""
        lines.append(f"| {r['arch']} | {r['d']} | {r['variant']} | {r['pass']} | {r['variant_per_hmma']:.2f} | "
                     f"{r['plain_per_hmma']:.2f} | {r['ratio']:.2f}{over} | {r['spill_bytes']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], choices=["sm_80", "sm_90"])
    parser.add_argument("--d", nargs="+", type=int, default=[64, 128], help="head dims (default 64 128)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = parser.parse_args()
    table = rows(args.arch, args.d)
    print(markdown(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
