"""Render a Spec into CUDA source with Jinja.

`render(spec)` is deterministic: equal specs give byte-identical source, and
the source's hash is part of every cache key downstream. The templates live in
the top-level `templates/` directory (shipped inside the wheel as
`fagen/templates`); what does not vary with the spec lives in plain CUDA
headers under `templates/include/fagen/`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import jinja2

from .spec import Spec

ELEM_CTYPE = {"fp16": "__half", "bf16": "__nv_bfloat16"}


def template_dir() -> Path:
    """The templates/ directory: inside the installed package, else the source tree."""
    packaged = Path(__file__).resolve().parent / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "templates"


def include_dir() -> Path:
    """Directory to pass as -I so that `#include <fagen/...>` finds the static headers."""
    return template_dir() / "include"


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its C type, name, and how the launcher passes it."""

    name: str
    ctype: str
    kind: str  # "tensor" (a device pointer) or a NumPy scalar type name: "int32", "float32", ...


@dataclass(frozen=True)
class Entry:
    """One `extern "C" __global__` kernel in a rendered source."""

    name: str
    params: tuple[Param, ...]
    threads: int       # threads per block (x dimension)
    block_rows: int    # query rows one block covers: grid.x = ceil(seqlen_q / block_rows)
    shared_bytes: int  # dynamic shared memory per block

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.block_rows), batch * heads, 1)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)


@dataclass(frozen=True)
class Source:
    """A rendered translation unit and what is needed to launch it."""

    spec: Spec
    code: str
    entries: tuple[Entry, ...]

    @functools.cached_property
    def hash(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()

    @property
    def short_hash(self) -> str:
        return self.hash[:12]

    def entry(self, name_suffix: str) -> Entry:
        for entry in self.entries:
            if entry.name.endswith(name_suffix):
                return entry
        raise KeyError(f"{self.spec.name} has no kernel ending in {name_suffix!r}")


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _strides(tensor: str) -> list[Param]:
    return [Param(f"{tensor}_stride_{axis}", "long long", "int64") for axis in ("b", "n", "h")]


def forward_params(spec: Spec) -> tuple[Param, ...]:
    elem = ELEM_CTYPE[spec.dtype]
    params = [
        Param("q", f"const {elem}* __restrict__", "tensor"),
        Param("k", f"const {elem}* __restrict__", "tensor"),
        Param("v", f"const {elem}* __restrict__", "tensor"),
        Param("out", f"{elem}* __restrict__", "tensor"),
    ]
    if spec.version == 2:
        params.append(Param("lse", "float* __restrict__", "tensor"))
    else:
        params += [Param("row_max_out", "float* __restrict__", "tensor"),
                   Param("row_sum_out", "float* __restrict__", "tensor")]
    if spec.key_padding:
        params.append(Param("seqlens_k", "const int* __restrict__", "tensor"))
    params += [Param(name, "int", "int32") for name in ("heads", "kv_heads", "seqlen_q", "seqlen_k")]
    for tensor in ("q", "k", "v", "o"):
        params += _strides(tensor)
    params.append(Param("softmax_scale_log2", "float", "float32"))
    if spec.dropout:
        params += [Param("seed", "unsigned long long", "uint64"),
                   Param("philox_offset", "unsigned int", "uint32"),
                   Param("keep_threshold", "unsigned int", "uint32"),
                   Param("keep_scale", "float", "float32")]
    return tuple(params)


def kernel_entries(spec: Spec) -> tuple[Entry, ...]:
    """The kernels a spec's source defines, with their signatures and geometry.

    Pure Python: generated op modules call this to launch a committed .cu file
    without rendering any template.
    """
    forward = Entry(
        name=f"{spec.name}_fwd",
        params=forward_params(spec),
        threads=spec.threads,
        block_rows=spec.block_m,
        shared_bytes=spec.shared_layout.total_bytes,
    )
    return (forward,)


def render(spec: Spec) -> Source:
    """Render every kernel of `spec` into one translation unit."""
    (forward,) = entries = kernel_entries(spec)
    template = environment().get_template("fwd_simple.cu.j2")
    code = template.render(
        spec=spec,
        entry=forward.name,
        params=forward.params,
        layout=spec.shared_layout,
        elem_ctype=ELEM_CTYPE[spec.dtype],
    )
    return Source(spec=spec, code=code, entries=entries)
