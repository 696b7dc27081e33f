"""The package's import graph stays layered (ARCHITECTURE.md, "Layers").

`LAYERS` is the table of every allowed package-to-package import: each package's tier and the
packages it may import besides the ground floor. The tests check that ARCHITECTURE.md shows the
same table, that every arrow in it points to a lower tier, that every import between rl360's
modules (module-level and function-level imports alike) is an arrow of the table, and that no
modules import each other in a cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rl360"

# the ground floor: every package may import it, it imports nothing of rl360 ("rl360" is the
# package's own __init__: its version)
GROUND = frozenset({"rl360", "recipe", "types", "ray_session"})
# package -> (tier, the packages it may import besides the ground floor)
LAYERS: dict[str, tuple[int, frozenset[str]]] = {
    "__main__": (6, frozenset({"cli"})),
    "cli": (5, frozenset({"launch", "merge", "serve"})),
    "launch": (4, frozenset({"actors", "serve", "weights", "envs", "policies"})),
    "actors": (3, frozenset({"serve", "weights", "envs", "policies"})),
    "serve": (2, frozenset({"weights", "policies"})),
    "envs": (2, frozenset({"rewards"})),
    "merge": (2, frozenset({"policies"})),
    "weights": (1, frozenset()),
    "policies": (1, frozenset()),
    "rewards": (1, frozenset()),
    **{g: (0, frozenset()) for g in GROUND},
}


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


def package_of(module: str) -> str:
    """The table's unit a module belongs to: rl360.serve.engines.base -> serve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def allowed(src: str, dst: str) -> bool:
    if src == dst:
        return True
    if src in GROUND:
        return False
    return dst in GROUND or dst in LAYERS[src][1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
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


def architecture_table() -> dict[str, tuple[int, frozenset[str]]]:
    """The table ARCHITECTURE.md's "Layers" section shows: tier | package(s) | what it is |
    may import (backticked names; "—" or "nothing of rl360" for none)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    table: dict[str, tuple[int, frozenset[str]]] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        tier, packages, may = int(cells[0]), re.findall(r"`([^`]+)`", cells[1]), cells[-1]
        for p in packages:
            table[p] = (tier, frozenset(re.findall(r"`([^`]+)`", may)))
    return table


def test_architecture_shows_this_table() -> None:
    assert architecture_table() == LAYERS


def test_every_arrow_of_the_table_points_down() -> None:
    up = [(src, dst) for src, (tier, deps) in LAYERS.items() for dst in deps
          if LAYERS[dst][0] >= tier]
    assert up == []
    assert all(LAYERS[g] == (0, frozenset()) for g in GROUND)


def test_every_package_is_in_the_table() -> None:
    assert {package_of(m) for m in import_graph()} - set(LAYERS) == set()


def test_every_import_is_an_arrow_of_the_table() -> None:
    bad = sorted(
        (mod, dep) for mod, deps in import_graph().items() for dep in deps
        if not allowed(package_of(mod), package_of(dep))
    )
    assert bad == []


def test_no_import_cycles() -> None:
    graph = {m: {d for d in deps if not is_package_init(m, d)} for m, deps in import_graph().items()}
    assert cycles(graph) == []


def test_the_checker_sees_a_cycle_and_an_arrow_up() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not allowed("rewards", "envs") and not allowed("weights", "serve")
    assert not allowed("recipe", "types") and allowed("envs", "recipe")
    assert package_of("rl360.serve.engines.base") == "serve" and package_of("rl360") == "rl360"
