"""Which kernels a call compiles on a given GPU, found by making the call.

The precompile section must build exactly the kernels the sections and the gpu tests will launch,
and those are whatever fagen's ops choose: a Spec built from the call's arguments, its tiles from
the tuning cache or the fallback table for the GPU's arch (`tuning.lookup`), fixed tiles for a
decoding step (with GQA packing decided from the heads), the ring's pair kernels, and so on. So
nothing here derives a Spec: the recorder makes the calls themselves, on small CPU tensors, with
two of fagen's seams replaced for the duration:

  - `fagen.tuning.lookup` resolves tiles for the GPU's identity (its arch) instead of the
    emulator's sm_80 fallback that CPU tensors get, and `fagen.ops.call.compiled_arch` names that
    arch, so that a mod's kernel gets the spill-free tiles the GPU's call would (kernels.spill_free);
  - `fagen.kernels.launch.load` records each Source's Spec and hands back kernels that do nothing, so no
    kernel compiles or runs and a call goes on to its next kernel (its outputs are garbage).

A Spec given explicitly (a test that renders its own) is recorded as it is: that is the kernel.

Recording swaps the seams back afterwards, and with them the caches that would remember a
recorded call (`_CACHES`); still, module attributes are replaced for its duration, so it belongs
in a process that runs nothing else meanwhile: precompile records in its spawned workers, tests in
a subprocess.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class Recorded:
    """Specs in first-use order (each once), each call's kernel names, the loads seen, and the
    calls that raised."""

    specs: list = field(default_factory=list)
    by_call: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    loads: int = 0
    label: str | None = None   # the call being made

    def add(self, spec, label: str | None = None) -> None:
        if spec not in self.specs:
            self.specs.append(spec)
        if label is not None and spec.name not in self.by_call.setdefault(label, []):
            self.by_call[label].append(spec.name)

    def names_of(self, prefix: str) -> list[str]:
        """Kernel names of the calls whose label starts with `prefix`, in first-use order."""
        names = [name for label, found in self.by_call.items() if label.startswith(prefix) for name in found]
        return list(dict.fromkeys(names))

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]


def identity_for(arch: str):
    """A stand-in identity for any GPU of `arch` (no tuning cache entry names it: the fallback
    table's tiles for that arch)."""
    from fagen.tuning import DeviceIdentity

    return DeviceIdentity(name=f"any {arch} GPU", arch=arch, driver="-", nvrtc="-")


# Per-process caches that remember a call's kernels past their first load: the launch plans
# (which would hold the do-nothing kernels), the ops' per-shape Source memo (which would hold the
# recorded arch's tiles for CPU calls) and the decode step's loaded set. Recording swaps in
# empty ones, so that every call loads its kernels again and nothing recorded outlives it.
_CACHES = (("fagen.kernels.attention_kernels", "_plans"), ("fagen.ops.call", "_call_sources"),
           ("fagen.ops.dense", "_calls"), ("fagen.ops.kvcache", "_loaded"))


@contextlib.contextmanager
def recording(identity, recorded: Recorded):
    """Within: every kernel load is recorded into `recorded` (and runs nothing), and tiles are
    looked up for `identity` (a DeviceIdentity)."""
    import fagen.kernels.launch as launch
    import fagen.ops.call as call
    import fagen.tuning as tuning

    real_load, real_lookup, real_arch = launch.load, tuning.lookup, call.compiled_arch

    def load(source, device):
        recorded.add(source.spec, recorded.label)
        recorded.loads += 1
        idle = {entry.name: _do_nothing for entry in source.entries}
        return launch.LoadedSource(source, device, idle, pointer=lambda t: t, tensor_map=lambda box, t, swizzle=None: t)

    def lookup(spec, **shape):
        shape.pop("device", None)
        shape["identity"] = identity
        return real_lookup(spec, **shape)

    launch.load, tuning.lookup, call.compiled_arch = load, lookup, lambda device: identity.arch
    try:
        with _fresh_caches():
            yield recorded
    finally:
        launch.load, tuning.lookup, call.compiled_arch = real_load, real_lookup, real_arch


@contextlib.contextmanager
def _fresh_caches():
    import importlib

    saved = []
    for module_name, attribute in _CACHES:
        module = importlib.import_module(module_name)
        if hasattr(module, attribute):   # a cache that was renamed away simply is not swapped
            saved.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, type(getattr(module, attribute))())
    try:
        yield
    finally:
        for module, attribute, value in saved:
            setattr(module, attribute, value)


def _do_nothing(*args, **kwargs) -> None:
    return None


def record(calls: Iterable[tuple[str, object]], identity) -> Recorded:
    """Make each (label, call) under `recording`: a call is a Spec (recorded as given) or a
    function of no arguments. A call that raises is an error only if it recorded no kernel:
    after its kernels, garbage outputs may well upset what follows them."""
    from fagen.spec import Spec

    recorded = Recorded()
    with recording(identity, recorded):
        for label, call in calls:
            recorded.label = label
            if isinstance(call, Spec):
                recorded.add(call, label)
                continue
            before = recorded.loads
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - reported with its call's label
                if recorded.loads == before:
                    recorded.errors.append(f"{label}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        recorded.label = None
    return recorded
