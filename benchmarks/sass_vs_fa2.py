"""fagen's main loops against FlashAttention-2's, from machine code, side by side in one run.

    python benchmarks/sass_vs_fa2.py [--arch sm_80 sm_90] [--json FILE]

The peer is FlashAttention-2 as PyTorch ships it: the kernels `flash_fwd_kernel` and
`flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel` in `libtorch_cuda.so` of PyTorch's CUDA wheel
(pinned below), fp16, even M/N/K, no dropout, causal and not, d 64 and 128, with the tiles
flash-attn picks for sm_80/sm_90 parts; fagen's side uses its fallback table's tiles for the arch
(what an untuned call runs). On first use the wheel is fetched from the package
registry (`pip download --no-deps`, about 0.5 GB), the SASS of just those kernels is kept in
the fagen cache (`<cache>/fa2-peer/torch-<version>/`) and everything else is deleted.

Both sides are measured with `fagen.sass` (the same main-loop steady state, the same
instruction classes); the table gives non-HMMA instructions per useful HMMA and the ratio
fagen / FA2. A benchmark, not a test: log the table in benchmarks/RESULTS.md.
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
from fagen.sass.listing import find_cuobjdump
from fagen.sass.listing import parse_listing
from fagen.sass.report import KernelGeometry, analyse_function, report_for_spec
from fagen.spec import Spec
from fagen.tuning.fallback import fallback_spec

TORCH_VERSION = "2.11.0"
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
LIBRARY = "torch/lib/libtorch_cuda.so"
# flash-attn's tiles on 144+ KB parts (sm_80, sm_90): (d, block_m, block_n, warps[, atom layouts]).
FWD_TRAITS = {64: (64, 128, 128, 4), 128: (128, 128, 64, 4)}
BWD_TRAITS = {64: (64, 128, 128, 8, 4, 4, 4), 128: (128, 64, 128, 8, 2, 4, 2)}
HALF = "N7cutlass6half_tE"


def fwd_name(traits, causal: bool) -> str:
    d, m, n, w = traits
    flags = "".join(f"ELb{int(b)}" for b in (False, causal, False, False, True, True, False, False))
    kernel = f"Li{d}ELi{m}ELi{n}ELi{w}"
    return (f"_ZN13pytorch_flash16flash_fwd_kernelI23Flash_fwd_kernel_traitsI{kernel}ELb0ELb0E{HALF}"
            f"19Flash_kernel_traitsI{kernel}ES3_EE{flags[1:]}EEEvNS_16Flash_fwd_paramsE")


def bwd_name(traits, causal: bool) -> str:
    d, m, n, w, a, b, c = traits
    flags = "".join(f"ELb{int(x)}" for x in (False, causal, False, False, True, True, False))
    kernel = f"Li{d}ELi{m}ELi{n}ELi{w}"
    return (f"_ZN13pytorch_flash44flash_bwd_dq_dk_dv_loop_seqk_parallel_kernelI23Flash_bwd_kernel_traitsI"
            f"{kernel}ELi{a}ELi{b}ELi{c}ELb0ELb0E{HALF}19Flash_kernel_traitsI{kernel}ES3_EE{flags[1:]}EEEv"
            f"NS_16Flash_bwd_paramsE")


def peer_kernels() -> list[dict]:
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            _, m, n, w = FWD_TRAITS[d]
            # Dynamic shared memory (flash-attn's kSmemSize): Q, and K and V.
            rows.append({"pass": "fwd", "head_dim": d, "causal": causal, "name": fwd_name(FWD_TRAITS[d], causal),
                         "geometry": KernelGeometry(2, m, n, d, w, 2 * n * d * 2), "tile": f"{m}x{n}, {w} warps",
                         "threads": 32 * w, "dynamic_shared": (m + 2 * n) * d * 2})
            _, m, n, w, *_ = BWD_TRAITS[d]
            # Q double-buffered and dO, K and V, dS and P.
            rows.append({"pass": "bwd", "head_dim": d, "causal": causal, "name": bwd_name(BWD_TRAITS[d], causal),
                         "geometry": KernelGeometry(5, m, n, d, w, 2 * m * d * 2), "tile": f"{m}x{n}, {w} warps",
                         "threads": 32 * w, "dynamic_shared": 3 * m * d * 2 + 2 * n * d * 2 + 2 * m * n * 2})
    return rows


def peer_dir() -> Path:
    return cache_dir() / "fa2-peer" / f"torch-{TORCH_VERSION}"


def _run(command: list[str], **kwargs) -> str:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... failed:\n{result.stderr.strip()[-2000:]}")
    return result.stdout


def fetch_peer(archs: list[str]) -> Path:
    """The peer's SASS and resource usage per (arch, kernel), fetched once into the cache."""
    target = peer_dir()
    wanted = [row["name"] for row in peer_kernels()]
    if all((target / arch / f"{index}.sass").exists() for arch in archs for index in range(len(wanted))):
        return target
    tool = find_cuobjdump()
    if tool is None:
        raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    with tempfile.TemporaryDirectory(prefix="fagen-fa2-") as tmp:
        tmp = Path(tmp)
        print(f"fetching PyTorch {TORCH_VERSION}'s CUDA wheel (once; about 0.5 GB)...", file=sys.stderr, flush=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", f"torch=={TORCH_VERSION}", "--platform",
              WHEEL_PLATFORM, "--python-version", "3.11", "--only-binary=:all:", "-d", str(tmp), "-q"])
        wheel = next(tmp.glob("torch-*.whl"))
        with zipfile.ZipFile(wheel) as archive, archive.open(LIBRARY) as src, open(tmp / "lib.so", "wb") as dst:
            shutil.copyfileobj(src, dst)
        wheel.unlink()
        for arch in archs:
            print(f"extracting FlashAttention-2's {arch} kernels...", file=sys.stderr, flush=True)
            cubins = tmp / arch
            cubins.mkdir()
            _run([tool, "-xelf", arch, str(tmp / "lib.so")], cwd=cubins)
            out = target / arch
            out.mkdir(parents=True, exist_ok=True)
            for index, name in enumerate(wanted):
                needle = name.encode()
                cubin = next((c for c in sorted(cubins.glob("*.cubin")) if needle in c.read_bytes()), None)
                if cubin is None:
                    raise SystemExit(f"{arch}: {name} is not in PyTorch {TORCH_VERSION}'s libtorch_cuda.so")
                (out / f"{index}.sass").write_text(_run([tool, "-sass", "-fun", name, str(cubin)]))
                (out / f"{index}.res").write_text(_run([tool, "-res-usage", "-fun", name, str(cubin)]))
            shutil.rmtree(cubins)
    (target / "kernels.json").write_text(json.dumps(wanted, indent=1))
    return target


def peer_report(arch: str, index: int, row: dict):
    out = peer_dir() / arch
    functions = parse_listing((out / f"{index}.sass").read_text())
    report = analyse_function(row["name"], functions[row["name"]], arch, row["geometry"])
    usage = (out / f"{index}.res").read_text()
    if m := re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage):
        report.registers, stack, static_shared, local = (int(x) for x in m.groups())
        report.spill_bytes = stack + local   # the stack frame holds the spills
        report.shared_bytes = static_shared + row["dynamic_shared"]
    report.threads = row["threads"]
    return report


def fagen_report(arch: str, row: dict):
    # The tiles an untuned `flash_attn_func` call runs with on this arch (the fallback table).
    spec = fallback_spec(Spec(row["head_dim"], mask="causal" if row["causal"] else "none"), arch)
    reports = report_for_spec(spec, arch)
    suffix = "_fwd" if row["pass"] == "fwd" else "_bwd"
    return spec, reports[spec.name + suffix]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], choices=["sm_80", "sm_90"])
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = parser.parse_args()
    fetch_peer(args.arch)
    header = (f"{'kernel':<16} {'fagen tile':<16} {'FA2 tile':<16} {'fagen':>7} {'FA2':>7} {'ratio':>6}  "
              f"{'HMMA fagen/useful':>17}  {'spill B fagen/FA2':>17}  {'warps/SM':>9}")
    print(f"non-HMMA instructions per useful HMMA, main loop steady state (fagen.sass); PyTorch {TORCH_VERSION} FA2")
    records = []
    for arch in args.arch:
        print(f"\n{arch}\n{header}")
        for index, row in enumerate(peer_kernels()):
            peer = peer_report(arch, index, row)
            spec, ours = fagen_report(arch, row)
            t = spec.backward_tiles
            tile = (f"{spec.block_m}x{spec.block_n}, {spec.num_warps} warps" if row["pass"] == "fwd"
                    else f"{t.block_m}x{t.block_n}, {t.num_warps} warps")
            ratio = ours.non_hmma_per_useful_hmma / peer.non_hmma_per_useful_hmma
            label = f"{row['pass']} d{row['head_dim']}{' causal' if row['causal'] else ''}"
            print(f"{label:<16} {tile:<16} {row['tile']:<16} {ours.non_hmma_per_useful_hmma:7.2f} "
                  f"{peer.non_hmma_per_useful_hmma:7.2f} {ratio:6.2f}  "
                  f"{ours.hmma:>8}/{ours.useful_hmma:<8g}  {ours.spill_bytes:>8}/{peer.spill_bytes:<8}  "
                  f"{ours.warps_per_sm}/{peer.warps_per_sm}")
            records.append({"arch": arch, "kernel": label, "ratio": ratio, "fagen": ours.to_json(),
                            "fa2": peer.to_json()})
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
