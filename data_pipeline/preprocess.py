"""`loomtrain preprocess`: text / JSONL / Parquet -> token shards (see shards.py).

Documents: a .jsonl line's text field, a .parquet row's text column, or a
whole .txt (or any other text) file. Every document ends with EOS.

Streaming with bounded memory: the main process reads inputs in work units of
~4 MiB (text files are cut at newlines, so a huge file is one document spread
over several units; with BPE, merges never span such a cut; Parquet is read
batch by batch), at most 2 x workers + 2 units are in flight, and finished
tokens go straight to the shard files. Workers (spawned processes, default:
all cores) decode, parse and tokenize; results are consumed in input order, so
the output does not depend on the number of workers. Inputs under 16 MiB (byte
tokenizer) or 256 KiB (BPE) are done in-process: a pool costs more there.

Validation split, by documents, deterministic: documents are numbered in input
order (globs in the order given, each one's matches sorted); consecutive documents i with
floor(i * val_fraction) == j form stratum j, and one document per stratum,
chosen by a generator seeded with (seed, j), goes to "val". So exactly
floor(n * val_fraction) (+1 at most) documents go to val, spread evenly over
the corpus, and the choice depends only on (fraction, seed, document order).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from loomtrain.data_pipeline.shards import (
    FORMAT, INDEX, SPLITS, VERSION, DataError, SplitWriter, atomic_write_json, token_dtype,
)
from loomtrain.data_pipeline.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

UNIT_BYTES = 4 << 20
PARQUET_BATCH_ROWS = 1024
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB per uint16 shard
_REPLACEMENT = b"\xef\xbf\xbd"


# Inputs -------------------------------------------------------------------
def expand_inputs(patterns: list[str]) -> list[Path]:
    """Globs -> sorted, de-duplicated files; a glob matching nothing is an error."""
    files: dict[str, Path] = {}
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not matches:
            raise DataError(f"input {pattern!r} matches no files")
        for m in matches:
            files.setdefault(os.path.abspath(m), Path(m))
    return list(files.values())


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".jsonl") or name.endswith(".ndjson"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def iter_units(files: list[Path], text_field: str, unit_bytes: int | None = None):
    """Work units, in input order: (kind, path, where, payload, first, last, nbytes)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    for path in files:
        kind = _kind(path)
        if kind == "parquet":
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
            except Exception as exc:
                raise DataError(f"{path}: cannot read as Parquet: {exc}") from None
            names = pf.schema_arrow.names
            if text_field not in names:
                raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); choose one with --text-field")
            rows, size, row = max(1, pf.metadata.num_rows), path.stat().st_size, 0
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
                texts = batch.column(0).to_pylist()
                yield ("texts", str(path), row, texts, True, True, size * len(texts) // rows)
                row += len(texts)
        elif kind == "jsonl":
            with open(path, "rb") as f:
                lines, nbytes, start = [], 0, 1
                for lineno, line in enumerate(f, 1):
                    lines.append(line)
                    nbytes += len(line)
                    if nbytes >= unit_bytes:
                        yield ("jsonl", str(path), start, lines, True, True, nbytes)
                        lines, nbytes, start = [], 0, lineno + 1
                if lines:
                    yield ("jsonl", str(path), start, lines, True, True, nbytes)
        else:
            with open(path, "rb") as f:
                # Read no more than the file holds: a 4 MiB buffer shrunk to a small
                # file's size fragments the heap, and RSS then grows with the corpus.
                left = os.fstat(f.fileno()).st_size
                pending, first = f.read(min(unit_bytes, left)), True
                left -= len(pending)
                while True:
                    more = f.read(min(unit_bytes, left)) if left > 0 else b""
                    left -= len(more)
                    if not more:
                        yield ("text", str(path), 0, pending, first, True, len(pending))
                        break
                    cut = _cut_point(pending)
                    yield ("text", str(path), 0, pending[:cut], first, False, cut)
                    pending, first = pending[cut:] + more, False


def _cut_point(data: bytes) -> int:
    """After the last newline; with none, before the last (maybe partial) UTF-8 character."""
    cut = data.rfind(b"\n") + 1
    if cut:
        return cut
    for back in range(1, min(4, len(data)) + 1):
        b = data[len(data) - back]
        if b < 0x80:
            break
        if b >= 0xC0:
            return len(data) - back or len(data)
    return len(data)


def _decode(raw: bytes) -> tuple[str, int]:
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.count(_REPLACEMENT)


def unit_texts(unit, text_field: str, skip_bad_lines: bool):
    """A unit's documents as strings, plus stats; raises DataError (file:line) on a
    bad JSONL line unless skip_bad_lines."""
    kind, path, where, payload, first, last, _ = unit
    stats = {"bad_lines": 0, "replaced_chars": 0, "empty_docs": 0}
    if kind == "text":
        text, stats["replaced_chars"] = _decode(payload)
        return [text], stats
    texts = []
    if kind == "texts":
        for i, t in enumerate(payload):
            if t is None:
                stats["empty_docs"] += 1
            elif not isinstance(t, str):
                raise DataError(f"{path}: row {where + i}: column {text_field!r} is {type(t).__name__}, not text")
            else:
                texts.append(t)
        return texts, stats
    for lineno, raw in enumerate(payload, where):
        if not raw.strip():
            continue
        line, bad = _decode(raw)
        stats["replaced_chars"] += bad
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
        else:
            value = obj.get(text_field) if isinstance(obj, dict) else None
            if isinstance(value, str):
                texts.append(value)
                continue
            if not isinstance(obj, dict) or text_field not in obj:
                problem = f"no field {text_field!r}"
            else:
                problem = f"field {text_field!r} is {type(value).__name__}, not a string"
        if not skip_bad_lines:
            raise DataError(f"{path}:{lineno}: {problem} (pass --skip-bad-lines to skip and count such lines)")
        stats["bad_lines"] += 1
    return texts, stats


# Workers ------------------------------------------------------------------
_W: dict = {}


def _init_worker(tokenizer, text_field: str, skip_bad_lines: bool) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _W.update(tokenizer=tokenizer, text_field=text_field, skip=skip_bad_lines)


def _tokenize_unit(unit):
    """-> (tokens, piece lengths, first piece continues a document, last piece left open, stats)."""
    tok = _W["tokenizer"]
    kind, first, last = unit[0], unit[4], unit[5]
    texts, stats = unit_texts(unit, _W["text_field"], _W["skip"])
    dtype = token_dtype(tok.vocab_size)
    eos = np.array([tok.eos_id], dtype=dtype)
    if kind == "text":
        cont, open_ = not first, not last
        if first and last and not texts[0]:
            stats["empty_docs"] += 1
            return np.zeros(0, dtype), [], False, False, stats
    else:
        cont = open_ = False
        stats["empty_docs"] += sum(1 for t in texts if not t)
        texts = [t for t in texts if t]
    arrays = tok.encode_batch_np(texts)
    pieces = []
    for i, a in enumerate(arrays):
        pieces.append(a.astype(dtype, copy=False))
        if not (open_ and i == len(arrays) - 1):
            pieces.append(eos)
    lengths = [a.size + (0 if (open_ and i == len(arrays) - 1) else 1) for i, a in enumerate(arrays)]
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    return tokens, lengths, cont, open_, stats


def _ordered_results(units, tokenizer, text_field, skip_bad_lines, workers):
    """Yield (unit nbytes, result) in input order with at most 2*workers+2 units in flight."""
    if workers <= 1:
        _init_worker(tokenizer, text_field, skip_bad_lines)
        for unit in units:
            yield unit[6], _tokenize_unit(unit)
        return
    import multiprocessing as mp

    # spawn, not fork: the caller may be a training process with threads.
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker,
                                       initargs=(tokenizer, text_field, skip_bad_lines)) as pool:
        pending: deque = deque()
        for unit in units:
            pending.append((unit[6], pool.apply_async(_tokenize_unit, (unit,))))
            if len(pending) >= 2 * workers + 2:
                nbytes, res = pending.popleft()
                yield nbytes, res.get()
        while pending:
            nbytes, res = pending.popleft()
            yield nbytes, res.get()


# The validation split ---------------------------------------------------------
class ValSplit:
    """Document i -> val? One document per stratum {i : floor(i*f) == j}, chosen with seed (seed, j)."""

    def __init__(self, fraction: float, seed: int):
        if not 0.0 <= fraction < 1.0:
            raise DataError(f"val fraction must be in [0, 1), got {fraction}")
        self.f, self.seed = float(fraction), int(seed)
        self._stratum, self._pick = -1, -1

    def _key(self, i: int) -> int:
        return math.floor(i * self.f)

    def _start(self, j: int) -> int:
        s = math.ceil(j / self.f)
        while s > 0 and self._key(s - 1) >= j:
            s -= 1
        while self._key(s) < j:
            s += 1
        return s

    def is_val(self, i: int) -> bool:
        if self.f == 0.0:
            return False
        j = self._key(i)
        if j != self._stratum:
            start, end = self._start(j), self._start(j + 1)
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, j])
            self._stratum, self._pick = j, start + int(rng.integers(0, end - start))
        return i == self._pick


# The driver ---------------------------------------------------------------
def preprocess_files(files: list[Path], output: str | os.PathLike, tokenizer="byte", *, text_field: str = "text",
                     val_fraction: float = 0.01, seed: int = 0, workers: int | None = None,
                     skip_bad_lines: bool = False, bpe_vocab_size: int = 4096, progress: bool = True,
                     shard_tokens: int = DEFAULT_SHARD_TOKENS, sources: list[str] | None = None,
                     log=print) -> dict:
    """Tokenize `files` into a shard directory; returns the index. `tokenizer` is
    "byte", "bpe" (trained here on the same files), a tokenizer.json path, or a tokenizer object."""
    from tqdm import tqdm

    if not files:
        raise DataError("no input files")
    workers = (os.cpu_count() or 1) if workers is None else max(1, int(workers))
    splitter = ValSplit(val_fraction, seed)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    old_index = out / INDEX
    if old_index.exists():
        old_index.unlink()  # the directory is incomplete until the new index lands
    total_bytes = sum(p.stat().st_size for p in files)
    t0 = time.perf_counter()

    if isinstance(tokenizer, str) and tokenizer == "bpe":
        if log:
            log(f"training a byte-level BPE (vocab {bpe_vocab_size}) on {len(files)} files ...")
        texts = (t for u in iter_units(files, text_field) for t in unit_texts(u, text_field, True)[0])
        tokenizer = train_bpe(texts, bpe_vocab_size, show_progress=progress and sys.stderr.isatty())
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    # Starting a pool (~1 s) only pays off for bigger inputs; BPE encodes ~100x slower than bytes.
    if total_bytes < (4 * UNIT_BYTES if isinstance(tokenizer, ByteTokenizer) else UNIT_BYTES // 16):
        workers = 1
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: SplitWriter(out, s, dtype, shard_tokens) for s in SPLITS}
    stats = {"files": len(files), "bytes": total_bytes, "bad_lines": 0, "replaced_chars": 0, "empty_docs": 0}
    doc, current = 0, None
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=not progress, file=sys.stderr)
    try:
        units = iter_units(files, text_field)
        for nbytes, (tokens, lengths, cont, _open, st) in _ordered_results(units, tokenizer, text_field, skip_bad_lines, workers):
            for k, v in st.items():
                stats[k] += v
            offset = 0
            for i, n in enumerate(lengths):
                if not (i == 0 and cont):
                    current = writers["val" if splitter.is_val(doc) else "train"]
                    current.start_doc()
                    doc += 1
                current.write(tokens[offset:offset + n])
                offset += n
            bar.update(nbytes)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()
    splits = {s: w.close() for s, w in writers.items()}
    if splits["train"]["num_tokens"] == 0 and splits["val"]["num_tokens"] == 0:
        raise DataError(f"inputs hold no text: {', '.join(sources or [str(p) for p in files[:3]])}")
    tokenizer.save(out)
    index = {
        "format": FORMAT, "version": VERSION, "dtype": dtype.name,
        "tokenizer": {"hash": tokenizer.hash, "name": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                      "eos_id": tokenizer.eos_id, "file": "tokenizer.json"},
        "splits": splits,
        "split": {"val_fraction": val_fraction, "seed": seed, "method": "one document per stratum floor(i*f)"},
        "stats": {**stats, "documents": doc, "seconds": round(time.perf_counter() - t0, 3), "workers": workers},
        "sources": sources or [str(p) for p in files],
    }
    atomic_write_json(out / INDEX, index)
    keep = {sh["file"] for s in splits.values() for sh in s["shards"]}
    for stale in out.glob("*_[0-9][0-9][0-9][0-9][0-9].bin"):
        if stale.name not in keep:
            stale.unlink()
    if log:
        n_tok = sum(s["num_tokens"] for s in splits.values())
        secs = index["stats"]["seconds"]
        log(f"preprocess: {len(files)} files, {doc} documents, {n_tok:,} tokens "
            f"(train {splits['train']['num_tokens']:,} / val {splits['val']['num_tokens']:,}) in {secs:.2f}s "
            f"({n_tok / max(secs, 1e-9):,.0f} tokens/s, {workers} worker(s)) -> {out}"
            + (f"; skipped {stats['bad_lines']} bad lines" if stats["bad_lines"] else "")
            + (f"; replaced {stats['replaced_chars']} invalid UTF-8 sequences" if stats["replaced_chars"] else ""))
        if val_fraction > 0 and splits["val"]["num_docs"] == 0:
            log(f"preprocess: warning: val split is empty ({doc} documents x val_fraction {val_fraction} < 1)")
    return index


def build_parser() -> argparse.ArgumentParser:
    from loomtrain.launcher.config import DataConfig  # defaults come from the run schema

    d = DataConfig()
    p = argparse.ArgumentParser(prog="loomtrain preprocess", description="Tokenize text/JSONL/Parquet into token shards.")
    p.add_argument("--input", nargs="+", required=True, metavar="GLOB", help=".txt/.jsonl/.parquet files (globs; ** allowed)")
    p.add_argument("--output", required=True, metavar="DIR", help="shard directory to write")
    p.add_argument("--tokenizer", default=d.tokenizer, help="byte | bpe (trained on the inputs) | PATH/tokenizer.json")
    p.add_argument("--bpe-vocab-size", type=int, default=d.bpe_vocab_size)
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction)
    p.add_argument("--seed", type=int, default=d.split_seed, help="validation split seed")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count bad JSONL lines instead of failing")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        files = expand_inputs(args.input)
        preprocess_files(
            files, args.output, args.tokenizer, text_field=args.text_field, val_fraction=args.val_fraction,
            seed=args.seed, workers=args.workers, skip_bad_lines=args.skip_bad_lines,
            bpe_vocab_size=args.bpe_vocab_size, progress=not args.no_progress, shard_tokens=args.shard_tokens,
            sources=args.input,
        )
    except DataError as exc:
        print(f"loomtrain preprocess: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
