"""The package's imports run one way (../shared/DESIGN.md): no module imports, even lazily
inside a function, a module that imports it back."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fagen"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(importer: str, is_package: bool, level: int, name: str | None) -> str:
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every fagen module `name` imports anywhere in its body (top level or inside functions).

    Importing a package's own ancestors is left out: Python runs them first for every
    submodule anyway, so they are not an arrow of the layering."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve(name, is_package, node.level, node.module)
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and not name.startswith(target + ".") and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def test_there_is_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_lazy_import(tmp_path):
    """Positive control: the check is not vacuous."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from .other import thing\n")
    assert imports_of("fagen.mod", source, {"fagen.mod", "fagen.other"}) == {"fagen.other"}


@pytest.mark.parametrize("low, high", [("fagen.spec", "fagen.kernels.render"), ("fagen.kernels.render", "fagen.ops"),
                                       ("fagen.kernels.launch", "fagen.ops"), ("fagen.tuning.cache", "fagen.ops"),
                                       ("fagen.tuning.command", "fagen.cli"), ("fagen.selftest.gate", "fagen.ops"),
                                       ("fagen.selftest.gate", "fagen.selftest.cases")])
def test_lower_layers_do_not_import_higher_ones(low, high):
    graph = import_graph()
    seen, todo = set(), [low]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(graph.get(node, ()))
    assert high not in seen, f"{low} reaches {high}"


# Users of ops that nothing below them may import (../shared/DESIGN.md: "users of ops; ops never
# imports them"), each with the modules allowed to: the package's front door, the package itself
# and the GPU check's sections.
TOP_LAYERS = {"fagen.distributed": ("fagen", "fagen.distributed", "fagen.bench")}
# What distributed/ and integrations/ may import of ops: its front (the entry points it
# re-exports) and its common layer, never a family's own module (DESIGN: "import from ops'
# common layer, never from the user-facing modules").
OPS_FOR_USERS = ("fagen.ops", "fagen.ops.common")


def importers_of(graph: dict[str, set[str]], package: str) -> set[str]:
    return {name for name, targets in graph.items()
            if any(t == package or t.startswith(package + ".") for t in targets)}


def _allowed(name: str, allowed: tuple) -> bool:
    """`fagen` itself by name only (every module is under it); the others with their submodules."""
    return name in allowed or any(name.startswith(a + ".") for a in allowed if a != "fagen")


@pytest.mark.parametrize("package", sorted(TOP_LAYERS))
def test_only_the_front_door_imports_a_top_layer(package):
    graph = import_graph()
    assert package in graph, f"{package} is not a module of fagen"
    assert "fagen" in importers_of(graph, package), f"fagen/__init__.py no longer exports {package}"
    intruders = sorted(m for m in importers_of(graph, package) if not _allowed(m, TOP_LAYERS[package]))
    assert not intruders, f"{', '.join(intruders)} import {package}"


def test_nothing_in_fagen_imports_the_integrations():
    """fagen.integrations is glue for other libraries (transformers): users import it; fagen's own
    modules, the front door included, never do (importing it pulls in that library)."""
    graph = import_graph()
    assert "fagen.integrations.transformers" in graph
    intruders = sorted(m for m in importers_of(graph, "fagen.integrations")
                       if not m.startswith("fagen.integrations") and not m.startswith("fagen.bench"))
    assert not intruders, f"{', '.join(intruders)} import fagen.integrations"


def test_the_top_layer_rule_sees_an_intruder():
    """Positive control: a lower module importing distributed, even a submodule of it, is caught."""
    graph = {"fagen": {"fagen.distributed"}, "fagen.distributed": {"fagen.ops.merge"},
             "fagen.ops.merge": {"fagen.ops"}, "fagen.ops": {"fagen.distributed.ring"}}
    found = {m for m in importers_of(graph, "fagen.distributed") if not _allowed(m, TOP_LAYERS["fagen.distributed"])}
    assert found == {"fagen.ops"}


def ops_imports_of_users(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """For each module of distributed/ and integrations/, the ops modules it imports beyond OPS_FOR_USERS."""
    found = {}
    for name, targets in graph.items():
        if name.startswith(("fagen.distributed", "fagen.integrations")):
            beyond = {t for t in targets if t.startswith("fagen.ops") and t not in OPS_FOR_USERS}
            if beyond:
                found[name] = beyond
    return found


def test_distributed_and_integrations_use_ops_through_its_front_and_common_layer():
    graph = import_graph()
    assert {"fagen.ops", "fagen.ops.common"} <= set().union(*(graph[m] for m in graph if m.startswith("fagen.distributed")))
    assert ops_imports_of_users(graph) == {}
    # Positive control: reaching into a family's module is caught.
    assert ops_imports_of_users({"fagen.distributed.ring": {"fagen.ops.dense", "fagen.ops.common"}}) == \
        {"fagen.distributed.ring": {"fagen.ops.dense"}}
