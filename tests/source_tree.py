"""The checkout as the tree-reading tests see it (docs paths, import rules, one home per
helper): one walk that skips what is not the project's (virtual env, git, caches, build and
run output), and each Python file read and parsed once per session."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "__pycache__", "build", "dist", "runs", ".pytest_cache"}


def _walk(directory: Path) -> Iterator[Path]:
    for p in sorted(directory.iterdir()):
        if p.is_dir():
            if p.name not in SKIP_DIRS and not p.name.endswith(".egg-info"):
                yield p
                yield from _walk(p)
        else:
            yield p


@cache
def entries() -> tuple[Path, ...]:
    """Every file and folder of the checkout, parents before their contents."""
    return tuple(_walk(ROOT))


def python_files() -> list[Path]:
    return [p for p in entries() if p.suffix == ".py"]


@cache
def source(path: Path) -> str:
    return path.read_text()


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(source(path))
