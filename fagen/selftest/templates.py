"""The self-test's templates: the named kernel paths of each family that a GPU proves once.

A template here is one path through a family's kernels: its forward at one head-dim bucket
(`sm90.d128`), or one feature of it (`sm90.softcap`, `sm80.paged`). `fagen selftest` runs one
small case per template (fagen.selftest_cases.cases) and stores a verdict for each. A call's Spec is
served by a family only where every template it uses passed (`templates_of`): a softcap call at
d = 128 on the sm90 family needs `sm90.d128` and `sm90.softcap`. That is a product of features
proven one at a time, not every combination: the trade that keeps the self-test under a minute.

A training Spec of the sm90 family runs its own backward where that takes it (`sm90.backward`,
proven by a case of its own), else the sm80 family's, whose templates of the same features are
then listed too. So where `sm90.backward` alone did not pass, the gate serves the spec with
`Spec.sm80_backward` set: its forward's sm90 templates and sm80's in place of `sm90.backward`. A
decoding Spec's combine and cache-update kernels are proven by its own family's cases (they run
the whole step).

Imports nothing of the pipeline but the Spec's own modules: the gate (fagen.selftest.gate)
classifies every call's Spec here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..arch_families import ARCH_FAMILIES, FAMILIES as FAMILY_FACTS, FP8_FAMILY, SM80
from ..kernels.families import KERNEL_FAMILIES

FAMILIES = ARCH_FAMILIES
# The sm80 family's head-dim buckets: its tile table's (tile_shapes.default_tiles), each named
# after its widest head dim.
SM80_HEAD_DIM_BUCKETS = SM80.head_dims

# Features, in a fixed order: (template suffix, families that have it, whether `spec` uses it).
FEATURES = (
    ("causal", FAMILIES, lambda s: s.mask == "causal"),
    ("key_padding", FAMILIES, lambda s: s.key_padding and s.kv_cache is None),
    ("window", FAMILIES, lambda s: s.window),
    ("softcap", FAMILIES, lambda s: s.softcap),
    ("alibi", FAMILIES, lambda s: s.alibi),
    ("sinks", FAMILIES, lambda s: s.sinks),
    ("dropout", FAMILIES, lambda s: s.dropout),
    ("mods", FAMILIES, lambda s: s.score_mod is not None or s.mask_mod is not None),
    ("varlen", FAMILIES, lambda s: s.varlen and s.kv_cache is None),
    ("head_dim_v", FAMILIES, lambda s: s.head_dim_v not in (None, s.head_dim) and not s.v_from_k),
    ("decode", FAMILIES, lambda s: s.kv_cache == "contiguous"),
    ("paged", FAMILIES, lambda s: s.kv_cache == "paged" and not s.varlen),
    ("varlen_paged", FAMILIES, lambda s: s.kv_cache == "paged" and s.varlen),
    ("pack_gqa", FAMILIES, lambda s: s.pack_gqa),
    ("mla", FAMILIES, lambda s: s.v_from_k),
    ("fp8", (FP8_FAMILY.name,), lambda s: s.fp8),            # the e4m3 forward and its backward
    ("fp8_cache", ("sm80",), lambda s: s.cache_fp8),         # decoding from an e4m3 KV cache
    ("fa1", ("sm80",), lambda s: s.version == 1),
    ("deterministic", ("sm80",), lambda s: s.deterministic),
    # A family's own backward where it lists another's after it (sm90: its backward takes some specs).
    ("backward", tuple(name for name, family in KERNEL_FAMILIES.items() if len(family.backward) > 1),
     lambda s: not s.forward_only and backward_family(s) == s.arch_family),
)


def head_dim_template(family: str, head_dim: int) -> str:
    """The template of a family's forward at `head_dim`: the first of its head dims with tiles of
    their own (`Family.head_dims`: each of sm90's, arch_families.sm90_tiles; sm80's tile table's
    buckets) at or above it."""
    return f"{family}.d{next(b for b in FAMILY_FACTS[family].head_dims if head_dim <= b)}"


def all_templates(family: str) -> tuple[str, ...]:
    """Every template of `family`, in the order the self-test runs them (head dims first)."""
    dims = FAMILY_FACTS[family].head_dims
    return tuple([head_dim_template(family, d) for d in dims] +
                 [f"{family}.{name}" for name, families, _ in FEATURES if family in families])


def templates_of(spec) -> tuple[str, ...]:
    """The templates whose kernels `spec`'s source holds: its family's forward (head dim and
    features, its own backward among them), and for a training Spec whose backward is another
    family's (sm90 runs sm80's where its own does not take the spec) that family's templates of
    the same features."""
    found = list(_family_templates(spec, spec.arch_family))
    backward = None if spec.forward_only else backward_family(spec)
    if backward not in (None, spec.arch_family):
        found += _family_templates(spec, backward)
    return tuple(found)


def backward_family(spec) -> str:
    """The family whose templates `spec`'s backward pass is rendered from (its own, or sm80's)."""
    return _folder_family(KERNEL_FAMILIES[spec.arch_family].backward_of(spec))


def fallback_backward_family(family: str) -> str:
    """The family whose backward serves what none of `family`'s own takes: its last listed (sm80
    runs its own; sm90 sm80's)."""
    return _folder_family(KERNEL_FAMILIES[family].backward[-1])


def _folder_family(found) -> str:
    """The family whose folder holds the pass `found`'s templates."""
    folder = found.templates[0].partition("/")[0]
    return next(facts.name for facts in FAMILY_FACTS.values() if facts.templates == folder)


def _family_templates(spec, family: str) -> list[str]:
    # Absorbed MLA's d = 576 is its own path (`mla`); every other Spec has a head-dim template.
    found = [] if spec.v_from_k else [head_dim_template(family, spec.head_dim)]
    return found + [f"{family}.{name}" for name, families, uses in FEATURES if family in families and uses(spec)]


# What each family's kernels are rendered from: its templates (its folder's, and those of the
# family whose backward it runs), and what every render shares. A change to any of these
# invalidates the family's verdicts (fagen.selftest.verdicts).
SHARED_TEMPLATES = ("translation_unit.cu.j2", "macros.j2", "attention.j2", "bwd_rows.j2", "combine.cu.j2",
                    "cache_update.cu.j2")


def family_templates(family: str) -> tuple[str, ...]:
    """The glob patterns, under templates/, of the templates `family`'s kernels are made from
    beyond the shared ones: its folder, and those of its passes that lie in another's (sm90's
    backward, sm80's)."""
    folder = FAMILY_FACTS[family].templates
    borrowed = [name for found in KERNEL_FAMILIES[family].passes for name in found.sources
                if "/" in name and not name.startswith(folder + "/")]
    return (f"{folder}/*.j2", *dict.fromkeys(borrowed))
# The host code that renders and launches them: launch geometry and arguments matter as much.
HOST_SOURCES = ("kernels/*.py", "kernels/families/*.py", "variants/*.py", "arch_families.py", "tile_shapes.py", "spec.py", "arch.py")


def sources_digest(family: str, template_dir: Path, package_dir: Path) -> str:
    """A hash of everything `family`'s kernels are made from: its templates and the shared ones,
    the static CUDA headers, and the host code that renders and launches them."""
    paths = []
    for pattern in SHARED_TEMPLATES + family_templates(family) + ("include/fagen/*.cuh",):
        paths += sorted(template_dir.glob(pattern))
    for pattern in HOST_SOURCES:
        paths += sorted(package_dir.glob(pattern))
    digest = hashlib.sha256(family.encode())
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
