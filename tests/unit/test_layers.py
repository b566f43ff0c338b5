"""The package's layering, checked over the source: no import cycles, no production code that leans on
the test helpers, no module past the size budget (STYLE.md, practice 10).

The import graph is read from the AST of every module under pdserve/, counting imports inside functions
and under TYPE_CHECKING too: such an import hides a cycle from the interpreter, not from a reader.
`from pdserve.kv.transport import heads` names the module heads, not the package; importing a module
is not counted as importing its parent packages' __init__.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = "pdserve"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
MAX_MODULE_LINES = 600
TEST_HELPERS = f"{PACKAGE}.testing"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    # A relative import counts from the importer's package: the module itself when it is a package.
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest pdserve module that `name` names or lies inside (a class, a function, a submodule)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """Every pdserve module `module` imports, at any depth in its body."""
    path = modules[module]
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            # `from pdserve.x import y` names module pdserve.x.y when y is a submodule, else pdserve.x.
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: imports_of(m, modules) for m in modules}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(root: str) -> None:
        # Iterative: a recursive walk over a few hundred modules is fine, but a deep chain need not be.
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(components, key=lambda c: (-len(c), c))


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto pdserve's layers: each subpackage (pdserve.kv, pdserve.sim, ...)
    is one node, each top-level module (pdserve.cli) its own."""
    modules = package_modules()

    def layer(module: str) -> str:
        parts = module.split(".")
        is_package = modules[module].name == "__init__.py"
        return ".".join(parts[:2]) if len(parts) > 2 or is_package else module

    folded: dict[str, set[str]] = {layer(m): set() for m in graph}
    for module, targets in graph.items():
        folded[layer(module)] |= {layer(t) for t in targets} - {layer(module)}
    return folded


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "  {" + ", ".join(component) + "}\n" + "\n".join(edges)


def test_no_import_cycles():
    graph = import_graph()
    cycles = import_cycles(graph)
    assert not cycles, "import cycles between pdserve modules (function-level imports count):\n" + "\n".join(
        _describe(c, graph) for c in cycles
    )


def test_no_import_cycles_between_packages():
    graph = package_graph(import_graph())
    cycles = import_cycles(graph)
    assert not cycles, "import cycles between pdserve's subpackages:\n" + "\n".join(
        _describe(c, graph) for c in cycles
    )


def test_production_code_does_not_import_the_test_helpers():
    graph = import_graph()
    offenders = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if not (m == TEST_HELPERS or m.startswith(TEST_HELPERS + "."))
        for t in targets
        if t == TEST_HELPERS or t.startswith(TEST_HELPERS + ".")
    )
    assert not offenders, "production modules import pdserve.testing:\n  " + "\n  ".join(offenders)


def test_modules_stay_under_the_size_budget():
    over = sorted(
        f"{m}: {n} lines"
        for m, p in package_modules().items()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert not over, f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(over)


def test_the_cycle_finder_sees_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


if __name__ == "__main__":
    for g in (import_graph(), package_graph(import_graph())):
        for c in import_cycles(g):
            print(_describe(c, g))
