"""The decode section's CUDA-graph row: a serving step captured once and replayed with new lengths.

The step (config.DecodeConfig.graph_shape): flash_attn_with_kvcache appending one new token per
entry with rotary (over the whole head dim, at each entry's position) to caches filled to seeded
lengths, then attention split in `graph_splits` key ranges and their combine: every kernel a
decoding step launches. It is captured with torch.cuda.graph after a warm-up (the first call
compiles and loads the kernels; torch's recipe warms up on a side stream), and cache_seqlens is
then changed in place, as a server advances its lengths between steps. The replay must read the
new lengths from the tensor on the device: its output and both caches are compared with the same
step run eagerly on copies of the caches and the new lengths, bit for bit (the same kernels with
the same split count, no atomics), which a replay that baked the capture's lengths in fails.
Then the replay and the eager step are timed: the difference is what the host's launch path
costs a step.

Where capture fails (a host sync in the step, no CUDA), the row is a skipped cell whose reason
says so in one line. `capture` is a seam: the CPU tests pass stand-ins for torch's graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..measure import torch_dtype
from ..peers import failure_reason, is_out_of_memory
from ..timing import Timing
from .config import DecodeConfig
from .step import fagen_decode_functions

ROTARY_BASE = 10000.0


@dataclass
class GraphInputs:
    """One serving step's tensors; `cache_seqlens` is the tensor the captured step reads, and
    `next_seqlens` the lengths copied into it before the replay."""

    q: object               # (B, 1, Hq, d)
    k_new: object           # (B, 1, Hk, d)
    v_new: object
    rotary_cos: object      # (capacity, d / 2)
    rotary_sin: object
    k_cache: object         # (B, capacity, Hk, d)
    v_cache: object
    cache_seqlens: object   # int32 (B,)
    next_seqlens: object    # int32 (B,)


def rotary_tables(capacity: int, head_dim: int, dtype, device) -> tuple:
    """cos and sin of position x base^(-2i/d), i < d/2, for every cache position (RoPE)."""
    import torch

    inverse = ROTARY_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(capacity, dtype=torch.float64), inverse)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def make_graph_inputs(config: DecodeConfig, device) -> GraphInputs:
    """Caches filled to seeded lengths between a quarter and a half of their capacity; the next
    lengths each a seeded 1 to capacity / 4 further (so the appended token always fits)."""
    import torch

    batch, capacity = config.graph_shape
    dtype = torch_dtype(config.dtype)
    generator = torch.Generator().manual_seed(config.seed)
    q = torch.randn(batch, 1, config.q_heads, config.head_dim, generator=generator, dtype=dtype)
    k_new, v_new = (torch.randn(batch, 1, config.kv_heads, config.head_dim, generator=generator, dtype=dtype)
                    for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, capacity, config.kv_heads, config.head_dim, generator=generator,
                                    dtype=dtype) for _ in range(2))
    lengths = torch.randint(capacity // 4, capacity // 2 + 1, (batch,), generator=generator, dtype=torch.int32)
    steps = torch.randint(1, max(1, capacity // 4) + 1, (batch,), generator=generator, dtype=torch.int32)
    cos, sin = rotary_tables(capacity, config.head_dim, dtype, device)
    on = [t.to(device) for t in (q, k_new, v_new, k_cache, v_cache, lengths, lengths + steps)]
    return GraphInputs(on[0], on[1], on[2], cos, sin, on[3], on[4], on[5], on[6])


def graph_step(inputs: GraphInputs, config: DecodeConfig, k_cache=None, v_cache=None) -> Callable:
    """The step on `inputs` (on other caches where given), reading inputs.cache_seqlens when it runs."""
    decode = fagen_decode_functions()[0]
    k_cache = inputs.k_cache if k_cache is None else k_cache
    v_cache = inputs.v_cache if v_cache is None else v_cache

    def step():
        return decode(inputs.q, k_cache, v_cache, inputs.k_new, inputs.v_new, inputs.rotary_cos, inputs.rotary_sin,
                      cache_seqlens=inputs.cache_seqlens, causal=True, num_splits=config.graph_splits)
    return step


def cuda_graph_capture(step: Callable, inputs: GraphInputs) -> tuple[Callable, object]:
    """torch.cuda.graph's recipe: warm up on a side stream, capture one call; (replay, its output).
    The output tensor is the graph's: every replay writes it again."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph.replay, out


def replay_equals_eager(replay: Callable, out, inputs: GraphInputs, config: DecodeConfig) -> dict:
    """New lengths into the captured tensor, then the replay against the eager step on copies of
    the caches as they were: output and caches bit for bit, and the output's largest gap."""
    import torch

    inputs.cache_seqlens.copy_(inputs.next_seqlens)
    k_eager, v_eager = inputs.k_cache.clone(), inputs.v_cache.clone()
    replay()
    eager = graph_step(inputs, config, k_eager, v_eager)()
    if str(out.device).startswith("cuda"):
        torch.cuda.synchronize()
    same = torch.equal(out, eager) and torch.equal(inputs.k_cache, k_eager) and torch.equal(inputs.v_cache, v_eager)
    gap = (out.float() - eager.float()).abs().max().item()
    return {"ok": bool(same), "max_err": gap if math.isfinite(gap) else str(gap)}


def measure_graph(config: DecodeConfig, device, timer: Callable[..., Timing], timer_kwargs: dict, *,
                  capture: Callable = cuda_graph_capture) -> dict:
    """The row: capture, the equality check, then the replay and the eager step timed; a step or
    a capture that fails is a skipped row with its reason in one line."""
    try:
        inputs = make_graph_inputs(config, device)
        step = graph_step(inputs, config)
        step()   # compile, load and warm outside any capture
    except Exception as exc:  # noqa: BLE001 - fail soft: the reason goes in the report
        return {"label": config.graph_label, "skipped": failure_reason(exc), "oom": is_out_of_memory(exc)}
    try:
        replay, out = capture(step, inputs)
    except Exception as exc:  # noqa: BLE001 - the point of the row: say why the step does not capture
        return {"label": config.graph_label, "skipped": f"capture failed: {failure_reason(exc, limit=200)}"}
    row: dict = {"label": config.graph_label}
    try:
        row["equal"] = replay_equals_eager(replay, out, inputs, config)
        row["replay"] = timer(replay, **timer_kwargs).to_dict()
        row["eager"] = timer(step, **timer_kwargs).to_dict()
    except Exception as exc:  # noqa: BLE001
        row["skipped"] = failure_reason(exc)
        return row
    row["replay/eager"] = row["replay"]["ms"] / row["eager"]["ms"]
    return row
