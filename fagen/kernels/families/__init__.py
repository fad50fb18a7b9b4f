"""The kernel families with their passes, by name: the registry that dispatch goes through.

A family's facts below the Spec (its refusals, tiles, NVRTC target, shared memory) are
`fagen.arch_families.Family`; its passes and templates are the module here named after it
(sm80.py, sm90.py), whose `FAMILY` is its `KernelFamily`, and its folder under templates/. The
one registry is `fagen.arch_families.FAMILIES`: each family listed there has its passes found
here by its name, so a new family is a `Family` and its line there, a module here, and a folder
of templates.
"""

from __future__ import annotations

import importlib

from ...arch_families import FAMILIES
from ...spec import Spec
from ..passes import KernelFamily


def _passes_of(name: str) -> KernelFamily:
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise ImportError(f"the kernel family {name!r} (fagen.arch_families.FAMILIES) has no passes: "
                          f"expected fagen/kernels/families/{name}.py defining FAMILY") from None
    family = module.FAMILY
    if family.name != name:
        raise ImportError(f"fagen/kernels/families/{name}.py defines the passes of {family.name!r}, not {name!r}")
    return family


KERNEL_FAMILIES = {name: _passes_of(name) for name in FAMILIES}


def kernel_family(spec: Spec) -> KernelFamily:
    """The family whose passes render `spec`'s kernels (Spec.arch_family)."""
    return KERNEL_FAMILIES[spec.arch_family]
