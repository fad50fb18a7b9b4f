"""`fagen tune`: tune specs on this machine's GPU, or show / clear the cache.

cli.py registers it with `add_tune_parser(subparsers)`.
"""

from __future__ import annotations

import argparse
import sys

from ..spec import DTYPES, Spec
from ..spec_flags import add_spec_flags, spec_fields, spec_flags_given

DEFAULT_SEQLENS = (2048,)
TOKENS_PER_BATCH = 16384    # FlashAttention-2's benchmark: batch = 16k tokens / seqlen
MODEL_DIM = 2048            # ... and heads = 2048 / head_dim
VARIANT_FLAGS = ("--window", "--softcap", "--alibi", "--sinks")

NO_GPU_MESSAGE = ("fagen tune: tuning times kernels on a CUDA GPU, and none is visible "
                  "(torch.cuda.is_available() is False). Untuned calls use the fallback tile table; "
                  "`fagen tune --show` and `fagen tune --clear` work without a GPU.")


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    tune = subparsers.add_parser(
        "tune", help="autotune block sizes on this GPU and cache the winners",
        description="Tune block_m, block_n, num_warps and num_stages for one spec on the visible GPU. "
                    "Winners are cached per GPU, driver, NVRTC version, spec and shape bucket, and "
                    "flash_attn_func uses them automatically.")
    tune.add_argument("--d", "--head-dim", dest="head_dim", type=int, help="head dim")
    add_spec_flags(tune)
    tune.add_argument("--dtype", choices=DTYPES, nargs="+", default=None,
                      help="element type(s) (default fp16)")
    tune.add_argument("--seqlen", type=int, nargs="+", default=None,
                      help=f"sequence length(s) to tune for, one tuning each (default {DEFAULT_SEQLENS[0]})")
    tune.add_argument("--seqlen-k", type=int, help="key length, if it differs from --seqlen")
    tune.add_argument("--batch", type=int, help=f"batch size (default {TOKENS_PER_BATCH} // seqlen)")
    tune.add_argument("--heads", type=int, help=f"query heads (default {MODEL_DIM} // head dim)")
    tune.add_argument("--workers", type=int, help="compile threads (default: one per CPU)")
    tune.add_argument("--show", action="store_true", help="list the cached tunings and exit")
    tune.add_argument("--clear", action="store_true", help="delete the cached tunings and exit")
    tune.set_defaults(func=cmd_tune)
    return tune


def _tuning_options_given(args) -> list[str]:
    given = ["--d"] if args.head_dim is not None else []
    given += spec_flags_given(args)
    given += [flag for field, flag in (("dtype", "--dtype"), ("seqlen", "--seqlen"), ("seqlen_k", "--seqlen-k"),
                                       ("batch", "--batch"), ("heads", "--heads"), ("workers", "--workers"))
              if getattr(args, field) is not None]
    return given


def cmd_tune(args) -> int:
    from . import cache

    if args.clear or args.show:
        given = _tuning_options_given(args)
        if given:
            raise ValueError(f"--show and --clear take no tuning options, got {', '.join(given)}")
        if args.clear:
            removed = cache.clear_cache()
            print(f"removed {removed} file(s) from {cache.tune_dir()}")
        if args.show:
            print(cache.show_cache())
        return 0
    if args.head_dim is None:
        print("fagen tune: --d (head dim) is required (or --show / --clear)", file=sys.stderr)
        return 2
    specs = [Spec(head_dim=args.head_dim, dtype=dtype, **spec_fields(args))
             for dtype in args.dtype or ["fp16"]]   # an illegal spec is reported before the GPU question
    variants = [flag for flag in spec_flags_given(args) if flag in VARIANT_FLAGS]
    if variants:   # the tuner's oracle check (measure.ReferenceCheck) runs no variant values yet
        print(f"fagen tune: {', '.join(variants)} {'is a variant' if len(variants) == 1 else 'are variants'}, "
              f"which tuning does not cover yet: variant calls use the fallback tile table. Tune without "
              f"{'it' if len(variants) == 1 else 'them'}.", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    from .tuner import tune

    heads = args.heads or max(1, MODEL_DIM // args.head_dim)
    for spec in specs:
        for seqlen in args.seqlen or DEFAULT_SEQLENS:
            batch = args.batch or max(1, TOKENS_PER_BATCH // seqlen)
            print(f"\n{spec.base_name}: batch {batch}, heads {heads}, seqlen {seqlen}"
                  + (f", seqlen_k {args.seqlen_k}" if args.seqlen_k else ""), flush=True)
            result = tune(spec, seqlen_q=seqlen, seqlen_k=args.seqlen_k, batch=batch, heads=heads,
                          workers=args.workers)
            print(result.table())
            fallback_ms = result.entry.fallback_ms
            speedup = f", {fallback_ms / result.entry.median_ms:.2f}x the fallback" if fallback_ms else ""
            print(f"winner: {result.winner.name} ({result.entry.median_ms:.4f} ms{speedup}); "
                  f"{len(result.pruned)} pruned, {len(result.rejected)} rejected, "
                  f"cached as {result.entry.path.name}")
    return 0
