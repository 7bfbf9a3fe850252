"""One split of a shard directory, read as one token sequence (ShardSet), from a local folder or
an object store by one code path: shards.py gives it the index and its checks, remote.py the
object-store pieces (pinned objects, the window cache)."""

from __future__ import annotations

import os

import numpy as np
from loomtrain.data_pipeline.remote import PinnedObject, WindowCache, list_directory
from loomtrain.data_pipeline.shards import DataError, check_tokenizer_hash, read_index
from loomtrain.storage import below, first_line, location


def _any_target(mask: np.ndarray, chunk: int = 1 << 24) -> bool:
    """Does a loss mask hold a 1? Read a chunk at a time, stopping at the first (at once in real data)."""
    return any(mask[i : i + chunk].any() for i in range(0, mask.size, chunk))


class ShardSet:
    """One split of a shard directory as a single token sequence, a folder or a URI alike:
    memory-mapped from a local folder; from an object store, read window by window with ranged
    GETs (remote.py: each object pinned to the size and ETag listed at open), `cache` being the
    stream's WindowCache (shared by its sources; without one, reads are fetched as they come).
    Sizes are checked against the index when the split is opened, ids on every read."""

    def __init__(
        self,
        shard_dir: str | os.PathLike,
        split: str = "train",
        expected_tokenizer_hash: str | None = None,
        cache=None,
    ):
        self.index = read_index(shard_dir)
        self.dir = below(shard_dir)
        self._objs = location(shard_dir, "data.path")
        self.local = self._objs.local
        check_tokenizer_hash(self.index, self.dir, expected_tokenizer_hash)
        if split not in self.index["splits"]:
            raise DataError(f"{self.dir}: no split {split!r} (has {', '.join(self.index['splits'])})")
        self.split = split
        self.dtype = np.dtype(self.index["dtype"])
        self._le = "<" + self.dtype.str[1:]
        self.tokenizer_hash = self.index["tokenizer"]["hash"]
        self.eos_id = self.index["tokenizer"]["eos_id"]
        self.vocab_size = self.index["tokenizer"]["vocab_size"]
        # Ids the dtype can hold but the vocabulary cannot are checked on every read.
        self._check_ids = np.iinfo(self.dtype).max >= self.vocab_size
        if not self.local:
            self.cache = cache if cache is not None else WindowCache(0)
            self._own_cache = cache is None
        info = self.index["splits"][split]
        listed = self._listing()
        self.segments: list = []  # per shard file with tokens: a memory map, or a pinned object
        self.files: list = []
        for shard in info["shards"]:
            bytes_ = shard["num_tokens"] * self.dtype.itemsize
            says = f"{shard['num_tokens']} tokens = {bytes_} bytes"
            segment = self._segment(listed, shard["file"], bytes_, "shard", says, self._le)
            if shard["num_tokens"]:
                self.segments.append(segment)
                self.files.append(below(shard_dir, shard["file"]))
        sizes = np.array([shard["num_tokens"] for shard in info["shards"] if shard["num_tokens"]], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self.starts[-1])
        if self.num_tokens != info["num_tokens"]:
            raise DataError(
                f"{self.dir}: split {split!r} shards hold {self.num_tokens} tokens, index says {info['num_tokens']}"
            )
        self.records = self.index.get("records", "text")  # version 1: text
        self.mask = None  # 1 = target, a segment of one byte per token; None: every token is a target
        if "loss_mask" in info:
            says = f"{self.num_tokens} bytes (one per token)"
            self.mask = self._segment(listed, info["loss_mask"], self.num_tokens, "loss mask", says, np.uint8)
            # It would train on nothing (loss 0.0000, ppl 1.00); read whole only where it is local.
            if self.local and self.num_tokens and not _any_target(self.mask):
                raise DataError(
                    f"{self.dir}: split {split!r} has no target tokens (its loss mask "
                    f"{below(shard_dir, info['loss_mask'])} is all zeros): nothing to train or evaluate on; "
                    "preprocess records with assistant replies, or with --train-on-prompt"
                )
        self._doc_starts: np.ndarray | None = None

    def _listing(self) -> dict[str, dict]:
        """{file name: its info (size; in an object store its ETag)} of the directory, one listing."""
        if self.local:
            return {name: {"size": size} for name, size in self._objs.sizes().items() if "/" not in name}
        self._fs, self._path = self._objs.fs, self._objs.path  # the filesystem read_index's check opened
        return list_directory(self._fs, self._path, str(self.dir))

    def _segment(self, listed: dict, name: str, expected: int, what: str, says: str, dtype):
        found = listed.get(name)
        actual = int(found.get("size") or 0) if found is not None else None
        if actual != expected:
            raise DataError(
                f"{what} {below(self.dir, name)} is {'missing' if found is None else 'truncated or corrupt'}: "
                f"index says {says}, the {self._objs.noun} has {actual if actual is not None else 0} bytes"
            )
        if self.local:  # memory-mapped: a read touches only its pages
            return np.memmap(self._objs.name(name), dtype=dtype, mode="r") if expected else np.zeros(0, dtype)
        return PinnedObject(self._fs, f"{self._path}/{name}", str(below(self.dir, name)), found, what)

    @property
    def doc_starts(self) -> np.ndarray:
        """int64 start offset of every document of the split (from {split}.docs.bin, starting at 0),
        read once; DataError when they are missing or incomplete."""
        if self._doc_starts is None:
            info = self.index["splits"][self.split]
            name = info.get("doc_offsets")
            data = None
            if name:
                try:
                    data = self._objs.read(name)
                except FileNotFoundError:
                    pass
                except Exception as exc:  # noqa: BLE001  (the store's own error)
                    raise DataError(f"{below(self.dir, name)}: cannot read it ({first_line(exc)})") from None
            if data is None or len(data) != 8 * info.get("num_docs", -1):
                where = below(self.dir, name) if name else "no doc_offsets in the index"
                raise DataError(
                    f"{self.dir}: split {self.split!r} has no complete document offsets ({where}); "
                    "re-run `loomtrain preprocess`"
                )
            starts = np.frombuffer(data, dtype="<u8").astype(np.int64)
            self._doc_starts = starts if starts.size and starts[0] == 0 else np.concatenate([[0], starts])
        return self._doc_starts

    # Reading ------------------------------------------------------------------
    def _pieces(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """Tokens [start, start + length) as (segment number, first token, end token) per shard crossed."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"token range [{start}, {start + length}) outside split of {self.num_tokens}")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset, need, out = start - int(self.starts[i]), length, []
        while need:
            take = min(need, int(self.starts[i + 1] - self.starts[i]) - offset)
            out.append((i, offset, offset + take))
            need -= take
            i, offset = i + 1, 0
        return out

    def _items(self, segment, a: int, b: int, dtype) -> np.ndarray:
        """Items [a, b) of a segment (shard or loss mask): from its memory map, or fetched through the cache."""
        if self.local:
            return segment[a:b]
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self.cache.get(segment, a * size, b * size), dtype=dtype)

    def read(self, start: int, length: int) -> np.ndarray:
        """A copy of tokens [start, start + length) of the split, crossing shard files as needed."""
        parts = []
        for i, a, b in self._pieces(start, length):
            part = np.array(self._items(self.segments[i], a, b, self._le), dtype=self.dtype)
            if self._check_ids:
                self._in_vocabulary(i, a, part)
            parts.append(part)
        if not parts:
            return np.zeros(0, self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """uint8 [length]: 1 where token start + i is a target (all ones without a loss mask)."""
        if self.mask is None:
            return np.ones(length, dtype=np.uint8)
        if not length:  # (an object store is not asked for no bytes)
            return np.zeros(0, np.uint8)
        return np.array(self._items(self.mask, start, start + length, np.uint8))

    def prefetch(self, start: int, length: int) -> None:
        """Fetch tokens [start, start + length) ahead from an object store (read() then finds them)."""
        if not self.local:
            size = self.dtype.itemsize
            for i, a, b in self._pieces(start, length):
                self.cache.ahead(self.segments[i], a * size, b * size)

    def prefetch_mask(self, start: int, length: int) -> None:
        if not self.local and self.mask is not None and length:
            self.cache.ahead(self.mask, start, start + length)

    def check_ids(self, chunk_tokens: int = 1 << 24) -> None:
        """Scan the whole split for ids >= the vocabulary size (DataError naming file and offset);
        in an object store ids are checked on every read instead (a scan would download the split)."""
        if not self._check_ids or not self.local:
            return
        for i, arr in enumerate(self.segments):
            for lo in range(0, arr.size, chunk_tokens):
                self._in_vocabulary(i, lo, arr[lo : lo + chunk_tokens])

    def _in_vocabulary(self, i: int, start: int, tokens: np.ndarray) -> None:
        """`tokens` (from token `start` of segment i) hold no id >= the vocabulary size, else DataError."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            offset = start + int(np.flatnonzero(np.asarray(tokens) >= self.vocab_size)[0])
            token = int(tokens[offset - start])
            raise DataError(
                f"{self.files[i]}: token id {token} at token offset {offset} (byte {offset * self.dtype.itemsize}) "
                f"is >= the vocabulary size {self.vocab_size}; the shard is corrupt or was made by another tokenizer"
            )

    def close(self) -> None:
        # Drop the maps; numpy unmaps each file when its last view is gone
        # (closing the mmap by hand while a view lives would crash the process).
        self.segments = []
        if not self.local and self._own_cache:
            self.cache.close()
