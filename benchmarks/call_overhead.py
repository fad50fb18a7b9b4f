"""Warm per-call Python overhead of fagen.flash_attn_func (everything but the kernels).

    python benchmarks/call_overhead.py [--calls 2000]

The kernel launches are replaced by no-ops, so what is timed is the host work
of a warm call: input checks, the custom-op dispatch, the tuning-cache lookup,
the cached render, argument packing and output allocation. Runs on CPU
tensors; on a GPU the same path adds CuPy's launch call per kernel.
"""

import argparse
import statistics
import time

import torch

import fagen
from fagen import launch


def per_call_us(fn, calls: int) -> float:
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    q = torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    fagen.flash_attn_func(q, k, v, causal=True).sum().backward()  # warm: render, compile, load
    launch.LoadedSource.launch = lambda self, entry, grid, values: None
    with torch.no_grad():
        fwd = per_call_us(lambda: fagen.flash_attn_func(q, k, v, causal=True), args.calls)
    out = fagen.flash_attn_func(q, k, v, causal=True)
    grad = torch.ones_like(out)
    fwd_bwd = per_call_us(lambda: torch.autograd.grad(fagen.flash_attn_func(q, k, v, causal=True),
                                                      (q, k, v), grad), args.calls // 4)
    sdpa = per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(
        q[:, :1, :1], k[:, :1, :1], v[:, :1, :1]), args.calls)
    print(f"warm forward call, kernels stubbed:            {fwd:7.1f} us")
    print(f"warm forward + backward, kernels stubbed:      {fwd_bwd:7.1f} us")
    print(f"for scale, torch SDPA on a 1x1x1 CPU problem:  {sdpa:7.1f} us")


if __name__ == "__main__":
    main()
