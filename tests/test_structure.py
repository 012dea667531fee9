"""The package's shape: no import cycles between shoal's modules, no file past 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "shoal"
MAX_LINES = 500


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST):
    """Every import statement: at module level, in functions and methods (a lazy import that hides
    a circle is still an edge of it), and under `if TYPE_CHECKING:` (a type the two modules share
    in a circle is a circle all the same: one of them is in the wrong place)."""
    return (node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for target in targets:
                # `import a.b.c` runs a.b.c; the nearest enclosing module of the package counts.
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, first repeated last) through each strongly connected group of
    modules, then the group's other modules (in brackets) where it has more than that cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm, recursive (the graph is a few hundred nodes)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        cycle = _cycle_in(graph, group)
        rest = sorted(group - set(cycle))
        cycles.append(cycle + ([f"[also {', '.join(rest)}]"] if rest else []))
    return cycles


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest cycle through the group's first module (by name), by breadth-first search."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group always has one


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_file_over_500_lines():
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in sorted(ROOT.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
