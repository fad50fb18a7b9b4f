"""`fagen build`: render, compile and write a spec's artifacts to a directory.

For each spec it writes three files, all deterministic so that the committed
`generated/` directory can be checked byte for byte:

  NAME.cu    the rendered CUDA source
  NAME.py    an importable op module that loads NAME.cu (no templates at import)
  NAME.json  the manifest: spec, kernel names, hashes, per-arch resource report
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from ..version import __version__
from .render import Source, environment, render
from .compile import CompiledKernel, compile_source, nvrtc_version, write_atomic
from ..spec import Spec

MANIFEST_FORMAT = 1
PACKAGE_INIT = '"""Kernels and op modules written by `fagen build`."""\n'


@dataclass
class BuildResult:
    spec: Spec
    source: Source
    compiled: dict[str, CompiledKernel]  # by arch
    paths: dict[str, Path]

    @property
    def compile_seconds(self) -> float:
        return sum(k.compile_seconds for k in self.compiled.values() if k.cache == "miss")


def default_specs() -> list[Spec]:
    """The small set committed under generated/: d 64 and 128, causal and not, fp16 and bf16."""
    return [Spec(head_dim=d, mask=mask, dtype=dtype)
            for d in (64, 128) for mask in ("none", "causal") for dtype in ("fp16", "bf16")]


def manifest(source: Source, compiled: dict[str, CompiledKernel]) -> dict:
    spec = source.spec
    return {
        "format": MANIFEST_FORMAT,
        "name": spec.name,
        "family": spec.base_name,   # the manifest's key for the name without tiles
        "spec": spec.to_dict(),
        "source": f"{spec.name}.cu",
        "source_sha256": source.hash,
        "fagen_version": __version__,
        "nvrtc_version": nvrtc_version(),
        "kernels": [{"name": e.name, "threads": e.threads, "rows_per_block": e.rows_per_block,
                     "rows_from": e.rows_from, "dynamic_shared_bytes": e.shared_bytes,
                     **({"slices": e.slices} if e.slices > 1 else {})}
                    for e in source.entries],
        "resources": {arch: {name: asdict(report) for name, report in sorted(k.resources.items())}
                      for arch, k in compiled.items()},
    }


def op_module(source: Source) -> str:
    template = environment().get_template("op_module.py.j2")
    return template.render(spec=source.spec, source_hash=source.hash)


def build_one(spec: Spec, archs: Iterable[str], out_dir: Path) -> BuildResult:
    """Render and compile one spec for every arch, then write its three files.

    Nothing is written unless every arch compiles, so a failed build never
    leaves a source without its manifest.
    """
    source = render(spec)
    compiled = {arch: compile_source(source, arch) for arch in archs}
    out_dir.mkdir(parents=True, exist_ok=True)
    init = out_dir / "__init__.py"
    if not init.exists():
        write_atomic(init, PACKAGE_INIT.encode())
    paths = {
        "source": out_dir / f"{spec.name}.cu",
        "module": out_dir / f"{spec.name}.py",
        "manifest": out_dir / f"{spec.name}.json",
    }
    write_atomic(paths["source"], source.code.encode())
    write_atomic(paths["module"], op_module(source).encode())
    write_atomic(paths["manifest"], (json.dumps(manifest(source, compiled), indent=2) + "\n").encode())
    return BuildResult(spec, source, compiled, paths)


def build_many(specs: list[Spec], archs: list[str], out_dir: Path,
               progress: Callable[[int, int, BuildResult], None] | None = None) -> list[BuildResult]:
    results = []
    for index, spec in enumerate(specs, 1):
        result = build_one(spec, archs, out_dir)
        results.append(result)
        if progress:
            progress(index, len(specs), result)
    return results


def read_manifests(directory: Path) -> list[dict]:
    """Manifests of the specs built in a directory, sorted by name."""
    manifests = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT and "spec" in data:
            manifests.append(data)
    return manifests
