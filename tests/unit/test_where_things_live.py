"""The import rules that README.md's "Where things live" map states hold in the tree.

Every `import` and `from ... import` of the project's .py files (inside functions too) is read
with `ast`; a relative import is resolved against its file's package. Each test is one row's
"must not know" column.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

import tomllib
from source_tree import ROOT, parse, python_files
from test_import_cycles import graph

STDLIB = frozenset(sys.stdlib_module_names)


def package_of(path: Path) -> str:
    """The dotted package a file's relative imports start from (the root is `loomtrain`)."""
    parts = path.relative_to(ROOT).parent.parts
    return ".".join(("loomtrain", *parts))


@cache
def imports() -> dict[str, frozenset[str]]:
    """repository-relative file -> the full dotted names of the modules it imports."""
    out = {}
    for path in python_files():
        names = set()
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package_of(path).split(".")
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                names.add(module)
                names.update(f"{module}.{a.name}" for a in node.names)
        out[path.relative_to(ROOT).as_posix()] = frozenset(names)
    return out


def importers(prefix: str) -> set[str]:
    """The files that import `prefix` or a module below it."""
    return {f for f, names in imports().items() if any(n == prefix or n.startswith(prefix + ".") for n in names)}


def foreign(folder: str, allowed: tuple[str, ...]) -> list[str]:
    """`file: module` for each import in `folder`/ outside the standard library and `allowed`."""
    bad = []
    for f, names in imports().items():
        if not f.startswith(folder + "/"):
            continue
        for n in sorted(names):
            top = n.split(".")[0]
            if top == "__future__" or top in STDLIB:
                continue
            if not any(n == a or n.startswith(a + ".") for a in allowed):
                bad.append(f"{f}: {n}")
    return bad


def test_model_imports_only_torch():
    assert imports(), "no .py file found"
    assert not foreign("model", ("torch", "loomtrain.model"))


def test_parallel_imports_only_torch_and_model():
    assert not foreign("parallel", ("torch", "loomtrain.model", "loomtrain.parallel"))


def test_data_pipeline_knows_no_process_group_deepspeed_or_ray():
    for module in ("torch.distributed", "deepspeed", "ray"):
        assert not {f for f in importers(module) if f.startswith("data_pipeline/")}, module


def test_ray_is_imported_only_in_launcher_cluster_and_tests():
    outside = {f for f in importers("ray") if not f.startswith(("launcher/cluster/", "tests/"))}
    assert not outside
    assert importers("ray"), "the scan finds Ray's imports"


def test_hooks_import_no_checkpoint_code():
    """The checkpoint hook imports the hooks module, never the reverse (no import cycle)."""
    assert "launcher/hooks.py" not in importers("loomtrain.launcher.checkpoints")
    assert "launcher/checkpoints/hook.py" in importers("loomtrain.launcher.hooks")


def test_only_the_entry_points_and_tests_import_the_cli():
    outside = {f for f in importers("loomtrain.launcher.cli") if not f.startswith(("launcher/cli/", "tests/"))} - {
        "__main__.py"
    }
    assert not outside
    assert "__main__.py" in importers("loomtrain.launcher.cli")


def test_the_library_imports_nothing_from_benchmarks_or_tests():
    library = (
        "model/",
        "parallel/",
        "data_pipeline/",
        "launcher/",
        "durable.py",
        "storage.py",
        "__init__.py",
        "__main__.py",
    )
    for name in ("benchmarks", "loomtrain.benchmarks", "tests", "loomtrain.tests"):
        assert not {f for f in importers(name) if f.startswith(library)}, name


# The launcher's rooms in README.md's order: each imports only rooms before it (and model/,
# parallel/, data_pipeline/), never one after it, so a room reads knowing only those before it.
LAUNCHER_ROOMS = (
    "launcher",
    "launcher/observe",
    "launcher/checkpoints",
    "launcher/training",
    "launcher/planning",
    "launcher/cluster",
    "launcher/cli",
)


def launcher_room(dotted: str) -> str | None:
    """The room of an imported name below loomtrain.launcher (the longest room that holds it)."""
    holding = [
        r
        for r in LAUNCHER_ROOMS
        if dotted == "loomtrain." + r.replace("/", ".") or dotted.startswith("loomtrain." + r.replace("/", ".") + ".")
    ]
    return max(holding, key=len, default=None)


def test_every_launcher_folder_is_a_room_in_readme_order():
    folders = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "launcher").rglob("__init__.py")}
    assert folders == set(LAUNCHER_ROOMS), "a launcher/ folder missing from (or gone from) LAUNCHER_ROOMS"
    readme = (ROOT / "README.md").read_text()
    rows = [line.split("`")[1].rstrip("/") for line in readme.splitlines() if line.startswith("| `launcher/")]
    assert rows == list(LAUNCHER_ROOMS), 'README.md\'s "Where things live" rows, in order'
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = {"loomtrain." + r.replace("/", ".") for r in LAUNCHER_ROOMS} - set(packages)
    assert not missing, f"pyproject.toml's packages lack {sorted(missing)}: a wheel would not hold them"


def test_a_launcher_room_imports_only_the_rooms_before_it():
    """Run-time imports, inside functions too (test_import_cycles' graph); an annotation's import
    under `if TYPE_CHECKING:` never runs and is left out (hooks.py names observe's MetricsLogger
    as the type of TrainContext.metrics)."""
    bad = []
    for module, edges in graph().items():
        own = launcher_room(module)
        if own is None:
            continue
        for target, where in sorted(edges.items()):
            room = launcher_room(target)
            if room is not None and LAUNCHER_ROOMS.index(room) > LAUNCHER_ROOMS.index(own):
                bad.append(f"{where}: {target} ({room}/ comes after {own}/)")
    assert not bad, "imports of a later room:\n" + "\n".join(bad)
    assert "loomtrain.launcher.observe.metrics" in graph()["loomtrain.launcher.training.loop"], "the scan sees rooms"
