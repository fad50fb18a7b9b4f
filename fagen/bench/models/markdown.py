"""The models section's text: its lines in the plan, its derived numbers, the short table and results.md.

From a config.ModelsConfig (`plan_lines`, which plan_text.describe calls, and the labels) or
the section's dict alone (no torch); report.py calls `short_lines` and `markdown_lines`. Timed
cells carry their median time and the tokens one call handles; tokens/s and the ratios fagen /
each system (of tokens/s: > 1 means fagen is faster) are derived here (`add_rates`).
"""

from __future__ import annotations

from ..markdown import cells_in_order, finite, heading, sanity_table, sanity_text, skip_text
from ..markdown import md as _md

# Labels of transformers' attn_implementation names, in table order.
MODEL_LABELS = {"fagen": "fagen", "sdpa": "SDPA", "flex_attention": "FlexAttention", "eager": "eager"}
LABEL_WIDTH = 14   # "FlexAttention"


def count_text(count: int) -> str:
    """1.10B, 86.3M, 86.3K: a parameter count at a glance."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(count)


def model_label(config) -> str:
    return (f"Llama {count_text(config.parameter_count())} ({config.layers} layers, hidden {config.hidden_size}, "
            f"Hq={config.heads} Hk={config.kv_heads} d={config.head_dim}), random weights, {config.dtype}")


def train_label(config) -> str:
    return f"train B={config.train_batch} x N={config.train_seqlen}: forward + loss + backward"


def decode_label(config) -> str:
    return (f"generate: {config.decode_batch} prompts of {config.min_prompt_len}-{config.prompt_len} tokens, "
            f"left-padded, + {config.new_tokens} new tokens each, greedy")


def tokens_per_s(tokens: float, ms: float) -> float:
    """Tokens one call handles over its median time."""
    if ms <= 0:
        raise ValueError(f"time must be positive, got {ms} ms")
    return tokens / (ms * 1e-3)


def _rated(results: dict) -> dict | None:
    """The section with its rates (add_rates), or None when it has no rows."""
    section = results.get("models") or {}
    return add_rates(section) if section.get("rows") else None


def add_rates(section: dict) -> dict:
    """Per timed cell: tokens/s; per row: fagen's tokens/s over each other system's."""
    for row in section.get("rows", []):
        for cell in row.get("results", {}).values():
            ms, tokens = finite(cell.get("ms")), finite(cell.get("tokens"))
            if ms is not None and tokens is not None and ms > 0:
                cell["tokens_per_s"] = tokens_per_s(tokens, ms)
        results = row.get("results", {})
        ours = finite((results.get("fagen") or {}).get("tokens_per_s"))
        row["ratios"] = {f"fagen/{name}": ours / rate for name, cell in results.items()
                         if name != "fagen" and ours is not None and (rate := finite(cell.get("tokens_per_s")))}
    return section


def section_note(section: dict) -> str:
    """One line for the sections table: fagen's ratios per row, the sanity, the guard's count."""
    add_rates(section)
    parts = []
    for row in section.get("rows", []):
        ratios = [f"{MODEL_LABELS.get(key.split('/')[1], key)} {ratio:.2f}" for key, ratio in row["ratios"].items()]
        if ratios:
            parts.append(f"{row['part']} tokens/s, fagen / " + ", / ".join(ratios))
    parts.append(sanity_text(section))
    if section.get("not_run"):
        parts.append(f"time guard: {section['not_run']} measurements not run")
    return "; ".join(parts)


# -- the plan ------------------------------------------------------------------------------

def plan_lines(c, fagen_kernels: int) -> list[str]:
    """The section (a config.ModelsConfig, and the fagen kernels it adds) in the plan's text."""
    if not c.enabled:
        return ["  models: none in this plan"]
    flex = f"FlexAttention (torch.compile; last, only with >= {c.flex_start_s:.0f} s left)"
    labels = {**MODEL_LABELS, "flex_attention": flex, "fagen": "fagen (fagen.integrations.transformers)"}
    lines = [f"  models: cap {c.cap_s:.0f} s; Hugging Face transformers, {model_label(c)}; one model "
             "(from_config, built on the GPU, no download), attn_implementation switched between systems",
             f"    parameters: {c.parameter_count():,} = 2 V h (embedding, LM head) + L (2 h Hq d + 2 h Hk d + 3 h I "
             "+ 2 h) + h"]
    if c.train_systems:
        lines.append(f"    {train_label(c)} on random tokens (gradients set to None before each step, no optimizer "
                     f"step); tokens/s = {c.train_tokens} / step time; systems "
                     + ", ".join(labels[s] for s in c.train_systems))
    if c.decode_systems:
        lines.append(f"    {decode_label(c)}; new tokens/s = {c.decode_batch} x {c.new_tokens} / call time; systems "
                     + ", ".join(labels[s] for s in c.decode_systems)
                     + ("; fagen gets the padding mask: flash_attn_varlen_func" if "fagen" in c.decode_systems else ""))
        lines.append(f"    prompt lengths (seed {c.seed}): {', '.join(map(str, c.prompt_lengths()))}")
    lines.append(f"    sanity first: {c.sanity_layers} layers, N={c.sanity_seqlen}, logits vs fp32 eager (2x bf16 "
                 "SDPA's error), plain and left-padded")
    lines.append(f"    timing: CUDA events, one warm-up call, then the median of {c.train_repeats} steps / "
                 f"{c.decode_repeats} generate calls; fagen kernels to compile: {fagen_kernels}; "
                 "ratios fagen / each")
    return lines


# -- the short table ------------------------------------------------------------------------

def short_lines(results: dict) -> list[str]:
    """The section's block of the short table: per row, one line per system."""
    section = _rated(results)
    if section is None:
        return []
    version = section.get("transformers")
    lines = [f"-- models (transformers {version or 'missing'}): {(section.get('config') or {}).get('model', '')}; "
             f"{sanity_text(section)}"]
    for row in section["rows"]:
        unit = "new tok/s" if row["part"] == "decode" else "tokens/s"
        lines += [row["label"], f"  {'system':<{LABEL_WIDTH}}       ms {unit:>9} fagen/this"]
        for name, label, cell in cells_in_order(row["results"], MODEL_LABELS, MODEL_LABELS, LABEL_WIDTH):
            if finite(cell.get("tokens_per_s")) is None:
                lines.append(f"  {label:<{LABEL_WIDTH}} {skip_text(cell, 60)}")
                continue
            ratio = row["ratios"].get(f"fagen/{name}")
            ratio_text = f"{ratio:10.2f}" if ratio is not None else f"{'-':>10}"
            lines.append(f"  {label:<{LABEL_WIDTH}} {cell['ms']:8.1f} {cell['tokens_per_s']:9.0f} {ratio_text}")
    return lines


# -- results.md --------------------------------------------------------------------------------

def markdown_lines(results: dict) -> list[str]:
    section = _rated(results)
    if section is None:
        return []
    config = section.get("config") or {}
    intro = (f"{_md(config.get('model', ''))}: {config.get('parameters', 0):,} parameters, in Hugging Face "
             f"transformers {section.get('transformers') or '(missing)'} (`AutoModelForCausalLM.from_config`, no "
             "download). One model, its attention switched with `set_attn_implementation`, so every system runs "
             "the same weights on the same tokens. Times are the median of CUDA-event timings after a warm-up call "
             "(which compiles FlexAttention). A training step is forward with labels, the loss and backward "
             "(gradients set to None first, no optimizer step); tokens/s = tokens per step / step time. Decode "
             "times a whole greedy `generate` call (prefill included); new tokens/s = prompts × new tokens / call "
             "time. Generate at this size may be host-bound (transformers' per-token Python), and fagen's path "
             "unpads the left-padded batch and pads it back in every layer (`flash_attn_varlen_func`). "
             "Ratios are fagen / this, of tokens/s (> 1: fagen is faster).")
    out = heading("Models (transformers)", intro, section.get("note"))
    if config.get("prompt_lengths"):
        out += ["", f"Prompt lengths: {', '.join(map(str, config['prompt_lengths']))}."]
    for row in section["rows"]:
        out += _markdown_row(row)
    return out + _markdown_sanity(section)


def _cell_note(cell: dict) -> str:
    notes = []
    if finite(cell.get("loss")) is not None:
        notes.append(f"loss {cell['loss']:.4f}")
    if cell.get("new_tokens") is not None:
        notes.append(f"{cell['new_tokens']} new tokens per prompt")
    if finite(cell.get("same_tokens_as_sdpa")) is not None:
        notes.append(f"{cell['same_tokens_as_sdpa']:.0%} of the new tokens are SDPA's")
    return "; ".join(notes)


def _markdown_row(row: dict) -> list[str]:
    unit = "new tokens/s" if row["part"] == "decode" else "tokens/s"
    title = row["label"][:1].upper() + row["label"][1:]
    out = ["", f"### {_md(title)}", "",
           f"| system | ms | {unit} | fagen / this | note |", "|---|---:|---:|---:|---|"]
    for name, label, cell in cells_in_order(row["results"], MODEL_LABELS, MODEL_LABELS):
        if finite(cell.get("tokens_per_s")) is None:
            out.append(f"| {label} | - | - | - | {_md(skip_text(cell, 400))} |")
            continue
        ratio = row["ratios"].get(f"fagen/{name}")
        out.append(f"| {label} | {cell['ms']:.1f} | {cell['tokens_per_s']:.0f} | "
                   f"{f'{ratio:.2f}' if ratio is not None else '-'} | {_md(_cell_note(cell))} |")
    return out


def _markdown_sanity(section: dict) -> list[str]:
    if not section.get("sanity"):
        return []
    return sanity_table("Sanity of fagen in the model (logits of a small model vs fp32 eager, next to bf16 SDPA)",
                        "check", section["sanity"], note_keys=("error", "shape"))
