"""The variants section's text: its lines in the plan, its block of the short table and its
tables in results.md.

From a config.VariantsConfig (`plan_lines`) or the section's dict alone (no torch). Its rows
have the speed sweep's point structure: ratios, cells and skip reasons come from speed.markdown.
"""

from __future__ import annotations

from ..markdown import heading, not_run_lines, sanity_table
from ..markdown import md as _md
from ..speed.config import PASS_LABELS
from ..speed.markdown import PASS_SHORT, add_ratios, cell_text, system_cells
from .config import FAGEN_VARIANT_SYSTEMS, NO_MOD_SYSTEMS, VARIANT_LABELS, VARIANT_SHORT, VARIANT_SYSTEMS

# How each variant is called in fagen (and, with the same mod, in FlexAttention).
_CASE_CALLS = {
    "window": "window_size=(W, 0); Flex mask_mod causal & q - k <= W",
    "softcap": "softcap=C; Flex score_mod C tanh(score / C)",
    "alibi": "alibi_slopes 2^(-8 i / H) fp32 (H,); Flex score_mod score - slope[h] |q - k|",
    "document": "mask_mod doc[b, q] == doc[b, k] (int32 ids on the GPU); Flex mask_mod causal & the same",
}


# -- the plan ------------------------------------------------------------------------------

def plan_lines(v) -> list[str]:
    """The section (a config.VariantsConfig) in the plan's text."""
    if not v.cases:
        return ["  variants: none in this plan"]
    lines = [f"  variants: passes {', '.join(PASS_LABELS[p] for p in v.passes)}; {v.label} "
             f"(cap {v.cap_s:.0f} s, FlexAttention allowance {v.flex_allowance_s:.0f} s)"]
    causal = v.visible_pairs("softcap")
    for case in v.cases:
        share = v.visible_pairs(case) / causal
        lines.append(f"    variant {case}: {v.case_label(case)}, {_CASE_CALLS[case]}; "
                     f"keys seen {share:.0%} of causal")
    if "document" in v.cases:
        lines.append(f"    document lengths (seed {v.seed}): {', '.join(map(str, v.document_lengths()))}")
    lines.append("    systems: " + ", ".join(VARIANT_LABELS[s] + (" (plain causal, measured once)"
                                                                   if s in NO_MOD_SYSTEMS else " (same mod)")
                                              for s in v.systems))
    lines.append(f"    timed runs: {v.timed_runs()}; fagen variant kernels to compile: "
                 f"{v.fagen_kernels()}; TFLOP/s counted as for causal attention; "
                 "ratios fagen v2 / each peer")
    return lines


# -- the short table ------------------------------------------------------------------------

def _ran(results: dict) -> tuple[dict, list[str]] | None:
    """The section with its ratios, and the systems with a cell in it (in table order); None when
    no point ran."""
    variants = results.get("variants") or {}
    if not variants.get("points"):
        return None
    add_ratios(variants)
    return variants, [s for s in VARIANT_SYSTEMS if any(s in p["results"] for p in variants["points"])]


def short_lines(results: dict) -> list[str]:
    ran = _ran(results)
    if ran is None:
        return []
    variants, systems = ran
    label = (variants.get("config") or {}).get("label", "")
    hopper = "fagen_sm90" in systems
    lines = [f"-- variants, {label}: v2{', s90' if hopper else ''}, flex with the mod; flsh, v2nm (fagen v2) "
             "plain causal; FLOPs as causal",
             "pass variant  seen |" + "".join(f"{VARIANT_SHORT.get(s, s)[:5]:>5}" for s in systems)
             + " | v2/flex v2/flsh v2/v2nm" + (" s90/flex" if hopper else "")]
    keys = (("fagen_v2/flex", 7), ("fagen_v2/sdpa_flash", 7), ("fagen_v2/fagen_v2_nomod", 7))
    keys += (("fagen_sm90/flex", 8),) if hopper else ()
    for point in variants["points"]:
        values = "".join(f"{cell_text(point['results'].get(s), 0):>5}" for s in systems)
        ratios = point.get("ratios", {})
        ratio_text = " ".join(f"{ratios[key]:{width}.2f}" if key in ratios else f"{'-':>{width}}"
                              for key, width in keys)
        pass_ = PASS_SHORT.get(point["pass"], point["pass"])
        lines.append(f"{pass_:<4} {point['variant'][:8]:<8} {point.get('visible_share', 1.0):4.0%} |{values} | "
                     f"{ratio_text}")
    return lines


# -- results.md --------------------------------------------------------------------------------

def markdown_lines(results: dict) -> list[str]:
    ran = _ran(results)
    if ran is None:
        return []
    variants, systems = ran
    config = variants.get("config") or {}
    out = heading("Variants (TFLOP/s)",
                  f"{config.get('label', '')}. fagen v2 and FlexAttention (torch.compile, block mask) run the same "
                  "mod; SDPA flash and fagen v2 (no mod) run plain causal attention, measured once for every row "
                  f"({_md(variants.get('sdpa', ''))}). FLOPs are the causal count (4·N²·d·H·B / 2 forward, 3.5× "
                  "for forward + backward) for every variant, so a mask that hides keys shows as a higher rate; "
                  "'keys seen' is the share of the causal keys the variant leaves visible. Ratios are fagen v2 / "
                  "peer.", variants.get("note"))
    ratio_keys = [(f"fagen_v2/{s}", f"v2 / {VARIANT_LABELS.get(s, s)}") for s in systems
                  if s not in FAGEN_VARIANT_SYSTEMS]
    if "fagen_sm90" in systems and "flex" in systems:
        ratio_keys.append(("fagen_sm90/flex", f"sm90 / {VARIANT_LABELS['flex']}"))
    for pass_ in dict.fromkeys(p["pass"] for p in variants["points"]):
        out += ["", f"### {PASS_LABELS.get(pass_, pass_)}", "",
                "| variant | keys seen | " + " | ".join(VARIANT_LABELS.get(s, s) for s in systems) + " | "
                + " | ".join(label for _, label in ratio_keys) + " |",
                "|---|---:|" + "---:|" * (len(systems) + len(ratio_keys))]
        for point in variants["points"]:
            if point["pass"] != pass_:
                continue
            cells = system_cells(point, systems)
            ratios = point.get("ratios", {})
            out.append(f"| {_md(point.get('label', point['variant']))} | {point.get('visible_share', 1.0):.0%} | "
                       + " | ".join(cells) + " | "
                       + " | ".join(f"{ratios[key]:.2f}" if key in ratios else "-" for key, _ in ratio_keys) + " |")
    return out + _markdown_not_run(variants)


def _markdown_not_run(variants: dict) -> list[str]:
    out = not_run_lines(variants, "Variant cells that did not run", VARIANT_LABELS)
    for name, sanity in (variants.get("sanity") or {}).items():
        if sanity:
            out += sanity_table(f"Sanity of the {VARIANT_LABELS.get(name, name)} variant kernels (small problem vs "
                                "the variant in fp32 torch)", "variant", sanity)
    return out
