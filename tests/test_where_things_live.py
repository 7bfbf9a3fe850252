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

from source_tree import ROOT, parse, python_files

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
    library = ("model/", "parallel/", "data_pipeline/", "launcher/", "durable.py", "__init__.py", "__main__.py")
    for name in ("benchmarks", "loomtrain.benchmarks", "tests", "loomtrain.tests"):
        assert not {f for f in importers(name) if f.startswith(library)}, name
