"""The checkpoint directory protocol: a checkpoint is either complete or invisible.

Layout under RUN_DIR/checkpoints/:

    .tmp-step_00000100/     being written (every rank writes its files here)
    step_00000100/          published: all files + manifest.json (written last)
    latest                  text file naming the newest published directory

Writing (`begin` -> files -> `add_part` per rank -> `publish` on rank 0):
every file is fsynced by whoever wrote it; rank 0 collects the per-rank parts
(file sizes and sha256 sums computed by the rank that wrote them, so no rank
re-reads the whole checkpoint), writes `manifest.json` last inside the temp
directory, fsyncs it and the directory, publishes it with one `os.rename`,
fsyncs the parent, and only then replaces `latest` (write a temp file +
`os.replace`). A crash at any point before the rename leaves only a `.tmp-*`
directory, which the next start removes; a crash between the rename and the
pointer update leaves a complete checkpoint that the scan below still finds.

Reading (`find_resumable`): published directories are tried newest first;
one without a manifest, with a missing file, a wrong size or a wrong checksum
is reported in one line naming it, and the next older one is tried. The
`latest` pointer is for people and tools: the scan does not trust it, so a
checkpoint published just before a crash (pointer not yet updated) is not lost.

This module knows nothing of torch, DeepSpeed or ranks; what goes into a checkpoint
is state.py's.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from loomtrain.durable import TMP_PREFIX, atomic_write, fsync_path, replace_dir, write_json_durable

MANIFEST = "manifest.json"
LATEST = "latest"
PARTS_DIR = ".parts"  # per-rank file lists inside a temp dir; folded into the manifest
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dirname(step: int) -> str:
    return f"step_{int(step):08d}"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def describe_files(root: str | os.PathLike, relpaths: Iterable[str]) -> dict[str, dict]:
    """{relpath: {"size", "sha256"}} for files under root (fsyncing each first)."""
    out = {}
    for rel in relpaths:
        p = Path(root) / rel
        fsync_path(p)
        out[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return out


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    manifest: dict | None = None


def verify(path: str | os.PathLike, checksums: bool = True) -> Verdict:
    """Is this published checkpoint complete and intact?"""
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        return Verdict(False, "not a directory")
    if not mpath.is_file():
        return Verdict(False, "no manifest.json (partial write)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return Verdict(False, f"unreadable manifest.json ({e})")
    for rel, info in sorted(files.items()):
        p = path / rel
        if not p.is_file():
            return Verdict(False, f"missing file {rel}")
        size = p.stat().st_size
        if size != info["size"]:
            return Verdict(False, f"{rel} has {size} bytes, manifest says {info['size']} (truncated?)")
        # A file without a sha256 (model/, optim/) has one per tile in the index, checked by
        # every reader of the tile: here its size only.
        if checksums and "sha256" in info and sha256_file(p) != info["sha256"]:
            return Verdict(False, f"{rel} fails its sha256 checksum")
    return Verdict(True, manifest=manifest)


class CheckpointStore:
    """File-level checkpoint directories of one run (rank-agnostic helpers)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        keep_last: int = 3,
        keep_every: int = 0,
        log: Callable[[str], None] | None = None,
    ):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = int(keep_last)
        self.keep_every = int(keep_every)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    # Paths -----------------------------------------------------------------
    def final_dir(self, step: int) -> Path:
        return self.root / step_dirname(step)

    def temp_dir(self, step: int) -> Path:
        return self.root / (TMP_PREFIX + step_dirname(step))

    def published(self) -> list[tuple[int, Path]]:
        """(step, path) of every published directory, oldest first (not verified)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
        return sorted(out)

    # Writing ----------------------------------------------------------------
    def begin(self, step: int) -> Path:
        """Create a fresh, empty temp directory for `step` (rank 0, before the others write)."""
        tmp = self.temp_dir(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / PARTS_DIR).mkdir(parents=True)
        fsync_path(self.root)
        return tmp

    def add_part(self, tmp: str | os.PathLike, rank: int, relpaths: Iterable[str] | dict[str, dict]) -> None:
        """One rank's contribution: size + sha256 of the files it wrote. Given a dict
        {relpath: {"size", "sha256"}} (hashed while writing, files already fsynced) it is
        taken as it is; given paths, they are fsynced and hashed here."""
        tmp = Path(tmp)
        files = dict(relpaths) if isinstance(relpaths, dict) else describe_files(tmp, relpaths)
        write_json_durable(tmp / PARTS_DIR / f"rank_{rank:05d}.json", files)

    def publish(self, tmp: str | os.PathLike, step: int, meta: dict) -> Path:
        """Rank 0, after every rank's add_part: manifest last, rename, then `latest`."""
        tmp = Path(tmp)
        files: dict[str, dict] = {}
        parts = tmp / PARTS_DIR
        for part in sorted(parts.glob("rank_*.json")):
            files.update(json.loads(part.read_text()))
        # Anything written without a part entry (e.g. by a library) is described here.
        rest = [
            str(p.relative_to(tmp))
            for p in sorted(tmp.rglob("*"))
            if p.is_file() and PARTS_DIR not in p.relative_to(tmp).parts and str(p.relative_to(tmp)) not in files
        ]
        rest = [r for r in rest if r != MANIFEST]
        files.update(describe_files(tmp, rest))
        shutil.rmtree(parts)
        for d in sorted({p.parent for p in tmp.rglob("*") if p.is_file()} | {tmp}):
            fsync_path(d)
        manifest = {"format": FORMAT_VERSION, "step": int(step), "time": time.time(), **meta, "files": files}
        write_json_durable(tmp / MANIFEST, manifest)
        # Re-saving a step (e.g. resumed and saved again) replaces it.
        final = replace_dir(tmp, self.final_dir(step))
        atomic_write(self.root / LATEST, final.name + "\n")
        self.apply_retention()
        return final

    def latest_pointer(self) -> str | None:
        p = self.root / LATEST
        try:
            return p.read_text().strip() or None
        except OSError:
            return None

    # Housekeeping -----------------------------------------------------------
    def clean_temp(self) -> list[Path]:
        """Remove leftovers of interrupted writes (rank 0, at start, before any save)."""
        removed = []
        if not self.root.is_dir():
            return removed
        for p in self.root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p)
                self.log(f"checkpoint: removed leftover {p} (interrupted write)")
        return removed

    def set_aside(self) -> Path | None:
        """Move every published checkpoint (and `latest`) into checkpoints/superseded-TIME/:
        a fresh start (checkpoint.resume=never) neither resumes from them later nor lets
        retention mix them with its own. Nothing is deleted."""
        pub = self.published()
        if not pub:
            return None
        dest = self.root / time.strftime("superseded-%Y%m%d-%H%M%S")
        dest.mkdir(parents=True, exist_ok=True)
        for _, path in pub:
            os.rename(path, dest / path.name)
        if (self.root / LATEST).exists():
            os.replace(self.root / LATEST, dest / LATEST)
        fsync_path(self.root)
        self.log(f"checkpoint: checkpoint.resume=never: moved {len(pub)} earlier checkpoint(s) to {dest}")
        return dest

    def apply_retention(self) -> list[Path]:
        """Keep the newest `keep_last` (<= 0: all) plus every `keep_every`-th step."""
        pub = self.published()
        if self.keep_last <= 0:
            return []
        keep = {step for step, _ in pub[-self.keep_last :]}
        if self.keep_every > 0:
            keep |= {step for step, _ in pub if step % self.keep_every == 0}
        pointer = self.latest_pointer()
        removed, doomed = [], []
        for step, path in pub:
            if step in keep or path.name == pointer:
                continue
            # Rename first so a crash mid-delete never leaves a half-deleted "published" dir
            # (the next start removes a `.tmp-*` leftover).
            doomed.append(self.root / f"{TMP_PREFIX}del-{path.name}.{uuid.uuid4().hex[:8]}")
            os.rename(path, doomed[-1])
            removed.append(path)
        if doomed:
            _delete_in_background(doomed)
        return removed

    # Reading ----------------------------------------------------------------
    def find_resumable(self, checksums: bool = True) -> Path | None:
        """The newest complete checkpoint; broken newer ones are reported and skipped."""
        found, broken = self._scan(checksums)
        for bad, reason in broken:
            self.log(f"checkpoint: skipping {bad}: {reason}; trying the previous one")
        return found

    def _scan(self, checksums: bool) -> tuple[Path | None, list[tuple[Path, str]]]:
        """(newest verified checkpoint or None, [(newer broken one, why)])."""
        broken: list[tuple[Path, str]] = []
        for _, path in reversed(self.published()):
            v = verify(path, checksums=checksums)
            if v.ok:
                return path, broken
            broken.append((path, v.reason))
        return None, broken

    def resume_point(self, checksums: bool = True) -> Path | None:
        """What a restart continues from: the newest complete checkpoint, or None when
        there is none at all. When checkpoints exist but none verifies, ValueError in
        one line naming each: the run must not silently start again at step 0."""
        found, broken = self._scan(checksums)
        if found is None and broken:
            each = "; ".join(f"{p.name}: {reason}" for p, reason in broken)
            raise ValueError(
                f"no usable checkpoint in {self.root} ({each}); to start afresh set checkpoint.resume=never "
                "(moves them aside, deletes nothing) or pick another run.dir"
            )
        for bad, reason in broken:
            self.log(f"checkpoint: skipping {bad}: {reason}; trying the previous one")
        return found

    def owns(self, path: str | os.PathLike) -> bool:
        """Is `path` this run's directory or one of its own checkpoints?"""
        p, root = Path(path).resolve(), self.root.resolve()
        return p == root.parent or p == root or root in p.parents

    def resolve_resume(self, resume: str, checksums: bool = True) -> Path | None:
        """checkpoint.resume: "auto" (newest complete, or None), "never", or a PATH.

        A PATH outside this run only seeds its first start: once the run has
        checkpoints of its own, a restart (the same command again, or a Ray worker
        group restart) continues from those instead of going back to the seed."""
        if resume == "never":
            return None
        if resume in ("auto", ""):
            return self.resume_point(checksums=checksums)
        path = Path(resume)
        if self.published() and not self.owns(path):
            found = self.resume_point(checksums=checksums)
            self.log(
                f"checkpoint: checkpoint.resume={resume} only seeds a run's first start; "
                f"{self.root.parent} has its own checkpoints: resuming from {found}"
            )
            return found
        if path.resolve() == self.root.parent.resolve():
            return self.resume_point(checksums=checksums)
        if path.is_dir() and not (path / MANIFEST).exists() and (path / "checkpoints").is_dir():
            # A run directory was given: its newest complete checkpoint.
            found = CheckpointStore(path, log=self.log).find_resumable(checksums=checksums)
            if found is None:
                raise ValueError(f"checkpoint.resume={resume!r}: no complete checkpoint under {path}/checkpoints")
            return found
        v = verify(path, checksums=checksums)
        if not v.ok:
            raise ValueError(f"checkpoint.resume={resume!r}: not a usable checkpoint: {v.reason}")
        return path


_deletions: list[threading.Thread] = []


def _delete_in_background(paths: list[Path]) -> None:
    """Remove pruned checkpoints off the saving thread: freeing a checkpoint's GBs takes a
    disk a good part of a second that no step needs to wait for. Deletions run one after
    another; the run waits for them when it stops (`wait_for_deletions`), the process at exit
    (a kill leaves `.tmp-del-*`, which the next start removes)."""
    before = _deletions[-1] if _deletions else None

    def run() -> None:
        if before is not None:
            before.join()
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)

    _deletions[:] = [t for t in _deletions if t.is_alive()]
    thread = threading.Thread(target=run, name="checkpoint-retention", daemon=True)
    thread.start()
    _deletions.append(thread)


@atexit.register
def wait_for_deletions() -> None:
    for thread in list(_deletions):
        thread.join()


class CheckpointWriteError(OSError):
    """A save failed on the disk (full, read-only, quota, file too large): one line naming
    the checkpoint being written and the newest one that stays `latest`."""


_OS_ERROR_IN_TEXT = re.compile(r'I/O error: ([^(\n]+?) \(os error|message: "([^"]+)"')


def is_write_error(exc: BaseException) -> bool:
    """An OSError, or safetensors' wrapping of one (SafetensorError("...I/O error: ... (os error N)"))."""
    return isinstance(exc, OSError) or (
        type(exc).__name__ == "SafetensorError" and _OS_ERROR_IN_TEXT.search(str(exc)) is not None
    )


def write_error(exc: BaseException, store: CheckpointStore, step: int) -> CheckpointWriteError:
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc)
        where = exc.filename or store.temp_dir(step)
    else:  # safetensors: 'Error while serializing: I/O error: No space left on device (os error 28)'
        m = _OS_ERROR_IN_TEXT.search(str(exc))
        what = (m.group(1) or m.group(2)) if m else str(exc).splitlines()[0]
        where = store.temp_dir(step)
    kept = store.latest_pointer()
    kept = f"{store.root / kept} stays the newest checkpoint" if kept else "no earlier checkpoint exists"
    return CheckpointWriteError(f"checkpoint: cannot save step {step}: {what}: {where}; {kept}")


def read_manifest(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())
