"""Token shards in object storage (data.path / data.sources[].path given as a URI such as
s3://bucket/ds): read in place with ranged reads of just the windows a rank needs.

A rank never downloads a split. It reads its own samples' windows (tokens [i*T, i*T + T + 1), or
a packed window), one ranged GET each (two where a window crosses shard files), and only the
small files whole: index.json, tokenizer.json and, when documents are packed, {split}.docs.bin.

    PinnedObject(fs, path, uri, info, what)   one object of a shard directory, pinned to the size
                                              and ETag listed; shards.ShardSet reads a split in
                                              object storage through these
    WindowCache(capacity_bytes)               the windows fetched ahead (a pool of threads) and,
                                              after use, kept up to capacity_bytes (LRU)

Read-ahead: the stream asks for the windows of its next batches (TokenStream._read_ahead) before
it builds one, so in the steady state a batch finds its windows fetched. The cache holds those
and, within data.cache_bytes, windows already read (a later epoch over a small split costs no GET).

Verification: when a split is opened, one listing of the directory gives every object's size,
checked against the index (a shard: num_tokens x itemsize; a loss mask: one byte per token), and
its ETag; every ranged read of a shard is conditional on that ETag where the store can do it
(S3: If-Match), so a shard deleted or rewritten during the run is one DataError line naming it,
never a batch of mixed bytes. Elsewhere a short read is caught the same way.
"""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from loomtrain.data_pipeline.shards import DataError
from loomtrain.storage import below, first_line, listing, location

FETCH_THREADS = 16  # ranged GETs in flight per stream: a GET's latency, not bandwidth, bounds a window's read


def list_directory(fs, path: str, uri: str) -> dict[str, dict]:
    """{object name: fsspec info (size, ETag, ...)} of the objects directly under `path`, listed afresh."""
    try:
        found = listing(fs, path, recursive=False)
    except Exception as exc:  # no credentials, no bucket, no connection: the library's own types
        raise DataError(f"{uri}: cannot list the shard directory ({first_line(exc)})") from None
    return {name: info for name, info in found.items() if info.get("type") == "file"}


def load_shard_tokenizer(shard_dir):
    """The tokenizer a shard directory holds (its tokenizer.json, and tokenizer_config.json when
    there is one: a chat template), a folder or a URI alike."""
    from loomtrain.data_pipeline.tokenizer import CHAT_CONFIG, load_tokenizer

    objs = location(shard_dir, "data.path")
    try:
        if "tokenizer.json" not in objs.entries():
            raise DataError(f"{below(shard_dir, 'tokenizer.json')}: not found (the shard directory's tokenizer)")
        with objs.local_copy(["tokenizer.json", CHAT_CONFIG]) as folder:
            return load_tokenizer(folder)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001  (the store's own error: no credentials, no bucket)
        raise DataError(f"{shard_dir}: cannot read the shard directory's tokenizer ({first_line(exc)})") from None


class WindowCache:
    """Byte windows of PinnedObjects, by (object URI, start, end): fetched ahead on a pool of
    threads (`ahead`), read once (`get`: waits for a window in flight, fetches one not asked for),
    then kept for reuse, least recently used first out, while everything held (fetched ahead and
    kept) stays within capacity_bytes; 0 keeps nothing beyond the windows fetched ahead."""

    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self._lock = threading.Lock()
        self._ahead: dict[tuple, Future] = {}  # fetched ahead (or in flight), not yet read
        self._ahead_bytes = 0
        self._kept: OrderedDict[tuple, bytes] = OrderedDict()  # read, kept for reuse
        self._kept_bytes = 0
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="loomtrain-fetch")
        # What tests and benchmarks read: bytes and GETs fetched, the most bytes held at once,
        # reads served from the cache, reads that had to wait for their window.
        self.fetched_bytes = self.fetches = self.peak_bytes = self.hits = self.waits = 0

    @property
    def held_bytes(self) -> int:
        return self._ahead_bytes + self._kept_bytes

    @property
    def in_flight(self) -> int:
        """Windows asked for ahead and not fetched yet."""
        with self._lock:
            return sum(not f.done() for f in self._ahead.values())

    def _count(self, data: bytes) -> bytes:
        with self._lock:
            self.fetched_bytes += len(data)
            self.fetches += 1
        return data

    def ahead(self, obj: PinnedObject, start: int, end: int) -> None:
        """Start fetching bytes [start, end) of `obj` unless they are held already."""
        key = (obj.uri, start, end)
        with self._lock:
            if key in self._ahead or key in self._kept:
                return
            self._ahead[key] = self._pool.submit(lambda: self._count(obj.fetch(start, end)))
            self._ahead_bytes += end - start
            self._trim()

    def get(self, obj: PinnedObject, start: int, end: int) -> bytes:
        """Bytes [start, end) of `obj`: fetched ahead, kept, or fetched now."""
        key = (obj.uri, start, end)
        with self._lock:
            future = self._ahead.get(key)
            if future is None and key in self._kept:
                self._kept.move_to_end(key)
                self.hits += 1
                return self._kept[key]
        if future is None:
            data = self._count(obj.fetch(start, end))
        else:
            if not future.done():
                with self._lock:
                    self.waits += 1
            data = future.result()  # a DataError raised by fetch() comes out here
        with self._lock:
            if self._ahead.pop(key, None) is not None:
                self._ahead_bytes -= end - start
            if self.capacity > 0 and key not in self._kept:
                self._kept[key] = data
                self._kept_bytes += len(data)
            self._trim()
        return data

    def _trim(self) -> None:
        while self._kept and self.held_bytes > self.capacity:
            _, data = self._kept.popitem(last=False)
            self._kept_bytes -= len(data)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def drop_ahead(self) -> None:
        """Forget the windows fetched ahead (the stream moved elsewhere: a loaded state)."""
        with self._lock:
            for future in self._ahead.values():
                future.cancel()
            self._ahead.clear()
            self._ahead_bytes = 0

    def close(self) -> None:
        self.drop_ahead()
        self._pool.shutdown(wait=False, cancel_futures=True)


class PinnedObject:
    """One object of a shard directory, pinned to the size and ETag the listing gave."""

    def __init__(self, fs, path: str, uri: str, info: dict, what: str):
        self.fs, self.path, self.uri, self.what = fs, path, uri, what
        self.size = int(info.get("size") or 0)
        self.etag = info.get("ETag") or info.get("etag")
        self._reader = None
        self._lock = threading.Lock()

    def _range_reader(self):
        """(start, end) -> bytes, opened on the first read. The object must still be the one
        listed (its ETag, else its size); with s3fs the open file's ranged fetches then carry
        If-Match: that ETag, so a later change fails a read instead of giving the new bytes."""
        with self._lock:
            if self._reader is None:
                f = self.fs.open(self.path, "rb", cache_type="none")
                details = getattr(f, "details", None) or self.fs.info(self.path)
                etag = details.get("ETag") or details.get("etag")
                if (etag or self.etag) != self.etag or int(details.get("size") or 0) != self.size:
                    f.close()
                    raise DataError(
                        f"{self.what} {self.uri} changed during the run (listed as {self.size} bytes, ETag "
                        f"{self.etag}; now {details.get('size')} bytes, ETag {etag}); {self.fix}"
                    )
                # Only s3fs' fetch is stateless (safe from the fetch threads at once) and pinned.
                fetch = getattr(f, "_fetch_range", None)
                if fetch is not None and self.etag and getattr(f, "read_kw", {}).get("IfMatch") == self.etag:
                    self._reader = fetch
                else:
                    f.close()
                    self._reader = lambda a, b: self.fs.cat_file(self.path, start=a, end=b)
            return self._reader

    fix = "restore it, or re-run `loomtrain preprocess` and start the run again"

    def fetch(self, start: int, end: int) -> bytes:
        fix = self.fix
        try:
            data = self._range_reader()(start, end)
        except FileNotFoundError:
            raise DataError(
                f"{self.what} {self.uri} disappeared during the run (it was listed with {self.size} bytes); {fix}"
            ) from None
        except Exception as exc:
            if isinstance(exc, OSError) and (exc.errno == errno.EBUSY or type(exc).__name__ == "FileExpired"):
                raise DataError(  # If-Match failed
                    f"{self.what} {self.uri} changed during the run (its ETag is no longer {self.etag}); {fix}"
                ) from None
            raise DataError(f"{self.what} {self.uri}: cannot read bytes [{start}, {end}) ({first_line(exc)})") from None
        if len(data) != end - start:
            raise DataError(
                f"{self.what} {self.uri} changed during the run: bytes [{start}, {end}) came back as "
                f"{len(data)} bytes (the listing gave {self.size}); {fix}"
            )
        return data


__all__ = ["PinnedObject", "WindowCache", "load_shard_tokenizer"]
