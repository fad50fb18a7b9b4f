"""Compile speed: cold NVRTC seconds per variant and warm cache-hit milliseconds.

A variant is one source holding its forward kernel and all its backward
kernels. NVRTC compiles it as two translation units, the forward's and the
backward's, in parallel threads (`Source.units`), so "cold" is what a user
waits for the first call of a new spec on one arch; each unit's own seconds
are printed beside it.

    python benchmarks/compile_speed.py [--arch sm_90] [--repeat 20] [--arch-family sm90] [--decoding] [--wide]
                                       [--head-dims 192,256]

With --arch-family sm90 the same variants' forward is the sm90 family's (wgmma, TMA; beside the
backward), compiled for sm_90a. With --decoding the variants are
decoding steps' instead (flash_attn_with_kvcache's specs: the forward over the cache, the split-KV
combine and the append). With --wide the head dims are those past 256: d 320, 384, 448 and 512,
plain and causal (decoding: d 512, and absorbed MLA's d = 576 with V from K). --head-dims names
the training specs' head dims instead (bf16, plain and causal; e.g. 192,256: the sm90 backward's paired form).

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
    parser.add_argument("--decoding", action="store_true", help="decoding steps' specs (kv_cache)")
    parser.add_argument("--wide", action="store_true", help="head dims past 256")
    parser.add_argument("--head-dims", default=None, help="training specs at these head dims, e.g. 192,256")
    args = parser.parse_args()
    args.arch = args.arch or ("sm_90a" if args.arch_family == "sm90" else "sm_90")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["FAGEN_CACHE_DIR"] = cache
        compiler.clear_memory_cache()
        cold, units, disk, memory = [], [], [], []
        specs = decoding_specs(args.wide) if args.decoding else training_specs(args.wide, args.head_dims)
        for spec in (in_family(s, args.arch_family) for s in specs):
            start = time.perf_counter()
            source = render(spec)
            render_s = time.perf_counter() - start
            kernel = compiler.compile_source(source, args.arch)
            assert kernel.cache == "miss"
            cold.append(kernel.compile_seconds)
            units.extend(kernel.unit_seconds)
            for _ in range(args.repeat):
                compiler.clear_memory_cache()
                start = time.perf_counter()
                assert compiler.compile_source(source, args.arch).cache == "disk"
                disk.append(time.perf_counter() - start)
                start = time.perf_counter()
                assert compiler.compile_source(source, args.arch).cache == "memory"
                memory.append(time.perf_counter() - start)
            each = " + ".join(f"{s:.2f}" for s in kernel.unit_seconds)
            print(f"{spec.name:<28} render {render_s * 1e3:6.1f} ms  cold NVRTC {kernel.compile_seconds:5.2f} s "
                  f"(units {each} s; {len(kernel.resources)} kernels)")
    what = "a decoding step's kernels each" if args.decoding else "forward + backward each"
    print(f"\nNVRTC {compiler.nvrtc_version()}, arch {args.arch}, {len(cold)} variants ({what})")
    print(f"cold compile per variant: median {statistics.median(cold):.2f} s, max {max(cold):.2f} s "
          f"(its units in parallel, on {os.cpu_count()} CPUs)")
    print(f"cold compile per unit:    median {statistics.median(units):.2f} s, max {max(units):.2f} s")
    print(f"warm disk-cache hit:     median {statistics.median(disk) * 1e3:.2f} ms")
    print(f"warm memory-cache hit:   median {statistics.median(memory) * 1e3:.3f} ms")


def in_family(spec, family: str):
    """`spec` as a call on that family builds it (a decoding step's on sm90: arch_families.chosen_decoding_spec)."""
    from fagen.arch_families import chosen_decoding_spec

    if spec.kv_cache is not None:
        return chosen_decoding_spec(spec, family, None)
    return spec.replace(arch_family=family)


def training_specs(wide: bool, head_dims: str | None = None) -> list:
    """`fagen build`'s default specs, or bf16 plain and causal ones at `head_dims` ("192,256"), or
    past d = 256."""
    from fagen.spec import Spec

    if not wide and head_dims is None:
        return default_specs()
    dims = [int(d) for d in head_dims.split(",")] if head_dims else (320, 384, 448, 512)
    return [Spec(d, dtype="bf16", mask=mask) for d in dims for mask in ("none", "causal")]


def decoding_specs(wide: bool) -> list:
    """The specs flash_attn_with_kvcache builds for one query per head over 8 query heads and 2 K/V
    heads (packed): contiguous and paged (pages of 256), plain and with a causal window, the softcap
    and ALiBi, at d 64, 128 and 256; `wide`: d 512 contiguous and paged, and absorbed MLA (d 576,
    V from K, 16 query heads on one K/V head, pages of 64)."""
    import torch

    from fagen.ops.kvcache import step_spec

    if wide:
        return [step_spec(512, torch.bfloat16, seqlen_q=1, heads=8, kv_heads=2, causal=False, page_size=page,
                          fields={}) for page in (None, 256)] + \
               [step_spec(576, torch.bfloat16, seqlen_q=1, heads=16, kv_heads=1, causal=False, page_size=64,
                          fields={"head_dim_v": 512, "v_from_k": True})]
    variants = ({}, {"window": True, "softcap": True, "alibi": True})
    return [step_spec(d, torch.bfloat16, seqlen_q=1, heads=8, kv_heads=2, causal=bool(fields), page_size=page,
                      fields=fields)
            for d in (64, 128, 256) for page in (None, 256) for fields in variants]


if __name__ == "__main__":
    main()
