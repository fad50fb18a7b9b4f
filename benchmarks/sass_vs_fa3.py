"""FlashAttention-3's Hopper kernels measured with fagen's SASS reader, beside fagen's own, in one run.

    python benchmarks/sass_vs_fa3.py [--json FILE]

The peer is FlashAttention-3 as two PyPI wheels ship it (pinned below): `flash-attn3-jax`
(forward and backward, d 128) and `fa3-fwd` (forward, d 64/128/256), their sm_90a cubins. On
first use the wheels are fetched (`pip download --no-deps`, about 50 MB), the SASS of just the
plain kernels is kept in the fagen cache (`<cache>/fa3-peer/`) and everything else is deleted.

A kernel is picked by its template arguments, read from its demangled name (c++filt, from
binutils, is needed): `CollectiveMainloopFwdSm90<Stages, Cluster, Tile<M, N, d>, d_v, Element,
float, Sm90, Is_causal, Is_local, Has_softcap, Varlen, PagedKVNonTMA, AppendKV, HasQv,
MmaPV_is_RS, IntraWGOverlap, PackGQA, Split, V_colmajor>` with d_v = d and every feature flag
false but Is_causal (and FA3's own choices MmaPV_is_RS, IntraWGOverlap), and
`CollectiveMainloopBwdSm90<..., Tile, Element, float, Sm90, Is_causal, Is_local, Has_softcap,
Varlen, Deterministic, ...>` with the features false. fp16 and bf16 both.

Both sides are read by `fagen.sass` (the same steady state and instruction classes). The peer
is divided by the HMMA-equivalents its iteration executes (one HGMMA.64xNx16 = N/8 per warp;
`fagen sass --cubin`), fagen by its useful HMMA (`fagen sass`), which for these kernels equal
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

from fagen.cache_files import cache_dir
from fagen.kernels.compile import compile_source
from fagen.kernels.render import render
from fagen.sass.listing import find_cuobjdump, parse_listing
from fagen.sass.report import analyse_foreign, cubin_reports, readable_names, report_for_spec
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
ROLE_WIDTHS = (4, 8, 6, 6, 5, 8)   # WGs, maxnreg P/C, cons instr, prod instr, TMA loads, exp2 in flight
EPILOGUE_THREADS = re.compile(r"CollectiveEpilogue\w*<.*?, (\d+), (?:true|false)")


def peer_dir() -> Path:
    return cache_dir() / "fa3-peer" / "-".join(f"{name}-{version}" for name, version in WHEELS.items())


def _run(command: list[str], **kwargs) -> str:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... failed:\n{result.stderr.strip()[-2000:]}")
    return result.stdout


def describe(demangled: str) -> dict | None:
    """The plain forward or backward kernel's (pass, d, dtype, causal, tile), from its demangled
    name; None for any other instantiation (a feature on, d_v != d, fp8)."""
    if "FlashAttnFwdSm90" in demangled and (m := FWD.search(demangled)):
        cluster, _, _, block_m, block_n, d, d_v, element, flags = m.groups()
        flags = [f == "true" for f in flags.split(", ")]
        causal, others = flags[0], flags[1:7] + flags[9:]   # skip MmaPV_is_RS, IntraWGOverlap
        if element in DTYPES and d == d_v and not any(others):
            return {"pass": "fwd", "head_dim": int(d), "dtype": DTYPES[element], "causal": causal,
                    "tile": f"{block_m}x{block_n}" + (f" c{cluster}" if cluster != "1" else "")}
    if "FlashAttnBwdSm90" in demangled and (m := BWD.search(demangled)):
        cluster, _, _, block_m, block_n, d, element, flags = m.groups()
        flags = [f == "true" for f in flags.split(", ")]
        if element in DTYPES and not any(flags[1:]):
            return {"pass": "bwd", "head_dim": int(d), "dtype": DTYPES[element], "causal": flags[0],
                    "tile": f"{block_m}x{block_n}" + (f" c{cluster}" if cluster != "1" else "")}
    return None


def warpgroups(demangled: str) -> dict[str, int] | None:
    """FA3's warpgroups by role: one producer, and as many consumers as its epilogue has threads
    (the consumers write the output) / 128; None where the name does not say."""
    m = EPILOGUE_THREADS.search(demangled)
    if m is None or int(m.group(1)) % 128:
        return None
    return {"producer": 1, "consumer": int(m.group(1)) // 128}


def fetch_peer() -> Path:
    """The plain kernels' SASS, one file per kernel, fetched once into the cache."""
    target = peer_dir()
    if (target / "kernels.json").exists():
        return target
    tool = find_cuobjdump()
    if tool is None or shutil.which("c++filt") is None:
        raise SystemExit("needs cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm) and c++filt")
    kernels = []
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fagen-fa3-") as tmp:
        tmp = Path(tmp)
        for wheel_name, version in WHEELS.items():
            print(f"fetching {wheel_name} {version} (once)...", file=sys.stderr, flush=True)
            _run([sys.executable, "-m", "pip", "download", "--no-deps", f"{wheel_name}=={version}", "-d", str(tmp),
                  "-q"])
            wheel = next(tmp.glob(wheel_name.replace("-", "_") + "-*.whl"))
            cubins = tmp / wheel_name
            cubins.mkdir()
            with zipfile.ZipFile(wheel) as archive:
                for member in (n for n in archive.namelist() if n.endswith(".so")):
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
                    found = describe(names[name])
                    if found is None:
                        continue
                    index = len(kernels)
                    (target / f"{index}.sass").write_text(_run([tool, "-sass", "-fun", name, str(cubin)]))
                    kernels.append({**found, "wheel": wheel_name, "name": name})
            shutil.rmtree(cubins)
    (target / "kernels.json").write_text(json.dumps(kernels, indent=1))
    return target


def peer_rows() -> list[dict]:
    target = fetch_peer()
    kernels = json.loads((target / "kernels.json").read_text())
    names = readable_names(kernel["name"] for kernel in kernels)
    rows = []
    for index, kernel in enumerate(kernels):
        functions = parse_listing((target / f"{index}.sass").read_text())
        rows.append({**kernel, "report": analyse_foreign(kernel["name"], functions[kernel["name"]], "sm_90"),
                     "warpgroups": warpgroups(names[kernel["name"]])})
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
    """fagen's mma.sync kernel for the same problem on sm_90 (its fallback tiles)."""
    spec = fallback_spec(Spec(row["head_dim"], dtype=row["dtype"], mask="causal" if row["causal"] else "none"),
                         "sm_90")
    reports = report_for_spec(spec, "sm_90")
    return reports[spec.name + ("_fwd" if row["pass"] == "fwd" else "_bwd")].non_hmma_per_useful_hmma


def fagen_sm90_figure(row: dict):
    """fagen's sm90 family forward for the same problem (Spec.arch_family = 'sm90', compiled for
    sm_90a), read as the peer is: per HMMA-equivalent (`cubin_reports`). (figure, report), or
    (None, None) where the family has no such kernel yet."""
    if row["pass"] != "fwd":
        return None, None
    try:
        spec = Spec(row["head_dim"], dtype=row["dtype"], mask="causal" if row["causal"] else "none", arch_family="sm90")
    except ValueError:   # a head dim the family does not take yet
        return None, None
    report = cubin_reports(compile_source(render(spec), "sm_90a").cubin, "sm_90a")[spec.name + "_fwd"]
    return report.non_tensor_per_tensor_op, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = parser.parse_args()
    rows = peer_rows()
    print("non-tensor instructions per HMMA-equivalent, main loop steady state (fagen.sass), sm_90(a)")
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
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
