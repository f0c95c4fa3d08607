"""The package's layers point down, and no module imports itself around a cycle.

The layer order is written once, in docs/architecture.md ("## Layers"); this test reads it. Every
``import`` and ``from ... import`` in ``gradsync/`` counts, also those inside functions (a lazy
import is still a dependency: it only moves the failure to run time).
"""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "gradsync")


def layers() -> dict[str, int]:
    """``{part: its layer}`` from docs/architecture.md; a part is a top-level module or sub-package."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    order = {}
    for number, names in re.findall(r"(?m)^(\d+)\. (.+)$", section):
        for name in names.split("(")[0].split(","):
            order[name.strip()] = int(number)
    return order


def modules() -> dict[str, str]:
    """``{dotted module name: path}`` of every module in the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".").removesuffix(".__init__")
                found[dotted] = path
    return found


def imports(path: str, known: dict[str, str]) -> set[str]:
    """The package's modules that the module at ``path`` imports (a ``from X import y`` of a
    submodule ``y`` counts as importing ``X.y``)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out


def part(module: str) -> str:
    """``gradsync.strategies.p3`` -> ``strategies``; ``gradsync`` itself -> ``gradsync``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "gradsync"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports(path, known) - {module} for module, path in known.items()}


def test_every_part_of_the_package_has_a_layer():
    order = layers()
    assert order, "docs/architecture.md has no '## Layers' list"
    missing = sorted({part(m) for m in modules()} - set(order))
    assert not missing, f"parts of gradsync/ missing from the layer list in docs/architecture.md: {missing}"


def test_no_part_imports_from_a_layer_above_it():
    order = layers()
    upward = [f"{module} (layer {order[part(module)]}) imports {target} (layer {order[part(target)]})"
              for module, targets in graph().items() for target in sorted(targets)
              if part(target) != part(module) and order[part(target)] >= order[part(module)]]
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``edges`` as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_and_the_layer_list_parses():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    order = layers()
    assert order["errors"] < order["transport"] < order["runtime"] < order["strategies"] < order["cli"]
