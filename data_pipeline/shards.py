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
from pathlib import Path

import numpy as np
from loomtrain.durable import AtomicFile
from loomtrain.storage import below, first_line, location

FORMAT = "loomtrain-shards"
VERSION = 2
READS = (1, 2)  # version 1: no loss masks and no "records" (text, every token a target)
INDEX = "index.json"
SPLITS = ("train", "val")


class DataError(Exception):
    """Bad input data or shards; the message is one line naming the file/field."""


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

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
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
