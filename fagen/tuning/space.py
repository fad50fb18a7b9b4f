"""The search space: candidate tiles, and pruning them by the resource report.

Pruning happens twice, both times before anything runs on a GPU:

1. statically, from the Spec alone: the dynamic shared memory of each kernel
   and its thread count against the device's per-block limits;
2. after compiling, from ptxas's report: spill bytes (any spill is pruned:
   local-memory traffic inside the inner loop costs more than any tile size
   wins), registers x threads against the registers per block, and static +
   dynamic shared memory against the opt-in limit.

On compute capability 9.0 one more candidate is the sm90 kernel family's forward
(`fagen.arch_families`, with its own tiles) beside the fallback's backward, where
the family takes the spec: the tuner then chooses the family too, per shape.

Only the forward kernel takes part: it is the kernel whose tiles are tuned
and timed. The backward kernels' tiles derive from the head dim alone
(`Spec.backward_tiles`), with a pipeline depth fitted to the device's shared
memory (`fit_backward_to`), so they are the same for every candidate.

Every pruned candidate comes with a sentence saying why.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ..arch import base_arch
from ..arch_families import SM90
from ..kernels.render import kernel_entries, render
from ..kernels.compile import CompileError, ResourceReport, compile_source, spec_target
from ..spec import Spec
from .device import DeviceLimits
from .fallback import fallback_spec, fit_backward_to

Resources = Mapping[str, ResourceReport]   # kernel name -> ptxas report


@dataclass(frozen=True)
class TileGrid:
    """The values tried for each knob; candidates are their legal combinations.

    The templates expose exactly these four knobs (see `Spec`)."""

    block_m: tuple[int, ...] = (64, 128, 256)
    block_n: tuple[int, ...] = (32, 64, 128)
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (1, 2, 3)

    def combinations(self) -> Iterable[dict]:
        for m, n, w, s in itertools.product(self.block_m, self.block_n, self.num_warps, self.num_stages):
            yield {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}


DEFAULT_GRID = TileGrid()


def candidates(spec: Spec, limits: DeviceLimits, grid: TileGrid = DEFAULT_GRID) -> list[Spec]:
    """`spec` with every legal tile combination of `grid`, the fallback for `limits.arch` first.

    Combinations the Spec rules reject (a warp split that does not divide
    block_m, shared memory beyond any arch) are not configs and are skipped
    here; limits of this particular device are `prune`'s job. The fallback is
    always included so that tuning never picks something slower than what
    runs untuned.
    """
    found = [fallback_spec(spec, limits.arch, limits.shared_per_block_optin)]
    for tiles in grid.combinations():
        try:
            candidate = spec.replace(**tiles)
        except ValueError:
            continue
        # Same backward pipeline as the fallback's, so equal forward tiles are one candidate.
        candidate = fit_backward_to(candidate, limits.arch, limits.shared_per_block_optin)
        if candidate not in found:
            found.append(candidate)
    hopper = _sm90_candidate(spec, limits, found[0])
    return found + ([hopper] if hopper is not None else [])


def _sm90_candidate(spec: Spec, limits: DeviceLimits, fallback: Spec) -> Spec | None:
    """The sm90 family's forward on a compute capability 9.0 device, beside the fallback's tiles
    for the backward (which stays the sm80 family's), where that family takes `spec`."""
    if base_arch(limits.arch) != SM90.arch or spec.arch_family != "sm80" or SM90.refusal(spec) is not None:
        return None
    return fallback.replace(arch_family=SM90.name)


def prune(specs: Iterable[Spec], limits: DeviceLimits, resources: Mapping[Spec, Resources] | None = None
          ) -> tuple[list[Spec], list[tuple[Spec, str]]]:
    """Split `specs` into (kept, [(pruned, reason), ...]).

    Without `resources` only what the Spec itself fixes is checked (dynamic
    shared memory, threads); with them (spec -> kernel name -> report) the
    compiled facts are checked too. A spec missing from `resources` is kept:
    the output check and timing still guard it.
    """
    kept, pruned = [], []
    for spec in specs:
        reasons = _static_reasons(spec, limits)
        if resources is not None and spec in resources:
            reasons += _compiled_reasons(spec, limits, resources[spec])
        if reasons:
            pruned.append((spec, "; ".join(reasons)))
        else:
            kept.append(spec)
    return kept, pruned


def tuned_kernels(spec: Spec) -> list:
    """The kernels whose resources depend on the tuned tiles."""
    return [kernel_entries(spec).forward]


def _static_reasons(spec: Spec, limits: DeviceLimits) -> list[str]:
    reasons = []
    for entry in tuned_kernels(spec):
        if entry.shared_bytes > limits.shared_per_block_optin:
            reasons.append(f"{_kernel_role(spec, entry.name)} needs {entry.shared_bytes} B of shared "
                           f"memory, {limits.arch} allows {limits.shared_per_block_optin} B per block")
        if entry.threads > limits.max_threads_per_block:
            reasons.append(f"{_kernel_role(spec, entry.name)} has {entry.threads} threads per block, "
                           f"the device allows {limits.max_threads_per_block}")
    return reasons


def _compiled_reasons(spec: Spec, limits: DeviceLimits, reports: Resources) -> list[str]:
    reasons = []
    for entry in tuned_kernels(spec):
        report = reports.get(entry.name)
        if report is None:
            continue
        role = _kernel_role(spec, entry.name)
        if report.spill_bytes > 0:
            reasons.append(f"{role} spills {report.spill_bytes} B (stores {report.spill_store_bytes}, "
                           f"loads {report.spill_load_bytes})")
        if report.registers > limits.max_registers_per_thread:
            reasons.append(f"{role} uses {report.registers} registers per thread, "
                           f"the limit is {limits.max_registers_per_thread}")
        block_registers = report.registers * entry.threads
        if block_registers > limits.registers_per_block:
            reasons.append(f"{role} needs {report.registers} registers x {entry.threads} threads = "
                           f"{block_registers} per block, the device has {limits.registers_per_block}")
        shared = entry.shared_bytes + report.static_shared_bytes
        if report.static_shared_bytes and shared > limits.shared_per_block_optin:
            reasons.append(f"{role} needs {entry.shared_bytes} B dynamic + {report.static_shared_bytes} B "
                           f"static shared memory = {shared} B, {limits.arch} allows "
                           f"{limits.shared_per_block_optin} B per block")
    return reasons


def _kernel_role(spec: Spec, kernel_name: str) -> str:
    """`_fwd` of `fa2_d64_fp16_fwd`: short enough for one line per pruned candidate."""
    return kernel_name[len(spec.name) + 1:] if kernel_name.startswith(spec.name + "_") else kernel_name


# -- compiling -------------------------------------------------------------

def nvrtc_resources(spec: Spec, arch: str) -> Resources:
    """Compile `spec` for a GPU of `arch`, for its family's target there (`spec_target`), through
    the cubin cache, and return its resource report."""
    return compile_source(render(spec), spec_target(spec, arch)).resources


def compile_all(specs: list[Spec], compile_one: Callable[[Spec], Resources], *, workers: int | None = None,
                progress: "ProgressLine | None" = None
                ) -> tuple[dict[Spec, Resources], list[tuple[Spec, str]]]:
    """Compile `specs` on a thread pool (NVRTC releases the GIL while it works).

    Returns ({spec: resources}, [(spec, reason) for each that failed to compile]).
    """
    resources, failed = {}, []
    if not specs:
        return resources, failed
    workers = workers or min(len(specs), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(compile_one, spec): spec for spec in specs}
        for future in concurrent.futures.as_completed(futures):
            spec = futures[future]
            try:
                resources[spec] = future.result()
            except (CompileError, ValueError) as exc:
                lines = [line for line in str(exc).splitlines() if line.strip()]
                first_line = lines[0] if lines else type(exc).__name__
                failed.append((spec, f"does not compile: {first_line}"))
            if progress is not None:
                progress.advance()
    # as_completed finishes in any order; report in the order the caller gave.
    order = {spec: i for i, spec in enumerate(specs)}
    failed.sort(key=lambda item: order[item[0]])
    return resources, failed


class ProgressLine:
    """A one-line progress bar on stderr: `compiling [#####-----] 12/24 3.1 s`.

    Redrawn in place on a terminal; elsewhere (CI logs) printed once when done.
    """

    WIDTH = 24

    def __init__(self, label: str, total: int, stream=None, enabled: bool = True):
        self.label, self.total, self.done = label, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.interactive = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()

    def advance(self, count: int = 1) -> None:
        self.done += count
        if self.interactive:
            self.stream.write("\r" + self._line())
            self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.stream.write(("\r" if self.interactive else "") + self._line() + "\n")
        self.stream.flush()

    def _line(self) -> str:
        filled = self.WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        return f"{self.label} [{bar}] {self.done}/{self.total} {time.perf_counter() - self.start:.1f} s"
