"""No import cycles among the package's own modules or between its rooms (folders), and
data_pipeline/ knows nothing of launcher/.

The graph: every library module (model/, parallel/, data_pipeline/, launcher/, durable.py, storage.py) -> the
loomtrain modules it imports, at module level or inside a function alike (an import moved into a
function still ties the two modules together; it only hides the tie until run time). Imports
under `if TYPE_CHECKING:` are left out: they never run. `from pkg import name` is an edge to
the submodule pkg.name where there is one, else to pkg itself. Imports by string
(importlib.import_module) are not read.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from source_tree import ROOT, parse, python_files

LIBRARY = ("model", "parallel", "data_pipeline", "launcher")


def module_name(path: Path) -> str:
    return ".".join(("loomtrain", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def _library_files() -> list[Path]:
    root_modules = (ROOT / "durable.py", ROOT / "storage.py", ROOT / "hf_cache.py")
    return [p for p in python_files() if p.relative_to(ROOT).parts[0] in LIBRARY or p in root_modules]


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


@cache
def graph() -> dict[str, dict[str, str]]:
    """module -> {imported loomtrain module: 'file:line' of an import of it (module level first)}."""
    modules = {module_name(p): p for p in _library_files()}
    out: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        tree, edges = parse(path), {}
        skip = _type_checking_only(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            for target in targets:
                while target and target not in modules:  # a name below a module (a class) stands for it
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, where)
        out[name] = edges
    return out


def cycles(g: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one
    cycle through its first module, in import order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return [_one_cycle(g, comp) for comp in sorted(components)]


def _one_cycle(g: dict[str, dict[str, str]], comp: list[str]) -> list[str]:
    """A shortest path from comp[0] back to itself inside the component (breadth first)."""
    members, start = set(comp), comp[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v]):
                if w == start:
                    return [*paths[v], start]
                if w in members and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"not a cycle: {comp}")


def describe(g: dict[str, dict[str, str]], found: list[list[str]]) -> str:
    """Each cycle on one line, then each of its imports with the file and line making it."""
    return "\n".join(
        f"  {' -> '.join(c)}\n" + "".join(f"    {a} -> {b} ({g[a][b]})\n" for a, b in zip(c, c[1:])) for c in found
    )


def test_the_graph_sees_function_level_imports():
    """A guard for the graph itself (an empty graph would pass the tests below): a module-level
    import and one inside a function (ray_train's `_store`, run only on the Ray driver) show up."""
    g = graph()
    assert "loomtrain.launcher.config" in g["loomtrain.launcher.distributed"]
    assert "loomtrain.launcher.checkpoints.store" in g["loomtrain.launcher.cluster.ray_train"]
    assert len(g) > 50 and sum(map(len, g.values())) > 150


def test_no_import_cycles():
    g = graph()
    found = cycles(g)
    assert not found, f"{len(found)} import cycle(s) among the package's modules:\n" + describe(g, found)


def room_graph() -> dict[str, dict[str, str]]:
    """The same imports between rooms (a module's folder: loomtrain.launcher.checkpoints.store
    lives in loomtrain.launcher.checkpoints, launcher/config.py in loomtrain.launcher)."""
    packages = {module_name(p) for p in _library_files() if p.name == "__init__.py"}

    def room(module: str) -> str:
        return module if module in packages else module.rpartition(".")[0]

    out: dict[str, dict[str, str]] = {}
    for name, edges in graph().items():
        for target, where in edges.items():
            out.setdefault(room(target), {})
            if room(target) != room(name):
                out.setdefault(room(name), {}).setdefault(room(target), where)
    return out


# Rooms that still import each other (none since the loop and start-up left the launcher root
# for launcher/training/). The list only shrinks; one that is gone fails too, so that it says
# what is left.
KNOWN_ROOM_CYCLES: list[set[str]] = []


def test_no_cycles_between_rooms():
    """A room (a folder of the package) and the rooms it imports never import it back, so each
    can be read knowing only those below it (launcher/config.py once reached into launcher/cluster/)."""
    g = room_graph()
    found = cycles(g)
    new = [c for c in found if set(c) not in KNOWN_ROOM_CYCLES]
    assert not new, "rooms that import each other:\n" + describe(g, new)
    gone = [sorted(k) for k in KNOWN_ROOM_CYCLES if k not in [set(c) for c in found]]
    assert not gone, f"no longer a cycle, remove it from KNOWN_ROOM_CYCLES: {gone}"


def test_data_pipeline_imports_nothing_from_launcher():
    bad = [
        f"{where}: {target}"
        for name, edges in graph().items()
        if name.startswith("loomtrain.data_pipeline")
        for target, where in edges.items()
        if target.startswith("loomtrain.launcher")
    ]
    assert not bad, "data_pipeline/ imports from launcher/ (a rank and size, an executor, arrive as arguments):\n" + (
        "\n".join(bad)
    )
