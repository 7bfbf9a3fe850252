"""The checkout as the tree-reading tests see it (docs paths, import rules, one home per
helper): the project's files, not what a user made in the checkout (the README's corpus,
data, mixture config, exports, run output), and each Python file read and parsed once per session.

The project's files are those git tracks, plus files not yet added (and not ignored) inside the
folders it tracks: a new module shows up before its first commit, a user's corpus of .py files
never does. Without git (an unpacked archive) a walk that skips the usual non-project folders
stands in."""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "__pycache__", "build", "dist", "runs", ".pytest_cache"}


def _git_ls(*flags: str) -> list[str]:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", *flags], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise OSError(proc.stderr.strip())
    return [p for p in proc.stdout.split("\0") if p]


def project_files() -> list[str] | None:
    """The project's files as paths relative to ROOT (see the module docstring), or None where
    ROOT is not a git checkout."""
    if not (ROOT / ".git").exists():
        return None
    try:
        tracked = _git_ls()
        new = _git_ls("--others", "--exclude-standard")
    except (OSError, subprocess.SubprocessError):
        return None
    folders = {PurePosixPath(p).parts[0] for p in tracked if "/" in p}
    new = [p for p in new if "/" in p and PurePosixPath(p).parts[0] in folders]
    return sorted(p for p in {*tracked, *new} if (ROOT / p).is_file())  # not deleted-but-tracked


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
    """Every file and folder of the project, parents before their contents."""
    files = project_files()
    if files is None:
        return tuple(_walk(ROOT))
    out: dict[Path, None] = {}
    for rel in files:
        parts = PurePosixPath(rel).parts
        for i in range(1, len(parts)):
            out.setdefault(ROOT.joinpath(*parts[:i]))
        out[ROOT.joinpath(*parts)] = None
    return tuple(out)


def python_files() -> list[Path]:
    return [p for p in entries() if p.suffix == ".py"]


@cache
def source(path: Path) -> str:
    return path.read_text()


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(source(path))
