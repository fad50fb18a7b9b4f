"""The plan as text: what --dry-run prints and results.json records (`Plan.describe`).

Torch-free like plan.py, whose sizes and caps it prints; the models and ring sections' lines
come from their report modules.
"""

from __future__ import annotations

from .models_report import plan_lines as models_plan_lines
from .plan import (DECODE_LABELS, GPU_TEST_KERNELS, NO_MOD_SYSTEMS, PASS_LABELS, SECTIONS, SYSTEM_LABELS,
                   short_seqlen)
from .ring_report import plan_lines as ring_plan_lines
from .schedule import caps, fits, replay


def describe(plan) -> str:
    """The plan as text: what --dry-run prints and results.json records."""
    lines = [f"plan {plan.name!r}: budget {plan.budget_s:.0f} s (time guard per section)"]
    lines.append("sections, in order: " + ", ".join(SECTIONS))
    lines.append(f"  precompile: the kernels the sections and the gpu tests call, recorded by making their calls "
                 f"on CPU tensors for this GPU's arch, then NVRTC in parallel (cap {plan.precompile_cap_s:.0f} s)")
    lines.append(f"  correctness: python -m pytest -m gpu tests/ (cap {plan.correctness_cap_s:.0f} s)")
    lines.append(f"  sanitizers: compute-sanitizer memcheck and racecheck on one small forward + "
                 f"backward if installed (cap {plan.sanitizer_cap_s:.0f} s each)")
    lines.append("  speed: passes " + ", ".join(PASS_LABELS[p] for p in plan.passes)
                 + f" (all the time the other sections leave, at least {plan.min_speed_s:.0f} s)")
    lines.append(f"    dtypes {', '.join(plan.dtypes)}; head dims {', '.join(map(str, plan.head_dims))}"
                 f"; causal {' and '.join('yes' if c else 'no' for c in plan.causal)}")
    lines.append(f"    seqlens {', '.join(short_seqlen(n) for n in plan.seqlens)} at "
                 f"{plan.tokens_per_batch} tokens per batch, hidden {plan.hidden_dim} "
                 f"(heads = {plan.hidden_dim}/d)")
    shapes = ", ".join(f"N={short_seqlen(n)}: B={plan.batch(n)}" for n in plan.seqlens)
    lines.append(f"    batch per seqlen: {shapes}")
    lines.append("    systems: " + ", ".join(SYSTEM_LABELS[s] for s in plan.systems))
    lines.append(f"    panels: {len(plan.configs())} ("
                 + "; ".join(c.label for c in plan.configs()) + ")")
    lines.append(f"    timed runs: {plan.timed_runs()} = {len(plan.configs())} panels x "
                 f"{len(plan.seqlens)} seqlens x {len(plan.passes)} passes x {len(plan.systems)} systems"
                 f"; fagen variants to compile: {plan.fagen_variants()} (+{GPU_TEST_KERNELS} "
                 "for the gpu tests), in parallel")
    lines.append(f"    timing: CUDA events, {plan.warmup} warm-up, median of {plan.min_repeats}-"
                 f"{plan.max_repeats} repeats (~{plan.target_ms:.0f} ms of GPU time each), fresh "
                 "torch.randn inputs per point; FlexAttention allowance "
                 f"{plan.flex_allowance_s:.0f} s")
    lines.append("    TFLOP/s = 4 N^2 d H B (forward), x2.5 (backward), x3.5 (both), /2 if causal; "
                 "matmul peak: 8192^3 bf16 torch.matmul")
    lines += variants_lines(plan)
    lines += decode_lines(plan)
    lines += models_plan_lines(plan.models, plan.models_kernels())
    lines += ring_plan_lines(plan.ring)
    mem = plan.memory
    lines.append(f"  memory: peak GPU memory, forward + backward, {mem.dtype} d={mem.head_dim} "
                 f"H={mem.heads} B={mem.batch}, seqlens {', '.join(short_seqlen(n) for n in mem.seqlens)}; "
                 f"systems {', '.join(SYSTEM_LABELS[s] for s in mem.systems)} (OOM recorded)")
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


def variants_lines(plan) -> list[str]:
    v = plan.variants
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
    lines.append("    systems: " + ", ".join(SYSTEM_LABELS[s] + (" (plain causal, measured once)"
                                                                  if s in NO_MOD_SYSTEMS else " (same mod)")
                                              for s in v.systems))
    lines.append(f"    timed runs: {v.timed_runs()}; fagen variant kernels to compile: "
                 f"{plan.variant_kernels()}; TFLOP/s counted as for causal attention; "
                 "ratios fagen v2 / each peer")
    return lines

def decode_lines(plan) -> list[str]:
    c = plan.decode
    if not c.enabled:
        return ["  decode: none in this plan"]
    lines = [f"  decode: cap {c.cap_s:.0f} s; fagen checked first against fp32 torch (2x bf16 torch's "
             "error)"]
    if c.decode_systems:
        lines.append(f"    decode step: {c.decode_label}, full caches; sanity at B={c.sanity_shape[0]} "
                     f"cache {short_seqlen(c.sanity_shape[1])}")
        lines.append("    systems: " + ", ".join(DECODE_LABELS[s] + _DECODE_CALLS.get(s, "").format(c=c)
                                                 for s in c.decode_systems))
        peers = []
        if any(s.startswith("sdpa") for s in c.decode_systems):
            peers.append(f"SDPA: (B, H, N, d) caches, enable_gqa where the backend takes it, else K/V expanded "
                         f"to {c.q_heads} heads beforehand ({c.group}x the bytes, counted)")
        if "flex" in c.decode_systems:
            peers.append(f"FlexAttention: torch.compile, enable_gqa, no block mask, run last, only with "
                         f">= {c.flex_start_s:.0f} s left")
        if peers:
            lines.append("    " + "; ".join(peers))
        lines.append(f"    bytes per step: K + V read (B N Hk d, 2 B each) + q + out = "
                     f"{c.decode_bytes() / 1e9:.2f} GB (K/V expanded to Hq heads: "
                     f"{c.decode_bytes(c.q_heads) / 1e9:.2f} GB); TB/s = bytes / median time, as a "
                     "fraction of the copy bandwidth (which counts read + write bytes alike)")
    if c.varlen_systems:
        batch, longest = c.padded_shape()
        lines.append(f"    varlen training: {c.varlen_label}; passes "
                     f"{', '.join(PASS_LABELS[p] for p in c.varlen_passes)}")
        lines.append(f"    document lengths (seed {c.seed}): {', '.join(map(str, c.document_lengths()))}")
        lines.append("    systems: " + ", ".join(DECODE_LABELS[s] + _VARLEN_CALLS[s].format(b=batch, n=longest)
                                                 for s in c.varlen_systems))
        lines.append(f"    TFLOP/s count the documents' causal FLOPs only "
                     f"({c.varlen_flops('fwd') / 1e9:.0f} GFLOP forward, x3.5 for both); "
                     "ratios fagen varlen / each")
    lines.append(f"    timed runs: {c.timed_runs()}; fagen kernels to compile: {plan.decode_kernels()}")
    return lines


# How each variant is called in fagen (and, with the same mod, in FlexAttention).
_CASE_CALLS = {
    "window": "window_size=(W, 0); Flex mask_mod causal & q - k <= W",
    "softcap": "softcap=C; Flex score_mod C tanh(score / C)",
    "alibi": "alibi_slopes 2^(-8 i / H) fp32 (H,); Flex score_mod score - slope[h] |q - k|",
    "document": "mask_mod doc[b, q] == doc[b, k] (int32 ids on the GPU); Flex mask_mod causal & the same",
}


# How the decode section's fagen systems and padded peers are called (formatted with the
# config `c`, or the padded batch's size b x n).
_DECODE_CALLS = {
    "fagen": " (flash_attn_with_kvcache, contiguous cache)",
    "fagen_paged": " (the same keys in pages of {c.page_size}, seeded random block table)",
}
_VARLEN_CALLS = {
    "fagen_varlen": " (flash_attn_varlen_func, packed)",
    "fagen_padded": " (flash_attn_func, causal, on B={b} x N={n} right-padded; no seqlens_k, which would "
                    "align each entry's diagonal to its own length)",
    "sdpa_padded": " (flash backend, else efficient; is_causal, B={b} x N={n})",
}
