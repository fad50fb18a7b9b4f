"""Compile speed: cold NVRTC seconds per variant and warm cache-hit milliseconds.

A variant is one translation unit holding its forward kernel and all its
backward kernels, so "cold" is what a user waits for the first call of a new
spec on one arch.

    python benchmarks/compile_speed.py [--arch sm_90] [--repeat 20] [--arch-family sm90]

With --arch-family sm90 the same variants' forward is the sm90 family's (wgmma, TMA; beside the
sm80 backward in the one translation unit), compiled for sm_90a.

Cold: a fresh cache directory, so every variant is compiled by NVRTC. Warm:
the same variants again from the disk cache (memory cache cleared) and from
the in-process memory cache. Prints one line per variant and the medians.
"""

import argparse
import os
import statistics
import tempfile
import time

from fagen.kernels import compile as compiler
from fagen.kernels.build import default_specs
from fagen.kernels.render import render


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default=None, help="default: sm_90, or sm_90a for --arch-family sm90")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--arch-family", choices=("sm80", "sm90"), default="sm80")
    args = parser.parse_args()
    args.arch = args.arch or ("sm_90a" if args.arch_family == "sm90" else "sm_90")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["FAGEN_CACHE_DIR"] = cache
        compiler.clear_memory_cache()
        cold, disk, memory = [], [], []
        for spec in (s.replace(arch_family=args.arch_family) for s in default_specs()):
            start = time.perf_counter()
            source = render(spec)
            render_s = time.perf_counter() - start
            kernel = compiler.compile_source(source, args.arch)
            assert kernel.cache == "miss"
            cold.append(kernel.compile_seconds)
            for _ in range(args.repeat):
                compiler.clear_memory_cache()
                start = time.perf_counter()
                assert compiler.compile_source(source, args.arch).cache == "disk"
                disk.append(time.perf_counter() - start)
                start = time.perf_counter()
                assert compiler.compile_source(source, args.arch).cache == "memory"
                memory.append(time.perf_counter() - start)
            print(f"{spec.name:<28} render {render_s * 1e3:6.1f} ms  cold NVRTC {kernel.compile_seconds:5.2f} s "
                  f"({len(kernel.resources)} kernels)")
    print(f"\nNVRTC {compiler.nvrtc_version()}, arch {args.arch}, {len(cold)} variants (forward + backward each)")
    print(f"cold compile per variant: median {statistics.median(cold):.2f} s, max {max(cold):.2f} s")
    print(f"warm disk-cache hit:     median {statistics.median(disk) * 1e3:.2f} ms")
    print(f"warm memory-cache hit:   median {statistics.median(memory) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
