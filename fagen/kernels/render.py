"""Render a Spec into CUDA source with Jinja.

`render(spec)` is deterministic: equal specs give byte-identical source, and
the source's hash is part of every cache key downstream. The templates live in
the top-level `templates/` directory (shipped inside the wheel as
`fagen/templates`): each kernel family's in a folder of its own (sm80/, sm90/),
the shared ones beside them; what does not vary with the spec lives in plain
CUDA headers under `templates/include/fagen/`. Which templates a spec's source
is made of is its family's (`fagen.kernels.families`): the passes it runs.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ..spec import Spec
from ..variants.cuda import variant_code
from .families import kernel_family
from .params import ELEM_CTYPE, VARLEN_K_ROWS, VARLEN_Q_ROWS, VARLEN_ROW_WORKSPACES, VARLEN_STATS
from .passes import Entries, Entry   # noqa: F401  (Entry: launch's and the op modules' name for a kernel)


def template_dir() -> Path:
    """The templates/ directory: inside the installed package, else the source tree."""
    package = Path(__file__).resolve().parents[1]   # fagen/
    packaged = package / "templates"
    if packaged.is_dir():
        return packaged
    return package.parent / "templates"


def include_dir() -> Path:
    """Directory to pass as -I so that `#include <fagen/...>` finds the static headers."""
    return template_dir() / "include"

@dataclass(frozen=True)
class Source:
    """A rendered translation unit and what is needed to launch it."""

    spec: Spec
    code: str
    kernels: Entries

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self.kernels.all

    @functools.cached_property
    def hash(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()



@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )

def kernel_entries(spec: Spec, debug: bool = False) -> Entries:
    """The kernels a spec's source defines, with their signatures and geometry: those of the
    passes its family runs for it (`KernelFamily.passes_of`).

    Pure Python: generated op modules call this to launch a committed .cu file
    without rendering any template.
    """
    return kernel_family(spec).entries(spec, debug)


def render(spec: Spec, debug: bool = False) -> Source:
    """Render every kernel of `spec` (forward and backward) into one translation unit.

    `debug` adds instrumentation for tests: the forward kernel records how many
    K/V tiles each thread block visits (`tiles_visited`), and with dropout the
    forward and backward kernels write the keep mask they used (`keep_mask`).
    """
    family = kernel_family(spec)
    entries = family.entries(spec, debug)
    code = environment().get_template("translation_unit.cu.j2").render(
        spec=spec,
        entries=entries,
        pass_templates=[name for found in family.passes_of(spec) for name in found.templates],
        family_headers=family.headers,
        **family.context(spec),
        layout=spec.shared_layout,
        bwd=spec.backward_tiles,
        bwd_layout=spec.backward_layout,
        dq_layout=spec.dq_layout,
        head_dim_pad=spec.head_dim_pad,
        row_tiles=spec.block_m // (16 * spec.num_warps),
        elem_ctype=ELEM_CTYPE[spec.dtype],
        debug=debug,
        variant=variant_code(spec),
        varlen={"q_rows": VARLEN_Q_ROWS, "k_rows": VARLEN_K_ROWS, "stats": VARLEN_STATS,
                "row_workspaces": VARLEN_ROW_WORKSPACES},
    )
    return Source(spec=spec, code=code, kernels=entries)


@functools.lru_cache(maxsize=512)
def source_for(spec: Spec) -> Source:
    """`render(spec)`, once per process: the ops and the tuner share these renders (the
    compiled kernels are cached further down, by `launch` and `compiler`)."""
    return render(spec)
