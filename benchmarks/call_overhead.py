"""Warm per-call host overhead of fagen.flash_attn_func and of a decoding step
(fagen.flash_attn_with_kvcache: everything but the kernels), as a ratio to a trivial
PyTorch SDPA call measured in the same run.

    python benchmarks/call_overhead.py [--calls 4000] [--repeats 7]

The kernel functions themselves are replaced by no-ops after a first real
call, so what is timed is the host work of a warm call: input checks, the
autograd dispatch, the tuning-cache lookup, the cached render, argument
packing (every kernel argument is still converted to its C type) and output
allocation. Runs on CPU tensors; on a GPU the same path adds CuPy's own
launch call per kernel.

The decoding step is the common serving call: B = 8, one query token with 32 query
heads over 8 K/V heads (GQA packing), d = 128, appending one token to a 4096-row cache
with rotary, and the same step on a paged cache (pages of 256 rows), with the split
count chosen by the heuristic each call.

The yardstick is the trivial SDPA call the issue's targets were set against:
`torch.nn.functional.scaled_dot_product_attention(q[:, :1, :1], k[:, :1, :1],
v[:, :1, :1])` on the same requires-grad inputs, a 1x1x1x64 problem: PyTorch's
own per-call cost (slicing and autograd recording included), next to no math.
"""

import argparse
import statistics
import time

import torch

import fagen
from fagen.kernels import launch


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(calls // 10):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def stub_kernels() -> None:
    """Every loaded kernel becomes a no-op that still takes its packed arguments."""
    for loaded in launch._loaded.values():
        for name in loaded.functions:
            loaded.functions[name] = lambda grid, block, args, shared_mem=0: None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    q = torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    fagen.flash_attn_func(q, k, v, causal=True).sum().backward()  # warm: render, compile, load
    stub_kernels()
    sdpa = per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(
        q[:, :1, :1], k[:, :1, :1], v[:, :1, :1]), args.calls, args.repeats)
    with torch.no_grad():
        fwd = per_call_us(lambda: fagen.flash_attn_func(q, k, v, causal=True), args.calls, args.repeats)
    grad = torch.ones(q.shape, dtype=q.dtype)
    fwd_bwd = per_call_us(lambda: torch.autograd.grad(fagen.flash_attn_func(q, k, v, causal=True),
                                                      (q, k, v), grad), args.calls // 4, args.repeats)
    decode, decode_paged = decode_steps(args.calls, args.repeats)
    print(f"trivial torch SDPA call (1x1x1x64, CPU):       {sdpa:7.1f} us")
    print(f"warm forward call, kernels stubbed:            {fwd:7.1f} us  ({fwd / sdpa:.2f}x SDPA)")
    print(f"warm forward + backward, kernels stubbed:      {fwd_bwd:7.1f} us  ({fwd_bwd / sdpa:.2f}x SDPA)")
    print(f"warm decode step (append + rotary), stubbed:   {decode:7.1f} us  ({decode / sdpa:.2f}x SDPA)")
    print(f"warm paged decode step, stubbed:               {decode_paged:7.1f} us  ({decode_paged / sdpa:.2f}x SDPA)")


def decode_steps(calls: int, repeats: int) -> tuple[float, float]:
    """Per-call host time of a warm decoding step, contiguous and paged (kernels stubbed)."""
    batch, heads, kv_heads, d, capacity, page = 8, 32, 8, 128, 4096, 256
    q = torch.randn(batch, 1, heads, d, dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, 1, kv_heads, d, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = torch.ones(capacity, 32, dtype=torch.bfloat16), torch.zeros(capacity, 32, dtype=torch.bfloat16)
    seqlens = torch.full((batch,), 1000, dtype=torch.int32)
    k_cache, v_cache = (torch.zeros(batch, capacity, kv_heads, d, dtype=torch.bfloat16) for _ in range(2))
    pages = batch * capacity // page
    k_pages, v_pages = (torch.zeros(pages, page, kv_heads, d, dtype=torch.bfloat16) for _ in range(2))
    table = torch.arange(pages, dtype=torch.int32).view(batch, -1)
    steps = {
        "contiguous": lambda: fagen.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin,
                                                            cache_seqlens=seqlens),
        "paged": lambda: fagen.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cos, sin,
                                                       cache_seqlens=seqlens, block_table=table),
    }
    for step in steps.values():
        step()   # warm: render, compile, load (the emulator runs it once for real)
    stub_kernels()
    return tuple(per_call_us(step, calls, repeats) for step in steps.values())


if __name__ == "__main__":
    main()
