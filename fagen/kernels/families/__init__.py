"""The kernel families with their passes, by name: the registry that dispatch goes through.

A family's facts below the Spec (its refusals, tiles, NVRTC target, shared memory) are
`fagen.arch_families.Family`; its passes and templates are its module here (sm80.py, sm90.py)
and its folder under templates/. A new family is a module here, a folder of templates, a
`Family` in arch_families, and one line in each registry.
"""

from __future__ import annotations

from ...spec import Spec
from ..passes import KernelFamily
from . import sm80, sm90

KERNEL_FAMILIES = {family.name: family for family in (sm80.FAMILY, sm90.FAMILY)}


def kernel_family(spec: Spec) -> KernelFamily:
    """The family whose passes render `spec`'s kernels (Spec.arch_family)."""
    return KERNEL_FAMILIES[spec.arch_family]
