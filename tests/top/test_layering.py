"""The package's imports run one way (docs/design.md, "Layers": this file holds the code to its
numbered rules): no module imports, even lazily inside a function, a module that imports it back."""

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
                                       ("fagen.selftest.gate", "fagen.selftest_cases.cases"),
                                       ("fagen.kernels.launch", "fagen.emulate"), ("fagen.kernels.build", "fagen.emulate"),
                                       ("fagen.kernels.compile", "fagen.emulate")])
def test_lower_layers_do_not_import_higher_ones(low, high):
    assert high not in reached_from(import_graph(), [low]), f"{low} reaches {high}"


def reached_from(graph: dict[str, set[str]], starts: list[str]) -> set[str]:
    """Every module `starts` import, directly or through others (themselves included)."""
    seen, todo = set(), list(starts)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(graph.get(node, ()))
    return seen


@pytest.mark.parametrize("high", ["fagen.ops", "fagen.selftest_cases", "fagen.bench", "fagen.kernel_record"])
def test_the_selftest_package_stays_below_the_ops(high):
    """docs/design.md, "Layers", rule 2: every module of fagen.selftest (the gate the ops ask, the
    verdicts, the templates, the watchdog, the command) stays below the ops; the cases that call
    the ops live in fagen.selftest_cases, started as a child process by module name."""
    graph = import_graph()
    low = sorted(node for node in graph if node == "fagen.selftest" or node.startswith("fagen.selftest."))
    assert len(low) >= 5, low   # the package was found
    reached = sorted(node for node in reached_from(graph, low) if node == high or node.startswith(high + "."))
    assert not reached, f"fagen.selftest reaches {reached}"


# Users of ops that nothing below them may import (docs/design.md, "Layers", rule 5), each with
# the modules allowed to: the package's front door, the package itself and the GPU check's sections.
TOP_LAYERS = {"fagen.distributed": ("fagen", "fagen.distributed", "fagen.bench")}
# What distributed/ and integrations/ may import of ops: its front (the entry points it
# re-exports), its common layer and `call` (the one path from call arguments to a Spec), never an
# entry point's own module (docs/design.md, "Layers", rule 5).
OPS_FOR_USERS = ("fagen.ops", "fagen.ops.common", "fagen.ops.call")


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


def test_distributed_and_integrations_use_ops_through_its_front_common_layer_and_call():
    graph = import_graph()
    assert {"fagen.ops", "fagen.ops.common"} <= set().union(*(graph[m] for m in graph if m.startswith("fagen.distributed")))
    assert ops_imports_of_users(graph) == {}
    # Positive control: reaching into a family's module is caught.
    assert ops_imports_of_users({"fagen.distributed.ring": {"fagen.ops.dense", "fagen.ops.common"}}) == \
        {"fagen.distributed.ring": {"fagen.ops.dense"}}


# The bottom layer: modules that import nothing of fagen, so that every stage can use them.
LEAVES = ("fagen.version", "fagen.dtypes", "fagen.cache_files", "fagen.environment")


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_leaf_imports_nothing_of_fagen(leaf):
    graph = import_graph()
    assert leaf in graph, f"{leaf} is not a module of fagen"
    assert graph[leaf] == set(), f"{leaf} imports {sorted(graph[leaf])}"


def test_no_package_of_fagen_reaches_the_emulator_from_the_kernels():
    """kernels/ and emulate/ no longer import each other: the emulator builds on the kernels'
    headers and registers itself as the CPU backend (kernels.launch.register_emulator)."""
    graph = import_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("fagen.kernels")
                    for t in targets if t.startswith("fagen.emulate"))
    assert not upward, ", ".join(upward)


# Above the front door (fagen/__init__.py): the command line and the GPU check, which call
# fagen as a user does. Every other module imports what it needs from the module that defines
# it (the version from fagen.version): the front door imports ops, tuning and distributed, so a
# module below them that imports it reaches the whole package.
ABOVE_THE_FRONT_DOOR = ("fagen.cli", "fagen.__main__", "fagen.bench")


def front_door_imports(name: str, path: Path, known: set[str]) -> list[str]:
    """The lines of `name` that import the package `fagen` itself or a name it defines
    (`import fagen`, `from fagen import __version__`, `from .. import __version__`); importing
    a submodule through it (`from .. import ops`) is an import of that submodule."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import fagen" for alias in node.names if alias.name == "fagen"]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module) if node.level else node.module
            if base == "fagen":
                found += [f"line {node.lineno}: from fagen import {alias.name}" for alias in node.names
                          if f"fagen.{alias.name}" not in known]
    return found


def test_only_the_top_imports_the_front_door():
    found = modules()
    known = set(found)
    intruders = {name: lines for name, path in found.items()
                 if name != "fagen" and not _allowed(name, ABOVE_THE_FRONT_DOOR)
                 and (lines := front_door_imports(name, path, known))}
    assert not intruders, intruders


def test_the_front_door_rule_sees_an_intruder(tmp_path):
    """Positive control: the import of the version from the package, relative or absolute, is caught."""
    source = tmp_path / "build.py"
    source.write_text("from .. import __version__\nfrom .. import spec\ndef f():\n    import fagen\n")
    known = {"fagen", "fagen.spec", "fagen.kernels", "fagen.kernels.build"}
    assert front_door_imports("fagen.kernels.build", source, known) == \
        ["line 1: from fagen import __version__", "line 4: import fagen"]
