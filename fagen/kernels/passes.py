"""A kernel family's passes, and the kernels (entries) each defines.

A pass is one template under templates/ (its family's folder, or the shared ones beside them) and
the `extern "C" __global__` kernels it defines, with their signatures and launch geometry. A
family (`fagen.kernels.families`) lists its passes; a Spec's source is the passes its family runs
for it (`KernelFamily.passes_of`), rendered one after the other, and each pass with the source's
prelude is a translation unit NVRTC compiles by itself (`render.Source.units`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable, Mapping

from ..arch_families import Family
from ..spec import Spec
from .params import GRID_OFFSETS, Param, varlen_params


@dataclass(frozen=True)
class Entry:
    """One `extern "C" __global__` kernel in a rendered source."""

    name: str
    params: tuple[Param, ...]
    threads: int               # threads per block (x dimension)
    rows_per_block: int | None  # rows of `rows_from` one block covers, or None: one block per batch*head
    rows_from: str             # "q" (query rows) or "k" (key rows)
    shared_bytes: int          # dynamic shared memory per block
    slices: int = 1            # blocks per row block (the sm90 forward's column slices of O: Sm90Tiles.slices)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        """(row blocks x slices, heads, batch). Heads or a batch past gridDim.y / .z's 65535 are
        launched in chunks (`launch.grid_chunks`, the kernels' `GRID_OFFSETS`)."""
        rows = seqlen_q if self.rows_from == "q" else seqlen_k
        blocks = 1 if self.rows_per_block is None else math.ceil(rows / self.rows_per_block)
        return (blocks * self.slices, heads, batch)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)


@dataclass(frozen=True)
class Entries:
    """The kernels of one spec, by role (each pass fills in its own roles)."""

    forward: Entry
    bwd_preprocess: Entry | None = None  # None for forward-only specs (kv_cache, fp8)
    bwd_main: Entry | None = None
    bwd_dq: Entry | None = None          # deterministic specs: the dQ pass without atomics
    bwd_dq_convert: Entry | None = None  # other specs: fp32 atomics accumulator -> dQ
    combine: Entry | None = None  # kv_cache specs (forward only, no backward): merges split-KV partials
    cache_update: Entry | None = None  # kv_cache specs: appends new keys / values (and rotary) in place

    @property
    def all(self) -> tuple[Entry, ...]:
        return tuple(e for e in (getattr(self, f.name) for f in fields(self)) if e is not None)

    @property
    def backward(self) -> tuple[Entry, ...]:
        """The backward pass's kernels in launch order: the preprocess (D, after which the caller
        may adjust it), the main kernel, then dQ's pass (whichever the spec has)."""
        return tuple(e for e in (self.bwd_preprocess, self.bwd_main, self.bwd_dq, self.bwd_dq_convert) if e is not None)


ROLES = tuple(f.name for f in fields(Entries))


@dataclass(frozen=True)
class Pass:
    """One pass of a family: the templates that define its kernels (included in this order), and
    its kernels by role: `entries(spec, debug)` -> {role of `Entries`: Entry}. `includes`: the
    templates those include in turn, beyond the shared ones (what the self-test's digest reads).
    `refusal(spec)`: why it does not take a spec its family does (the family then runs the next
    pass it lists for that role), or None."""

    templates: tuple[str, ...]
    entries: Callable[[Spec, bool], dict]
    includes: tuple[str, ...] = ()
    refusal: Callable[[Spec], str | None] = lambda spec: None   # why it cannot take `spec` yet, or None

    @property
    def sources(self) -> tuple[str, ...]:
        return self.templates + self.includes


@dataclass(frozen=True)
class KernelFamily:
    """A kernel family (`fagen.arch_families.Family`, its facts below the Spec) with its passes:
    the forward (by FlashAttention version), the backward, decoding's forward (by version) and its
    combine and cache append. `headers` are the static headers (templates/include/fagen/) its
    kernels need beyond the shared ones; `context(spec)` what its templates read beyond the Spec's.
    `backward` lists the backward passes in order of preference: a spec's is the first that takes it."""

    facts: Family
    forward: Mapping[int, Pass]
    backward: tuple[Pass, ...]
    decoding: Mapping[int, Pass]
    combine: Pass
    headers: tuple[str, ...] = ()
    context: Callable[[Spec], dict] = lambda spec: {}

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def passes(self) -> tuple[Pass, ...]:
        """Every pass it has, each once."""
        found = (*self.forward.values(), *self.backward, *self.decoding.values(), self.combine)
        return tuple(dict.fromkeys(found))

    def backward_of(self, spec: Spec) -> Pass:
        """The backward pass that renders `spec`'s gradients: the first listed that takes it."""
        return next(found for found in self.backward if found.refusal(spec) is None)

    def passes_of(self, spec: Spec) -> tuple[Pass, ...]:
        """The passes of `spec`'s source: training's forward and backward; decoding's
        forward, with the split-KV combine and the append unless queries are packed (varlen); the
        8-bit forward, with its backward where one takes it (Spec.forward_only)."""
        if spec.kv_cache:
            return (self.decoding[spec.version],) + (() if spec.varlen else (self.combine,))
        if spec.forward_only:
            return (self.forward[spec.version],)
        return (self.forward[spec.version], self.backward_of(spec))

    def entries(self, spec: Spec, debug: bool = False) -> Entries:
        """The kernels `spec`'s source defines, with their signatures and geometry."""
        roles = {}
        for found in self.passes_of(spec):
            roles.update(found.entries(spec, debug))
        return Entries(**roles)


def entry(spec: Spec, role: str, params, threads: int, rows: int | None, rows_from: str, smem: int,
          slices: int = 1) -> Entry:
    """The kernel `<spec.name>_<role>`: a decoding spec's k and v are a cache (sm80: cache_views;
    sm90: KeySource), never a packed sequence; packed sequences add their parameters; every kernel
    takes the grid's chunk offsets last."""
    if spec.kv_cache:
        params = tuple(replace(p, name=p.name + "_cache") if p.name in ("k", "v") else p for p in params)
    params = tuple(varlen_params(list(params))) if spec.varlen else params
    return Entry(f"{spec.name}_{role}", params + GRID_OFFSETS, threads, rows, rows_from, smem, slices)
