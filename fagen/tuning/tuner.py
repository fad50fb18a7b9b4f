"""Tuning one spec for one shape, and looking the result up at call time.

`tune` runs the whole pipeline: candidates -> static pruning -> parallel
NVRTC compile -> pruning by the resource report -> output check -> timing ->
cache. Every step that touches hardware is an injectable callable (`compile`,
`check`, `timer`), which is how the tests drive it on a CPU.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ..arch import SMEM_LIMIT_BYTES, base_arch
from ..spec import Spec
from .cache import INDEX, ShapeBucket, TuneEntry, now_utc
from .device import DeviceIdentity, DeviceLimits, cuda_index
from .fallback import DEFAULT_ARCH, fallback_spec
from .measure import CheckOutcome, CudaEventTimer, ReferenceCheck
from .space import (DEFAULT_GRID, ProgressLine, Resources, TileGrid, candidates, compile_all, nvrtc_resources,
                    prune)

DEFAULT_HEADS = 16


class TuningError(RuntimeError):
    """No candidate survived pruning, compiling and the output check."""


@dataclass
class TuneResult:
    winner: Spec
    entry: TuneEntry
    timings: list[tuple[Spec, float]] = field(default_factory=list)    # fastest first
    pruned: list[tuple[Spec, str]] = field(default_factory=list)       # limits, spills, compile errors
    rejected: list[tuple[Spec, str]] = field(default_factory=list)     # wrong output, failed launch

    def table(self) -> str:
        """Timed candidates, fastest first, the winner and the fallback marked."""
        fallback = fallback_spec(self.winner, self.entry.identity.arch)
        lines = [f"{'candidate':<44} {'median ms':>10}"]
        for spec, ms in self.timings:
            marks = (" <- winner" if spec == self.winner else "") + (" (fallback)" if spec == fallback else "")
            lines.append(f"{spec.name:<44} {ms:>10.4f}{marks}")
        return "\n".join(lines)


def _as_spec(spec_or_fields) -> Spec:
    if isinstance(spec_or_fields, Spec):
        return spec_or_fields
    if isinstance(spec_or_fields, str):
        return Spec.from_name(spec_or_fields)
    if isinstance(spec_or_fields, Mapping):
        return Spec(**spec_or_fields)
    raise TypeError(f"expected a Spec, a spec name or a dict of Spec fields, "
                    f"got {type(spec_or_fields).__name__}")


def _is_cuda(device) -> bool:
    if device is None:
        return torch.cuda.is_available()
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return torch.device(device).type == "cuda"


def tune(spec_or_fields, *, seqlen_q: int, seqlen_k: int | None = None, batch: int = 1,
         heads: int = DEFAULT_HEADS, device=None, grid: TileGrid = DEFAULT_GRID,
         limits: DeviceLimits | None = None, identity: DeviceIdentity | None = None,
         compile_one: Callable[[Spec], Resources] | None = None, check: Callable[[Spec], object] | None = None,
         timer: Callable[[Spec], float] | None = None, workers: int | None = None,
         verbose: bool = True, store: bool = True) -> TuneResult:
    """Tune the tiles of one spec for one problem shape; returns the result (cached when `store`).

    On a GPU everything defaults to the real thing (limits and identity from
    the driver, NVRTC, the kernel vs the float64 reference, CUDA events).
    Elsewhere pass `limits`, `identity`, `check` and `timer` (`compile_one`
    defaults to NVRTC, which needs no GPU).

    compile_one(spec) -> {kernel name: ResourceReport}; raises CompileError
    check(spec) -> CheckOutcome or bool: is this candidate's output right?
    timer(spec) -> float: its median milliseconds on the tuned shape
    """
    base = _as_spec(spec_or_fields)
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    bucket = ShapeBucket.of(seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=batch, heads=heads)
    on_gpu = _is_cuda(device)
    if on_gpu and not torch.cuda.is_available():
        raise RuntimeError("tuning on a CUDA device, but torch.cuda.is_available() is False")
    if not on_gpu and (limits is None or identity is None or check is None or timer is None):
        raise RuntimeError("tuning times kernels on a CUDA GPU; without one, pass limits, identity, "
                           "check and timer (as the tests do)")
    if on_gpu:
        device = torch.device("cuda", cuda_index(device))
    limits = limits or DeviceLimits.from_device(device)
    identity = identity or DeviceIdentity.from_device(device)
    compile_one = compile_one or (lambda spec: nvrtc_resources(spec, limits.arch))
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if verbose else (lambda text: None)

    # 1. candidates, pruned by what the spec alone says about shared memory and threads
    generated = candidates(base, limits, grid)
    fallback = generated[0]
    kept, pruned = prune(generated, limits)
    say(f"tuning {base.base_name} for {bucket.label} on {identity.key}: {len(generated)} candidates")

    # 2. compile in parallel, then prune by the resource report
    progress = ProgressLine("compiling", len(kept), enabled=verbose)
    resources, failed = compile_all(kept, compile_one, workers=workers, progress=progress)
    progress.close()
    kept, pruned_by_report = prune([s for s in kept if s in resources], limits, resources)
    pruned += failed + pruned_by_report
    for spec, reason in pruned:
        say(f"  pruned {spec.name}: {reason}")

    # 3. check every survivor against the reference before any timing
    if check is None:
        check = ReferenceCheck(base, seqlen_q=seqlen_q, seqlen_k=seqlen_k, device=device)
    correct, rejected = [], []
    progress = ProgressLine("checking ", len(kept), enabled=verbose)
    for spec in kept:
        verdict, reason = _run_check(check, spec)
        if verdict:
            correct.append(spec)
        else:
            rejected.append((spec, reason))
        progress.advance()
    progress.close()

    # 4. time the correct ones
    if timer is None:
        timer = CudaEventTimer(base, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                               device=device)
    timings = []
    progress = ProgressLine("timing   ", len(correct), enabled=verbose)
    for spec in correct:
        try:
            ms = float(timer(spec))
        except Exception as exc:  # noqa: BLE001 - a launch failure disqualifies this candidate only
            rejected.append((spec, f"failed to run: {type(exc).__name__}: {exc}"))
        else:
            if math.isfinite(ms) and ms > 0:
                timings.append((spec, ms))
            else:
                rejected.append((spec, f"timer returned {ms!r}"))
        progress.advance()
    progress.close()
    for spec, reason in rejected:
        say(f"  rejected {spec.name}: {reason}")
    if not timings:
        first = (rejected or pruned or [(base, "no candidates")])[0]
        raise TuningError(f"no candidate of {base.base_name} survived tuning ({len(pruned)} pruned, "
                          f"{len(rejected)} rejected); first: {first[0].name}: {first[1]}")

    # 5. the fastest correct candidate wins (ties: the earlier, i.e. the fallback first)
    timings.sort(key=lambda item: item[1])
    winner, winner_ms = timings[0]
    # The kernel family is chosen too (space.candidates: sm90 on compute capability 9.0); it is
    # stored with the tiles only where it is not the default, so sm80 entries read as before.
    tiles = {**winner.tiles, **({"arch_family": winner.arch_family} if winner.arch_family != "sm80" else {})}
    entry = TuneEntry(identity=identity, base_name=base.base_name, bucket=bucket, tiles=tiles,
                      median_ms=winner_ms, fallback_ms=next((ms for s, ms in timings if s == fallback), None),
                      shape={"batch": batch, "heads": heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k},
                      counts={"generated": len(generated), "pruned": len(pruned), "rejected": len(rejected),
                              "timed": len(timings)},
                      tuned_at=now_utc())
    if store:
        try:
            path = INDEX.store(entry)
        except OSError as exc:   # an unwritable cache must not throw away the measurements
            warnings.warn(f"could not cache the tuning of {base.base_name}: {exc}", stacklevel=2)
        else:
            say(f"winner {winner.name}: {winner_ms:.4f} ms (cached in {path})")
    return TuneResult(winner=winner, entry=entry, timings=timings, pruned=pruned, rejected=rejected)


def _run_check(check, spec: Spec) -> tuple[bool, str]:
    try:
        verdict = check(spec)
    except Exception as exc:  # noqa: BLE001 - a crash in the check is a failed check
        return False, f"failed to run: {type(exc).__name__}: {exc}"
    if isinstance(verdict, CheckOutcome):
        return verdict.ok, verdict.reason
    return bool(verdict), "wrong output"


def autotune(spec_or_fields, *, seqlen_q: int, seqlen_k: int | None = None, batch: int = 1,
             heads: int = DEFAULT_HEADS, device=None, **options) -> Spec:
    """Tune, cache and return the fastest correct Spec (see `tune` for the options)."""
    return tune(spec_or_fields, seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=batch, heads=heads,
                device=device, **options).winner


def lookup(spec: Spec, *, seqlen_q: int, seqlen_k: int | None = None, batch: int = 1, heads: int = 1,
           device=None, identity: DeviceIdentity | None = None) -> Spec:
    """The Spec to run: the cached winner for this GPU and shape, else the fallback table's tiles.

    Cheap enough for every call: after the first, a dict read (and, on a
    GPU, a cached identity). CPU tensors, which run in the emulator, get the
    fallback for sm_80. `identity` overrides the device's (tests).
    """
    shared = None
    if identity is None:
        if not _is_cuda(device):
            return _emulator_fallback(spec)
        identity = DeviceIdentity.from_device(device)
        if base_arch(identity.arch) not in SMEM_LIMIT_BYTES:  # an arch the table lacks: ask the driver
            shared = _device_shared_limit(cuda_index(device))
    bucket = ShapeBucket.of(seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=batch, heads=heads)
    return INDEX.spec_for(spec, identity, bucket, shared_per_block_optin=shared)


def is_tuned(spec: Spec, *, seqlen_q: int, seqlen_k: int | None = None, batch: int = 1, heads: int = 1,
             device=None) -> bool:
    """Whether a tuning result (this shape's or a neighbouring bucket's), not the fallback table,
    gives `spec`'s tiles on the CUDA `device`: its family then wins over the self-test's default
    (fagen.selftest.gate), the tuner having checked its output on this GPU."""
    if not _is_cuda(device):
        return False
    bucket = ShapeBucket.of(seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=batch, heads=heads)
    return INDEX.find(DeviceIdentity.from_device(device), spec.base_name, bucket) is not None


@functools.lru_cache(maxsize=None)
def _device_shared_limit(index: int) -> int:
    return DeviceLimits.from_device(index).shared_per_block_optin


@functools.lru_cache(maxsize=256)
def _emulator_fallback(spec: Spec) -> Spec:
    return fallback_spec(spec, DEFAULT_ARCH)
