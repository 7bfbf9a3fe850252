"""Durable file writes: after a crash a file holds its old content or its new content, never
a torn mix, and once a call returns the new content is on disk, not only in the page cache.

    atomic_write(path, data)        small file from memory: temp file beside it, fsync, rename
                                    onto it, fsync the directory (the rename itself is durable)
    atomic_write_json(path, obj)    the same for JSON (one format: indent 1, sorted keys)
    AtomicFile(path)                a large file written piece by piece, renamed into place by
                                    commit(); on an exception (or discard()) the temp file goes
                                    and an earlier file at `path` is left as it was
    write_durable(path, data)       in place, fsynced: for files inside a temp directory that is
                                    published later as a whole by replace_dir
    create_durable(path, data)      a new file, fsynced, only where there is none (a lock, a lease)
    replace_dir(tmp, final)         publish a finished temp directory with one rename; an earlier
                                    `final` is moved aside first and removed only afterwards
    fsync_path(path)                fsync a file or a directory

A temp file is named `.tmp-NAME.PID.RANDOM` beside its target, so the housekeeping that
removes leftovers of interrupted writes (names starting `.tmp-`) finds it.

This module sits at the package root, below model/, parallel/, data_pipeline/ and launcher/,
and imports only the standard library: every room may use it without an import cycle.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

TMP_PREFIX = ".tmp-"


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (directories: where the OS allows it)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0)
    with contextlib.suppress(OSError):  # gone meanwhile, or a filesystem that refuses fsync on directories
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_name(path: str | os.PathLike) -> Path:
    """A fresh temp path beside `path` (unique per process and call)."""
    path = Path(path)
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def _as_bytes(data: bytes | str) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else data


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


class AtomicFile:
    """A binary file that appears at `path` whole, or not at all.

    Written under a temp name (`tmp`, default `temp_name(path)`); `commit()` flushes, fsyncs,
    renames it onto `path` and fsyncs the directory. `discard()` (or an exception inside a
    `with` block) removes the temp file. `fsync=False` keeps the atomic rename but skips both
    fsyncs: for files whose loss in a power cut does not matter (liveness heartbeats)."""

    def __init__(self, path: str | os.PathLike, tmp: str | os.PathLike | None = None, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tmp) if tmp is not None else temp_name(self.path)
        self.fsync = fsync
        self.file: IO[bytes] = open(self.tmp, "wb")

    def write(self, data: bytes | str) -> int:
        with naming(self.path):  # a full disk fails the write itself, with no file name
            return self.file.write(_as_bytes(data))

    def commit(self) -> Path:
        try:
            with naming(self.path):
                self.file.flush()
                if self.fsync:
                    os.fsync(self.file.fileno())
                self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        if self.fsync:
            fsync_path(self.path.parent)
        return self.path

    def discard(self) -> None:
        # On the way out of a failed write (a full or read-only disk) closing and removing may
        # fail too: the first error is the one to report (a leftover .tmp- file is swept later).
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def atomic_write(path: str | os.PathLike, data: bytes | str, fsync: bool = True) -> Path:
    """Replace `path` with `data` (bytes, or str as UTF-8) atomically and durably."""
    with AtomicFile(path, fsync=fsync) as f:
        f.write(data)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, obj, fsync: bool = True) -> Path:
    return atomic_write(path, json_bytes(obj), fsync=fsync)


def write_durable(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `path` in place and fsync it (its directory is published later by a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(_as_bytes(data))
        f.flush()
        os.fsync(f.fileno())


def create_durable(path: str | os.PathLike, data: bytes) -> bool:
    """Create `path` holding `data`, fsynced, only where nothing is (False when something is). A
    failed write removes it: a half-written lock or lease would read as an unknown holder."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):  # the write's error is the one to report
            os.unlink(path)
        raise
    return True


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Publish the finished directory `tmp` as `final` with one rename (tmp and the parent
    fsynced). An earlier `final` is renamed to `.tmp-NAME.old` beside it first and deleted
    only once the new one is in place; a crash in between leaves that folder, which the next
    replace_dir of the same `final` removes, and never a half-deleted `final`."""
    tmp, final = Path(tmp), Path(final)
    fsync_path(tmp)
    old = final.with_name(f"{TMP_PREFIX}{final.name}.old")
    if old.exists():  # a crash's leftover, whether or not it got as far as renaming tmp
        shutil.rmtree(old)
    had_final = final.exists()
    if had_final:
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if had_final:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """An OSError raised inside without a file name (a write to an already open file: ENOSPC,
    EIO) gets `path`, so that the one line a user reads names the file; the error is otherwise
    unchanged (its type, errno and traceback)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = os.fspath(path)
        raise
