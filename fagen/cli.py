"""The `fagen` command line: build | list | show | verify | tune | profile | sass | bench.

    fagen build --d 64 --causal          (also: python -m fagen build --d 64 --causal)

Options a command would ignore, or that contradict each other, are errors
(exit 2) rather than silently dropped. Progress of long work (NVRTC and
emulator builds) is logged through the `fagen` logger, which the command
shows at INFO level on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from .version import __version__
from .arch import DEFAULT_ARCHS, smem_limit
from .arch_families import family_archs
from .spec import DTYPES, Spec
from .spec_flags import add_spec_flags, build_command, spec_fields, spec_flags_given, window_sizes

DEFAULT_OUT = "generated"
SASS_DEFAULT_ARCH = "sm_90"   # fagen sass's arch for a family with no target of its own (sm80), and for --cubin
TILE_OPTIONS = (("block_m", "--block-m"), ("block_n", "--block-n"), ("num_warps", "--num-warps"),
                ("num_stages", "--num-stages"), ("bwd_stages", "--bwd-stages"), ("bwd_block_n", "--bwd-block-n"))


class CommandError(ValueError):
    """A command line that cannot be run as given; printed as `fagen: ...`, exit 2."""


def _add_spec_args(parser: argparse.ArgumentParser, many: bool) -> None:
    nargs = "+" if many else None
    parser.add_argument("--d", "--head-dim", dest="head_dim", type=int, nargs=nargs, default=None,
                        help="head dim (several build several specs)" if many else "head dim")
    add_spec_flags(parser)
    parser.add_argument("--dtype", choices=DTYPES, nargs=nargs, default=None,
                        help="element type (default fp16)")
    parser.add_argument("--block-m", type=int, help="query rows per tile (B_r)")
    parser.add_argument("--block-n", type=int, help="key rows per tile (B_c)")
    parser.add_argument("--num-warps", type=int, help="warps per thread block")
    parser.add_argument("--num-stages", type=int, help="K/V pipeline depth")
    parser.add_argument("--bwd-stages", type=int,
                        help="backward Q/dO pipeline depth (default: the table's, made shallow "
                             "enough for every --arch)")
    parser.add_argument("--bwd-block-n", type=int,
                        help="keys per backward thread block (default: the table's, made small enough "
                             "for every --arch)")


def _spec_options_given(args) -> list[str]:
    """Every option that describes a spec, as the user spelled it."""
    given = ["--d"] if args.head_dim is not None else []
    given += ["--dtype"] if args.dtype is not None else []
    given += spec_flags_given(args)
    return given + [flag for field, flag in TILE_OPTIONS if getattr(args, field) is not None]


def _specs_from_args(args) -> list[Spec]:
    head_dims = args.head_dim if isinstance(args.head_dim, list) else [args.head_dim]
    dtypes = args.dtype if isinstance(args.dtype, list) else [args.dtype or "fp16"]
    if head_dims == [None]:
        raise CommandError("--d (head dim) is required")
    tiles = {field: getattr(args, field) for field, _ in TILE_OPTIONS}
    return [Spec(head_dim=d, dtype=dtype, **spec_fields(args), **tiles)
            for d in head_dims for dtype in dtypes]


def _given_archs(args) -> list[str] | None:
    """The archs --arch names, None where it is not given."""
    from .kernels.compile import parse_archs

    return parse_archs(args.arch) if args.arch is not None else None


def _archs(args, specs: list[Spec]) -> tuple[list[str], str]:
    """The archs to compile `specs` for, and where they came from (for the summary): those of --arch,
    each one every spec's arch family can use, else a family's own target (sm90's sm_90a), else the
    visible GPU's, $FAGEN_ARCH's or the defaults."""
    from .kernels.compile import ARCH_ENV, default_archs, describe_target, gpu_arch

    given = _given_archs(args)
    for family in sorted({spec.arch_family for spec in specs}):
        chosen = family_archs(family, given)
        if given is None and chosen is not None:
            return chosen, f"the {family} family's arch-specific target"
    if given is not None:
        return given, "from --arch"
    device_arch = gpu_arch()
    if device_arch is not None:
        archs = default_archs()
        return archs, f"for this GPU: {describe_target(device_arch, archs[0])}"
    if os.environ.get(ARCH_ENV):
        return default_archs(), f"from ${ARCH_ENV}"
    return default_archs(), "the defaults (no GPU visible)"


# -- build -----------------------------------------------------------------

def _print_summary(results) -> None:
    print(f"\n{'kernel':<40} {'arch':<10} {'regs':>5} {'spill B':>8} {'smem B':>8} {'compile s':>10}")
    for result in results:
        for arch, compiled in result.compiled.items():
            for entry in result.source.entries:
                report = compiled.resources.get(entry.name)
                regs = report.registers if report else "?"
                spills = report.spill_bytes if report else "?"
                smem = entry.shared_bytes + (report.static_shared_bytes if report else 0)
                seconds = f"{compiled.compile_seconds:.2f}" if compiled.cache == "miss" else compiled.cache
                print(f"{entry.name:<40} {arch:<10} {regs:>5} {spills:>8} {smem:>8} {seconds:>10}")


def cmd_build(args) -> int:
    from .kernels.build import build_many, default_specs
    from .kernels.compile import nvrtc_version

    if args.default_set:
        given = _spec_options_given(args)
        if given:
            raise CommandError(f"--default-set builds a fixed set of specs; it takes no "
                               f"{', '.join(given)} (drop --default-set to build your own)")
    specs = default_specs() if args.default_set else _specs_from_args(args)
    archs, where = _archs(args, specs)
    if args.bwd_stages is None and args.bwd_block_n is None:
        # One source serves every arch named: its backward must fit the smallest.
        smallest = min(smem_limit(arch) for arch in archs)
        specs = [spec.fit_backward(smallest) for spec in specs]
    out = Path(args.out)
    print(f"building {len(specs)} spec(s) for {', '.join(archs)} ({where}; NVRTC {nvrtc_version()}) "
          f"into {out}/", flush=True)
    start = time.perf_counter()

    def progress(index, total, result):
        print(f"[{index}/{total}] {result.spec.name}: {result.compile_seconds:.2f} s", flush=True)

    results = build_many(specs, archs, out, progress=progress)
    _print_summary(results)
    print(f"\nwrote {3 * len(results)} file(s) in {time.perf_counter() - start:.1f} s")
    return 0


# -- list / show -----------------------------------------------------------

def cmd_list(args) -> int:
    from .kernels.build import read_manifests

    directory = Path(args.dir)
    if not directory.is_dir():
        raise CommandError(f"no such directory: {directory}/ (`fagen build --out {directory}` makes it)")
    manifests = read_manifests(directory)
    if not manifests:
        print(f"no fagen specs in {directory}/")
        return 0
    for data in manifests:
        spec = data["spec"]
        archs = ",".join(data["resources"])
        print(f"{data['name']:<44} v{spec['version']} d={spec['head_dim']:<4} {spec['mask']:<7} "
              f"{spec['dtype']}  sha256 {data['source_sha256'][:12]}  [{archs}]")
    return 0


def _decoding_spec(name: str) -> Spec | None:
    """The kv_cache spec a name describes, or None (not a name, or not a decoding kernel)."""
    try:
        spec = Spec.from_name(name)
    except ValueError:
        return None
    return spec if spec.kv_cache else None


def _not_built(name: str, directory: Path) -> str:
    try:
        spec = Spec.from_name(name)
    except ValueError as exc:
        return f"fagen: no spec {name!r} in {directory}/, and it is not a spec name: {exc}"
    if spec.kv_cache:
        return (f"fagen: {name} is a decoding kernel: flash_attn_with_kvcache compiles it at run time and no "
                f"op module builds it; `fagen show {name}` prints its CUDA")
    return (f"fagen: {name} is not built in {directory}/; build it with:\n"
            f"    {build_command(spec, directory)}")


def cmd_show(args) -> int:
    directory = Path(args.dir)
    manifest_path = directory / f"{args.name}.json"
    if not manifest_path.exists():
        decoding = _decoding_spec(args.name)
        if decoding is not None and not args.resources:
            # Decoding kernels have no op module to build (flash_attn_with_kvcache renders them
            # at run time), so their source is shown as rendered.
            from .kernels.render import render

            print(render(decoding).code, end="")
            return 0
        print(_not_built(args.name, directory), file=sys.stderr)
        return 2
    data = json.loads(manifest_path.read_text())
    if not args.resources:
        print((directory / data["source"]).read_text(), end="")
        return 0
    print(f"{'kernel':<40} {'arch':<10} {'regs':>5} {'spill B':>8} {'stack B':>8} {'smem B':>8}")
    dynamic = {k["name"]: k["dynamic_shared_bytes"] for k in data["kernels"]}
    for arch, kernels in data["resources"].items():
        for name, r in kernels.items():
            spills = r["spill_store_bytes"] + r["spill_load_bytes"]
            smem = dynamic.get(name, 0) + r["static_shared_bytes"]
            print(f"{name:<40} {arch:<10} {r['registers']:>5} {spills:>8} {r['stack_bytes']:>8} {smem:>8}")
    return 0


# -- verify ----------------------------------------------------------------

def cmd_verify(args) -> int:
    from . import identities

    given = _spec_options_given(args)
    if args.spec:
        if given:
            raise CommandError(f"--spec {args.spec} names the whole spec; it takes no {', '.join(given)}")
        spec = Spec.from_name(args.spec)
    elif given and args.head_dim is None:
        verb = "describes" if len(given) == 1 else "describe"
        raise CommandError(f"{', '.join(given)} {verb} a spec, which also needs --d (or name one with --spec)")
    else:
        spec = _specs_from_args(args)[0] if args.head_dim is not None else None
    results = identities.run(spec=spec)
    print(identities.format_table(results))
    return 0 if all(r.ok for r in results) else 1


def _one_spec(args, run_time: tuple[str, ...] = ()) -> Spec:
    """The spec a command names, by NAME or by --d and its flags (not both). Options in
    `run_time` give run-time values, not the spec, so a NAME takes them too."""
    given = [flag for flag in _spec_options_given(args) if not (args.name and flag in run_time)]
    if args.name and given:
        raise CommandError(f"{args.name} names the whole spec; it takes no {', '.join(given)}")
    if not args.name and args.head_dim is None:
        raise CommandError("name a spec (e.g. fa2_d64_causal_fp16) or give --d and its flags")
    return Spec.from_name(args.name) if args.name else _specs_from_args(args)[0]


# -- profile ---------------------------------------------------------------

def _profile_values(args, spec: Spec) -> dict:
    """`profiling.profile`'s run-time values of `spec`'s variants: the window's sizes from --window,
    fixed values for the others (they change no count)."""
    from . import profiling

    sizes = window_sizes(args)
    if sizes is not None and not spec.window:   # only with a NAME: without one, --window makes a window spec
        raise CommandError(f"--window gives a sliding window's sizes, but {spec.name} has no window")
    if spec.window and not sizes:
        raise CommandError(f"{spec.name} has a sliding window, and fagen profile runs it: give its sizes, "
                           f"--window LEFT RIGHT (e.g. --window 16 0; -1 is unbounded)")
    values = profiling.default_variant_values(spec, heads=args.heads)
    if sizes:
        left, right = sizes
        if left == -1 and (right == -1 or spec.causal):   # flash-attn: no window at all
            why = "-1 leaves the left unbounded and causal already bounds the right" if spec.causal \
                else "-1 is unbounded on both sides"
            raise CommandError(f"--window {left} {right} is no window ({why}): give a LEFT size >= 0")
        values["window_size"] = (left, right)
    return values


def cmd_profile(args) -> int:
    from . import profiling

    spec = _one_spec(args, run_time=("--window",))
    values = _profile_values(args, spec)
    print(f"profiling {spec.name} on the CPU emulator's instrumented build (the first run compiles it)...",
          file=sys.stderr, flush=True)
    result = profiling.profile(spec, seqlen_q=args.seqlen, seqlen_k=args.seqlen_k, batch=args.batch,
                               heads=args.heads, kv_heads=args.kv_heads, backward=args.backward, **values)
    print(profiling.format_table(result))
    if args.json:
        profiling.write_json(result, Path(args.json))
        print(f"\nwrote {args.json}")
    return 0


# -- sass ------------------------------------------------------------------

def _require_cuobjdump() -> None:
    from .sass.listing import find_cuobjdump

    if find_cuobjdump() is None:
        raise CommandError("fagen sass reads machine code with cuobjdump: "
                           "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (the `test` extra has them)")


def cmd_sass(args) -> int:
    from .sass.report import format_reports, report_for_spec

    archs = _given_archs(args)
    if archs is not None and len(archs) != 1:
        raise CommandError(f"--arch takes one arch, got {args.arch!r}")
    if args.cubin:
        _require_cuobjdump()
        given = ([args.name] if args.name else []) + _spec_options_given(args)
        if given:
            raise CommandError(f"--cubin reads a cubin built elsewhere; it takes no spec ({', '.join(given)})")
        return _sass_of_cubin(args, archs[0] if archs else SASS_DEFAULT_ARCH)
    spec = _one_spec(args)
    arch = (family_archs(spec.arch_family, archs) or [SASS_DEFAULT_ARCH])[0]
    _require_cuobjdump()
    reports = report_for_spec(spec, arch)
    print(f"{spec.name} on {arch}: each kernel's main loop, one steady-state iteration, per warp "
          f"(instructions per useful HMMA: FlashAttention-2's measure)")
    print(format_reports(reports, opcodes=args.opcodes))
    if args.json:
        Path(args.json).write_text(json.dumps({name: r.to_json() for name, r in reports.items()}, indent=1))
        print(f"\nwrote {args.json}")
    return 0


def _sass_of_cubin(args, arch: str) -> int:
    """`fagen sass --cubin PATH`: any cubin's kernels (a peer's), per HMMA-equivalent executed."""
    from .sass.listing import SassError
    from .sass.report import cubin_reports, format_cubin_reports

    path = Path(args.cubin)
    if not path.is_file():
        raise CommandError(f"--cubin {args.cubin}: no such file")
    try:
        reports = cubin_reports(path.read_bytes(), arch=arch)
    except SassError as exc:
        raise CommandError(f"--cubin {args.cubin}: {exc}") from None
    print(f"{path.name} ({arch}): each kernel's main loop, one steady-state iteration, per warp; tensor-core "
          f"work in m16n8k16 HMMA-equivalents (one HGMMA.64xNx16 = N/8)")
    print(format_cubin_reports(reports))
    if args.json:
        Path(args.json).write_text(json.dumps({name: r.to_json() for name, r in reports.items()}, indent=1))
        print(f"\nwrote {args.json}")
    return 0


# -- bench -----------------------------------------------------------------

def cmd_bench(args) -> int:
    from .bench.__main__ import main as bench_main

    return bench_main(args.bench_args)


BENCH_DESCRIPTION = """\
Runs `python -m fagen.bench`. Its one command today:

  gpu-check   correctness on the hardware, speed against PyTorch's attention backends,
              peak memory and compute-sanitizer, on one GPU in under 8 minutes
              (`fagen bench gpu-check --dry-run` checks a machine without a GPU)

See `fagen bench gpu-check --help` for its options."""


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fagen", description="fagen: attention kernels from a spec")
    parser.add_argument("--version", action="version", version=f"fagen {__version__}",
                        help="print fagen's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = sub.add_parser("build", help="render, compile and write kernels and op modules")
    _add_spec_args(build, many=True)
    build.add_argument("--default-set", action="store_true",
                       help="the specs committed in generated/ (d 64/128, causal or not, fp16/bf16)")
    build.add_argument("--arch", help=f"comma-separated archs, e.g. sm_80,sm_90 or sm_90a (Hopper's "
                                      f"arch-specific target; cubins for compute capability 9.0 only) "
                                      f"(default: the GPU's, else $FAGEN_ARCH, else {','.join(DEFAULT_ARCHS)}; "
                                      f"for the sm90 family, whose only arch it is, sm_90a)")
    build.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: generated/)")
    build.set_defaults(func=cmd_build)

    listing = sub.add_parser("list", help="list the specs built in a directory")
    listing.add_argument("dir", nargs="?", default=DEFAULT_OUT, metavar="DIR",
                         help="a directory `fagen build` wrote (default: generated/)")
    listing.set_defaults(func=cmd_list)

    show = sub.add_parser("show", help="print a spec's CUDA source or its resource report")
    show.add_argument("name", metavar="NAME", help="a spec's name, e.g. fa2_d64_causal_fp16 (see `fagen list`)")
    show.add_argument("--resources", action="store_true", help="registers, spills, shared memory per kernel and arch")
    show.add_argument("--dir", default=DEFAULT_OUT, help="where the spec was built (default: generated/)")
    show.set_defaults(func=cmd_show)

    verify = sub.add_parser("verify", help="prove the gradient identities with sympy")
    verify.add_argument("--spec", help="only the identities this spec relies on, e.g. fa2_d64_causal_bf16")
    _add_spec_args(verify, many=False)
    verify.set_defaults(func=cmd_verify)

    from .tuning.command import add_tune_parser

    add_tune_parser(sub)
    from .selftest.command import add_selftest_parser

    add_selftest_parser(sub)

    prof = sub.add_parser("profile", help="count a spec's memory traffic, bank conflicts and ops on the CPU",
                          description="Run a spec's kernels in the emulator's instrumented build and count, per kernel: "
                                      "HBM bytes, 32-byte sectors per request, shared-memory bank conflicts, mma, "
                                      "barriers, Philox calls; beside each pass, the FlashAttention IO model's "
                                      "bytes. Counts of a model machine, not GPU timings. Variants run with "
                                      "their run-time values: the window's sizes from --window LEFT RIGHT; fixed "
                                      "ones for softcap, ALiBi and sinks, which change no count "
                                      "(fagen.profiling.default_variant_values).")
    prof.add_argument("name", nargs="?", metavar="NAME", help="a spec's name, e.g. fa2_d64_causal_fp16 "
                                                              "(or give --d and its flags)")
    _add_spec_args(prof, many=False)
    prof.add_argument("--seqlen", type=int, required=True, help="query length N")
    prof.add_argument("--seqlen-k", type=int, help="key length (default: --seqlen)")
    prof.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    prof.add_argument("--heads", type=int, default=1, help="query heads (default 1)")
    prof.add_argument("--kv-heads", type=int, help="K/V heads for GQA/MQA (default: --heads)")
    prof.add_argument("--backward", action="store_true", help="profile the backward kernels too")
    prof.add_argument("--json", metavar="FILE", help="also write the counters as JSON")
    prof.set_defaults(func=cmd_profile)

    sass = sub.add_parser("sass", help="count the main loops' instructions per tensor-core op from SASS (no GPU)",
                          description="Compile a spec's kernels with NVRTC, disassemble it (cuobjdump) and, for each "
                                      "kernel, count one steady-state iteration of its main loop by instruction "
                                      "class, per useful HMMA (gemms x block_m x block_n x d / 2048 / warps), with "
                                      "registers, spills, shared memory and occupancy. See fagen/sass/.")
    sass.add_argument("name", nargs="?", metavar="NAME", help="a spec's name, e.g. fa2_d64_causal_fp16 "
                                                              "(or give --d and its flags)")
    _add_spec_args(sass, many=False)
    sass.add_argument("--arch", help=f"the one arch to compile for (default {SASS_DEFAULT_ARCH}; for the sm90 "
                                     f"family, whose only arch it is, sm_90a)")
    sass.add_argument("--json", metavar="FILE", help="also write the figures as JSON, per kernel")
    sass.add_argument("--opcodes", action="store_true", help="also list each main loop's opcodes per iteration")
    sass.add_argument("--cubin", metavar="PATH",
                      help="read a cubin built elsewhere (a peer's, e.g. FlashAttention-3's) instead of compiling a "
                           "spec; --arch names its arch")
    sass.set_defaults(func=cmd_sass)

    bench = sub.add_parser("bench", help="the GPU check and benchmarks (see `fagen bench gpu-check --help`)",
                           description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="gpu-check ...",
                       help="the bench command and its options, e.g. gpu-check --dry-run")
    bench.set_defaults(func=cmd_bench)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (tests and tools swap it)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def show_progress_log() -> None:
    """Show the `fagen` logger's INFO messages (what is being compiled, for which backend)."""
    logger = logging.getLogger("fagen")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("fagen: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    show_progress_log()
    from .kernels.compile import CompileError

    try:
        return args.func(args)
    except ValueError as exc:
        print(f"fagen: {exc}", file=sys.stderr)
        return 2
    except CompileError as exc:   # NVRTC refused the source, or ptxas serialised a wgmma pipeline
        print(f"fagen: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
