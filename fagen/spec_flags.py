"""The Spec's mask, flags and version as command-line options.

`fagen build`, `fagen verify` and `fagen tune` share them. They live here,
below both `fagen.cli` and `fagen.tuning.command`, so that neither imports the
other. Every option defaults to "not given" (False or None), so a command can
tell which ones the user set and refuse combinations it would otherwise
silently ignore.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from .arch_families import ARCH_FAMILIES
from .spec import Spec
from .tile_shapes import default_tiles
from .variants.builtins import BUILTINS, WINDOW

DEFAULT_VERSION = 2
# The built-ins but the window (which takes its sizes: `window_sizes`) are flags, one per row.
_SWITCHES = tuple(row for row in BUILTINS if row is not WINDOW)
_FLAGS = (("causal", "--causal"), ("key_padding", "--key-padding"), ("dropout", "--dropout"),
          ("deterministic", "--deterministic"), *((row.flag, row.option[0]) for row in _SWITCHES))


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--causal", action="store_true", help="causal mask (bottom-right aligned)")
    parser.add_argument("--key-padding", action="store_true", help="per-batch key lengths (seqlens_k)")
    parser.add_argument("--dropout", action="store_true", help="Philox dropout in the kernel")
    parser.add_argument("--deterministic", action="store_true", help="backward without atomics")
    # The variants' values are run-time arguments: a flag builds the kernels that take them.
    parser.add_argument(WINDOW.option[0], nargs="*", type=int, metavar="L R", default=None, help=WINDOW.option[1])
    for row in _SWITCHES:
        parser.add_argument(row.option[0], action="store_true", help=row.option[1])
    parser.add_argument("--dv", "--head-dim-v", dest="head_dim_v", type=int, default=None,
                        help="V's head dim d_v, at most --d (default: --d), e.g. --d 192 --dv 128")
    parser.add_argument("--version", type=int, choices=(1, 2), default=None,
                        help=f"1 = FlashAttention-1, 2 = FlashAttention-2 (default {DEFAULT_VERSION})")
    parser.add_argument("--arch-family", choices=ARCH_FAMILIES, default=None,
                        help="the forward's kernel family: sm80 (mma.sync, the default) or sm90 (wgmma and TMA, "
                             "sm_90a only; fagen.arch_families)")


def window_sizes(args: argparse.Namespace) -> list[int] | None:
    """--window's sizes as given: None (no --window), [] (the flag alone) or [left, right]."""
    window = getattr(args, "window", None)
    if window is not None and (len(window) not in (0, 2) or any(w < -1 for w in window)):
        raise ValueError(f"--window takes two ints >= -1 (left right) or none, got {' '.join(map(str, window))}")
    return window


def spec_fields(args: argparse.Namespace) -> dict:
    """The Spec fields the spec options give (unset ones take the Spec's defaults)."""
    window = window_sizes(args)
    return {"version": DEFAULT_VERSION if args.version is None else args.version,
            "mask": "causal" if args.causal else "none", "key_padding": args.key_padding,
            "dropout": args.dropout, "deterministic": args.deterministic, "window": window is not None,
            "head_dim_v": getattr(args, "head_dim_v", None),
            "arch_family": getattr(args, "arch_family", None) or "sm80",
            **{row.flag: getattr(args, row.flag, False) for row in _SWITCHES}}


def spec_flags_given(args: argparse.Namespace) -> list[str]:
    """The spec options set on the command line, as the user spelled them."""
    given = [flag for field, flag in _FLAGS if getattr(args, field, False)]
    given += ["--window"] if getattr(args, "window", None) is not None else []
    given += ["--dv"] if getattr(args, "head_dim_v", None) is not None else []
    given += ["--arch-family"] if getattr(args, "arch_family", None) is not None else []
    return given + (["--version"] if args.version is not None else [])


def build_command(spec: Spec, out_dir: Path | str | None = None) -> str:
    """The `fagen build` command line that writes `spec`'s kernels (into `out_dir`)."""
    parts = ["fagen", "build", "--d", str(spec.head_dim)]
    if spec.head_dim_v != spec.head_dim:
        parts += ["--dv", str(spec.head_dim_v)]
    if spec.dtype != "fp16":
        parts += ["--dtype", spec.dtype]
    if spec.version != DEFAULT_VERSION:
        parts += ["--version", str(spec.version)]
    parts += [flag for field, flag in _FLAGS
              if (spec.causal if field == "causal" else getattr(spec, field))]
    parts += ["--window"] if spec.window else []
    parts += ["--arch-family", spec.arch_family] if spec.arch_family != "sm80" else []
    if spec.score_mod is not None or spec.mask_mod is not None:
        raise ValueError(f"{spec.name} has a custom mod: build it from Python (fagen.variants), not the command line")
    if spec.tiles != default_tiles(spec.head_dim, spec.version):
        parts += ["--block-m", str(spec.block_m), "--block-n", str(spec.block_n),
                  "--num-warps", str(spec.num_warps), "--num-stages", str(spec.num_stages)]
    table = Spec(spec.head_dim, version=spec.version)
    if spec.bwd_stages != table.bwd_stages:
        parts += ["--bwd-stages", str(spec.bwd_stages)]
    if spec.bwd_block_n != table.bwd_block_n:
        parts += ["--bwd-block-n", str(spec.bwd_block_n)]
    if out_dir is not None:
        parts += ["--out", str(out_dir)]
    return shlex.join(parts)
