"""The `fagen` command line: build | list | show | verify | tune | bench."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .spec import DEFAULT_ARCHS, DTYPES, Spec, smem_limit

DEFAULT_OUT = "generated"


def add_variant_flags(parser: argparse.ArgumentParser) -> None:
    """The Spec's mask, flags and version as options (build, verify and tune share them)."""
    parser.add_argument("--causal", action="store_true", help="causal mask (bottom-right aligned)")
    parser.add_argument("--key-padding", action="store_true", help="per-batch key lengths (seqlens_k)")
    parser.add_argument("--dropout", action="store_true", help="Philox dropout in the kernel")
    parser.add_argument("--deterministic", action="store_true", help="backward without atomics")
    parser.add_argument("--version", type=int, choices=(1, 2), default=2,
                        help="1 = FlashAttention-1, 2 = FlashAttention-2 (default)")


def _add_spec_args(parser: argparse.ArgumentParser, many: bool) -> None:
    nargs = "+" if many else None
    parser.add_argument("--d", "--head-dim", dest="head_dim", type=int, nargs=nargs, default=None,
                        help="head dim (several build several variants)" if many else "head dim")
    add_variant_flags(parser)
    parser.add_argument("--dtype", choices=DTYPES, nargs=nargs, default=None,
                        help="element type (default fp16)")
    parser.add_argument("--block-m", type=int, help="query rows per tile (B_r)")
    parser.add_argument("--block-n", type=int, help="key rows per tile (B_c)")
    parser.add_argument("--num-warps", type=int, help="warps per thread block")
    parser.add_argument("--num-stages", type=int, help="K/V pipeline depth")
    parser.add_argument("--bwd-stages", type=int,
                        help="backward Q/dO pipeline depth (default: the table's, made shallow "
                             "enough for every --arch)")


def _specs_from_args(args) -> list[Spec]:
    head_dims = args.head_dim if isinstance(args.head_dim, list) else [args.head_dim]
    dtypes = args.dtype if isinstance(args.dtype, list) else [args.dtype or "fp16"]
    if head_dims == [None]:
        raise ValueError("--d (head dim) is required")
    return [Spec(head_dim=d, dtype=dtype, version=args.version, mask="causal" if args.causal else "none",
                 key_padding=args.key_padding, dropout=args.dropout, deterministic=args.deterministic,
                 block_m=args.block_m, block_n=args.block_n, num_warps=args.num_warps,
                 num_stages=args.num_stages, bwd_stages=getattr(args, "bwd_stages", None))
            for d in head_dims for dtype in dtypes]


def _archs(args) -> list[str]:
    from .compiler import default_archs, parse_archs

    return parse_archs(args.arch) if args.arch else default_archs()


# -- build -----------------------------------------------------------------

def _print_summary(results) -> None:
    print(f"\n{'kernel':<40} {'arch':<7} {'regs':>5} {'spill B':>8} {'smem B':>8} {'compile s':>10}")
    for result in results:
        for arch, compiled in result.compiled.items():
            for entry in result.source.entries:
                report = compiled.resources.get(entry.name)
                regs = report.registers if report else "?"
                spills = report.spill_bytes if report else "?"
                smem = entry.shared_bytes + (report.static_shared_bytes if report else 0)
                seconds = f"{compiled.compile_seconds:.2f}" if compiled.cache == "miss" else compiled.cache
                print(f"{entry.name:<40} {arch:<7} {regs:>5} {spills:>8} {smem:>8} {seconds:>10}")


def cmd_build(args) -> int:
    from .build import build_many, default_specs

    specs = default_specs() if args.default_set else _specs_from_args(args)
    archs = _archs(args)
    if args.default_set or args.bwd_stages is None:
        # One source serves every arch named: its backward must fit the smallest.
        smallest = min(smem_limit(arch) for arch in archs)
        specs = [spec.fit_backward(smallest) for spec in specs]
    out = Path(args.out)
    print(f"building {len(specs)} variant(s) for {', '.join(archs)} into {out}/", flush=True)
    start = time.perf_counter()

    def progress(index, total, result):
        print(f"[{index}/{total}] {result.spec.name}: {result.compile_seconds:.2f} s", flush=True)

    results = build_many(specs, archs, out, progress=progress)
    _print_summary(results)
    print(f"\nwrote {3 * len(results)} file(s) in {time.perf_counter() - start:.1f} s")
    return 0


# -- list / show -----------------------------------------------------------

def cmd_list(args) -> int:
    from .build import read_manifests

    manifests = read_manifests(Path(args.dir))
    if not manifests:
        print(f"no fagen variants in {args.dir}/")
        return 0
    for data in manifests:
        spec = data["spec"]
        archs = ",".join(data["resources"])
        print(f"{data['name']:<44} v{spec['version']} d={spec['head_dim']:<4} {spec['mask']:<7} "
              f"{spec['dtype']}  sha256 {data['source_sha256'][:12]}  [{archs}]")
    return 0


def cmd_show(args) -> int:
    directory = Path(args.dir)
    manifest_path = directory / f"{args.name}.json"
    if not manifest_path.exists():
        print(f"fagen: no variant {args.name!r} in {directory}/ (see `fagen list {directory}`)",
              file=sys.stderr)
        return 2
    data = json.loads(manifest_path.read_text())
    if not args.resources:
        print((directory / data["source"]).read_text(), end="")
        return 0
    print(f"{'kernel':<40} {'arch':<7} {'regs':>5} {'spill B':>8} {'stack B':>8} {'smem B':>8}")
    dynamic = {k["name"]: k["dynamic_shared_bytes"] for k in data["kernels"]}
    for arch, kernels in data["resources"].items():
        for name, r in kernels.items():
            spills = r["spill_store_bytes"] + r["spill_load_bytes"]
            smem = dynamic.get(name, 0) + r["static_shared_bytes"]
            print(f"{name:<40} {arch:<7} {r['registers']:>5} {spills:>8} {r['stack_bytes']:>8} {smem:>8}")
    return 0


# -- verify ----------------------------------------------------------------

def cmd_verify(args) -> int:
    from . import identities

    if args.spec:
        spec = Spec.from_name(args.spec)
    else:
        spec = _specs_from_args(args)[0] if args.head_dim is not None else None
    results = identities.run(spec=spec)
    print(identities.format_table(results))
    return 0 if all(r.ok for r in results) else 1


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fagen", description="fagen: attention kernels from a spec")
    sub = parser.add_subparsers(dest="command", required=True)

    build = sub.add_parser("build", help="render, compile and write kernels and op modules")
    _add_spec_args(build, many=True)
    build.add_argument("--default-set", action="store_true",
                       help="the variants committed in generated/ (d 64/128, causal or not, fp16/bf16)")
    build.add_argument("--arch", help=f"comma-separated archs (default: the GPU's, else $FAGEN_ARCH, "
                                      f"else {','.join(DEFAULT_ARCHS)})")
    build.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: generated/)")
    build.set_defaults(func=cmd_build)

    listing = sub.add_parser("list", help="list the variants in a directory")
    listing.add_argument("dir", nargs="?", default=DEFAULT_OUT)
    listing.set_defaults(func=cmd_list)

    show = sub.add_parser("show", help="print a variant's CUDA source or its resource report")
    show.add_argument("name")
    show.add_argument("--resources", action="store_true", help="registers, spills, shared memory")
    show.add_argument("--dir", default=DEFAULT_OUT)
    show.set_defaults(func=cmd_show)

    verify = sub.add_parser("verify", help="prove the gradient identities with sympy")
    verify.add_argument("--spec", help="only the identities this spec relies on, e.g. fa2_d64_causal_bf16")
    _add_spec_args(verify, many=False)
    verify.set_defaults(func=cmd_verify)

    from .tuning import add_tune_parser

    add_tune_parser(sub)

    bench = sub.add_parser("bench", help="GPU checks and benchmarks (see `fagen bench gpu-check --help`)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for python -m fagen.bench")
    bench.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args) -> int:
    from .bench.__main__ import main as bench_main

    return bench_main(args.bench_args)


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"fagen: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
