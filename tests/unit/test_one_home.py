"""One home per helper: no library module reaches into another's private names, and the
shared helpers (barrier, durable writes) are defined once."""

import ast
from pathlib import Path

from source_tree import ROOT, parse, python_files

LIBRARY = [
    p for p in python_files() if p.relative_to(ROOT).parts[0] in ("model", "parallel", "data_pipeline", "launcher")
] + [ROOT / "durable.py"]


def _module(path: Path) -> str:
    return "loomtrain." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_names():
    found = []
    for path in LIBRARY:
        tree = parse(path)
        aliases = {}  # local name -> the loomtrain module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("loomtrain"):
                for a in node.names:
                    if _private(a.name):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("loomtrain") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target is not None and target != _module(path):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr} ({target})")
    assert not found, "\n".join(found)


def _defs(name: str) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}:{n.lineno}"
        for p in LIBRARY
        for n in ast.walk(parse(p))
        if isinstance(n, ast.FunctionDef) and n.name.lstrip("_") == name
    ]


def test_shared_helpers_are_defined_once():
    assert _defs("barrier") == [_defs("barrier")[0]] and _defs("barrier")[0].startswith("launcher/distributed.py")
    for name in ("fsync_path", "atomic_write", "atomic_write_json", "write_durable", "broadcast_str"):
        assert len(_defs(name)) == 1, (name, _defs(name))
    assert _defs("atomic_write")[0].startswith("durable.py")


def test_only_the_storage_layer_tells_a_uri_from_a_path():
    """Where a location is a folder or an object store is storage.py's to decide, once: a
    caller asks the backend (`storage.location`) or `storage.scheme`, never `is_uri` itself."""
    found = [
        f"{p.relative_to(ROOT)}:{n.lineno}"
        for p in python_files()
        if p.relative_to(ROOT).parts[0] not in ("tests", "benchmarks") and p != ROOT / "storage.py"
        for n in ast.walk(parse(p))
        if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "is_uri"
    ]
    assert not found, found
