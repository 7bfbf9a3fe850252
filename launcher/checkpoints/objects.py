"""Checkpoint bytes in an object store (run.storage=s3://bucket/prefix, or any URI fsspec knows):
the few operations the checkpoint store and its readers need, over an fsspec filesystem.

    Objects(uri)                 a prefix: child paths, listings that never trust a cache,
                                 whole-object reads and writes, recursive deletes
    Objects.upload(rel)          a streaming upload: the caller writes bytes as it makes them;
                                 on S3 a multipart upload with UPLOADS_IN_FLIGHT parts of
                                 PART_BYTES sent at once by a small thread pool, elsewhere
                                 fsspec's own buffered writer (its block size = PART_BYTES)

An object store has no rename and no directories: a prefix exists while an object lies under
it, and an object appears whole when its upload completes (never half-written). Listings go to
the server every time (fsspec caches them per process; another rank's writes would be missed).

Credentials and the endpoint come from the library's standard chain (loomtrain.storage).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from loomtrain.storage import object_store

# A multipart upload sends parts of this size (S3 wants >= 5 MiB but the last), several at once.
PART_BYTES = 16 << 20
UPLOADS_IN_FLIGHT = 4

_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _upload_pool() -> ThreadPoolExecutor:
    """One small pool of part uploaders per process (made anew in a forked child)."""
    import os

    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(2 * UPLOADS_IN_FLIGHT, thread_name_prefix="checkpoint-upload"))
        return _pool[1]


class Objects:
    """The objects under one URI prefix."""

    def __init__(self, uri: str, what: str = "run.storage"):
        self.fs, self.path = object_store(uri, what)
        self.path = self.path.rstrip("/")
        self.uri = uri.rstrip("/")

    def child(self, rel: str) -> Objects:
        out = object.__new__(Objects)
        out.fs, out.path, out.uri = self.fs, self._key(rel), f"{self.uri}/{rel.strip('/')}"
        return out

    def _key(self, rel: str) -> str:
        return f"{self.path}/{rel.strip('/')}" if rel else self.path

    def name(self, rel: str = "") -> str:
        """The URI of an object or prefix below (for messages and pointers)."""
        return f"{self.uri}/{rel.strip('/')}" if rel else self.uri

    # Listing ------------------------------------------------------------------------------
    def entries(self, rel: str = "") -> dict[str, str]:
        """{name: "file" | "directory"} directly under a prefix (empty when there is none)."""
        self.fs.invalidate_cache()
        try:
            listed = self.fs.ls(self._key(rel), detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        base = self._key(rel) + "/"
        out = {}
        for e in listed:
            name = e["name"].rstrip("/")
            if name.startswith(base):
                out[name[len(base) :]] = e.get("type", "file")
        return out

    def sizes(self, rel: str = "") -> dict[str, int]:
        """{relative path: size} of every object below a prefix (one recursive listing)."""
        self.fs.invalidate_cache()
        base = self._key(rel) + "/"
        try:
            found = self.fs.find(self._key(rel), detail=True)
        except FileNotFoundError:
            return {}
        return {k[len(base) :]: int(v.get("size") or 0) for k, v in found.items() if k.startswith(base)}

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
        self.fs.pipe_file(self._key(rel), bytes(data))

    def upload(self, rel: str) -> Upload:
        return Upload(self.fs, self._key(rel))

    def delete(self, rel: str) -> None:
        try:
            self.fs.rm_file(self._key(rel))
        except FileNotFoundError:
            pass

    def delete_tree(self, rel: str) -> None:
        """Every object below a prefix."""
        self.fs.invalidate_cache()
        try:
            self.fs.rm(self._key(rel), recursive=True)
        except FileNotFoundError:
            pass

    def copy_tree(self, rel: str, dest_rel: str) -> None:
        self.fs.invalidate_cache()
        self.fs.copy(self._key(rel), self._key(dest_rel), recursive=True)


class Upload:
    """An object written as a stream: `write(bytes)` as they are made, `close()` when done
    (the object appears then, whole), `abort()` on failure (nothing appears).

    On S3 the bytes go up as a multipart upload whose parts (PART_BYTES) are sent by the
    process' upload pool, at most UPLOADS_IN_FLIGHT of this object's at a time: the caller keeps
    producing the next part while the previous ones travel, and memory stays bounded. A file
    smaller than one part is one PUT. Other stores get fsspec's buffered writer."""

    def __init__(self, fs, key: str, part_bytes: int = PART_BYTES, in_flight: int = UPLOADS_IN_FLIGHT):
        self.fs, self.key = fs, key
        self.part_bytes, self.size = part_bytes, 0
        self._s3 = hasattr(fs, "call_s3") and hasattr(fs, "split_path")
        self._buffer = bytearray()
        self._parts: list[Future] = []
        self._slots = threading.BoundedSemaphore(in_flight)
        self._upload_id = None
        self._file = None if self._s3 else fs.open(key, "wb", block_size=part_bytes)

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
        bucket, key, _ = self.fs.split_path(self.key)
        if self._upload_id is None:
            self._upload_id = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        number = len(self._parts) + 1
        self._slots.acquire()  # at most `in_flight` parts of this object held and travelling

        def send() -> dict:
            try:
                out = self.fs.call_s3(
                    "upload_part", Bucket=bucket, Key=key, PartNumber=number, UploadId=self._upload_id, Body=part
                )
                return {"PartNumber": number, "ETag": out["ETag"]}
            finally:
                self._slots.release()

        self._parts.append(_upload_pool().submit(send))

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
        bucket, key, _ = self.fs.split_path(self.key)
        self.fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        )
        self.fs.invalidate_cache()
        return self.size

    def abort(self) -> None:
        """Drop what was sent (a failed write leaves no object and no parts billed)."""
        if self._file is not None:
            try:
                self._file.discard() if hasattr(self._file, "discard") else None
            except Exception:  # noqa: BLE001  (best effort: the write already failed)
                pass
            return
        for p in self._parts:
            try:
                p.result()
            except Exception:  # noqa: BLE001
                pass
        if self._upload_id is not None:
            bucket, key, _ = self.fs.split_path(self.key)
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=self._upload_id)
            except Exception:  # noqa: BLE001
                pass
            self._upload_id = None
