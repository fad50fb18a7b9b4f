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
from .params import (ELEM_CTYPE, VARLEN_BLOCK_WORKSPACES, VARLEN_K_ROWS, VARLEN_Q_ROWS, VARLEN_ROW_WORKSPACES,
                     VARLEN_STATS)
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
class Unit:
    """A translation unit that NVRTC compiles by itself: the source's prelude (its header, includes,
    element type and variant code) and the kernels of one pass (`names`)."""

    prelude: str
    body: str
    names: tuple[str, ...]

    @property
    def code(self) -> str:
        return self.prelude + self.body


@dataclass(frozen=True)
class Source:
    """A spec's rendered CUDA and what is needed to launch it.

    `code` is the whole source: what `fagen build` writes, what the emulator runs and what every
    cache key hashes. NVRTC compiles it as `units`, one per pass (`pass_units`: the forward and the
    backward apart, in parallel, each cached by itself); a source built from code alone (an op
    module's file, a test's mutant) is one unit."""

    spec: Spec
    code: str
    kernels: Entries
    pass_units: tuple[Unit, ...] = ()

    def __post_init__(self):
        if self.pass_units and self.code != self.pass_units[0].prelude + "".join(u.body for u in self.pass_units):
            raise ValueError(f"{self.spec.name}: the source's pass_units do not make up its code; "
                             f"replace both, or give the code alone")

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self.kernels.all

    @property
    def units(self) -> tuple[Unit, ...]:
        """What NVRTC compiles: the pass units, else the whole code as one."""
        return self.pass_units or (Unit("", self.code, tuple(e.name for e in self.entries)),)

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
    """Render every kernel of `spec` (forward and backward) into one source, whose passes are
    also its translation units (`Source.units`).

    `debug` adds instrumentation for tests: the forward kernel records how many
    K/V tiles each thread block visits (`tiles_visited`), and with dropout the
    forward and backward kernels write the keep mask they used (`keep_mask`).
    """
    family = kernel_family(spec)
    entries = family.entries(spec, debug)
    template = environment().get_template("translation_unit.cu.j2")
    context = _context(spec, entries, debug)
    prelude = template.render(**context, pass_templates=[])
    units = []
    for found in family.passes_of(spec):
        # Each pass renders after the prelude in the same context, so the units join into the whole.
        body = template.render(**context, pass_templates=list(found.templates))[len(prelude):]
        units.append(Unit(prelude, body, tuple(e.name for e in found.entries(spec, debug).values())))
    code = prelude + "".join(u.body for u in units)
    return Source(spec=spec, code=code, kernels=entries, pass_units=tuple(units) if len(units) > 1 else ())


def _context(spec: Spec, entries: Entries, debug: bool) -> dict:
    """What translation_unit.cu.j2 and the pass templates it includes read."""
    family = kernel_family(spec)
    return dict(
        spec=spec,
        entries=entries,
        family_headers=(family.headers + (("fp8.cuh",) if spec.fp8 else ())
                        + (("fp8_cache.cuh",) if spec.cache_fp8 else ())),
        **family.context(spec),
        layout=spec.shared_layout,
        bwd=spec.backward_tiles,
        bwd_layout=spec.backward_layout,
        dq_layout=spec.dq_layout,
        head_dim_pad=spec.head_dim_pad,
        row_tiles=spec.block_m // (16 * spec.num_warps),
        elem_ctype=ELEM_CTYPE[spec.output_dtype],
        debug=debug,
        variant=variant_code(spec),
        varlen={"q_rows": VARLEN_Q_ROWS, "k_rows": VARLEN_K_ROWS, "stats": VARLEN_STATS,
                "row_workspaces": VARLEN_ROW_WORKSPACES, "block_workspaces": VARLEN_BLOCK_WORKSPACES},
    )


@functools.lru_cache(maxsize=512)
def source_for(spec: Spec) -> Source:
    """`render(spec)`, once per process: the ops and the tuner share these renders (the
    compiled kernels are cached further down, by `launch` and `compiler`)."""
    return render(spec)
