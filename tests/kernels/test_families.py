"""The kernel families (fagen.arch_families.Family, fagen.kernels.families): each pass lists the
templates its kernels are rendered from, each family's folder holds only its passes' templates,
and dispatch by a family's name stays in the family's own modules."""

import re
from pathlib import Path

import pytest

from fagen.arch_families import FAMILIES
from fagen.kernels.families import KERNEL_FAMILIES
from fagen.kernels.render import template_dir

PACKAGE = Path(__file__).resolve().parents[2] / "fagen"
INCLUDE = re.compile(r"""{%-?\s*(?:include|import)\s+"([^"]+)"\s""")


def included(name: str) -> set[str]:
    """The templates `name` includes or imports, directly or through others."""
    found, todo = set(), [name]
    while todo:
        for child in INCLUDE.findall((template_dir() / todo.pop()).read_text()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def test_every_family_has_its_facts_and_a_folder():
    assert set(KERNEL_FAMILIES) == set(FAMILIES)
    for name, family in KERNEL_FAMILIES.items():
        assert family.facts is FAMILIES[name] and (template_dir() / family.facts.templates).is_dir()


def test_a_family_in_the_registry_without_passes_is_named():
    """FAMILIES is the one registry: a family's passes are found by its name, and one listed
    there without a module of passes fails at import, naming the file it needs."""
    from fagen.kernels.families import _passes_of

    assert _passes_of("sm90") is KERNEL_FAMILIES["sm90"]
    with pytest.raises(ImportError, match=r"'sm99'.*fagen/kernels/families/sm99\.py defining FAMILY"):
        _passes_of("sm99")


@pytest.mark.parametrize("name", sorted(KERNEL_FAMILIES))
def test_a_pass_lists_every_template_its_own_include(name):
    """What the self-test's digest reads (Pass.sources): a pass's templates and, beyond the shared
    ones at templates/'s root, every template they include."""
    for found in KERNEL_FAMILIES[name].passes:
        for template in found.templates:
            missing = {t for t in included(template) if "/" in t} - set(found.sources)
            assert not missing, (template, missing)


def test_a_family_folder_holds_its_passes_templates_only():
    for family in KERNEL_FAMILIES.values():
        folder = template_dir() / family.facts.templates
        listed = {name for found in family.passes for name in found.sources}
        on_disk = {f"{family.facts.templates}/{path.name}" for path in folder.glob("*.j2")}
        assert on_disk and on_disk <= listed, on_disk - listed


def test_a_family_is_named_only_in_its_own_modules():
    """Dispatch goes through the family objects: no module but the family's own spells its name
    as a string (the sm80 family, the default, is the Spec's default value and stays)."""
    own = {PACKAGE / "arch_families.py", PACKAGE / "kernels" / "families" / "sm90.py"}
    spelled = [f"{path.relative_to(PACKAGE)}:{number}" for path in sorted(PACKAGE.rglob("*.py")) if path not in own
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"""["']sm90["']""", line)]
    assert not spelled, spelled
