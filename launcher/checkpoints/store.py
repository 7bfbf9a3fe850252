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

With run.storage a URI (s3://bucket/prefix, ...) the same protocol runs in an object store,
by the same code: the store reads and writes through a backend (loomtrain.storage: `Folder` for
a local path, `Objects` for a URI) and what only a disk does stays in the Folder. An object
store has no rename, so there every rank writes straight into `step_N/`, the manifest written
last is the commit point (a step without one is an interrupted write, removed at the next
start) and `latest` is an object written after it. The writers and readers (state.py,
shards.py) ask the store, not the filesystem: `write_file`, `tensor_sink`, `write_folder`,
`parts_done`, `read_manifest`, `read_checkpoint_file`.

This module knows nothing of torch, DeepSpeed or ranks; what goes into a checkpoint
is state.py's.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomtrain.durable import (
    TMP_PREFIX,
    json_bytes,
)
from loomtrain.launcher.rundir import superseded_name
from loomtrain.storage import below, file_entry, first_line, inside, location, same_location, store_failure

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
    """Is this published checkpoint (a folder or a URI) complete and intact? One listing for the
    sizes; a file without a sha256 (model/, optim/) has one per tile in the index, checked by
    every reader of the tile: here its size only."""
    objs = location(path, "checkpoint")
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
            return Verdict(False, f"missing {objs.noun} {rel}")
        if sizes[rel] != info["size"]:
            return Verdict(False, f"{rel} has {sizes[rel]} bytes, manifest says {info['size']} (truncated?)")
        if checksums and "sha256" in info and objs.sha256(rel) != info["sha256"]:
            return Verdict(False, f"{rel} fails its sha256 checksum")
    return Verdict(True, manifest=manifest)


def _no_manifest(objs) -> str:
    """Why a checkpoint location has no manifest: a partial write (other files are there), nothing
    at all under it, or no such bucket (told apart: the fix differs)."""
    try:
        return "no manifest.json (partial write)" if objs.sizes() else objs.absent()
    except Exception as exc:  # noqa: BLE001  (the store itself: unreachable, credentials)
        return store_failure(exc) or first_line(exc)


class CheckpointStore:
    """The checkpoints of one run (rank-agnostic helpers), under RUN_DIR/checkpoints (a Folder)
    or {run.storage}/checkpoints (Objects): one code path for both; what only a disk does
    (fsync, the temporary name and the rename that publishes it) is the Folder's."""

    def __init__(
        self,
        where: str | os.PathLike,
        keep_last: int = 3,
        keep_every: int = 0,
        log: Callable[[str], None] | None = None,
    ):
        self.base = below(where)  # RUN_DIR, or run.storage: where the run keeps checkpoints/
        self.objects = location(where, "run.storage").child("checkpoints")
        self.root = self.objects.root
        self.poll_s = self.objects.poll_s  # how often an async save's rank 0 looks for the other ranks' parts
        self.keep_last = int(keep_last)
        self.keep_every = int(keep_every)
        self.latest_known: str | None = None  # the newest checkpoint published or read here
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def _failure(self, exc: BaseException) -> str:
        return store_error(self.base, exc, "run.dir" if self.objects.local else "run.storage")

    def verify(self, path, checksums: bool = True) -> Verdict:
        return verify(path, checksums=checksums)

    def check_reachable(self) -> None:
        """One line for an unreachable endpoint, refused credentials or a missing bucket (a local
        folder always can be used)."""
        try:
            found = self.objects.bucket_exists()
        except Exception as exc:  # noqa: BLE001  (credentials, endpoint, network: said in one line)
            raise ValueError(store_error(self.base, exc)) from None
        if not found:
            raise ValueError(
                f"run.storage={self.base}: bucket {self.objects.bucket!r} does not exist (or these "
                "credentials cannot see it); create it or point run.storage at another"
            )

    def _at(self, tmp):
        """The files of one step being written (tmp: its folder or URI)."""
        return self.objects.child(str(tmp).rstrip("/").rsplit("/", 1)[-1])

    # Paths ------------------------------------------------------------------------------
    def final_dir(self, step: int):
        return self.objects.name(step_dirname(step))

    def _stage(self, step: int) -> str:
        """Where a step is written: a temporary name renamed when published (a folder), or where
        it stays (an object store: no rename; the manifest written last is the commit point)."""
        return (TMP_PREFIX if self.objects.renames else "") + step_dirname(step)

    def temp_dir(self, step: int):
        return self.objects.name(self._stage(step))

    def published(self) -> list[tuple[int, Any]]:
        """(step, location) of every published checkpoint, oldest first (not verified). In an
        object store a step without a manifest is an interrupted write, not listed; in a folder
        every step_N was renamed into place complete (one without a manifest is damaged: listed,
        and named by the scan)."""
        out = []
        for name, kind in self.objects.entries().items():
            m = _STEP_RE.match(name)
            if m and kind == "directory" and (self.objects.renames or self.objects.exists(f"{name}/{MANIFEST}")):
                out.append((int(m.group(1)), self.objects.name(name)))
        return sorted(out)

    # Writing ----------------------------------------------------------------------------
    def begin(self, step: int):
        """Rank 0, before the others write: an earlier attempt at this step goes, manifest first."""
        stage = self._stage(step)
        self.objects.delete(f"{stage}/{MANIFEST}")
        self.objects.delete_tree(stage)
        self.objects.make_folder(f"{stage}/{PARTS_DIR}")
        return self.temp_dir(step)

    def write_file(self, tmp, rel: str, data: bytes) -> dict:
        """Write `data` durably at tmp/rel -> its file-list entry (size, sha256)."""
        self._at(tmp).write(rel, data)
        return file_entry(data)

    def write_raw(self, tmp, rel: str, data: bytes) -> None:
        self._at(tmp).write(rel, data)

    def read_file(self, tmp, rel: str) -> bytes:
        return self._at(tmp).read(rel)

    def tensor_sink(self, tmp, rel: str):
        """(what a streaming safetensors writer writes to, its stream): a path and no stream on a
        disk, a URI and a multipart upload in an object store."""
        return self._at(tmp).sink(rel)

    def write_folder(self, tmp, rel: str, fill: Callable[[str], None]) -> dict[str, dict]:
        """Files a library writes into a folder of its own (a tokenizer's save): fill(folder),
        then their file-list entries."""
        return self._at(tmp).write_folder(rel, fill)

    def add_part(self, tmp, rank: int, files: dict[str, dict]) -> None:
        """One rank's contribution: {relpath: {"size", "sha256"}} of the files it wrote (hashed
        while writing, already durable; a file no part lists, publish describes)."""
        self._at(tmp).write(f"{PARTS_DIR}/rank_{rank:05d}.json", json_bytes(files))

    def parts_done(self, tmp, world: int) -> bool:
        """Has every rank finished writing (its file list exists)? A rank that failed says so."""
        at = self._at(tmp)
        names = set(at.entries(PARTS_DIR))
        failed = sorted(n for n in names if n.endswith(".failed"))
        if failed:
            text = at.read(f"{PARTS_DIR}/{failed[0]}").decode(errors="replace").strip()
            raise RuntimeError(f"{below(tmp, PARTS_DIR + '/' + failed[0])}: {text}")
        return all(f"rank_{r:05d}.json" in names for r in range(world))

    def mark_failed(self, tmp, rank: int, error: BaseException) -> None:
        try:
            self._at(tmp).write(f"{PARTS_DIR}/rank_{rank:05d}.failed", f"{error}\n".encode())
        except Exception:  # noqa: BLE001  (the store itself may be what failed)
            pass

    def publish(self, tmp, step: int, meta: dict):
        """Rank 0, after every rank's part: the manifest last (the commit point; a folder is then
        renamed into place), then `latest`."""
        at = self._at(tmp)
        files: dict[str, dict] = {}
        for name in sorted(n for n in at.entries(PARTS_DIR) if n.startswith("rank_") and n.endswith(".json")):
            files.update(json.loads(at.read(f"{PARTS_DIR}/{name}")))
        sizes = at.sizes()
        for rel, info in sorted(files.items()):  # every write completed, at its size
            if sizes.get(rel) != info["size"]:
                raise RuntimeError(f"{below(tmp, rel)}: {sizes.get(rel, 'no')} bytes stored, {info['size']} written")
        for rel in sorted(sizes):  # anything written without a part entry (e.g. by a library)
            if rel not in files and rel != MANIFEST and not rel.startswith(PARTS_DIR + "/"):
                files[rel] = at.describe(rel)
        at.delete_tree(PARTS_DIR)
        at.sync()
        manifest = {"format": FORMAT_VERSION, "step": int(step), "time": time.time(), **meta, "files": files}
        self._write_manifest(at, manifest)
        if self.objects.renames:  # re-saving a step (resumed and saved again) replaces it
            self.objects.rename(self._stage(step), step_dirname(step))
        self.objects.replace(LATEST, (step_dirname(step) + "\n").encode())
        self.latest_known = step_dirname(step)  # what a failure later names without asking the store
        try:
            self.apply_retention()
        except Exception as exc:  # noqa: BLE001  (published all the same; the next save prunes again)
            self.log(f"checkpoint: step {step} saved, but pruning older ones failed: {self._failure(exc)}")
        return self.final_dir(step)

    def _write_manifest(self, at, manifest: dict) -> None:
        """The commit point: every file is written and durable, nothing is visible yet."""
        at.write(MANIFEST, json_bytes(manifest))

    def latest_pointer(self) -> str | None:
        try:
            pointer = self.objects.read(LATEST).decode().strip() or None
        except (FileNotFoundError, UnicodeDecodeError):  # a store's own error is raised, as any read's
            return None
        self.latest_known = pointer
        return pointer

    # Housekeeping -----------------------------------------------------------------------
    def clean_temp(self) -> list:
        """Remove leftovers of interrupted writes (rank 0, at start, before any save): `.tmp-*`
        in a folder, step prefixes without a manifest in an object store."""
        removed = []
        for name, kind in self.objects.entries().items():
            unpublished = (
                not self.objects.renames
                and kind == "directory"
                and _STEP_RE.match(name)
                and not self.objects.exists(f"{name}/{MANIFEST}")
            )
            if name.startswith(TMP_PREFIX) or unpublished:
                self.objects.delete_tree(name)
                removed.append(self.objects.name(name))
                self.log(f"checkpoint: removed leftover {removed[-1]} (interrupted write)")
        return removed

    def set_aside(self) -> Path | str | None:
        """Move every published checkpoint (and `latest`) into checkpoints/superseded-TIME/:
        a fresh start (checkpoint.resume=never) neither resumes from them later nor lets
        retention mix them with its own. Nothing is deleted: a folder is renamed, an object
        store's prefix copied, checked, then deleted manifest first (the backend's move_aside)."""
        names = [str(path).rstrip("/").rsplit("/", 1)[-1] for _, path in self.published()]
        if not names:
            return None
        pointer = [LATEST] if self.latest_pointer() is not None else []
        dest = self.objects.move_aside(names + pointer, superseded_name())
        self.objects.sync(tree=False)
        self.log(f"checkpoint: checkpoint.resume=never: moved {len(names)} earlier checkpoint(s) to {dest}")
        return dest

    def apply_retention(self) -> list:
        """Keep the newest `keep_last` (<= 0: all) plus every `keep_every`-th step and the one
        `latest` names. A pruned checkpoint goes out of sight at once (renamed aside, or its
        manifest deleted first), its bytes in the background."""
        if self.keep_last <= 0:  # keep all: nothing to list or read
            return []
        published, pointer = self.published(), self.latest_pointer()
        keep = {step for step, _ in published[-self.keep_last :]}
        keep |= {step for step, _ in published if self.keep_every > 0 and step % self.keep_every == 0}
        removed, retired = [], []
        for step, where in published:
            if step not in keep and step_dirname(step) != pointer:
                retired.append(self.objects.retire(step_dirname(step), MANIFEST))
                removed.append(where)
        if retired:
            _in_background([lambda n=n: self._delete_quietly(n) for n in retired])
        return removed

    def _delete_quietly(self, name: str) -> None:
        """A pruned checkpoint's bytes (already out of sight: a failure here leaves a leftover
        the next start removes)."""
        try:
            self.objects.delete_tree(name)
        except Exception as exc:  # noqa: BLE001
            self.log(f"checkpoint: could not delete all of {self.objects.name(name)}: {self._failure(exc)}")

    # Reading ----------------------------------------------------------------------------
    def find_resumable(self, checksums: bool = True, refuse: bool = False):
        """The newest complete checkpoint; broken newer ones are reported and skipped. With
        `refuse` (what a restart continues from), when checkpoints exist but none verifies,
        ValueError in one line naming each: the run must not silently start again at step 0."""
        broken: list[tuple[Any, str]] = []
        for _, path in reversed(self.published()):
            v = self.verify(path, checksums=checksums)
            if v.ok:
                break
            broken.append((path, v.reason))
        else:
            path = None
        if path is None and broken and refuse:
            each = "; ".join(f"{str(p).rstrip('/').rsplit('/', 1)[-1]}: {reason}" for p, reason in broken)
            raise ValueError(
                f"no usable checkpoint in {self.root} ({each}); to start afresh set checkpoint.resume=never "
                "(moves them aside, deletes nothing) or pick another run.dir"
            )
        for bad, reason in broken:
            self.log(f"checkpoint: skipping {bad}: {reason}; trying the previous one")
        return path

    def owns(self, path: str | os.PathLike) -> bool:
        """Is `path` this run's directory (or run.storage) or one of its own checkpoints?"""
        return same_location(path, self.base) or inside(path, self.root)

    def resolve_resume(self, resume: str, checksums: bool = True):
        """checkpoint.resume: "auto" (newest complete, or None), "never", or a PATH or URI (a
        checkpoint, or a run directory / run.storage whose newest complete one is taken).

        A PATH outside this run only seeds its first start: once the run has
        checkpoints of its own, a restart (the same command again, or a Ray worker
        group restart) continues from those instead of going back to the seed."""
        if resume == "never":
            return None
        if resume in ("auto", "") or same_location(resume, self.base):  # this run's own newest
            return self.find_resumable(checksums, refuse=True)
        if self.published() and not self.owns(resume):
            found = self.find_resumable(checksums, refuse=True)
            self.log(
                f"checkpoint: checkpoint.resume={resume} only seeds a run's first start; "
                f"{self.base} has its own checkpoints: resuming from {found}"
            )
            return found
        other = run_store_at(resume, log=self.log)
        if other is not None:  # a run directory (or run.storage) was given: its newest complete checkpoint
            found = other.find_resumable(checksums=checksums)
            if found is None:
                raise ValueError(f"checkpoint.resume={resume!r}: no complete checkpoint under {other.root}")
            return found
        v = verify(resume, checksums=checksums)
        if not v.ok:
            raise ValueError(f"checkpoint.resume={resume!r}: not a usable checkpoint: {v.reason}")
        return below(resume)


_deletions: list[threading.Thread] = []


def _in_background(jobs: list[Callable[[], None]]) -> None:
    """Deletions of pruned checkpoints, one after another, off the saving thread: freeing a
    checkpoint's GBs takes a disk a good part of a second that no step needs to wait for. The
    run waits for them when it stops (`wait_for_deletions`), the process at exit (a kill leaves
    a leftover, which the next start removes)."""
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
    failure = store_failure(exc)
    if failure:  # the object store went away (or refused us) mid-save: the store is not asked again
        what, where, kept = failure, store.temp_dir(step), store.latest_known
    elif isinstance(exc, OSError):
        what, where, kept = exc.strerror or str(exc), exc.filename or store.temp_dir(step), store.latest_pointer()
    else:  # safetensors: 'Error while serializing: I/O error: No space left on device (os error 28)'
        m = _OS_ERROR_IN_TEXT.search(str(exc))
        what = (m.group(1) or m.group(2)) if m else str(exc).splitlines()[0]
        where, kept = store.temp_dir(step), store.latest_pointer()
    newest = below(store.root, kept) if kept else None
    stays = f"{newest} stays the newest checkpoint" if kept else "no earlier checkpoint exists"
    err = CheckpointWriteError(f"checkpoint: cannot save step {step}: {what}: {where}; {stays}")
    if failure:  # the newest checkpoint as the store last named it (train.py's message tells it)
        err.latest = (newest, kept) if kept else None
    return err


def read_manifest(path: str | os.PathLike) -> dict:
    return json.loads(location(path, "checkpoint").read(MANIFEST))


def read_checkpoint_file(path: str | os.PathLike, rel: str) -> bytes:
    """One file of a checkpoint (a folder or a URI), whole; a missing one is named in one line."""
    try:
        return location(path, "checkpoint").read(rel)
    except FileNotFoundError:
        raise FileNotFoundError(f"{below(path, rel)}: missing") from None


def store_error(storage, exc: BaseException, what: str = "run.storage") -> str:
    """One line for a store's own error (endpoint down, credentials refused, no bucket; a disk's)."""
    return f"{what}={storage}: {store_failure(exc) or first_line(exc)}"


def run_store_at(where: str | os.PathLike, log=None) -> CheckpointStore | None:
    """The store of a run directory or run.storage given as checkpoint.resume (None when
    `where` is a checkpoint itself, or nothing)."""
    objs = location(where, "checkpoint.resume")
    if not objs.exists(MANIFEST) and objs.entries().get("checkpoints") == "directory":
        return CheckpointStore(where, log=log)
    return None
