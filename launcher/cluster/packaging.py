"""What `loomtrain submit` uploads: the package's Python files and the configs named, nothing else.

A checkout holds more than code: `.env` files, cloud credentials, SSH and TLS keys,
kubeconfigs, run outputs with checkpoints, exported weights, data. Ray uploads
whatever `working_dir` holds to the cluster's storage, so the staging directory is
built from an allow-list rather than from "everything minus some excludes":

* the package: every regular `*.py` file of the package tree, i.e. the project root
  and each folder reached through folders holding an `__init__.py` (the
  subpackages pyproject lists), copied to `loomtrain/...`;
* the config given on the command line and the files it `extends:` (inside the
  project they keep their place, e.g. `loomtrain/configs/tiny.yaml`).

On top of that a deny-list (SECRET_PATTERNS, DENIED_DIRS) is checked for every
path component, so even a file inside the package named like a secret
(`credentials.py`) stays home, and a named config that looks like one is refused.
Symbolic links are never followed (a link inside the package could point at
~/.aws). `loomtrain submit --dry-run` prints this list with sizes.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "loomtrain"
# Never shipped, wherever they are (matched against each path component, lower case).
SECRET_PATTERNS = (
    ".env",
    ".env.*",
    "*.env",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    ".netrc",
    "_netrc",
    ".pgpass",
    "kubeconfig*",
    "*credentials*",
    "secrets*",
    "*.secret",
    "auth_token",
    ".npmrc",
    ".pypirc",
    ".dockercfg",
)
# Folders that hold secrets, run outputs, exports or data: nothing under them ships.
DENIED_DIRS = (
    ".aws",
    ".ssh",
    ".gnupg",
    ".kube",
    ".ray",
    ".docker",
    ".config",
    ".azure",
    ".gcloud",
    ".git",
    ".venv",
    "venv",
    "__pycache__",
    "runs",
    "exports",
    "export",
    "data",
    "datasets",
    ".data_cache",
    "checkpoints",
    "final",
    "wandb",
    "tb",
)
# The package's own subpackages whose names are also on that list (pyproject's `packages`).
OWN_SUBPACKAGES = ("launcher/checkpoints",)


class PackagingError(ValueError):
    """A file that must not or cannot be shipped (one line, naming it)."""


@dataclass(frozen=True)
class ShipEntry:
    source: Path  # on this machine
    dest: str  # relative to the job's working_dir
    size: int


def denied(rel: str | os.PathLike, folders: bool = True) -> str | None:
    """The deny rule a relative path breaks, or None (`folders`: also DENIED_DIRS)."""
    parts = Path(rel).parts
    for i, part in enumerate(parts):
        low = part.lower()
        own = "/".join(parts[: i + 1]) in OWN_SUBPACKAGES
        if folders and i < len(parts) - 1 and low in DENIED_DIRS and not own:
            return f"folder {part}/"
        for pat in SECRET_PATTERNS:
            if fnmatch.fnmatchcase(low, pat):
                return f"secret pattern {pat}"
    return None


def package_files(root: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """(shipped, left_out) relative paths of the package tree under `root`.

    left_out holds (path, why) for entries that looked like package files but are
    symlinks or denied; other files (data, docs, tests) are simply not package files."""
    shipped: list[str] = []
    left_out: list[tuple[str, str]] = []
    todo = [root]
    while todo:
        folder = todo.pop()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = str(Path(e.path).relative_to(root))
            if e.is_symlink():
                if e.name.endswith(".py") or e.is_dir():
                    left_out.append((rel, "symbolic link (not followed)"))
                continue
            if e.is_dir(follow_symlinks=False):
                if (Path(e.path) / "__init__.py").is_file() and not denied(rel + "/x"):
                    todo.append(Path(e.path))
                continue
            if not e.name.endswith(".py"):
                continue
            why = denied(rel)
            if why:
                left_out.append((rel, why))
            elif e.is_file(follow_symlinks=False):  # a regular file (not a FIFO, a socket, a device)
                shipped.append(rel)
    return sorted(shipped), left_out


def plan_shipment(config: str | os.PathLike, root: Path) -> tuple[list[ShipEntry], list[tuple[str, str]], str]:
    """(files to ship, files left out with why, CONFIG's path inside the working_dir)."""
    root = root.resolve()
    shipped, left_out = package_files(root)
    entries = [ShipEntry(root / rel, f"{PACKAGE}/{rel}", os.lstat(root / rel).st_size) for rel in shipped]
    from loomtrain.launcher.config_loader import load_yaml

    # The config first, then each file its `extends:` chain names, once; read as the loader reads
    # them (submit's config check has refused a missing file, a bad base or bad YAML by then).
    chain = dict.fromkeys(Path(source) for _, source in reversed(load_yaml(Path(config))))
    config_in_job = ""
    for i, path in enumerate(chain):
        try:
            dest = f"{PACKAGE}/{path.relative_to(root)}"
        except ValueError:
            # A config outside the project goes next to the package (its `extends:` must
            # then be absolute or point into the project).
            dest = path.name
        # Named explicitly, so a saved runs/NAME/config.yaml may ship; a secret's name may not.
        why = denied(path.name, folders=False)
        if why:
            raise PackagingError(f"refusing to ship config {path}: its name matches a {why}; rename it")
        if dest not in {e.dest for e in entries}:
            entries.append(ShipEntry(path, dest, path.stat().st_size))
        if i == 0:
            config_in_job = dest
    return entries, left_out, config_in_job


def stage(entries: list[ShipEntry], dest_root: Path) -> None:
    """Copy the planned files (contents only, no links) under dest_root."""
    for e in entries:
        target = dest_root / e.dest
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(e.source, target, follow_symlinks=True)


def format_listing(entries: list[ShipEntry], left_out: list[tuple[str, str]]) -> str:
    lines = [f"{e.size:>10,}  {e.dest}" for e in sorted(entries, key=lambda e: e.dest)]
    total = sum(e.size for e in entries)
    lines.append(f"{total:>10,}  total: {len(entries)} files would be shipped")
    lines += [f"not shipped: {rel} ({why})" for rel, why in left_out]
    return "\n".join(lines)
