"""The models section: a 1B-class Llama in Hugging Face transformers, trained and decoded with
attn_implementation "fagen" against "sdpa" and "flex_attention" (config.ModelsConfig).

One model (random weights from `from_config`, built on the GPU in bf16, no download), its
attention switched between systems with `set_attn_implementation`, so every system runs the
same weights on the same tokens, and the model is built once:

  train    one step on B = 1 x 4096 random tokens: forward with labels (the loss), backward;
           gradients set to None before each step, and no optimizer step (the same work for
           every system, which would only dilute the difference). tokens/s = B N / step time.
  decode   greedy `generate` of 32 new tokens for 32 prompts of seeded random lengths (64-128),
           left-padded: fagen then gets transformers' (B, N) padding mask and runs
           flash_attn_varlen_func (fagen.integrations.transformers). new tokens/s = prompts x
           new tokens / the whole call's time (prefill included; host-bound at this size).

Times are CUDA events (timing.time_cuda) after one warm-up call (which compiles Flex's
kernels, and fagen's where the precompile section did not). FlexAttention runs last, and only
with `flex_start_s` of the cap left. Before timing, fagen's logits on a 2-layer model of the
same architecture are checked against fp32 eager next to bf16 SDPA (the 2x rule), plain and
left-padded. Failing soft throughout: transformers missing, a failed build or a system that
raises give skipped cells with the reason; a lost CUDA context stops the section.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Callable

from ..measure import GUARD_REASON, context_lost, free_memory, torch_dtype
from ..peers import failure_reason, is_out_of_memory
from ..timing import Deadline, Timing, time_cuda
from .config import ModelsConfig
from .markdown import add_rates, decode_label, model_label, section_note, train_label

FLEX = "flex_attention"
FLEX_GUARD_REASON = GUARD_REASON + " (too little left for a Flex compile)"
# Seconds a step needs left before it starts (a guess at its length, from the plan's estimate).
SANITY_NEED_S, BUILD_NEED_S, TRAIN_NEED_S, DECODE_NEED_S = 3.0, 4.0, 2.0, 4.5
PAD_ID, BOS_ID = 0, 1   # the random tokens avoid both
SANITY_ABS_FLOOR = 1e-4


def import_transformers() -> str:
    """transformers' version, with "fagen" registered as an attn_implementation."""
    import transformers

    import fagen.integrations.transformers  # noqa: F401 - registers "fagen"

    return transformers.__version__


def llama_config(config: ModelsConfig, layers: int | None = None):
    """The plan's Llama as a transformers LlamaConfig. No eos token: with random weights greedy
    decoding could emit it, and every prompt must get all its new tokens."""
    import transformers

    longest = max(config.train_seqlen, config.prompt_len + config.new_tokens, config.sanity_seqlen)
    return transformers.LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers if layers is None else layers, num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads, head_dim=config.head_dim, vocab_size=config.vocab_size,
        max_position_embeddings=longest, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=None,
        tie_word_embeddings=False)


def build_model(config: ModelsConfig, device, dtype, *, layers: int | None = None, implementation: str = "sdpa"):
    """The model with seeded random weights, created on `device` (initialising 1B parameters on
    the host and copying them over would take longer than the measurements)."""
    import torch
    import transformers

    torch.manual_seed(config.seed)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(llama_config(config, layers),
                                                             attn_implementation=implementation, dtype=dtype)


def random_tokens(config: ModelsConfig, shape: tuple, device, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(BOS_ID + 1, config.vocab_size, shape, generator=generator).to(device)


def left_padded_prompts(config: ModelsConfig, device):
    """(input_ids, attention_mask) of the plan's prompts, left-padded to the longest."""
    import torch

    lengths = config.prompt_lengths()
    ids = random_tokens(config, (len(lengths), max(lengths)), "cpu", config.seed + 1)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, ids.shape[1] - n:] = 1
    return ids.masked_fill(mask == 0, PAD_ID).to(device), mask.to(device)


def training_step(model, ids) -> Callable:
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss
    return step


def generate_call(model, ids, mask, new_tokens: int) -> Callable:
    def call():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=PAD_ID)
    return call


# -- sanity ------------------------------------------------------------------------------------

def model_sanity(config: ModelsConfig, device, implementation: str = "fagen") -> dict:
    """Logits of `implementation` on a `sanity_layers`-layer model of the plan's architecture in
    bf16, against the same weights in fp32 eager, next to bf16 SDPA's (the 2x rule): on two
    plain rows, and with the second row left-padded by a quarter (compared at its real tokens)."""
    import torch

    n = config.sanity_seqlen
    ids = random_tokens(config, (2, n), device, config.seed + 2)
    mask = torch.ones_like(ids)
    mask[1, :n // 4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)   # each row's tokens from 0, as generate numbers them
    cases = {"logits": ({}, None), "logits, left-padded": ({"attention_mask": mask, "position_ids": positions},
                                                           mask.bool())}
    model = build_model(config, device, torch.float32, layers=config.sanity_layers, implementation="eager")
    try:
        with torch.no_grad():
            exact = {case: model(ids, **kwargs).logits for case, (kwargs, _) in cases.items()}
            model.to(torch_dtype(config.dtype))
            runs = {}
            for name in ("sdpa", implementation):
                model.set_attn_implementation(name)
                try:
                    runs[name] = {case: model(ids, **kwargs).logits for case, (kwargs, _) in cases.items()}
                except Exception as exc:  # noqa: BLE001 - recorded as the check's error
                    runs[name] = failure_reason(exc)
    finally:
        del model
        free_memory(device)
    shape = f"B=2 N={n}, {config.sanity_layers} layers"
    out = {}
    for case, (_, real) in cases.items():
        failed = next((r for r in (runs[implementation], runs["sdpa"]) if isinstance(r, str)), None)
        if failed is not None:
            out[case] = {"ok": False, "error": failed, "shape": shape}
            continue
        errors = [_max_error(runs[name][case], exact[case], real) for name in (implementation, "sdpa")]
        out[case] = {"fwd_err": errors[0], "fwd_torch_err": errors[1], "shape": shape,
                     "ok": bool(errors[0] <= 2 * errors[1] + SANITY_ABS_FLOOR)}
    return out


def _max_error(logits, exact, real) -> float:
    diff = (logits.float() - exact).abs()
    return (diff[real] if real is not None else diff).max().item()


# -- the section -------------------------------------------------------------------------------

class _Section:
    """The section's results and the bookkeeping its steps share."""

    def __init__(self, config: ModelsConfig, deadline: Deadline, log, checkpoint):
        self.config, self.deadline, self.log, self._checkpoint = config, deadline, log, checkpoint
        self.data: dict = {
            "status": "ok", "note": "", "transformers": None, "sanity": {}, "not_run": 0, "rows": [],
            "config": {"model": model_label(config), "parameters": config.parameter_count(),
                       "train": train_label(config), "decode": decode_label(config),
                       "prompt_lengths": config.prompt_lengths() if config.decode_systems else []}}
        self.rows = {}
        for part, label, systems in (("train", train_label(config), config.train_systems),
                                     ("decode", decode_label(config), config.decode_systems)):
            if systems:
                self.rows[part] = {"part": part, "label": label, "results": {}}
                self.data["rows"].append(self.rows[part])

    def checkpoint(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint(self.data)

    def systems(self, part: str) -> tuple:
        return self.config.train_systems if part == "train" else self.config.decode_systems

    def skip_all(self, reason: str) -> None:
        """Every cell not yet filled gets `reason`."""
        for part, row in self.rows.items():
            for name in self.systems(part):
                if name not in row["results"]:
                    self.skip(part, name, reason)

    def skip(self, part: str, name: str, reason: str) -> None:
        if reason.startswith(GUARD_REASON):
            self.data["not_run"] += 1
        self.rows[part]["results"][name] = {"skipped": reason}

    def lost(self, where: str, reason: str) -> dict:
        self.data["status"] = "error"
        self.data["note"] = f"the CUDA context was lost at {where}: {reason}; the section stopped there"
        self.log("  " + self.data["note"])
        self.skip_all("not run: the CUDA context was lost")
        return self.data


def _measure(model, name: str, call: Callable, timer, timer_kwargs: dict, describe: Callable) -> tuple[dict, object]:
    """One system's cell (its timing and what `describe` reads off the warm-up call's result),
    and that result."""
    try:
        model.set_attn_implementation(name)
        first = call()   # the warm-up: compiles (Flex), loads kernels, grows the allocator
        info = describe(first)
        timing = timer(call, **timer_kwargs)
    except Exception as exc:  # noqa: BLE001 - fail soft: the reason goes in the report
        return {"skipped": failure_reason(exc), "oom": is_out_of_memory(exc)}, None
    return {**timing.to_dict(), **info}, first


def _describe_step(tokens: int):
    def describe(loss) -> dict:
        value = float(loss.detach())
        if not math.isfinite(value):   # a broken backward would still time well
            raise FloatingPointError(f"the loss is {value}")
        return {"tokens": tokens, "loss": value}
    return describe


def _describe_generate(prompt_width: int):
    def describe(out) -> dict:
        new = out.shape[1] - prompt_width
        return {"tokens": out.shape[0] * new, "new_tokens": new}
    return describe


def _timer_kwargs(repeats: int) -> dict:
    # A fixed count (target_ms tiny): a step is 0.1-0.3 s and a generate call about a second.
    return {"warmup": 1, "min_repeats": repeats, "max_repeats": repeats, "target_ms": 1.0}


def _run_cells(run: _Section, model, part: str, names: list, call: Callable, describe: Callable, timer,
               outputs: dict) -> dict | None:
    """`part`'s cells for `names`, each guarded by the deadline; a lost context's section, else None."""
    config = run.config
    repeats = config.train_repeats if part == "train" else config.decode_repeats
    need = TRAIN_NEED_S if part == "train" else DECODE_NEED_S
    for name in names:
        if name == FLEX and run.deadline.expired(config.flex_start_s):
            run.skip(part, name, FLEX_GUARD_REASON)
            continue
        if run.deadline.expired(need):
            run.skip(part, name, GUARD_REASON)
            continue
        cell, outputs[name] = _measure(model, name, call, timer, _timer_kwargs(repeats), describe)
        run.rows[part]["results"][name] = cell
        model.zero_grad(set_to_none=True)
        free_memory(model.device)
        run.log(f"  {part} {name}: " + (f"{cell['ms']:.1f} ms, {cell['tokens'] / cell['ms'] * 1e3:.0f} tokens/s"
                                        if "ms" in cell else cell["skipped"]))
        if context_lost(cell.get("skipped", "")):
            return run.lost(f"{part} {name}", cell["skipped"])
        run.checkpoint()
    return None


def _agreement(row: dict, outputs: dict, prompt_width: int) -> None:
    """Per decode cell: the share of its new tokens equal to SDPA's (greedy on random weights: a
    near-tie may break either way in bf16, so informative, not a check)."""
    reference = outputs.get("sdpa")
    if reference is None:
        return
    for name, out in outputs.items():
        if out is not None and name != "sdpa" and out.shape == reference.shape:
            same = (out[:, prompt_width:] == reference[:, prompt_width:]).float().mean().item()
            row["results"][name]["same_tokens_as_sdpa"] = same


def _timed_parts(run: _Section, model, device, timer) -> dict | None:
    """Training then decoding, each without Flex; then Flex's cells (its compile last)."""
    import torch

    config = run.config
    ids = random_tokens(config, (config.train_batch, config.train_seqlen), device, config.seed)
    prompts, mask = left_padded_prompts(config, device) if config.decode_systems else (None, None)
    outputs: dict = {}
    parts = [("train", [n for n in config.train_systems if n != FLEX]),
             ("decode", [n for n in config.decode_systems if n != FLEX]),
             ("train", [n for n in config.train_systems if n == FLEX]),
             ("decode", [n for n in config.decode_systems if n == FLEX])]
    for part, names in parts:
        if not names:
            continue
        if part == "train":
            model.train()
            call, describe = training_step(model, ids), _describe_step(ids.numel())
        else:
            model.eval()
            call = generate_call(model, prompts, mask, config.new_tokens)
            describe = _describe_generate(prompts.shape[1])
        with torch.enable_grad() if part == "train" else torch.no_grad():
            stopped = _run_cells(run, model, part, names, call, describe, timer,
                                 outputs.setdefault(part, {}))
        if stopped is not None:
            return stopped
    if "decode" in run.rows:
        _agreement(run.rows["decode"], outputs.get("decode", {}), prompts.shape[1])
    return None


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings (generation defaults, padding hints) would fill the log the device
    tool returns; restored after."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def run_models_section(plan, deadline: Deadline, *, device="cuda", timer: Callable[..., Timing] = time_cuda,
                       log: Callable[[str], None] = print, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """The sanity check, then the model built once and each system timed, within `deadline`."""
    config = plan.models
    run = _Section(config, deadline, log, checkpoint)
    if not config.enabled:
        run.data["note"] = "no models section in this plan"
        return run.data
    started = time.monotonic()
    try:
        run.data["transformers"] = import_transformers()
    except Exception as exc:  # noqa: BLE001 - the GPU machine's test extra installs it; fail soft
        reason = f"transformers (or fagen.integrations.transformers) does not import: {failure_reason(exc)}"
        run.skip_all(f"skipped: {reason}")
        run.data.update(status="skipped", note=reason)
        log("  " + reason)
        return run.data
    with _quiet_transformers():
        stopped = _sanity_and_timing(run, device, timer)
    if stopped is not None:
        return stopped
    add_rates(run.data)
    run.data["seconds"] = round(time.monotonic() - started, 1)
    if run.data["not_run"] and run.data["status"] == "ok":
        run.data["status"] = "partial"
    run.data["note"] = (run.data["note"] + "; " if run.data["note"] else "") + section_note(run.data)
    log("  " + run.data["note"])
    run.checkpoint()
    return run.data


def _sanity_and_timing(run: _Section, device, timer) -> dict | None:
    config = run.config
    if "fagen" in config.train_systems + config.decode_systems and not run.deadline.expired(SANITY_NEED_S):
        try:
            run.data["sanity"] = model_sanity(config, device)
        except Exception as exc:  # noqa: BLE001 - the eager reference or the build failed
            run.data["sanity"] = {"logits": {"ok": False, "error": failure_reason(exc)}}
        errors = [r.get("error", "") for r in run.data["sanity"].values()]
        lost = next((e for e in errors if context_lost(e)), None)
        if lost is not None:
            return run.lost("the sanity check", lost)
        run.checkpoint()
    if run.deadline.expired(BUILD_NEED_S):
        run.skip_all(GUARD_REASON)
        return None
    try:
        model = build_model(config, device, torch_dtype(config.dtype))
    except Exception as exc:  # noqa: BLE001 - every cell says why
        reason = failure_reason(exc)
        run.skip_all(f"the model was not built: {reason}")
        run.data.update(status="error", note=f"the model was not built: {reason}")
        return run.lost("the model's build", reason) if context_lost(reason) else None
    try:
        return _timed_parts(run, model, device, timer)
    finally:   # the memory section runs next and pushes the allocator to out-of-memory
        del model
        free_memory(device)
