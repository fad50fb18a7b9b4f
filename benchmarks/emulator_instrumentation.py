"""What racecheck and the counters cost: the emulator's time per forward + backward pass,
instrumented against plain, measured in one run.

    python benchmarks/emulator_instrumentation.py [--seqlen 256] [--heads 2] [--repeats 3]

Builds are made before timing (the instrumented build is a separate, cached
module). Times are medians of `--repeats` runs of a FlashAttention-2 forward and
backward (d = 64, causal, bf16) through `fagen.kernels.attention_kernels` on CPU tensors.
"""

import argparse
import os
import statistics
import time

import torch

from fagen.kernels import attention_kernels
from fagen.kernels.render import source_for
from fagen.emulate import collect_counters
from fagen.spec import Spec


def one_pass(source, q, k, v, dout):
    out, stats = attention_kernels.forward(source, q, k, v)
    attention_kernels.backward(source, q, k, v, out, stats, dout)


def median_seconds(fn, repeats: int) -> float:
    fn()  # build and warm
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    source = source_for(Spec(64, mask="causal", dtype="bf16"))
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, args.seqlen, args.heads, 64, generator=gen).bfloat16() for _ in range(4))
    run = lambda: one_pass(source, q, k, v, dout)  # noqa: E731

    os.environ.pop("FAGEN_EMULATE_RACECHECK", None)
    plain = median_seconds(run, args.repeats)
    os.environ["FAGEN_EMULATE_RACECHECK"] = "1"
    racecheck = median_seconds(run, args.repeats)
    os.environ.pop("FAGEN_EMULATE_RACECHECK")

    def counted():
        with collect_counters():
            run()

    counters = median_seconds(counted, args.repeats)
    print(f"FA-2 d=64 causal bf16, B=1, H={args.heads}, N={args.seqlen}, forward + backward, "
          f"{os.cpu_count()} CPUs, median of {args.repeats}")
    print(f"plain emulator:   {plain * 1e3:8.1f} ms")
    print(f"racecheck:        {racecheck * 1e3:8.1f} ms  ({racecheck / plain:.2f}x)")
    print(f"counters:         {counters * 1e3:8.1f} ms  ({counters / plain:.2f}x)")


if __name__ == "__main__":
    main()
