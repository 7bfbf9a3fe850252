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

With run.storage a URI (s3://bucket/prefix, ...) the same protocol runs in an object store
(`ObjectCheckpointStore`, below; `open_store` picks the backend by location): no rename there,
so every rank writes straight into `step_N/`, the manifest written last is the commit point and
`latest` is an object written after it (see the class). The writers and readers (state.py,
shards.py) ask the store, not the filesystem: `write_file`, `tensor_sink`, `write_folder`,
`parts_done`, `read_manifest`, `read_checkpoint_file`.

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
from typing import Any

from loomtrain.durable import (
    TMP_PREFIX,
    atomic_write,
    fsync_path,
    json_bytes,
    replace_dir,
    write_durable,
    write_json_durable,
)
from loomtrain.launcher.checkpoints.objects import Objects
from loomtrain.launcher.rundir import superseded_name
from loomtrain.launcher.set_aside import move_aside
from loomtrain.storage import first_line, is_uri, store_failure

MANIFEST = "manifest.json"
LATEST = "latest"
PARTS_DIR = ".parts"  # per-rank file lists inside a temp dir; folded into the manifest
FORMAT_VERSION = 1  # manifest.json's "format"
# What a manifest's "checkpoint_format" names (the layout state.py writes; state.READS: what it reads)
CHECKPOINT_FORMAT = "loomtrain-sharded-v3"
_SHARDED_RE = re.compile(r"^loomtrain-sharded-v(\d+)$")
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


def format_problem(manifest: dict) -> str:
    """What is wrong with a manifest's own format fields ("" when nothing): a missing or unknown
    format, or one newer than this loomtrain writes (a newer loomtrain wrote it: upgrade to read it)."""
    fmt = manifest.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        return f"manifest.json has no valid format number (format={fmt!r}, expected {FORMAT_VERSION})"
    if fmt > FORMAT_VERSION:
        return (
            f"manifest.json format {fmt} is newer than this loomtrain's ({FORMAT_VERSION}): a newer loomtrain "
            "wrote it; upgrade loomtrain to resume from it"
        )
    layout = manifest.get("checkpoint_format")
    if layout is None:  # written before the field existed: model/index.json's own format is checked on load
        return ""
    m = _SHARDED_RE.match(layout) if isinstance(layout, str) else None
    if m is None:
        return f"manifest.json checkpoint_format {layout!r} is not one loomtrain knows (expected {CHECKPOINT_FORMAT!r})"
    if int(m.group(1)) > int(_SHARDED_RE.match(CHECKPOINT_FORMAT).group(1)):
        return (
            f"manifest.json checkpoint_format {layout!r} is newer than this loomtrain's ({CHECKPOINT_FORMAT!r}): a "
            "newer loomtrain wrote it; upgrade loomtrain to resume from it"
        )
    return ""


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
    if format_problem(manifest):
        return Verdict(False, format_problem(manifest))
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


def pruned(published: list[tuple[int, Any]], keep_last: int, keep_every: int, pointer: str | None) -> list:
    """The (step, location) of `published` (oldest first) that retention removes: all but the
    newest `keep_last` (<= 0: none removed), every `keep_every`-th step and the one `latest`
    names."""
    if keep_last <= 0:
        return []
    keep = {step for step, _ in published[-keep_last:]}
    if keep_every > 0:
        keep |= {step for step, _ in published if step % keep_every == 0}
    return [(step, where) for step, where in published if step not in keep and step_dirname(step) != pointer]


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

    # What every backend offers (store.py: a local folder; ObjectCheckpointStore: run.storage) --
    poll_s = 0.05  # how often an async save's rank 0 looks for the other ranks' parts

    def verify(self, path, checksums: bool = True) -> Verdict:
        return verify(path, checksums=checksums)

    def check_reachable(self) -> None:
        """ValueError in one line when the store cannot be used (a local folder always can)."""

    def where(self, path, rel: str = ""):
        """A checkpoint's file (or the checkpoint itself) as messages name it."""
        return Path(path) / rel if rel else Path(path)

    def write_file(self, tmp, rel: str, data: bytes) -> dict:
        """Write `data` durably at tmp/rel -> its file-list entry (size, sha256)."""
        write_durable(Path(tmp) / rel, data)
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def write_raw(self, tmp, rel: str, data: bytes) -> None:
        write_durable(Path(tmp) / rel, data)

    def read_file(self, tmp, rel: str) -> bytes:
        return (Path(tmp) / rel).read_bytes()

    def tensor_sink(self, tmp, rel: str):
        """(what a streaming safetensors writer writes to, its sink): here a path and no sink."""
        return Path(tmp) / rel, None

    def write_folder(self, tmp, rel: str, fill: Callable[[str], None]) -> dict[str, dict]:
        """Files a library writes into a folder of its own (a tokenizer's save): fill(folder),
        then their file-list entries."""
        folder = Path(tmp) / rel
        folder.mkdir(exist_ok=True)
        fill(str(folder))
        return describe_files(tmp, [str(p.relative_to(tmp)) for p in sorted(folder.rglob("*")) if p.is_file()])

    def parts_done(self, tmp, world: int) -> bool:
        """Has every rank finished writing (its file list exists)? A rank that failed says so."""
        parts = Path(tmp) / PARTS_DIR
        failed = sorted(parts.glob("rank_*.failed"))
        if failed:
            raise RuntimeError(f"{failed[0]}: {failed[0].read_text().strip()}")
        return all((parts / f"rank_{r:05d}.json").is_file() for r in range(world))

    def mark_failed(self, tmp, rank: int, error: BaseException) -> None:
        try:
            write_durable(Path(tmp) / PARTS_DIR / f"rank_{rank:05d}.failed", f"{error}\n".encode())
        except OSError:
            pass

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

    def set_aside(self) -> Path | str | None:
        """Move every published checkpoint (and `latest`) into checkpoints/superseded-TIME/:
        a fresh start (checkpoint.resume=never) neither resumes from them later nor lets
        retention mix them with its own. Nothing is deleted: a folder is renamed, an object
        store's prefix copied, checked, then deleted manifest first (launcher/set_aside.py).
        The same code for both backends."""
        names = [str(path).rstrip("/").rsplit("/", 1)[-1] for _, path in self.published()]
        if not names:
            return None
        pointer = [LATEST] if self.latest_pointer() is not None else []
        dest = move_aside(self.root, names + pointer, superseded_name())
        if not is_uri(self.root):
            fsync_path(self.root)
        self.log(f"checkpoint: checkpoint.resume=never: moved {len(names)} earlier checkpoint(s) to {dest}")
        return dest

    def apply_retention(self) -> list[Path]:
        """Keep the newest `keep_last` (<= 0: all) plus every `keep_every`-th step."""
        removed, doomed = [], []
        for _, path in pruned(self.published(), self.keep_last, self.keep_every, self.latest_pointer()):
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
            v = self.verify(path, checksums=checksums)
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
        if is_uri(path):
            return False
        p, root = Path(path).resolve(), self.root.resolve()
        return p == root.parent or p == root or root in p.parents

    @property
    def base(self):
        """Where the run keeps its checkpoints: RUN_DIR (checkpoints/ below it)."""
        return self.root.parent

    def is_base(self, location: str | os.PathLike) -> bool:
        return not is_uri(location) and Path(location).resolve() == self.root.parent.resolve()

    def resolve_resume(self, resume: str, checksums: bool = True) -> Path | str | None:
        """checkpoint.resume: "auto" (newest complete, or None), "never", or a PATH or URI (a
        checkpoint, or a run directory / run.storage whose newest complete one is taken).

        A PATH outside this run only seeds its first start: once the run has
        checkpoints of its own, a restart (the same command again, or a Ray worker
        group restart) continues from those instead of going back to the seed."""
        if resume == "never":
            return None
        if resume in ("auto", ""):
            return self.resume_point(checksums=checksums)
        if self.published() and not self.owns(resume):
            found = self.resume_point(checksums=checksums)
            self.log(
                f"checkpoint: checkpoint.resume={resume} only seeds a run's first start; "
                f"{self.base} has its own checkpoints: resuming from {found}"
            )
            return found
        if self.is_base(resume):
            return self.resume_point(checksums=checksums)
        other = run_store_at(resume, log=self.log)
        if other is not None:  # a run directory (or run.storage) was given: its newest complete checkpoint
            found = other.find_resumable(checksums=checksums)
            if found is None:
                raise ValueError(f"checkpoint.resume={resume!r}: no complete checkpoint under {other.root}")
            return found
        v = verify_at(resume, checksums=checksums)
        if not v.ok:
            raise ValueError(f"checkpoint.resume={resume!r}: not a usable checkpoint: {v.reason}")
        return resume.rstrip("/") if is_uri(resume) else Path(resume)


_deletions: list[threading.Thread] = []


def _delete_in_background(paths: list[Path]) -> None:
    """Remove pruned checkpoints off the saving thread: freeing a checkpoint's GBs takes a
    disk a good part of a second that no step needs to wait for. Deletions run one after
    another; the run waits for them when it stops (`wait_for_deletions`), the process at exit
    (a kill leaves `.tmp-del-*`, which the next start removes)."""
    _in_background([lambda p=p: shutil.rmtree(p, ignore_errors=True) for p in paths])


def _in_background(jobs: list[Callable[[], None]]) -> None:
    """Deletions, one after another, off the saving thread (see _delete_in_background)."""
    before = _deletions[-1] if _deletions else None

    def run() -> None:
        if before is not None:
            before.join()
        for job in jobs:
            job()

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
    failure = store_failure(exc) if is_uri(store.root) else ""
    if failure:  # the object store went away (or refused us) mid-save: the store is not asked again
        kept = getattr(store, "latest_known", None)
        err = CheckpointWriteError(
            f"checkpoint: cannot save step {step}: {failure}: {store.temp_dir(step)}; "
            + (
                f"{store.where(store.root, kept)} stays the newest checkpoint"
                if kept
                else "no earlier checkpoint exists"
            )
        )
        err.latest = (store.where(store.root, kept), kept) if kept else None
        return err
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc)
        where = exc.filename or store.temp_dir(step)
    else:  # safetensors: 'Error while serializing: I/O error: No space left on device (os error 28)'
        m = _OS_ERROR_IN_TEXT.search(str(exc))
        what = (m.group(1) or m.group(2)) if m else str(exc).splitlines()[0]
        where = store.temp_dir(step)
    kept = store.latest_pointer()
    kept = f"{store.where(store.root, kept)} stays the newest checkpoint" if kept else "no earlier checkpoint exists"
    return CheckpointWriteError(f"checkpoint: cannot save step {step}: {what}: {where}; {kept}")


def read_manifest(path: str | os.PathLike) -> dict:
    if is_uri(path):
        return json.loads(Objects(str(path), "checkpoint").read(MANIFEST))
    return json.loads((Path(path) / MANIFEST).read_text())


def read_checkpoint_file(path: str | os.PathLike, rel: str) -> bytes:
    """One file of a checkpoint (a folder or a URI), whole; a missing one is named in one line."""
    if not is_uri(path):
        return (Path(path) / rel).read_bytes()
    try:
        return Objects(str(path), "checkpoint").read(rel)
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(path).rstrip('/')}/{rel}: missing") from None


def checkpoint_has(path: str | os.PathLike, rel: str, manifest: dict) -> bool:
    """Does the checkpoint hold `rel`? (an object store: its published manifest says so)"""
    if is_uri(path):
        return rel in manifest.get("files", {})
    return (Path(path) / rel).exists()


# Object storage (run.storage=URI) -----------------------------------------------------------
class ObjectCheckpointStore(CheckpointStore):
    """The same protocol in an object store, under {run.storage}/checkpoints/:

        step_00000100/...              every rank uploads its own files straight here, then its
                                       part (.parts/rank_R.json: sizes and sha256 computed while
                                       writing); rank 0 merges the parts, deletes .parts/ and
                                       writes manifest.json last
        latest                         an object naming the newest step, written after the manifest

    An object store has no rename: a checkpoint exists iff its manifest does. A step prefix
    without one is an interrupted write: the scan ignores it and rank 0 removes it at the next
    start (clean_temp), as it removes `.tmp-*` folders on disk. Retention deletes the manifest
    first (the checkpoint is gone at once, never half there), then the rest in the background."""

    poll_s = 0.25  # listing `.parts/` is a request to the store

    def __init__(
        self,
        storage: str,
        keep_last: int = 3,
        keep_every: int = 0,
        log: Callable[[str], None] | None = None,
    ):
        self.storage = str(storage).rstrip("/")
        self.latest_known: str | None = None  # the newest checkpoint published or read here
        self.objects = Objects(self.storage, "run.storage").child("checkpoints")
        self.root = self.objects.uri
        self.keep_last = int(keep_last)
        self.keep_every = int(keep_every)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    @property
    def base(self) -> str:
        return self.storage

    def is_base(self, location) -> bool:
        return is_uri(location) and str(location).rstrip("/") == self.storage

    def owns(self, path) -> bool:
        p = str(path).rstrip("/")
        return is_uri(path) and (p == self.storage or p == self.root or p.startswith(self.root + "/"))

    def where(self, path, rel: str = "") -> str:
        return f"{str(path).rstrip('/')}/{rel}" if rel else str(path).rstrip("/")

    def _at(self, tmp) -> Objects:
        """The objects of one step's prefix (tmp: its URI)."""
        return self.objects.child(str(tmp).rstrip("/").rsplit("/", 1)[-1])

    # Paths ------------------------------------------------------------------------------
    def final_dir(self, step: int) -> str:
        return self.objects.name(step_dirname(step))

    def temp_dir(self, step: int) -> str:  # no rename: a checkpoint is written where it stays
        return self.final_dir(step)

    def _steps(self) -> list[tuple[int, str]]:
        out = []
        for name, kind in self.objects.entries().items():
            m = _STEP_RE.match(name)
            if m and kind == "directory":
                out.append((int(m.group(1)), name))
        return sorted(out)

    def published(self) -> list[tuple[int, str]]:
        """(step, URI) of every checkpoint with a manifest, oldest first (not verified)."""
        return [(step, self.objects.name(n)) for step, n in self._steps() if self.objects.exists(f"{n}/{MANIFEST}")]

    # Writing ----------------------------------------------------------------------------
    def begin(self, step: int) -> str:
        """Rank 0, before the others write: an earlier attempt at this step goes, manifest first."""
        name = step_dirname(step)
        self.objects.delete(f"{name}/{MANIFEST}")
        self.objects.delete_tree(name)
        return self.final_dir(step)

    def write_file(self, tmp, rel: str, data: bytes) -> dict:
        self._at(tmp).write(rel, data)
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def write_raw(self, tmp, rel: str, data: bytes) -> None:
        self._at(tmp).write(rel, data)

    def read_file(self, tmp, rel: str) -> bytes:
        return self._at(tmp).read(rel)

    def tensor_sink(self, tmp, rel: str):
        return self.where(tmp, rel), self._at(tmp).upload(rel)

    def write_folder(self, tmp, rel: str, fill: Callable[[str], None]) -> dict[str, dict]:
        import tempfile

        out = {}
        with tempfile.TemporaryDirectory(prefix="loomtrain-upload-") as folder:
            fill(folder)
            for p in sorted(Path(folder).rglob("*")):
                if p.is_file():
                    out[f"{rel}/{p.relative_to(folder)}"] = self.write_file(
                        tmp, f"{rel}/{p.relative_to(folder)}", p.read_bytes()
                    )
        return out

    def add_part(self, tmp, rank: int, relpaths: Iterable[str] | dict[str, dict]) -> None:
        at = self._at(tmp)
        if isinstance(relpaths, dict):
            files = dict(relpaths)
        else:
            files = {}
            for rel in relpaths:
                data = at.read(rel)
                files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        at.write(f"{PARTS_DIR}/rank_{rank:05d}.json", json_bytes(files))

    def parts_done(self, tmp, world: int) -> bool:
        at = self._at(tmp)
        names = set(at.entries(PARTS_DIR))
        failed = sorted(n for n in names if n.endswith(".failed"))
        if failed:
            text = at.read(f"{PARTS_DIR}/{failed[0]}").decode(errors="replace").strip()
            raise RuntimeError(f"{self.where(tmp, PARTS_DIR + '/' + failed[0])}: {text}")
        return all(f"rank_{r:05d}.json" in names for r in range(world))

    def mark_failed(self, tmp, rank: int, error: BaseException) -> None:
        try:
            self._at(tmp).write(f"{PARTS_DIR}/rank_{rank:05d}.failed", f"{error}\n".encode())
        except Exception:  # noqa: BLE001  (the store itself may be what failed)
            pass

    def publish(self, tmp, step: int, meta: dict) -> str:
        """Rank 0, after every rank's part: the manifest (the commit point), then `latest`."""
        at = self._at(tmp)
        files: dict[str, dict] = {}
        for name in sorted(n for n in at.entries(PARTS_DIR) if n.startswith("rank_") and n.endswith(".json")):
            files.update(json.loads(at.read(f"{PARTS_DIR}/{name}")))
        sizes = at.sizes()
        for rel, info in sorted(files.items()):  # every upload completed, at its size
            if sizes.get(rel) != info["size"]:
                raise RuntimeError(f"{at.name(rel)}: {sizes.get(rel, 'no')} bytes stored, {info['size']} written")
        for rel in sorted(sizes):  # anything written without a part entry (e.g. the merged index)
            if rel not in files and rel != MANIFEST and not rel.startswith(PARTS_DIR + "/"):
                data = at.read(rel)
                files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        at.delete_tree(PARTS_DIR)
        manifest = {"format": FORMAT_VERSION, "step": int(step), "time": time.time(), **meta, "files": files}
        at.write(MANIFEST, json_bytes(manifest))
        self.objects.write(LATEST, (step_dirname(step) + "\n").encode())
        self.latest_known = step_dirname(step)  # what a failure later names without asking the store
        try:
            self.apply_retention()
        except Exception as exc:  # noqa: BLE001  (published all the same; the next save prunes again)
            self.log(f"checkpoint: step {step} saved, but pruning older ones failed: {store_error(self.storage, exc)}")
        return self.final_dir(step)

    def latest_pointer(self) -> str | None:
        try:
            pointer = self.objects.read(LATEST).decode().strip() or None
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        self.latest_known = pointer
        return pointer

    # Housekeeping -----------------------------------------------------------------------
    def clean_temp(self) -> list[str]:
        """Remove step prefixes without a manifest (interrupted writes; rank 0, at start)."""
        removed = []
        for _, name in self._steps():
            if not self.objects.exists(f"{name}/{MANIFEST}"):
                self.objects.delete_tree(name)
                removed.append(self.objects.name(name))
                self.log(f"checkpoint: removed leftover {removed[-1]} (interrupted write)")
        return removed

    def apply_retention(self) -> list[str]:
        """Keep the newest `keep_last` (<= 0: all) plus every `keep_every`-th step; a pruned
        checkpoint loses its manifest first (gone at once), then its objects in the background."""
        removed, names = [], []
        for step, uri in pruned(self.published(), self.keep_last, self.keep_every, self.latest_pointer()):
            name = step_dirname(step)
            self.objects.delete(f"{name}/{MANIFEST}")
            removed.append(uri)
            names.append(name)
        if names:
            _in_background([lambda n=n: self._delete_quietly(n) for n in names])
        return removed

    def _delete_quietly(self, name: str) -> None:
        """A pruned checkpoint's objects (its manifest is gone already: a failure here leaves
        a prefix without one, which the next start removes)."""
        try:
            self.objects.delete_tree(name)
        except Exception as exc:  # noqa: BLE001
            self.log(f"checkpoint: could not delete all of {self.objects.name(name)}: {store_error(self.storage, exc)}")

    def verify(self, path, checksums: bool = True) -> Verdict:
        return verify_object(str(path), checksums=checksums)

    def check_reachable(self) -> None:
        """One line for an unreachable endpoint, refused credentials or a missing bucket (told
        apart: S3's HeadBucket answers 404 for a missing bucket, 403 for refused credentials)."""
        bucket = self.objects.path.split("/", 1)[0]
        fs = self.objects.fs
        try:
            if hasattr(fs, "call_s3"):
                fs.call_s3("head_bucket", Bucket=bucket)
                found = True
            else:
                found = fs.exists(bucket)
        except FileNotFoundError:
            found = False
        except Exception as exc:  # noqa: BLE001  (credentials, endpoint, network: said in one line)
            raise ValueError(store_error(self.storage, exc)) from None
        if not found:
            raise ValueError(
                f"run.storage={self.storage}: bucket {bucket!r} does not exist (or these credentials cannot see "
                "it); create it or point run.storage at another"
            )


def store_error(storage: str, exc: BaseException) -> str:
    """One line for an object store's own error (endpoint down, credentials refused, no bucket)."""
    return f"run.storage={storage}: {store_failure(exc) or first_line(exc)}"


def verify_object(uri: str, checksums: bool = True) -> Verdict:
    """Is this checkpoint in an object store complete and intact? (one listing for the sizes)"""
    objs = Objects(uri, "checkpoint")
    try:
        manifest = json.loads(objs.read(MANIFEST))
        files = manifest["files"]
    except FileNotFoundError:
        return Verdict(False, _no_manifest(objs))
    except (ValueError, KeyError, TypeError) as e:
        return Verdict(False, f"unreadable manifest.json ({e})")
    if format_problem(manifest):
        return Verdict(False, format_problem(manifest))
    sizes = objs.sizes()
    for rel, info in sorted(files.items()):
        if rel not in sizes:
            return Verdict(False, f"missing object {rel}")
        if sizes[rel] != info["size"]:
            return Verdict(False, f"{rel} has {sizes[rel]} bytes, manifest says {info['size']} (truncated?)")
        if checksums and "sha256" in info and hashlib.sha256(objs.read(rel)).hexdigest() != info["sha256"]:
            return Verdict(False, f"{rel} fails its sha256 checksum")
    return Verdict(True, manifest=manifest)


def _no_manifest(objs: Objects) -> str:
    """Why a checkpoint URI has no manifest: a partial write (other objects are there), nothing at
    all under it, or no such bucket (told apart: the fix differs)."""
    try:
        if objs.sizes():
            return "no manifest.json (partial write)"
        if hasattr(objs.fs, "call_s3"):
            bucket = objs.path.split("/", 1)[0]
            try:
                objs.fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:
                return f"bucket {bucket!r} does not exist"
    except Exception as exc:  # noqa: BLE001  (the store itself: unreachable, credentials)
        return store_failure(exc) or first_line(exc)
    return "nothing there (no object under this prefix)"


def verify_at(location: str | os.PathLike, checksums: bool = True) -> Verdict:
    """verify() for a checkpoint folder or a checkpoint URI."""
    return verify_object(str(location), checksums) if is_uri(location) else verify(location, checksums)


def open_store(
    location: str | os.PathLike, keep_last: int = 3, keep_every: int = 0, log: Callable[[str], None] | None = None
) -> CheckpointStore:
    """The checkpoints of a run: under RUN_DIR (a folder) or run.storage (a URI)."""
    cls = ObjectCheckpointStore if is_uri(location) else CheckpointStore
    return cls(location, keep_last=keep_last, keep_every=keep_every, log=log)


def run_store_at(location: str | os.PathLike, log=None) -> CheckpointStore | None:
    """The store of a run directory or run.storage given as checkpoint.resume (None when
    `location` is a checkpoint itself, or nothing)."""
    if is_uri(location):
        objs = Objects(str(location), "checkpoint.resume")
        if not objs.exists(MANIFEST) and objs.entries("checkpoints"):
            return ObjectCheckpointStore(str(location), log=log)
        return None
    path = Path(location)
    if path.is_dir() and not (path / MANIFEST).exists() and (path / "checkpoints").is_dir():
        return CheckpointStore(path, log=log)
    return None
