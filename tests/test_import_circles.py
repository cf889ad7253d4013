"""No import circles among the project's modules, imports inside functions included (they hide a circle, they do not
remove it): every module's imports read from its source (ast), the graph's strongly connected components listed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ddtree", "compat")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (a name imported from a package that is a
    module of it counts as that module)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join([*base, *(node.module or "").split(".")]).strip(".")
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != m:
                    graph[m].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_check_finds_a_circle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_are_edges(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from ddtree.pipeline import job\n")
    graph = import_graph({"ddtree.x": f, "ddtree.pipeline.job": f, "ddtree.pipeline": f})
    assert graph["ddtree.x"] == {"ddtree.pipeline.job"}


def test_the_project_has_no_import_circles():
    mods = _modules()
    assert len(mods) > 80
    assert circles(import_graph(mods)) == []
