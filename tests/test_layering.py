"""The package's import graph stays layered (ARCHITECTURE.md, "Layers"): no import cycles
between rl360's modules (module-level and function-level imports alike), nothing below
`launch` imports it, and the ground floor (`recipe`, `types`) imports nothing of rl360."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "rl360"
BELOW_LAUNCH = ("serve", "actors", "envs", "policies", "rewards", "merge")
GROUND = ("rl360.recipe", "rl360.types")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the rl360 modules it imports (a `from pkg import name` that names a submodule
    counts as importing that submodule)."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name.startswith("rl360") and name != mod:
                    deps.add(name)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def is_package_init(mod: str, dep: str) -> bool:
    """A package's __init__ re-exporting its own submodules is not a cycle of substance."""
    return dep.startswith(mod + ".")


def test_no_import_cycles() -> None:
    graph = {m: {d for d in deps if not is_package_init(m, d)} for m, deps in import_graph().items()}
    assert cycles(graph) == []


def test_nothing_below_launch_imports_it() -> None:
    bad = sorted(
        (mod, dep) for mod, deps in import_graph().items() for dep in deps
        if mod.split(".")[1:2] and mod.split(".")[1] in BELOW_LAUNCH and dep.startswith("rl360.launch")
    )
    assert bad == []


def test_the_ground_floor_imports_nothing_of_rl360() -> None:
    graph = import_graph()
    assert {m: sorted(graph[m]) for m in GROUND if graph[m]} == {}


def test_the_checker_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
