"""Where durable bytes live: a local path, or an object-store URI (`s3://bucket/prefix`, and
whatever else fsspec knows: `gs://`, `az://`, `file://`).

    is_uri(location)            does it name a scheme (`s3://...`)? Such a string is never a path:
                                treating `s3://b/x` as one writes a local folder `./s3:/b/x`
    known_scheme(location)      a URI whose scheme fsspec knows (no library imported)
    location_problem(value)     in words, what is wrong with `S3://`, `s4://`, `s3:/b`, `s3:///b`
    object_store(uri, what)     (fsspec filesystem, path inside it) for a URI, or one line naming
                                `what` (the config key or option) and the value when its scheme
                                is unknown or its library is missing
    join(base, *parts)          a child location of a path or a URI (`/` for URIs)
    filesystem(location)        (fsspec filesystem, path) for a URI or a local path alike

Objects, one primitive each (a failure is one line naming the object: StorageError / failed):
    listing(fs, path)           a prefix listed afresh (sizes, ETags); list_objects(uri) by URI
    read_object(uri, start, end)  an object's bytes, or a byte range of them (a ranged GET)
    write_object(uri, data)     one small object, whole; delete_objects: named ones, or a prefix
    upload_file / upload_folder  local files up, several in flight on transfer_pool() (in_flight),
                                a folder's commit objects last;
                                download_verified: down, checked against a manifest, cached
    Objects(uri)                a prefix (the checkpoint store's view: errors pass through);
                                move_aside: entries copied, checked, then deleted (no rename)
    Folder(path)                a local folder behind Objects' interface: what only a disk does
                                (fsync, the rename that publishes or moves aside, a memory map)
                                lives in it
    location(where, what)       Folder or Objects for a path or a URI: the one place callers
                                (checkpoint store, shard reader, run markers) tell them apart
    below(where, rel)           a location as messages and pointers name it (a Path, or a URI)
    same_location / inside      compare locations of either kind; absolute(where) for a worker
    Upload                      a streaming multipart upload, parts in flight on transfer_pool()

Credentials and the endpoint come from the storage library's standard chain (for S3:
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL, profiles, instance roles); nothing
here takes, logs or writes them.

This module sits at the package root beside durable.py: data_pipeline/ and launcher/ both use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from urllib.parse import urlsplit

from loomtrain.durable import TMP_PREFIX, AtomicFile, atomic_write, fsync_path, replace_dir, write_durable

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_uri(location: str | os.PathLike) -> bool:
    return isinstance(location, str) and _SCHEME.match(location) is not None


def scheme(location: str | os.PathLike) -> str:
    m = _SCHEME.match(location) if isinstance(location, str) else None
    return m.group(1).lower() if m else ""


def known_scheme(location: str | os.PathLike) -> bool:
    """A URI whose scheme fsspec knows (without importing its library: config checks stay pure)."""
    from fsspec.registry import known_implementations, registry

    proto = scheme(location)
    return bool(proto) and (proto in known_implementations or proto in registry)


_ONE_SLASH = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):/(?!/)")


def location_problem(location: str | os.PathLike, local: str = "") -> str:
    """What is wrong with a location written as (or like) a URI, in words ("" when nothing is:
    a URI of a scheme fsspec knows, or a plain path; a plain path only when `local` says why). Checked
    once for every option that takes a location, so that `S3://b/x` or `s3:/b/x` never becomes a
    traceback later, or a local folder."""
    if not isinstance(location, str) or not location:
        return ""
    if local and is_uri(location):
        return f"expected a local directory path, not a URI ({local})"
    one = _ONE_SLASH.match(location)
    if one:  # s3:/bkt/x is a path ./s3:/bkt/x to the OS (a drive letter C:/ has one character)
        return f"a URI has two slashes after its scheme ({one.group(1)}://{location[one.end() :]})"
    m = _SCHEME.match(location)
    if not m:
        return ""
    proto, rest = m.group(1), location[m.end() :]
    if proto != proto.lower():
        return f"a URI's scheme is written in lower case ({proto.lower()}://{rest})"
    if not known_scheme(location):
        return f"unknown storage scheme {proto}:// (expected s3://, gs://, az://, file://, or a local path)"
    if proto != "file" and (not rest.strip("/") or rest.startswith("/")):
        return f"no bucket after {proto}:// (expected {proto}://BUCKET/PREFIX)"
    return ""


def object_store(uri: str, what: str = "location"):
    """The fsspec filesystem for `uri` and the path inside it. ValueError in one line, naming
    `what` and `uri`, for a scheme fsspec does not know or whose library is not installed."""
    import fsspec

    proto = scheme(uri)
    if not proto:
        raise ValueError(f"{what}={uri!r}: expected a URI such as s3://bucket/prefix")
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except ImportError as e:
        raise ValueError(f"{what}={uri!r}: the library for {proto}:// is not installed ({e})") from None
    except ValueError as e:
        raise ValueError(f"{what}={uri!r}: unknown storage scheme {proto}:// ({e})") from None
    return fs, path


def filesystem(location: str | os.PathLike):
    """(fsspec filesystem, path inside it) for a URI or a local path: one code path for code
    that works on either (a run's outputs moved aside, run.storage's lease and marker)."""
    if is_uri(location):
        return object_store(str(location))
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem(), os.path.abspath(os.path.expanduser(os.fspath(location)))


def is_local(fs) -> bool:
    """A filesystem with folders and an atomic rename (a local path, file://), not an object store."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def join(base: str | os.PathLike, *parts: str) -> str:
    if is_uri(base):
        return "/".join([str(base).rstrip("/"), *(str(p).strip("/") for p in parts)])
    return os.path.join(os.fspath(base), *parts)


# Whole objects: listing, reading, writing, uploading and verified downloads ------------------
# A missing or damaged object, or a store that cannot be reached, is a StorageError of one line
# naming the object; readers above turn it into their own error type.


class StorageError(ValueError):
    """An object that is missing, damaged or cannot be read or written (one line naming it).
    `detail`: the store's own error in one line, for a caller that words its own message."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


TRANSFERS_IN_FLIGHT = 8  # threads of the process' transfer pool: objects (or parts) moved at once

_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def transfer_pool() -> ThreadPoolExecutor:
    """The process' one bounded pool of transfers (made anew in a forked child). Its tasks move
    bytes and must never wait for one another (no in_flight or Upload inside a task): then
    sharing it cannot deadlock."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(TRANSFERS_IN_FLIGHT, thread_name_prefix="loomtrain-transfer"))
        return _pool[1]


def in_flight(fn, items: list) -> list:
    """[fn(item) for item in items], several at once on the transfer pool; returns when all are
    done (none left running), raising the first failure."""
    futures = [transfer_pool().submit(fn, item) for item in items]
    wait(futures)
    return [f.result() for f in futures]


def message_line(exc: BaseException) -> str:
    """An error's text cut to its first line (its type's name when it has none), for a one-line message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def first_line(exc: BaseException) -> str:
    """A storage library's error in one line: its type and the first line of its text."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# An object store's own errors, told apart: unreachable, credentials, a missing bucket. The
# library retries a request first (botocore: 5 attempts with backoff, about 20 s for a dead
# endpoint; s3fs: its own retries of timeouts), so a failure here is past that budget.
_UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ProxyConnectionError",
}
_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403", "AccessDenied"}
_NO_BUCKET = {"NoSuchBucket"}
_STORE_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "urllib3", "gcsfs", "adlfs", "google", "azure")


def _chain(exc: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and len(out) < 8 and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _endpoint(exc: BaseException) -> str:
    url = (getattr(exc, "kwargs", None) or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL", "")
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else (url or "the default S3 endpoint")


def store_failure(exc: BaseException) -> str:
    """What an object store's error means, in one line naming the endpoint where it matters:
    unreachable, credentials refused, no such bucket; "" when `exc` is no object store's error
    (a local disk's OSError, a bug)."""
    chain = _chain(exc)
    for e in chain:
        name = type(e).__name__
        if name in _UNREACHABLE:
            return f"cannot reach the object store at {_endpoint(e)} ({name}; retried by the storage library first)"
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return "no object-store credentials found (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile or a role)"
        error = (getattr(e, "response", None) or {}).get("Error") or {}
        code = str(error.get("Code", ""))
        if code in _CREDENTIALS:
            return f"the object store at {_endpoint(e)} refused access with these credentials ({code})"
        if code in _NO_BUCKET:
            bucket = f"bucket {error['BucketName']!r}" if error.get("BucketName") else "the bucket"
            return f"{bucket} does not exist at {_endpoint(e)} ({code}): create it or name another"
    if any(type(e).__module__.split(".")[0] in _STORE_MODULES for e in chain):
        return first_line(exc)
    return ""


def failed(uri: str, action: str, exc: BaseException) -> StorageError:
    return StorageError(f"{uri}: cannot {action} ({first_line(exc)})", first_line(exc))


def listing(fs, path: str, recursive: bool = True) -> dict[str, dict]:
    """{name relative to the prefix `path`: the library's info (size, type, ETag, ...)} of every
    object below it (recursive) or of the objects and folders directly under it, listed afresh:
    fsspec caches listings per process, and another process' writes must be seen. An absent
    prefix is an empty dict; the library's own errors (no credentials, no bucket) pass through."""
    path = path.rstrip("/")
    fs.invalidate_cache()
    try:
        if recursive:
            found = fs.find(path, detail=True)
        else:
            found = {info["name"]: info for info in fs.ls(path, detail=True, refresh=True)}
    except FileNotFoundError:
        return {}
    base = path + "/"
    return {name.rstrip("/")[len(base) :]: info for name, info in found.items() if name.startswith(base)}


def list_objects(uri: str) -> dict[str, dict]:
    """Every object under the prefix `uri`: {path relative to it: {"size", "version"}}, where
    "version" changes whenever the object does (its ETag, else its modification time). An
    absent prefix is an empty dict."""
    fs, root = object_store(uri)
    try:
        found = listing(fs, root)
    except Exception as exc:  # no credentials, no bucket, connection refused: the library's own types
        raise failed(uri, "list it", exc) from None
    out = {}
    for rel, info in found.items():
        if info.get("type", "file") != "file":
            continue
        version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
        out[rel] = {"size": int(info.get("size") or 0), "version": str(version).strip('"')}
    return out


def read_object(uri: str | os.PathLike, start: int | None = None, end: int | None = None) -> bytes | None:
    """The object's (or a local file's) bytes (only [start, end) with either given: a ranged
    read), or None when there is none."""
    fs, path = filesystem(uri)
    try:
        return fs.cat_file(path, start=start, end=end)
    except (FileNotFoundError, NotADirectoryError):  # (a local path through a file is no object either)
        return None
    except Exception as exc:
        raise failed(uri, "read it", exc) from None


def _parent_folder(fs, path: str) -> None:
    if is_local(fs):  # file:// has folders; object stores do not
        fs.makedirs(fs._parent(path), exist_ok=True)


def write_object(uri: str, data: bytes) -> None:
    """One object, whole: a reader finds the old object or the new one, never a part (an object
    store's PUT appears complete or not; on a disk the bytes go to a temp file renamed over it)."""
    fs, path = object_store(uri)
    try:
        _parent_folder(fs, path)
        if is_local(fs):
            # The temp name keeps none of the object's: a reader that goes by names (TensorBoard
            # takes any file named *tfevents*) must not take it for an object meanwhile.
            with AtomicFile(path, tmp=Path(path).with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}")) as f:
                f.write(data)
        else:
            fs.pipe_file(path, data)
    except Exception as exc:
        raise failed(uri, "write it", exc) from None


def delete_objects(uri: str, relpaths: list[str] | None = None) -> None:
    """The named objects under `uri` (absent ones are fine), or with relpaths None every
    object under the prefix."""
    if relpaths is None:
        relpaths = sorted(list_objects(uri))
    fs, root = object_store(uri)
    paths = [f"{root.rstrip('/')}/{rel}" for rel in relpaths]
    if not paths:
        return
    try:
        fs.rm(paths)
    except FileNotFoundError:
        pass
    except Exception as exc:
        raise failed(uri, f"delete {relpaths[0]} and {len(paths) - 1} more objects under it", exc) from None


def upload_file(local: str | os.PathLike, uri: str) -> None:
    """One local file up to the object `uri` (a large file in parts, as the store's library does it)."""
    fs, path = object_store(uri)
    try:
        _parent_folder(fs, path)
        fs.put_file(os.fspath(local), path)
    except Exception as exc:
        raise failed(uri, f"upload {os.fspath(local)} to it", exc) from None


def upload_folder(local_dir: str | os.PathLike, uri: str, commits: tuple[str, ...]) -> None:
    """A finished local folder onto object storage in place of whatever is under `uri` (an object
    store has no rename), so that no reader takes a mix for a whole folder: the objects a reader
    takes it by (`commits`, outermost last) go first, then the rest; every other file goes up,
    several in flight; the commits last, in order."""
    local = Path(local_dir)
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    for rel in reversed(commits):
        delete_objects(uri, [rel])
    delete_objects(uri)
    in_flight(lambda rel: upload_file(local / rel, join(uri, rel)), [n for n in names if n not in commits])
    for rel in commits:
        upload_file(local / rel, join(uri, rel))


FETCHED = ".fetched.json"  # download_verified's record of what the local folder holds
_FETCH_LOCK = ".fetch.lock"
_CHUNK = 8 << 20


def download_verified(
    uri: str, local_dir: str | os.PathLike, files: dict[str, dict | None], written: dict[str, bytes] | None = None
) -> Path:
    """Make local_dir hold exactly `files` as they are under `uri` (nothing else), several in
    flight; returns local_dir. `files` maps a relative path to {"size", "sha256"} (a manifest's
    entry: the object is checked against both, the sha256 while it streams in) or None (taken as
    it is). A file already there from an earlier call is kept when neither its manifest entry nor
    the object's version (ETag) changed and it is as that call left it (size, mtime); anything
    else is fetched again. `written`: small files put there from memory as well (such as the
    manifest the entries came from). Processes on one host share the folder under a file lock.

    A missing object, one of another size than its manifest entry or failing its sha256 is a
    StorageError naming it, checked before anything is kept."""
    from loomtrain.durable import atomic_write_json, temp_name

    local = Path(local_dir)
    written = written or {}
    for rel in [*files, *written]:  # a name from a manifest must not lead out of the folder
        if not rel or rel.startswith("/") or ".." in rel.split("/") or rel in (FETCHED, _FETCH_LOCK):
            raise StorageError(f"{join(uri, rel)}: not a file name inside {uri}")
    local.mkdir(parents=True, exist_ok=True)
    listed = list_objects(uri)
    for rel, want in sorted(files.items()):
        got = listed.get(rel)
        if got is None:
            raise StorageError(f"{join(uri, rel)}: missing (expected {rel} under {uri})")
        if want is not None and got["size"] != want["size"]:
            raise StorageError(
                f"{join(uri, rel)}: {got['size']} bytes, the manifest says {want['size']} "
                "(a damaged or replaced object)"
            )
    fs, root = object_store(uri)

    def key(rel: str) -> str:
        want = files[rel]
        return f"{want['sha256'] if want else ''}:{listed[rel]['version']}:{listed[rel]['size']}"

    def state(rel: str) -> dict:  # FETCHED's entry: the file is kept while all three still hold
        st = (local / rel).stat()
        return {"key": key(rel), "size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def fetch(rel: str) -> dict:
        dest = local / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(dest)
        digest = hashlib.sha256()
        try:
            with fs.open(f"{root.rstrip('/')}/{rel}", "rb", block_size=_CHUNK) as src, open(tmp, "wb") as out:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"{join(uri, rel)}: missing (it went while being read)") from None
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            raise failed(join(uri, rel), "download it", exc) from None
        want = files[rel]
        if want is not None and digest.hexdigest() != want["sha256"]:
            tmp.unlink(missing_ok=True)
            raise StorageError(
                f"{join(uri, rel)}: fails its sha256 checksum (the manifest says {want['sha256'][:12]}..., "
                f"the object hashes to {digest.hexdigest()[:12]}...): a damaged object"
            )
        os.replace(tmp, dest)
        return state(rel)

    with open(local / _FETCH_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            record = json.loads((local / FETCHED).read_text())
        except (OSError, ValueError):
            record = {}
        keep = {rel: record[rel] for rel in files if (local / rel).is_file() and record.get(rel) == state(rel)}
        for p in sorted(local.rglob("*"), reverse=True):  # what the files do not name goes
            rel = p.relative_to(local).as_posix()
            if p.is_file() and rel not in files and rel not in written and rel not in (FETCHED, _FETCH_LOCK):
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        todo = sorted(rel for rel in files if rel not in keep)
        atomic_write_json(local / FETCHED, keep, fsync=False)  # what is being replaced is not trusted meanwhile
        fetched = dict(zip(todo, in_flight(fetch, todo)))
        for rel, data in written.items():
            if not (local / rel).is_file() or (local / rel).read_bytes() != data:
                atomic_write(local / rel, data, fsync=False)
        atomic_write_json(local / FETCHED, {**keep, **fetched}, fsync=False)
    return local


# A prefix, and streaming multipart uploads ----------------------------------------------------

COMMIT = "manifest.json"  # the commit object of a checkpoint and of final/: Objects.move_aside deletes it first

# A multipart upload sends parts of this size (S3 wants >= 5 MiB but the last), several at once.
PART_BYTES = 16 << 20
UPLOADS_IN_FLIGHT = 4  # of one object's parts


class Objects:
    """The objects under one URI prefix: child paths, listings that never trust a cache,
    whole-object reads and writes, recursive deletes. The library's own errors pass through
    (FileNotFoundError for a missing object): the checkpoint store words them."""

    def __init__(self, uri: str, what: str = "run.storage"):
        self.fs, self.path = object_store(uri, what)
        self.path = self.path.rstrip("/")
        self.uri = self.root = uri.rstrip("/")

    def child(self, rel: str) -> Objects:
        return Objects(self.name(rel))  # (the same filesystem: fsspec keeps one instance per store)

    def _key(self, rel: str) -> str:
        return f"{self.path}/{rel.strip('/')}" if rel else self.path

    def name(self, rel: str = "") -> str:
        """The URI of an object or prefix below (for messages and pointers)."""
        return f"{self.uri}/{rel.strip('/')}" if rel else self.uri

    # Listing ------------------------------------------------------------------------------
    def entries(self, rel: str = "") -> dict[str, str]:
        """{name: "file" | "directory"} directly under a prefix (empty when there is none)."""
        return {name: info.get("type", "file") for name, info in listing(self.fs, self._key(rel), False).items()}

    def sizes(self, rel: str = "") -> dict[str, int]:
        """{relative path: size} of every object below a prefix (one recursive listing)."""
        return {name: int(info.get("size") or 0) for name, info in listing(self.fs, self._key(rel)).items()}

    def exists(self, rel: str) -> bool:
        self.fs.invalidate_cache()
        try:
            self.fs.info(self._key(rel))
        except FileNotFoundError:
            return False
        return True

    # Reading and writing ------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        """A whole object (FileNotFoundError when there is none)."""
        return self.fs.cat_file(self._key(rel))

    def write(self, rel: str, data: bytes) -> None:
        """One object, whole (a single PUT)."""
        _parent_folder(self.fs, self._key(rel))
        self.fs.pipe_file(self._key(rel), bytes(data))

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(rel))

    def delete_tree(self, rel: str) -> None:
        """Every object below a prefix."""
        self.fs.invalidate_cache()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._key(rel), recursive=True)

    def move_aside(self, names: list[str], dest_rel: str) -> str:
        """Move each of `names` (objects or prefixes directly under this one) to dest_rel/NAME;
        returns that prefix. file:// has folders: each moves with one rename (Folder.move_aside).
        An object store has no rename, so each is copied, the copy listed and checked, and only
        then are the originals deleted (`_move`): a failure before the deletes leaves them as
        they were (and a partial copy beside them, which a later move adds to under another name)."""
        dest_rel = dest_rel.strip("/")
        if is_local(self.fs):
            Folder(self.path).move_aside(names, dest_rel)
        else:
            for name in names:
                self._move(name, f"{dest_rel}/{name}")
        return self.name(dest_rel)

    def _move(self, rel: str, dest_rel: str) -> None:
        """Copy every object at or below `rel` to `dest_rel`, check that each copy is there at
        its size, then delete the originals, each prefix's commit object (COMMIT) first: a
        checkpoint or final/ is gone whole at once, never half there."""
        src, dst = self._key(rel), self._key(dest_rel)
        self.fs.invalidate_cache()
        one = self.fs.isfile(src)  # one object (`latest`), named "" below

        def sizes(at_rel: str) -> dict[str, int]:
            return {"": int(self.fs.info(self._key(at_rel)).get("size") or 0)} if one else self.sizes(at_rel)

        def at(base: str, below_rel: str) -> str:
            return f"{base}/{below_rel}" if below_rel else base

        objects = sizes(rel)
        if not objects:
            return
        in_flight(lambda r: self.fs.copy(at(src, r), at(dst, r)), sorted(objects))
        self.fs.invalidate_cache()
        copied = sizes(dest_rel)
        for r, size in objects.items():
            if copied.get(r) != size:
                raise OSError(
                    f"{at(dst, r)}: the copy has {copied.get(r, 'no')} bytes, {size} expected; nothing deleted"
                )
        commits = {r for r in objects if r.rsplit("/", 1)[-1] == COMMIT}
        for batch in (commits, objects.keys() - commits):
            if batch:
                self.fs.rm([at(src, r) for r in sorted(batch)])
        self.fs.invalidate_cache()

    # What the checkpoint store asks of every backend (Folder below answers the same) ----------
    local = False
    renames = False  # no rename: a checkpoint is written where it stays, its manifest the commit
    noun = "object"
    poll_s = 0.25  # listing is a request to the store

    replace = write  # a small object readers poll (a pointer): a PUT appears whole

    def sink(self, rel: str):
        """(where, the stream to write to) for a streaming writer."""
        return self.name(rel), Upload(self.fs, self._key(rel))

    def describe(self, rel: str) -> dict:
        """Its file-list entry: size and sha256 (read back whole)."""
        return file_entry(self.read(rel))

    def sha256(self, rel: str) -> str:
        return hashlib.sha256(self.read(rel)).hexdigest()

    def write_folder(self, rel: str, fill) -> dict[str, dict]:
        """Files a library writes into a folder of its own: filled in a local temporary folder,
        uploaded -> {relative path: file-list entry}."""
        out = {}
        with tempfile.TemporaryDirectory(prefix="loomtrain-upload-") as folder:
            fill(folder)
            for p in sorted(Path(folder).rglob("*")):
                if p.is_file():
                    data, key = p.read_bytes(), f"{rel}/{p.relative_to(folder)}"
                    self.write(key, data)
                    out[key] = file_entry(data)
        return out

    def make_folder(self, rel: str) -> None:
        """(an object store has no folders)"""

    @contextlib.contextmanager
    def local_copy(self, names: list[str]):
        """A local folder holding those of `names` that are here (for a library that reads only
        files: a tokenizer); removed afterwards."""
        present = set(self.entries())
        with tempfile.TemporaryDirectory(prefix="loomtrain-copy-") as folder:
            for name in names:
                if name in present:
                    Path(folder, name).write_bytes(self.read(name))
            yield folder

    def sync(self, rel: str = "", tree: bool = True) -> None:
        """(a PUT is durable when it returns)"""

    def retire(self, rel: str, commit: str) -> str:
        """Make a folder of objects invisible at once, before they go: its commit object (a
        checkpoint's manifest) first."""
        self.delete(f"{rel}/{commit}")
        return rel

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    def bucket_exists(self) -> bool:
        """Is the bucket there? (S3's HeadBucket answers 404 for a missing bucket, 403 for refused
        credentials: the library's error passes through for the latter)"""
        try:
            if hasattr(self.fs, "call_s3"):
                self.fs.call_s3("head_bucket", Bucket=self.bucket)
                return True
            return self.fs.exists(self.bucket)
        except FileNotFoundError:
            return False

    def absent(self) -> str:
        """Why nothing is under this prefix: no such bucket, or simply nothing there."""
        if not self.bucket_exists():
            return f"bucket {self.bucket!r} does not exist"
        return "nothing there (no object under this prefix)"


class Folder:
    """A local folder behind Objects' interface: the checkpoint store's one code path runs on
    both. What only a local disk does lives here: every file written is fsynced, a pointer is
    replaced by a rename, a checkpoint is written under a temporary name and published whole by
    one rename (`renames`), the folders are fsynced for a rename to hold, and a streaming writer
    writes the file itself (`sink`: a path, no stream)."""

    local = True
    renames = True
    noun = "file"
    poll_s = 0.05

    def __init__(self, path: str | os.PathLike):
        self.root = Path(os.path.expanduser(os.fspath(path)))

    @property
    def uri(self) -> str:
        return str(self.root)

    def child(self, rel: str) -> Folder:
        return Folder(self.root / rel)

    def name(self, rel: str = "") -> Path:
        return self.root / rel

    def entries(self, rel: str = "") -> dict[str, str]:
        folder = self.root / rel
        if not folder.is_dir():
            return {}
        return {p.name: "directory" if p.is_dir() else "file" for p in folder.iterdir()}

    def sizes(self, rel: str = "") -> dict[str, int]:
        folder = self.root / rel
        if not folder.is_dir():
            return {}
        return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def read(self, rel: str) -> bytes:
        try:
            return (self.root / rel).read_bytes()
        except (IsADirectoryError, NotADirectoryError):
            raise FileNotFoundError(str(self.root / rel)) from None

    def write(self, rel: str, data: bytes) -> None:
        """Written in place and fsynced (its folder is published later by a rename)."""
        write_durable(self.root / rel, data)

    def replace(self, rel: str, data: bytes) -> None:
        atomic_write(self.root / rel, data)

    def sink(self, rel: str):
        return self.root / rel, None

    def describe(self, rel: str) -> dict:
        path = self.root / rel
        fsync_path(path)
        return {"size": path.stat().st_size, "sha256": self.sha256(rel)}

    def sha256(self, rel: str) -> str:
        return sha256_file(self.root / rel)

    def write_folder(self, rel: str, fill) -> dict[str, dict]:
        folder = self.root / rel
        folder.mkdir(parents=True, exist_ok=True)
        fill(str(folder))
        files = [str(p.relative_to(self.root)) for p in sorted(folder.rglob("*")) if p.is_file()]
        return {f: self.describe(f) for f in files}

    def make_folder(self, rel: str) -> None:
        (self.root / rel).mkdir(parents=True)
        fsync_path(self.root)

    def local_copy(self, names: list[str]):
        """(the folder itself)"""
        return contextlib.nullcontext(str(self.root))

    def sync(self, rel: str = "", tree: bool = True) -> None:
        """fsync the folder (and, with `tree`, every folder below): what a rename needs to hold."""
        top = self.root / rel
        for folder in sorted({p.parent for p in top.rglob("*") if p.is_file()} | {top}) if tree else [top]:
            fsync_path(folder)

    def rename(self, rel: str, dest_rel: str) -> Path:
        """Publish a finished folder whole (an earlier one of that name is replaced)."""
        return replace_dir(self.root / rel, self.root / dest_rel)

    def move_aside(self, names: list[str], dest_rel: str) -> Path:
        """Move each of `names` (files or folders directly under this one) to dest_rel/NAME,
        each with one rename; returns that folder."""
        dest = self.root / dest_rel.strip("/")
        dest.mkdir(parents=True, exist_ok=True)
        for name in names:
            target = dest / name
            if target.exists():  # two fresh starts within one second: keep both
                target = dest / f"{name}.{time.time_ns()}"
            os.rename(self.root / name, target)
        return dest

    def retire(self, rel: str, commit: str) -> str:
        """Renamed out of sight first, so a crash mid-delete never leaves a half-deleted
        checkpoint (the next start removes the `.tmp-del-*` leftover); `commit` is for a store."""
        doomed = f"{TMP_PREFIX}del-{Path(rel).name}.{uuid.uuid4().hex[:8]}"
        os.rename(self.root / rel, self.root / doomed)
        return doomed

    def delete(self, rel: str) -> None:
        (self.root / rel).unlink(missing_ok=True)

    def delete_tree(self, rel: str) -> None:
        path = self.root / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def bucket_exists(self) -> bool:
        return True

    def absent(self) -> str:
        return "nothing there (an empty folder)" if self.root.is_dir() else "not a directory"


@contextlib.contextmanager
def output_folder(where: str | os.PathLike, commits: tuple[str, ...], staging: str | os.PathLike | None = None):
    """The local folder a command writes its output in (an export, an import): `where` itself for
    a path (the writer publishes it with its own rename), or a folder under `staging` that goes
    up once it is complete (`upload_folder`, `commits` last: a URI, as an object store has no rename)."""
    if not is_uri(where):
        yield Path(os.path.expanduser(os.fspath(where)))
        return
    with tempfile.TemporaryDirectory(prefix="loomtrain-out-", dir=staging) as tmp:
        yield Path(tmp) / "out"
        upload_folder(Path(tmp) / "out", str(where).rstrip("/"), commits)


def local_folder(where: str | os.PathLike, fetch, local=Path) -> Path:
    """A local folder for the location `where`: `local(path)` of a path (the folder itself), or
    what `fetch(uri)` makes of a URI's objects on this host (a verified copy in a cache, ...)."""
    return fetch(str(where)) if is_uri(where) else Path(local(where))


def file_entry(data: bytes) -> dict:
    """A manifest's entry for a file written from memory: its size and sha256."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def location(where: str | os.PathLike, what: str = "location") -> Objects | Folder:
    """The backend for a location: a Folder for a local path, Objects for a URI (`what` names
    the option in a one-line error for a URI whose scheme is unknown)."""
    return Objects(str(where), what) if is_uri(where) else Folder(where)


def below(where: str | os.PathLike, rel: str = "") -> Path | str:
    """A location, or one below it, as the store names it: a Path for a local path, a URI
    string (no trailing slash) for an object store."""
    if is_uri(where):
        return join(where, rel) if rel else str(where).rstrip("/")
    return Path(where) / rel


def absolute(where: str) -> str:
    """A location as a process in another working directory reads it: a path made absolute
    (`~` expanded), a URI (or nothing) as it is."""
    if not where or is_uri(where):
        return where
    return str(Path(os.path.expanduser(os.fspath(where))).absolute())


def canonical(where: str | os.PathLike) -> str:
    """A location's one spelling: a URI without its trailing slash, a path resolved (absolute,
    `~` expanded, links followed)."""
    if is_uri(where):
        return str(where).rstrip("/")
    return str(Path(os.path.expanduser(os.fspath(where))).resolve())


def same_location(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return canonical(a) == canonical(b)  # a path's spelling starts with /, a URI's with its scheme


def inside(where: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Is `where` the location `root` or one below it?"""
    w, r = canonical(where), canonical(root)
    return w == r or w.startswith(r.rstrip("/") + "/")  # (a path and a URI: never, as same_location)


class Upload:
    """An object written as a stream: `write(bytes)` as they are made, `close()` when done
    (the object appears then, whole), `abort()` on failure (nothing appears).

    On S3 the bytes go up as a multipart upload whose parts (PART_BYTES) are sent by the
    process' transfer pool, at most UPLOADS_IN_FLIGHT of this object's at a time: the caller keeps
    producing the next part while the previous ones travel, and memory stays bounded. A file
    smaller than one part is one PUT. Other stores get fsspec's buffered writer."""

    def __init__(self, fs, key: str, part_bytes: int = PART_BYTES, in_flight: int = UPLOADS_IN_FLIGHT):
        self.fs, self.key = fs, key
        self.part_bytes, self.size = part_bytes, 0
        self._buffer = bytearray()
        self._parts: list[Future] = []
        self._slots = threading.BoundedSemaphore(in_flight)
        self._upload_id = None
        self._file = None
        if hasattr(fs, "call_s3") and hasattr(fs, "split_path"):
            bucket, name, _ = fs.split_path(key)
            self._object = {"Bucket": bucket, "Key": name}  # what every multipart request names
        else:
            _parent_folder(fs, key)  # file:// has folders to make
            self._file = fs.open(key, "wb", block_size=part_bytes)

    def write(self, data) -> None:
        self.size += len(data)
        if self._file is not None:
            self._file.write(data)
            return
        view = memoryview(data).cast("B")
        while len(view):  # each byte is copied once, into the part it travels in
            room = self.part_bytes - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) == self.part_bytes:
                part, self._buffer = self._buffer, bytearray()
                self._send(part)

    def _send(self, part: bytes | bytearray) -> None:
        if self._upload_id is None:
            self._upload_id = self.fs.call_s3("create_multipart_upload", **self._object)["UploadId"]
        number = len(self._parts) + 1
        self._slots.acquire()  # at most `in_flight` parts of this object held and travelling

        def send() -> dict:
            try:
                out = self.fs.call_s3(
                    "upload_part", **self._object, PartNumber=number, UploadId=self._upload_id, Body=part
                )
                return {"PartNumber": number, "ETag": out["ETag"]}
            finally:
                self._slots.release()

        self._parts.append(transfer_pool().submit(send))

    def close(self) -> int:
        """Complete the object; returns its size."""
        if self._file is not None:
            self._file.close()
            return self.size
        if self._upload_id is None:  # smaller than a part: one PUT
            self.fs.pipe_file(self.key, bytes(self._buffer))
            self._buffer = bytearray()
            return self.size
        if self._buffer:
            part, self._buffer = self._buffer, bytearray()
            self._send(part)
        try:
            parts = [p.result() for p in self._parts]
        except BaseException:
            self.abort()
            raise
        upload = {"UploadId": self._upload_id, "MultipartUpload": {"Parts": parts}}
        self.fs.call_s3("complete_multipart_upload", **self._object, **upload)
        self.fs.invalidate_cache()
        return self.size

    def abort(self) -> None:
        """Drop what was sent (a failed write leaves no object and no parts billed)."""
        if self._file is not None:
            with contextlib.suppress(Exception):  # best effort: the write already failed
                if hasattr(self._file, "discard"):
                    self._file.discard()
            return
        for p in self._parts:
            with contextlib.suppress(Exception):
                p.result()
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", **self._object, UploadId=self._upload_id)
            self._upload_id = None
