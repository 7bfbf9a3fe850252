"""The on-disk token shard format: writing (atomic, streaming) and reading
(memory-mapped, verified against the index).

A shard directory holds
  index.json            written last; its presence means the directory is complete
  tokenizer.json        the tokenizer that made the shards (see tokenizer.py)
  {split}_{i:05d}.bin   flat little-endian token arrays (uint16 when the vocabulary
                        fits, else uint32); a split's tokens are its shards in order,
                        documents separated by EOS and free to span shard files
  {split}.docs.bin      uint64 start offset of every document in the split's token
                        stream (kept out of index.json so the index stays small
                        whatever the corpus size)
  {split}.mask.bin      (version 2, instruction and chat data only) one uint8 per token of
                        the split: 1 where the token is a target of the loss, 0 where it is
                        not (a prompt); without it every token is a target

index.json:
  {"format": "loomtrain-shards", "version": 2, "dtype": "uint16",
   "records": "text" | "prompt-response" | "chat",   (version 2; version 1 shards are text)
   "tokenizer": {"hash", "name", "vocab_size", "eos_id", "file"},
   "splits": {"train": {"num_tokens", "num_docs", "doc_offsets": "train.docs.bin",
                        "shards": [{"file", "num_tokens"}, ...]},
                        "loss_mask": "train.mask.bin" (version 2, masked records only)},
              "val": {...}},
   "split": {"val_fraction", "seed", "method"}, "stats": {...}, "sources": [...]}
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import numpy as np
from loomtrain.durable import AtomicFile, atomic_write_json
from loomtrain.storage import below, first_line, location

FORMAT = "loomtrain-shards"
VERSION = 2
READS = (1, 2)  # version 1: no loss masks and no "records" (text, every token a target)
INDEX = "index.json"
SPLITS = ("train", "val")


class DataError(Exception):
    """Bad input data or shards; the message is one line naming the file/field."""


def doc_starts_from(data: bytes | None, info: dict, directory, split: str, where) -> np.ndarray:
    """A split's document start offsets (int64, from 0) out of its {split}.docs.bin bytes
    (`data`; None: missing, read from `where`); DataError when they are missing or incomplete."""
    if where is None or data is None or len(data) != 8 * info.get("num_docs", -1):
        raise DataError(
            f"{directory}: split {split!r} has no complete document offsets "
            f"({where or 'no doc_offsets in the index'}); re-run `loomtrain preprocess`"
        )
    starts = np.frombuffer(data, dtype="<u8").astype(np.int64)
    return starts if starts.size and starts[0] == 0 else np.concatenate([[0], starts])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


class SplitWriter:
    """Appends token pieces to one split's shard files; each file is an AtomicFile
    (temp name, fsynced, renamed into place when full or at close)."""

    def __init__(
        self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, masked: bool = False, on_file=None
    ):
        self.dir, self.split, self.dtype, self.shard_tokens = out_dir, split, np.dtype(dtype), int(shard_tokens)
        # on_file(name): called as each file is complete in out_dir (preprocess uploads it meanwhile)
        self.on_file = on_file or (lambda name: None)
        self.shards: list[dict] = []
        self.num_tokens = 0
        self.num_docs = 0
        self._file: AtomicFile | None = None
        self._file_tokens = 0
        self._docs_name = f"{split}.docs.bin"
        self._docs = AtomicFile(out_dir / self._docs_name)
        self._mask_name = f"{split}.mask.bin"
        self._mask = AtomicFile(out_dir / self._mask_name) if masked else None

    def _open(self) -> None:
        self._name = f"{self.split}_{len(self.shards):05d}.bin"
        self._file = AtomicFile(self.dir / self._name)
        self._file_tokens = 0

    def _finish_file(self) -> None:
        if self._file is None:
            return
        self._file.commit()
        self.shards.append({"file": self._name, "num_tokens": self._file_tokens})
        self._file = None
        self.on_file(self._name)

    def start_doc(self) -> None:
        self._docs.write(np.uint64(self.num_tokens).tobytes())
        self.num_docs += 1

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        while tokens.size:
            if self._file is None:
                self._open()
            room = self.shard_tokens - self._file_tokens
            part, tokens = tokens[:room], tokens[room:]
            self._file.write(part.astype("<" + self.dtype.str[1:], copy=False).tobytes())
            self._file_tokens += part.size
            self.num_tokens += part.size
            if self._file_tokens >= self.shard_tokens:
                self._finish_file()

    def write_docs(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Whole documents at once: `lengths` (tokens each) cover `tokens`; `mask` (1 = target,
        one per token) for a writer made with masked=True."""
        if (mask is None) != (self._mask is None):
            raise ValueError(f"{self.split}: a loss mask is {'missing' if mask is None else 'not expected'}")
        if not len(lengths):
            return
        starts = self.num_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        self._docs.write(starts.astype("<u8").tobytes())
        self.num_docs += len(lengths)
        if mask is not None:
            self._mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.write(tokens)

    def close(self) -> dict:
        self._finish_file()
        self._docs.commit()
        self.on_file(self._docs_name)
        info = {
            "num_tokens": self.num_tokens,
            "num_docs": self.num_docs,
            "doc_offsets": self._docs_name,
            "shards": self.shards,
        }
        if self._mask is not None:
            self._mask.commit()
            self.on_file(self._mask_name)
            info["loss_mask"] = self._mask_name
        return info

    def abort(self) -> None:
        for f in (self._file, self._docs, self._mask):
            if f is not None:
                f.discard()


def read_index(shard_dir: str | os.PathLike) -> dict:
    """A shard directory's index (a folder or a URI), checked; what is wrong in one line."""
    try:
        objs = location(shard_dir, "data.path")
        data = objs.read(INDEX)
    except ValueError as exc:  # a URI of an unknown scheme, or its library missing
        raise DataError(str(exc)) from None
    except FileNotFoundError:
        if not objs.entries():
            raise DataError(f"data directory not found: {shard_dir}") from None
        how = "`loomtrain preprocess`" + ("" if objs.local else " --output URI")
        raise DataError(f"{shard_dir} has no {INDEX}: not a complete shard directory (make one with {how})") from None
    except Exception as exc:  # noqa: BLE001  (unreadable, or the store's own error: no credentials, no bucket)
        raise DataError(f"{below(shard_dir, INDEX)}: cannot read it ({first_line(exc)})") from None
    return parse_index(data, below(shard_dir, INDEX))


def parse_index(data: bytes, path) -> dict:
    """index.json's bytes -> the index, checked (format, version, every key the readers use);
    `path` (a file or an object's URI) names it in the errors."""
    try:
        index = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(
            f"{path} is not a loomtrain shard index (format "
            f"{index.get('format') if isinstance(index, dict) else None!r})"
        )
    if index.get("version") not in READS:
        raise DataError(
            f"{path}: shard format version {index.get('version')} is not supported "
            f"(this code reads {', '.join(map(str, READS))})"
        )
    _check_index_keys(index, path)
    return index


def _check_index_keys(index: dict, path) -> None:
    """Every key the readers use is present, so a damaged index is one line naming the key, not a KeyError."""

    def need(obj, key: str, dotted: str, kind):
        if not isinstance(obj, dict) or key not in obj:
            raise DataError(
                f"{path} is missing the key {dotted!r} (not a complete shard index; re-run `loomtrain preprocess`)"
            )
        if not isinstance(obj[key], kind) or isinstance(obj[key], bool):
            raise DataError(f"{path}: key {dotted!r} is {obj[key]!r}, expected a {kind.__name__}")
        return obj[key]

    dtype = need(index, "dtype", "dtype", str)
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"{path}: key 'dtype' is {dtype!r}, expected uint16 or uint32")
    tok = need(index, "tokenizer", "tokenizer", dict)
    need(tok, "hash", "tokenizer.hash", str)
    need(tok, "vocab_size", "tokenizer.vocab_size", int)
    need(tok, "eos_id", "tokenizer.eos_id", int)
    if "records" in index and index["records"] not in ("text", "prompt-response", "chat"):
        raise DataError(f"{path}: key 'records' is {index['records']!r}, expected text, prompt-response or chat")
    for split, info in need(index, "splits", "splits", dict).items():
        if not isinstance(info, dict):
            raise DataError(f"{path}: key 'splits.{split}' is {info!r}, expected a dict")
        need(info, "num_tokens", f"splits.{split}.num_tokens", int)
        if "loss_mask" in info:
            need(info, "loss_mask", f"splits.{split}.loss_mask", str)
        for i, shard in enumerate(need(info, "shards", f"splits.{split}.shards", list)):
            need(shard, "file", f"splits.{split}.shards[{i}].file", str)
            need(shard, "num_tokens", f"splits.{split}.shards[{i}].num_tokens", int)


def check_tokenizer_hash(index: dict, shard_dir, expected: str | None) -> None:
    found = index["tokenizer"]["hash"]
    if expected is not None and found != expected:
        raise DataError(
            f"{shard_dir}: shards were made by tokenizer {found} ({index['tokenizer'].get('name')}), "
            f"but this run's tokenizer is {expected}; re-run `loomtrain preprocess` with the run's tokenizer"
        )


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
            from loomtrain.data_pipeline.remote import WindowCache

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
        from loomtrain.data_pipeline.remote import list_directory, open_store

        fs, path = open_store(str(self.dir))
        self._fs, self._path = fs, path
        return list_directory(fs, path, str(self.dir))

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
        from loomtrain.data_pipeline.remote import PinnedObject

        return PinnedObject(self._fs, f"{self._path}/{name}", str(below(self.dir, name)), found, what)

    @property
    def doc_starts(self) -> np.ndarray:
        """int64 start offset of every document of the split (from {split}.docs.bin), read once."""
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
            self._doc_starts = doc_starts_from(
                data, info, self.dir, self.split, below(self.dir, name) if name else None
            )
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

    def _bytes(self, segment, a: int, b: int) -> bytes:
        """Bytes [a, b) of an object-store segment: fetched ahead, kept, or fetched now."""
        return self.cache.get((segment.uri, a, b), partial(segment.fetch, a, b))

    def _tokens(self, i: int, a: int, b: int) -> np.ndarray:
        segment = self.segments[i]
        if self.local:
            return segment[a:b]
        size = self.dtype.itemsize
        return np.frombuffer(self._bytes(segment, a * size, b * size), dtype=self._le)

    def read(self, start: int, length: int) -> np.ndarray:
        """A copy of tokens [start, start + length) of the split, crossing shard files as needed."""
        parts = []
        for i, a, b in self._pieces(start, length):
            part = np.array(self._tokens(i, a, b), dtype=self.dtype)
            if self._check_ids and part.size and int(part.max()) >= self.vocab_size:
                bad = int(np.flatnonzero(part >= self.vocab_size)[0])
                raise self._bad_id(i, a + bad, int(part[bad]))
            parts.append(part)
        if not parts:
            return np.zeros(0, self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """uint8 [length]: 1 where token start + i is a target (all ones without a loss mask)."""
        if self.mask is None:
            return np.ones(length, dtype=np.uint8)
        if self.local:
            return np.array(self.mask[start : start + length])
        if not length:
            return np.zeros(0, np.uint8)
        return np.frombuffer(self._bytes(self.mask, start, start + length), np.uint8).copy()

    def prefetch(self, start: int, length: int) -> None:
        """Fetch tokens [start, start + length) ahead from an object store (read() then finds them)."""
        if not self.local:
            size = self.dtype.itemsize
            for i, a, b in self._pieces(start, length):
                segment = self.segments[i]
                self.cache.ahead((segment.uri, a * size, b * size), partial(segment.fetch, a * size, b * size))

    def prefetch_mask(self, start: int, length: int) -> None:
        if not self.local and self.mask is not None and length:
            self.cache.ahead((self.mask.uri, start, start + length), partial(self.mask.fetch, start, start + length))

    def check_ids(self, chunk_tokens: int = 1 << 24) -> None:
        """Scan the whole split for ids >= the vocabulary size (DataError naming file and offset);
        in an object store ids are checked on every read instead (a scan would download the split)."""
        if not self._check_ids or not self.local:
            return
        for i, arr in enumerate(self.segments):
            for lo in range(0, arr.size, chunk_tokens):
                part = arr[lo : lo + chunk_tokens]
                if int(part.max()) >= self.vocab_size:
                    bad = lo + int(np.flatnonzero(np.asarray(part) >= self.vocab_size)[0])
                    raise self._bad_id(i, bad, int(arr[bad]))

    def _bad_id(self, i: int, offset: int, token: int) -> DataError:
        return DataError(
            f"{self.files[i]}: token id {token} at token offset {offset} (byte {offset * self.dtype.itemsize}) "
            f"is >= the vocabulary size {self.vocab_size}; the shard is corrupt or was made by another tokenizer"
        )

    def close(self) -> None:
        # Drop the maps; numpy unmaps each file when its last view is gone
        # (closing the mmap by hand while a view lives would crash the process).
        self.segments = []
        if not self.local and self._own_cache:
            self.cache.close()


def write_arrays(
    out_dir: str | os.PathLike,
    splits: dict[str, np.ndarray],
    tokenizer_info: dict,
    shard_tokens: int = 1 << 27,
    dtype=None,
    doc_lengths: dict[str, list[int]] | None = None,
    masks: dict[str, np.ndarray] | None = None,
    records: str | None = None,
) -> dict:
    """Write ready token arrays as a shard directory (synthetic data for tests and
    benchmarks). tokenizer_info: {"hash", "name", "vocab_size", "eos_id"}. Each split is one
    document unless doc_lengths gives its documents' lengths; masks (uint8, 1 = target, per
    token) make a loss-masked split, and records names the data ("chat" by default then)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype) if dtype is not None else token_dtype(tokenizer_info["vocab_size"])
    doc_lengths, masks = doc_lengths or {}, masks or {}
    info = {}
    for split in SPLITS:
        w = SplitWriter(out, split, dtype, shard_tokens, masked=bool(masks))
        tokens = splits.get(split, np.zeros(0, dtype))
        lengths = doc_lengths.get(split, [tokens.size] if tokens.size else [])
        if masks:
            w.write_docs(tokens, np.asarray(lengths, dtype=np.int64), masks.get(split, np.zeros(0, np.uint8)))
        elif tokens.size:
            w.write_docs(tokens, np.asarray(lengths, dtype=np.int64))
        info[split] = w.close()
    index = {
        "format": FORMAT,
        "version": VERSION,
        "records": records or ("chat" if masks else "text"),
        "dtype": dtype.name,
        "tokenizer": {"file": None, **tokenizer_info},
        "splits": info,
        "split": {},
        "stats": {},
        "sources": ["write_arrays"],
    }
    atomic_write_json(out / INDEX, index)
    return index
