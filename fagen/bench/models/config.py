"""The models section's model, systems and sizes (ModelsConfig), and its forecast.

Pure data and arithmetic (no torch, no transformers): the plan, its text and the CPU tests use it
anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

# The models section: attn_implementation names in transformers, in the order they run (Flex,
# which compiles, last).
MODEL_SYSTEMS = ("fagen", "sdpa", "flex_attention")


@dataclass(frozen=True)
class ModelsConfig:
    """The models section: a Llama (random weights) in Hugging Face transformers, bf16, with its
    attention run by each attn_implementation in turn (one model, switched between systems).

    train: one step (forward, loss, backward; no optimizer step) on B x N random tokens.
    decode: greedy `generate` of `new_tokens` on `decode_batch` prompts of seeded random lengths
    up to `prompt_len`, left-padded (so the padding mask's path runs).
    sanity: the same architecture with `sanity_layers` layers, logits of fagen against fp32 eager,
    next to bf16 SDPA (the 2x rule), on `sanity_seqlen` tokens, plain and left-padded."""

    hidden_size: int = 2048
    intermediate_size: int = 8192
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 32000
    dtype: str = "bf16"
    train_batch: int = 1
    train_seqlen: int = 4096
    train_systems: tuple = MODEL_SYSTEMS
    decode_batch: int = 32
    prompt_len: int = 128
    min_prompt_len: int = 64
    new_tokens: int = 32
    decode_systems: tuple = ("fagen", "sdpa")   # Flex's generate recompiles as the cache grows
    sanity_layers: int = 2
    sanity_seqlen: int = 256
    seed: int = 0
    # Timed calls after one warm-up call and the timer's sizing call (not in the median).
    train_repeats: int = 3
    decode_repeats: int = 2
    # The section's cap; FlexAttention (torch.compile of its forward and backward, about 20 s)
    # runs last and only starts with at least `flex_start_s` of it left.
    cap_s: float = 40.0
    flex_start_s: float = 20.0

    @property
    def enabled(self) -> bool:
        return bool(self.train_systems or self.decode_systems)

    def parameter_count(self, layers: int | None = None) -> int:
        """Llama's parameters (no biases, untied embeddings): embedding and LM head, per layer
        q/k/v/o, gate/up/down and two RMSNorms, and the final norm."""
        h, inner = self.hidden_size, self.heads * self.head_dim
        attention = h * inner * 2 + h * self.kv_heads * self.head_dim * 2
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return 2 * self.vocab_size * h + (self.layers if layers is None else layers) * layer + h

    @property
    def train_tokens(self) -> int:
        return self.train_batch * self.train_seqlen

    def prompt_lengths(self) -> list[int]:
        """Prompt lengths (seeded), the first the longest (`prompt_len`, the padded width), the
        others random between `min_prompt_len` and it."""
        import random

        rng = random.Random(self.seed)
        rest = [rng.randint(self.min_prompt_len, self.prompt_len) for _ in range(self.decode_batch - 1)]
        return [self.prompt_len] + rest if self.decode_batch else []

    def estimate_seconds(self) -> float:
        """About 9 s to import transformers, check the small model and build this one; 2 s per
        training system (5 steps of 0.1-0.3 s), 4.5 s per decode system (4 generate calls of
        about 1 s, host-bound), and Flex's compile (about 20 s), within the cap."""
        if not self.enabled:
            return 0.0
        flex = sum(1 for names in (self.train_systems, self.decode_systems) if "flex_attention" in names)
        train = sum(1 for s in self.train_systems if s != "flex_attention")
        decode = sum(1 for s in self.decode_systems if s != "flex_attention")
        return min(self.cap_s, 9.0 + 2.0 * train + 4.5 * decode + 21.0 * flex)

    def fagen_kernels(self, sweep_compiles_causal: bool) -> int:
        """Distinct fagen kernels the section adds: plain causal (training, unless the sweep
        compiles it: `sweep_compiles_causal`) and varlen causal (generate's padded batch)."""
        train = "fagen" in self.train_systems and not sweep_compiles_causal
        return int(train) + int("fagen" in self.decode_systems)
