"""FlashAttention-3's Hopper kernels measured with fagen's SASS reader, beside fagen's own, in one run.

    python benchmarks/sass_vs_fa3.py [--json FILE]

The peer is FlashAttention-3 as three PyPI wheels ship it (pinned below): `flash-attn3-jax`
(forward and backward, d 128), `fa3-fwd` (forward, d 64/128/256) and `dew-flash-attn-cu12`
(backward, d 64/128/192/256, with deterministic variants; ptxas 12.9), their sm_90a cubins. On
first use the wheels are fetched (`pip download --no-deps`, about 150 MB), the SASS of just the
plain kernels is kept in the fagen cache (`<cache>/fa3-peer/`) and everything else is deleted.

A kernel is picked by its template arguments, read from its demangled name (c++filt, from
binutils, is needed): `CollectiveMainloopFwdSm90<Stages, Cluster, Tile<M, N, d>, d_v, Element,
float, Sm90, Is_causal, Is_local, Has_softcap, Varlen, PagedKVNonTMA, AppendKV, HasQv,
MmaPV_is_RS, IntraWGOverlap, PackGQA, Split, V_colmajor>` with d_v = d and every feature flag
false but Is_causal (and FA3's own choices MmaPV_is_RS, IntraWGOverlap), and
`CollectiveMainloopBwdSm90<..., Tile, Element, float, Sm90, Is_causal, Is_local, Has_softcap,
Varlen, Deterministic, ...>` with the features false. fp16 and bf16 both, and the forward in
e4m3 (issue 45's peer: the `sm90` columns read fagen's e4m3 forward, `Spec(dtype="e4m3")`, at the
head dims it takes, 64, 128, 192 and 256; the sm80 family has no fp8 kernel, so `fagen` is a dash there).

A second table, "FA3 backward", reads every dense backward of `dew-flash-attn-cu12` (and of
`flash-attn3-jax`, d128), deterministic or not (`describe_backward`): the mainloop's thirteen
template arguments `<Stages, Stages_dO, Stages_dS, Cluster, Tile<M, N, d>, Element, float, Sm90,
Is_causal, Is_local, Has_softcap, Varlen, Deterministic, SdP_swapAB, dKV_swapAB, dQ_swapAB,
NumMmaWarpGroups, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ, Mma_dP_is_RS>`, with the
epilogue that writes dK and dV (`CollectiveEpilogueBwd`; each kernel also comes with GQA's
fp32 epilogue, `CollectiveEpilogueBwdGQA`, left out). Its `other loops` column reads, the same
way, the kernel's other loops with as much tensor work as the consumer's: FA3 runs a causal key
block's masked iterations in a loop of their own at d <= 64 (`SeparateMaskingIterations`), and
the main-loop rule (`fagen.sass.report`: on a tie, the first) reads the masked one. It is issue
44's SASS target. Its `fagen` column is the sm80 family's backward; `sm90` is the sm90 family's own
backward (templates/sm90/hopper_bwd.cu.j2 at d 64 and 128, hopper_bwd_paired.cu.j2 at 192 and 256),
read as FA3's cubins are. Its d64 rows end with the prototype Hopper backward micro-kernel's figures
(tests/emulate/kernels/hopper_backward.cu, not fagen's dispatched backward; `prototype_figures`):
compiled for sm_90a by fagen's NVRTC path and read as FA3's cubins are (`cubin_reports`). Its
`causal` is a runtime argument and it masks every tile, so one consumer loop serves causal and
non-causal alike (no separate unmasked loop); it has no deterministic mode.

Both sides are read by `fagen.sass` (the same steady state and instruction classes). The peer
is divided by the HMMA-equivalents its iteration executes (one HGMMA.64xNx16 = N/8 per warp, an
e4m3 QGMMA.64xNx32 N/4; `fagen sass --cubin`), fagen by its useful HMMA (`fagen sass`), which for these kernels equal
the executed ones. A benchmark, not a test: log the table in benchmarks/RESULTS.md.

FA3's kernels are warp-specialised, and the columns after fagen/FA3 read each role's loop
(`fagen.sass.roles`):
- the warpgroups: one producer + the consumers, whose count is the epilogue's thread count
  / 128 (`CollectiveEpilogue*<..., NumEpilogueThreads, ...>`);
- the `setmaxnreg` each runs under (producer/consumer);
- the instructions of one steady-state iteration of the consumer's and of the producer's
  loop, and the producer's loads (UTMALDG) in it. An iteration of the producer's loop is
  as ptxas laid it out: at d128 forward it is unrolled to two K/V blocks, four UTMALDG
  each, against the consumer's one;
- how many of the consumer's exp2 issue while a wgmma group is in flight
  (`fagen.sass.overlap`);
- whether the register budgets and setmaxnreg values fit sm_90a (`fagen.sass.facts`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from fagen.arch_families import sm90_backward_refusal
from fagen.cache_files import cache_dir
from fagen.kernels.compile import compile_source, nvrtc_version
from fagen.kernels.render import render
from fagen.sass.cfg import build_graph
from fagen.sass.classes import TENSOR_CLASSES, tensor_equivalents
from fagen.sass.listing import find_cuobjdump, parse_listing
from fagen.sass.report import analyse_foreign, cubin_reports, readable_names, report_for_spec
from fagen.sass.steady_state import steady_iteration
from fagen.spec import Spec
from fagen.tuning.fallback import fallback_spec

WHEELS = {"flash-attn3-jax": "0.2.3", "fa3-fwd": "0.0.3"}
FLAGS = ("true", "false")
TRIPLE = r"cute::tuple<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)> >"   # a cute shape of three
FWD = re.compile(rf"CollectiveMainloopFwdSm90<\d+, {TRIPLE}, {TRIPLE}, (\d+), cutlass::(\w+), float, "
                 r"cutlass::arch::Sm90, ((?:(?:true|false), ){11}(?:true|false))>")
BWD = re.compile(rf"CollectiveMainloopBwdSm90<\d+, \d+, \d+, {TRIPLE}, {TRIPLE}, cutlass::(\w+), float, "
                 r"cutlass::arch::Sm90, ((?:(?:true|false), ){4}(?:true|false))")
DTYPES = {"bfloat16_t": "bf16", "half_t": "fp16"}
FORWARD_DTYPES = {**DTYPES, "float_e4m3_t": "e4m3"}   # issue 45's peer: FA3's e4m3 forward (it has no fp8 backward)
BACKWARD_WHEELS = {"dew-flash-attn-cu12": "0.3.6", "flash-attn3-jax": "0.2.3"}
LIBRARIES = {"dew-flash-attn-cu12": "flash_attn3"}   # its other library is FlashAttention-2's (366 MB, no sm_90a)
BWD_ARGS = re.compile(rf"CollectiveMainloopBwdSm90<(\d+), (\d+), (\d+), {TRIPLE}, {TRIPLE}, cutlass::(\w+), float, "
                      r"cutlass::arch::Sm90, ((?:\w+, ){11,12}\w+)>, flash::(CollectiveEpilogue\w*)<")
BWD_ARG_NAMES = ("causal", "local", "softcap", "varlen", "deterministic", "sdp_swap_ab", "dkv_swap_ab", "dq_swap_ab",
                 "mma_warpgroups", "atom_m_sdp", "atom_n_dkv", "atom_m_dq", "dp_is_rs")
ROLE_WIDTHS = (4, 8, 6, 6, 5, 8)   # WGs, maxnreg P/C, cons instr, prod instr, TMA loads, exp2 in flight
EPILOGUE_THREADS = re.compile(r"CollectiveEpilogue\w*<.*?, (\d+), (?:true|false)")
# The prototype Hopper backward (issue 44's de-risking micro-kernel, d 64 only): one kernel per dtype.
PROTOTYPE = Path(__file__).resolve().parents[1] / "tests" / "emulate" / "kernels" / "hopper_backward.cu"
PROTOTYPE_HEAD_DIM, PROTOTYPE_TILE = 64, "64x128"   # query rows per step x keys per CTA
PROTOTYPE_WIDTHS = (7, 6, 8, 7, 8, 5, 5, 9)   # loop, cons instr, HMMA-eq, proto, maxnreg P/C, SHFL, regs, proto/FA3


def peer_dir() -> Path:
    """The forward kernels' cache: the wheels', with e4m3's (fetched again where an older cache lacks them)."""
    return cache_dir() / "fa3-peer" / ("-".join(f"{name}-{version}" for name, version in WHEELS.items()) + "-e4m3")


def _run(command: list[str], **kwargs) -> str:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... failed:\n{result.stderr.strip()[-2000:]}")
    return result.stdout


def describe(demangled: str) -> dict | None:
    """The plain forward or backward kernel's (pass, d, dtype, causal, tile), from its demangled
    name (the forward in e4m3 too); None for any other instantiation (a feature on, d_v != d)."""
    if "FlashAttnFwdSm90" in demangled and (m := FWD.search(demangled)):
        cluster, _, _, block_m, block_n, d, d_v, element, flags = m.groups()
        flags = [f == "true" for f in flags.split(", ")]
        causal, others = flags[0], flags[1:7] + flags[9:]   # skip MmaPV_is_RS, IntraWGOverlap
        if element in FORWARD_DTYPES and d == d_v and not any(others):
            return {"pass": "fwd", "head_dim": int(d), "dtype": FORWARD_DTYPES[element], "causal": causal,
                    "tile": f"{block_m}x{block_n}" + (f" c{cluster}" if cluster != "1" else "")}
    if "FlashAttnBwdSm90" in demangled and (m := BWD.search(demangled)):
        cluster, _, _, block_m, block_n, d, element, flags = m.groups()
        flags = [f == "true" for f in flags.split(", ")]
        if element in DTYPES and not any(flags[1:]):
            return {"pass": "bwd", "head_dim": int(d), "dtype": DTYPES[element], "causal": flags[0],
                    "tile": f"{block_m}x{block_n}" + (f" c{cluster}" if cluster != "1" else "")}
    return None


def describe_backward(demangled: str) -> dict | None:
    """A dense backward kernel's (pass, d, dtype, causal, deterministic, tile) and its other
    template arguments, from its demangled name; None for any other kernel (a local window,
    softcap or varlen on, GQA's epilogue, fp8)."""
    m = BWD_ARGS.search(demangled) if "FlashAttnBwdSm90" in demangled else None
    if m is None:
        return None
    stages, stages_do, stages_ds, cluster, _, _, block_m, block_n, d, element, args, epilogue = m.groups()
    values = dict(zip(BWD_ARG_NAMES, (v == "true" if v in FLAGS else int(v) if v.isdigit() else v
                                      for v in args.split(", "))))
    if element not in DTYPES or epilogue != "CollectiveEpilogueBwd" or any(
            values[k] for k in ("local", "softcap", "varlen")):
        return None
    return {"pass": "bwd", "head_dim": int(d), "dtype": DTYPES[element], "causal": values["causal"],
            "deterministic": values["deterministic"],
            "tile": f"{block_m}x{block_n}" + (f" c{cluster}" if cluster != "1" else ""),
            "template": {"stages": int(stages), "stages_do": int(stages_do), "stages_ds": int(stages_ds),
                         **{k: v for k, v in values.items() if k in BWD_ARG_NAMES[5:]}}}


def warpgroups(demangled: str) -> dict[str, int] | None:
    """FA3's warpgroups by role: one producer, and as many consumers as its epilogue has threads
    (the consumers write the output) / 128; None where the name does not say."""
    m = EPILOGUE_THREADS.search(demangled)
    if m is None or int(m.group(1)) % 128:
        return None
    return {"producer": 1, "consumer": int(m.group(1)) // 128}


def backward_dir() -> Path:
    return cache_dir() / "fa3-peer" / ("bwd-" + "-".join(f"{n}-{v}" for n, v in BACKWARD_WHEELS.items()))


def fetch_peer() -> Path:
    """The plain kernels' SASS, one file per kernel, fetched once into the cache."""
    return fetch_kernels(peer_dir(), WHEELS, describe)


def fetch_kernels(target: Path, wheels: dict[str, str], pick, libraries: dict[str, str] | None = None) -> Path:
    """The SASS of the kernels `pick` (demangled name -> the kernel's fields, or None) takes from
    the wheels' sm_90a cubins, one file per kernel, fetched once into `target`; `libraries`: a
    wheel's shared libraries read, by a part of their name (default: all)."""
    if (target / "kernels.json").exists():
        return target
    tool = find_cuobjdump()
    if tool is None or shutil.which("c++filt") is None:
        raise SystemExit("needs cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm) and c++filt")
    kernels = []
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fagen-fa3-") as tmp:
        tmp = Path(tmp)
        for wheel_name, version in wheels.items():
            print(f"fetching {wheel_name} {version} (once)...", file=sys.stderr, flush=True)
            _run([sys.executable, "-m", "pip", "download", "--no-deps", f"{wheel_name}=={version}", "-d", str(tmp),
                  "-q"])
            wheel = next(tmp.glob(wheel_name.replace("-", "_") + "-*.whl"))
            cubins = tmp / wheel_name
            cubins.mkdir()
            with zipfile.ZipFile(wheel) as archive:
                for member in (n for n in archive.namelist() if n.endswith(".so")
                               and (libraries or {}).get(wheel_name, "") in Path(n).name):
                    library = cubins / Path(member).name
                    library.write_bytes(archive.read(member))
                    _run([tool, "-xelf", "all", str(library)], cwd=cubins)
                    library.unlink()
            wheel.unlink()
            for cubin in sorted(cubins.glob("*sm_90a.cubin")):
                sass = _run([tool, "-sass", str(cubin)])
                functions = parse_listing(sass)
                names = readable_names(functions)
                for name in functions:
                    found = pick(names[name])
                    if found is None:
                        continue
                    index = len(kernels)
                    (target / f"{index}.sass").write_text(_run([tool, "-sass", "-fun", name, str(cubin)]))
                    kernels.append({**found, "wheel": wheel_name, "name": name})
            shutil.rmtree(cubins)
    (target / "kernels.json").write_text(json.dumps(kernels, indent=1))
    return target


def peer_rows(target: Path | None = None) -> list[dict]:
    target = target or fetch_peer()
    kernels = json.loads((target / "kernels.json").read_text())
    names = readable_names(kernel["name"] for kernel in kernels)
    rows = []
    for index, kernel in enumerate(kernels):
        instructions = parse_listing((target / f"{index}.sass").read_text())[kernel["name"]]
        rows.append({**kernel, "report": analyse_foreign(kernel["name"], instructions, "sm_90"),
                     "warpgroups": warpgroups(names[kernel["name"]]), "instructions": instructions})
    return rows


def role_columns(report, groups: dict[str, int] | None) -> tuple[str, dict]:
    """The table's columns after fagen/FA3 (the roles, setmaxnreg, overlap, limits) and their JSON."""
    consumer, producer = report.roles.get("consumer"), report.roles.get("producer")
    registers = "/".join(str(r.registers) if r and r.registers else "-" for r in (producer, consumer))
    problems = report.limit_problems(groups)
    record = {"warpgroups": groups, "roles": {role: loop.to_json() for role, loop in report.roles.items()},
              "overlap": report.overlap and report.overlap.to_json(), "limit_problems": problems}
    overlap = report.overlap
    cells = ("-" if groups is None else f"1+{groups['consumer']}", registers,
             consumer.instructions if consumer else "-", producer.instructions if producer else "-",
             producer.work["UTMALDG"] if producer else "-",
             "-" if overlap is None else f"{overlap.exp2_in_flight}/{overlap.exp2}")
    text = " ".join(f"{cell:>{width}}" for cell, width in zip(cells, ROLE_WIDTHS))
    return f"{text} {'ok' if not problems else '; '.join(problems)}", record


def fagen_figure(row: dict) -> float | None:
    """fagen's mma.sync kernel for the same problem on sm_90 (its fallback tiles); None for e4m3,
    which the sm80 family does not take (its fp8 forward is the sm90 family's: `fagen_sm90_figure`)."""
    if row["dtype"] not in ("fp16", "bf16"):
        return None
    spec = fallback_spec(Spec(row["head_dim"], dtype=row["dtype"], mask="causal" if row["causal"] else "none"),
                         "sm_90")
    reports = report_for_spec(spec, "sm_90")
    return reports[spec.name + ("_fwd" if row["pass"] == "fwd" else "_bwd")].non_hmma_per_useful_hmma


def fagen_sm90_figure(row: dict):
    """fagen's sm90 family kernel for the same problem (Spec.arch_family = 'sm90', compiled for
    sm_90a): its forward, or its own backward where that takes the spec; read as the peer is: per
    HMMA-equivalent (`cubin_reports`). (figure, report), or (None, None) where the family has no
    such kernel yet."""
    try:
        spec = Spec(row["head_dim"], dtype=row["dtype"], mask="causal" if row["causal"] else "none", arch_family="sm90",
                    deterministic=row["pass"] != "fwd" and row.get("deterministic", False))
    except ValueError:   # a head dim the family does not take yet
        return None, None
    if row["pass"] != "fwd" and sm90_backward_refusal(spec) is not None:   # it runs the sm80 family's
        return None, None
    report = cubin_reports(*compile_source(render(spec), "sm_90a").cubins, arch="sm_90a")[spec.name + "_" + row["pass"]]
    return report.non_tensor_per_tensor_op, report


def other_loops(instructions, report) -> list[dict]:
    """The function's loops, other than the main one, with as much tensor work of their own as it
    (FA3's masked and unmasked loops of a causal key block at d <= 64), each read as the main loop is."""
    graph = build_graph(instructions)

    def own(loop):   # report.analyse_function's measure: the tensor work not in a loop nested in it
        nested = set().union(*(child.body for child in loop.children))
        return sum(tensor_equivalents(i) for b in loop.body - nested for i in graph.blocks[b].instructions)

    main = next((loop for loop in graph.loops if graph.blocks[loop.header].start == report.loop_address), None)
    found = []
    for loop in graph.loops if main else ():
        start = graph.blocks[loop.header].start
        if loop is main or own(loop) < own(main):
            continue
        iteration = steady_iteration(graph, loop)
        non_tensor = iteration.instructions - sum(iteration.counts.get(c, 0) for c in TENSOR_CLASSES)
        found.append({"loop": f"{start:#06x}", "instructions": iteration.instructions,
                      "hmma_equivalents": iteration.tensor_ops, "shfl": iteration.counts.get("SHFL", 0),
                      "fa3": non_tensor / iteration.tensor_ops})
    return found


def prototype_figures() -> dict[str, dict] | None:
    """The prototype Hopper backward micro-kernel (PROTOTYPE) by dtype: compiled for sm_90a by
    fagen's NVRTC path (`compile_source`, which refuses a build with serialised wgmma) and read
    from its cubin as FA3's kernels are (`cubin_reports`: the loop with the most tensor work of its
    own, one steady-state iteration, per HMMA-equivalent from its HGMMA shapes), with the registers
    ptxas reports. Its `causal` is a runtime argument and it masks every tile, so one loop serves
    causal and non-causal. None where the source is not in the tree."""
    if not PROTOTYPE.exists():
        return None
    kernel = compile_source(PROTOTYPE.read_text(), "sm_90a")
    reports = cubin_reports(*kernel.cubins, arch="sm_90a")
    figures = {}
    for dtype in ("bf16", "fp16"):   # the prototype's two kernels
        name = f"hopper_backward_{dtype}"
        report = reports[name]
        consumer, producer = report.roles.get("consumer"), report.roles.get("producer")
        figures[dtype] = {
            "kernel": name, "tile": PROTOTYPE_TILE, "ratio": report.non_tensor_per_tensor_op,
            "loop": None if report.loop_address is None else f"{report.loop_address:#06x}",
            "instructions": consumer.instructions if consumer else report.instructions,
            "hmma_equivalents": report.tensor_ops, "shfl": report.counts.get("SHFL", 0),
            "setmaxnreg": "/".join(str(r.registers) if r and r.registers else "-" for r in (producer, consumer)),
            "ptxas_registers": kernel.resources[name].registers,
            "spill_bytes": kernel.resources[name].spill_bytes, "problem": report.problem}
    return figures


def prototype_cells(figure: dict | None, peer: float | None) -> tuple[str, float | None]:
    """The d64 rows' trailing prototype columns, and prototype/FA3."""
    ratio = figure and figure["ratio"]
    versus = ratio / peer if ratio and peer else None
    cells = ("-",) * 7 if figure is None else (
        figure["loop"] or "-", figure["instructions"], f"{figure['hmma_equivalents']:g}",
        "-" if ratio is None else f"{ratio:.2f}", figure["setmaxnreg"], figure["shfl"], figure["ptxas_registers"])
    cells += ("-" if versus is None else f"{versus:.2f}",)
    return " ".join(f"{cell:>{width}}" for cell, width in zip(cells, PROTOTYPE_WIDTHS)), versus


def backward_rows() -> list[dict]:
    return peer_rows(fetch_kernels(backward_dir(), BACKWARD_WHEELS, describe_backward, LIBRARIES))


def backward_table(rows: list[dict]) -> list[dict]:
    """Print the backward tables, one per wheel; their JSON records."""
    records, fagen, prototype = [], {}, None
    if any(r["head_dim"] == PROTOTYPE_HEAD_DIM for r in rows):
        prototype = prototype_figures()
    proto_header = (" " * 3 + " ".join(f"{h:>{w}}" for h, w in zip(
        ("proto", "cons", "HMMA-eq", "proto", "maxnreg", "SHFL", "ptxas", "proto/FA3"), PROTOTYPE_WIDTHS)),
        " " * 3 + " ".join(f"{h:>{w}}" for h, w in zip(("loop", "instr", "", "", "P/C", "", "regs", ""),
                                                       PROTOTYPE_WIDTHS)).rstrip())
    header = (f"{'d':>4} {'causal':>6} {'det':>4} {'dtype':>5} {'tile':<7} {'WGs':>4} {'maxnreg':>8} {'cons':>6}"
              f" {'HMMA-eq':>8} {'FA3':>5} {'SHFL':>5} {'dQ':>8}  {'other loops':<18} {'fagen':>6} {'fagen/FA3':>9}"
              f" {'sm90':>5} {'sm90/FA3':>8}")
    for wheel, version in BACKWARD_WHEELS.items():
        mine = sorted((r for r in rows if r["wheel"] == wheel),
                      key=lambda r: (r["head_dim"], r["causal"], r["deterministic"], r["dtype"]))
        print(f"\nFA3 backward ({wheel} {version})")
        with_prototype = prototype is not None and any(r["head_dim"] == PROTOTYPE_HEAD_DIM for r in mine)
        print(header + (proto_header[0] if with_prototype else ""))
        second = f"{'':<31}{'C':>4} {'P/C':>8} {'instr':>6}"
        print(second + (f"{'':<{len(header) - len(second)}}{proto_header[1]}" if with_prototype else ""))
        seen = set()
        for row in mine:
            key = tuple(row[k] for k in ("head_dim", "causal", "deterministic", "dtype", "tile"))
            if key in seen:
                continue
            seen.add(key)
            report, groups = row["report"], row["warpgroups"]
            peer, consumer = report.non_tensor_per_tensor_op, report.roles.get("consumer")
            registers = "/".join(str(r.registers) if r and r.registers else "-"
                                 for r in (report.roles.get("producer"), consumer))
            if not row["deterministic"] and (row["head_dim"], row["dtype"], row["causal"]) not in fagen:
                fagen[row["head_dim"], row["dtype"], row["causal"]] = fagen_figure(row)
            ours = None if row["deterministic"] else fagen[row["head_dim"], row["dtype"], row["causal"]]
            sm90 = fagen_sm90_figure(row)[0]   # deterministic rows: dQ's reductions take turns
            others = other_loops(row["instructions"], report)
            shown = ", ".join(f"{o['loop']}: {o['fa3']:.2f}" for o in others) or "-"
            reduce = sum(n for op, n in report.opcodes.items() if op.split(".")[0] in ("REDG", "RED", "ATOMG"))
            dq = f"REDG {reduce}" if reduce else "writer" if "writer" in report.roles else "-"
            yes = {True: "yes", False: "no"}
            proto_text, proto_record = "", None
            if with_prototype and row["head_dim"] == PROTOTYPE_HEAD_DIM:
                figure = None if row["deterministic"] else prototype[row["dtype"]]   # it has no deterministic mode
                proto_text, versus = prototype_cells(figure, peer)
                proto_text = "   " + proto_text
                proto_record = figure and {**figure, "prototype_over_fa3": versus, "prototype_over_fa3_other_loops": [
                    figure["ratio"] / o["fa3"] for o in others if figure["ratio"] and o["fa3"]]}
            print(f"{row['head_dim']:>4} {yes[row['causal']]:>6} {yes[row['deterministic']]:>4} {row['dtype']:>5}"
                  f" {row['tile']:<7} {'-' if groups is None else groups['consumer']:>4} {registers:>8}"
                  f" {report.instructions:>6} {report.tensor_ops:>8g} {'-' if peer is None else f'{peer:.2f}':>5}"
                  f" {report.counts.get('SHFL', 0):>5} {dq:>8}  {shown:<18} {'-' if ours is None else f'{ours:.2f}':>6}"
                  f" {'-' if not (ours and peer) else f'{ours / peer:.2f}':>9}"
                  f" {'-' if sm90 is None else f'{sm90:.2f}':>5} {'-' if not (sm90 and peer) else f'{sm90 / peer:.2f}':>8}"
                  + (f"  ({report.problem})" if report.problem else "") + proto_text)
            _, role_record = role_columns(report, groups)
            records.append({k: row[k] for k in ("wheel", "pass", "head_dim", "dtype", "causal", "deterministic",
                                                 "tile", "template")}
                           | {"table": "fa3_backward", "version": version, "fa3": peer, "fagen": ours,
                              "fagen_sm90": sm90, "hmma_equivalents": report.tensor_ops,
                              "instructions": report.instructions, "shfl": report.counts.get("SHFL", 0), "dq": dq,
                              "main_loop": None if report.loop_address is None else f"{report.loop_address:#06x}",
                              "other_loops": others} | role_record
                           | ({"prototype": proto_record} if row["head_dim"] == PROTOTYPE_HEAD_DIM else {}))
        missing = sorted({r["head_dim"] for r in mine} - {r["head_dim"] for r in mine if r["deterministic"]})
        if missing:
            print(f"(no deterministic kernel in the wheel at d {', '.join(map(str, missing))})")
    print("FA3: non-tensor instructions per HMMA-equivalent, the consumer loop's steady state (the loop with the most\n"
          "  tensor work, on a tie the first); other loops: the kernel's other loops with as much, read the same way;\n"
          "  dQ: REDG n = reduced from the consumer loop, writer = bulk-reduced by the writer warp (UBLKRED);\n"
          "  fagen: the sm80 family's non-deterministic backward (mma.sync, fallback tiles, per useful HMMA);\n"
          "  sm90: the sm90 family's own backward (wgmma, TMA; d 64-256; det: dQ's reductions in key-block\n"
          "  order, a semaphore per query block), read as FA3 is")
    if prototype is not None:
        print("proto (d64 rows): the prototype Hopper backward micro-kernel (tests/emulate/kernels/\n"
              "  hopper_backward.cu, not fagen's dispatched backward), compiled for sm_90a by NVRTC, read as FA3 is:\n"
              "  its consumer loop, instructions, HMMA-equivalents and non-tensor/HMMA-eq per iteration per warp\n"
              "  (its tile 64x128: 64 queries x 128 keys, 2 consumer WGs), setmaxnreg P/C, SHFL, ptxas's registers,\n"
              "  proto/FA3 (over the FA3 column); causal is a runtime argument and it masks every tile: one loop\n"
              "  serves causal and non-causal, no separate unmasked loop; no deterministic mode: '-' in det rows")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = parser.parse_args()
    rows = peer_rows()
    # ptxas's version decides some of fagen's figures (12.9 joins the e4m3 forward's packed P with 28
    # PRMT at d 128 that 13.x folds into F2FP ... MERGE_C): say which compiled them.
    print(f"non-tensor instructions per HMMA-equivalent, main loop steady state (fagen.sass), sm_90(a); fagen's "
          f"kernels compiled by NVRTC {nvrtc_version()}")
    print("fagen = the sm80 family (mma.sync, the fallback tiles); sm90 = fagen's sm90 family (wgmma, TMA);"
          " exp2 in wgmma: FA3's / the sm90 family's")
    print(f"{'wheel':<16} {'kernel':<18} {'FA3 tile':<9} {'HMMA-eq':>8} {'FA3':>6} {'fagen':>6} {'fagen/FA3':>9}"
          f" {'sm90':>6} {'sm90/FA3':>8}  {'WGs':>4} {'maxnreg':>8} {'cons':>6} {'prod':>6} {'TMA':>5} {'exp2':>8}"
          f" {'sm90':>6} limits")
    print(f"{'':<96}{'P/C':>8} {'instr':>6} {'instr':>6} {'loads':>5} {'in wgmma':>8}")
    records, seen = [], set()
    for row in sorted(rows, key=lambda r: (r["pass"] != "fwd", r["head_dim"], r["dtype"], r["causal"], r["wheel"])):
        key = tuple(row[k] for k in ("wheel", "pass", "head_dim", "dtype", "causal", "tile"))
        if key in seen:   # a wheel ships some kernels in two libraries (e.g. hdim128 and hdimall)
            continue
        seen.add(key)
        report = row["report"]
        peer = report.non_tensor_per_tensor_op
        ours = fagen_figure(row)
        label = f"{row['pass']} d{row['head_dim']} {row['dtype']}{' causal' if row['causal'] else ''}"
        ratio = ours / peer if peer and ours else None
        sm90, sm90_report = fagen_sm90_figure(row)
        sm90_ratio = sm90 / peer if peer and sm90 else None
        overlap = sm90_report.overlap if sm90_report else None
        sm90_exp2 = "-" if overlap is None else f"{overlap.exp2_in_flight}/{overlap.exp2}"
        roles, role_record = role_columns(report, row["warpgroups"])
        print(f"{row['wheel']:<16} {label:<18} {row['tile']:<9} {report.tensor_ops:>8g} "
              f"{'-' if peer is None else f'{peer:.2f}':>6} {'-' if ours is None else f'{ours:.2f}':>6} "
              f"{'-' if ratio is None else f'{ratio:.2f}':>9} {'-' if sm90 is None else f'{sm90:.2f}':>6} "
              f"{'-' if sm90_ratio is None else f'{sm90_ratio:.2f}':>8}"
              + (f"  ({report.problem})" if report.problem else "") + f"  {roles.replace(' ok', f' {sm90_exp2:>6} ok')}")
        records.append({key: row[key] for key in ("wheel", "pass", "head_dim", "dtype", "causal", "tile")}
                       | {"fa3": peer, "fagen": ours, "fagen_sm90": sm90, "hmma_equivalents": report.tensor_ops}
                       | role_record)
    records += backward_table(backward_rows())
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
