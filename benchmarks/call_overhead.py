"""Warm per-call host overhead of fagen.flash_attn_func (everything but the kernels),
as a ratio to a trivial PyTorch SDPA call measured in the same run.

    python benchmarks/call_overhead.py [--calls 4000] [--repeats 7]

The kernel functions themselves are replaced by no-ops after a first real
call, so what is timed is the host work of a warm call: input checks, the
autograd dispatch, the tuning-cache lookup, the cached render, argument
packing (every kernel argument is still converted to its C type) and output
allocation. Runs on CPU tensors; on a GPU the same path adds CuPy's own
launch call per kernel.

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
from fagen import launch


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
    print(f"trivial torch SDPA call (1x1x1x64, CPU):       {sdpa:7.1f} us")
    print(f"warm forward call, kernels stubbed:            {fwd:7.1f} us  ({fwd / sdpa:.2f}x SDPA)")
    print(f"warm forward + backward, kernels stubbed:      {fwd_bwd:7.1f} us  ({fwd_bwd / sdpa:.2f}x SDPA)")


if __name__ == "__main__":
    main()
