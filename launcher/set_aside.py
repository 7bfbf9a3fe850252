"""Moving an earlier run's outputs aside, never deleting them: one code path for a run directory,
a file:// folder and an object-store prefix (run.storage=s3://...), through fsspec.

    moved, dest = move_aside(location, names, "checkpoints/superseded-TIME")

On a filesystem with folders (a local path, file://) each entry moves with one rename. An object
store has no rename, so a move is a copy, then a delete: every object of every entry is copied
under dest first, the copy is listed and each object checked to be there at its size, and only
then are the originals deleted, each prefix's manifest.json first (a checkpoint or final/ is gone
whole at once, never half there). A failure before the deletes leaves the originals as they were
(and a partial copy beside them, which a later move adds to under another name).

checkpoint.resume=never and a fresh start (step 0) both use it: store.py for checkpoints/,
rundir.supersede for metrics.jsonl, final/, tb/ and TensorBoard's event files.
"""

from __future__ import annotations

import fnmatch
import os
import time
from pathlib import Path

from loomtrain.storage import below, filesystem, in_flight, is_local, listing

MANIFEST = "manifest.json"  # the commit point of a checkpoint and of final/ in an object store


def _location(base: Path | str, rel: str) -> Path | str:
    return below(base, rel)


def entries(location: Path | str, patterns: tuple[str, ...]) -> dict[str, int]:
    """{name: bytes (-1 for a folder or prefix)} of the entries directly under `location` that
    match one of `patterns`."""
    fs, root = filesystem(location)
    out = {}
    for name, info in listing(fs, root.rstrip("/"), recursive=False).items():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            out[name] = int(info.get("size") or 0) if info.get("type", "file") == "file" else -1
    return out


def move_aside(location: Path | str, names: list[str], dest_rel: str) -> Path | str:
    """Move each of `names` (files, folders, objects or prefixes directly under `location`) to
    `location`/`dest_rel`/NAME; returns that folder or prefix. Nothing is deleted before its copy
    is complete and checked."""
    fs, root = filesystem(location)
    root = root.rstrip("/")
    dest = f"{root}/{dest_rel.strip('/')}"
    if is_local(fs):
        fs.makedirs(dest, exist_ok=True)
        for name in names:
            target = f"{dest}/{name}"
            if os.path.exists(target):  # two fresh starts within one second: keep both
                target = f"{target}.{time.time_ns()}"
            os.rename(f"{root}/{name}", target)
        return _location(location, dest_rel.strip("/"))
    for name in names:
        _move_objects(fs, f"{root}/{name}", f"{dest}/{name}")
    return _location(location, dest_rel.strip("/"))


def _move_objects(fs, src: str, dst: str) -> None:
    """Copy every object at or below `src` to `dst`, check the copy, then delete the originals."""
    fs.invalidate_cache()
    if fs.isfile(src):  # one object (`latest`)
        objects = {"": int(fs.info(src).get("size") or 0)}
    else:
        objects = {rel: int(info.get("size") or 0) for rel, info in listing(fs, src).items()}
    if not objects:
        return

    def at(base: str, rel: str) -> str:
        return f"{base}/{rel}" if rel else base

    in_flight(lambda rel: fs.copy(at(src, rel), at(dst, rel)), sorted(objects))
    fs.invalidate_cache()
    copied = (
        {"": int(fs.info(dst).get("size") or 0)}
        if "" in objects
        else {rel: int(info.get("size") or 0) for rel, info in listing(fs, dst).items()}
    )
    for rel, size in objects.items():
        if copied.get(rel) != size:
            raise OSError(
                f"{at(dst, rel)}: the copy has {copied.get(rel, 'no')} bytes, {size} expected; nothing deleted"
            )
    first = [at(src, rel) for rel in objects if rel == MANIFEST or rel.endswith("/" + MANIFEST)]
    if first:
        fs.rm(first)
    rest = [at(src, rel) for rel in objects if at(src, rel) not in first]
    if rest:
        fs.rm(rest)
    fs.invalidate_cache()
