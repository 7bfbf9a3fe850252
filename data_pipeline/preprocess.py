"""Preprocessing: text / JSONL / Parquet -> token shards (see shards.py); the command is
`loomtrain preprocess` (launcher/cli/preprocess.py).

Documents (documents.py): a .jsonl line's text field, a .parquet row's text
column, or a whole .txt (or any other text) file. Every document ends with EOS. Instruction
and chat records (records.py: --format prompt-response | chat, detected from the first
record) are one document each, with a loss mask beside their tokens ({split}.mask.bin).

Two phases, both in OUTPUT.partial/ (staging.py), published by one rename:
1. Tokenize: each input file becomes a part (its tokens and document lengths),
   marked complete when written; a rerun skips complete parts. Locally, the
   main process reads ~4 MiB work units, at most 2 x workers + 2 in flight
   through a pool of spawned workers (default: all cores; inputs under 16 MiB
   byte-level or 256 KiB BPE are done in-process), results consumed in order,
   written as they come (bounded memory). With an executor (`preprocess --ray`: Ray tasks,
   launcher/cluster/preprocess_tasks.py), each file is a task of that executor.
2. Assemble: the parts, in input order, are cut into shards and split. So the
   output depends on neither workers, Ray, nor which run tokenized which file.

Validation split, by documents, deterministic: documents are numbered in input
order (globs in the order given, each one's matches sorted); consecutive documents i with
floor(i * val_fraction) == j form stratum j, and one document per stratum,
chosen by a generator seeded with (seed, j), goes to "val". So exactly
floor(n * val_fraction) (+1 at most) documents go to val, spread evenly over
the corpus, and the choice depends only on (fraction, seed, document order). A requested split
is never empty: with fewer than 1 / val_fraction documents the first stratum is cut short by the
end of the corpus, and its pick, if it fell beyond the end, wraps into it (pick mod n); a corpus
of one document cannot be split, which is an error.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from functools import partial
from pathlib import Path

import numpy as np
from loomtrain.data_pipeline import documents
from loomtrain.data_pipeline.documents import iter_units, jsonl_values, unit_texts, zero_stats
from loomtrain.data_pipeline.records import TEXT, RecordFormat, check_format, detect_format, record_tokens
from loomtrain.data_pipeline.remote_output import open_output
from loomtrain.data_pipeline.shards import FORMAT, INDEX, SPLITS, VERSION, DataError, SplitWriter, token_dtype
from loomtrain.data_pipeline.staging import Parts, PartWriter, Progress, clear_assembly, open_partial
from loomtrain.data_pipeline.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from loomtrain.durable import atomic_write_json
from tqdm import tqdm

DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB per uint16 shard


# Workers ------------------------------------------------------------------
_W: dict = {}


def _init_worker(tokenizer, text_field: str, skip_bad_lines: bool, records: RecordFormat = TEXT) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _W.update(tokenizer=tokenizer, text_field=text_field, skip=skip_bad_lines, records=records)


def _init_pool_worker(tokenizer, text_field: str, skip_bad_lines: bool, records: RecordFormat = TEXT) -> None:
    # Ctrl-C reaches the whole process group: the parent stops the pool and says what was
    # kept; a worker left to raise KeyboardInterrupt would print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(tokenizer, text_field, skip_bad_lines, records)


def _tokenize_records(unit):
    """A JSONL unit of instruction or chat records -> _tokenize_unit's result, with the loss mask.
    A bad record is one line naming file:line (or skipped and counted with --skip-bad-lines)."""
    tok, fmt = _W["tokenizer"], _W["records"]
    _, path, where, payload, _, _, _ = unit
    stats = zero_stats()
    dtype = token_dtype(tok.vocab_size)
    tokens, masks, lengths = [np.zeros(0, dtype)], [np.zeros(0, np.uint8)], []  # (for a unit with no records)
    for lineno, record, problem in jsonl_values(payload, where, stats):
        if problem is None:
            try:
                ids, mask = record_tokens(record, fmt, tok)
            except ValueError as exc:
                problem = str(exc)
            else:
                tokens.append(ids.astype(dtype))
                masks.append(mask)
                lengths.append(ids.size)
                continue
        if not _W["skip"]:
            raise DataError(f"{path}:{lineno}: {problem}; --skip-bad-lines skips and counts such records")
        stats["bad_lines"] += 1
    return np.concatenate(tokens), lengths, False, False, stats, np.concatenate(masks)


def _tokenize_unit(unit):
    """-> (tokens, piece lengths, first piece continues a document, last piece left open, stats,
    loss mask: None for text)."""
    if _W["records"].masked:
        return _tokenize_records(unit)
    tok = _W["tokenizer"]
    first, last = unit[4], unit[5]  # False only in the units of a text file cut into several
    texts, stats = unit_texts(unit, _W["text_field"], _W["skip"])
    dtype = token_dtype(tok.vocab_size)
    eos = np.array([tok.eos_id], dtype=dtype)
    cont, open_ = not first, not last
    if first and last:  # whole documents: an empty one is counted and dropped
        stats["empty_docs"] += sum(1 for t in texts if not t)
        texts = [t for t in texts if t]
    pieces, lengths = [], []
    for i, a in enumerate(tok.encode_batch_np(texts)):
        ends = not (open_ and i == len(texts) - 1)  # an open document's EOS comes in a later unit
        pieces.append(a.astype(dtype, copy=False))
        if ends:
            pieces.append(eos)
        lengths.append(a.size + int(ends))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    return tokens, lengths, cont, open_, stats, None


def _ordered_results(tagged_units, tokenizer, text_field, skip_bad_lines, workers, records=TEXT):
    """(tag, unit) pairs -> (tag, unit nbytes, result) in input order, at most 2*workers+2 units in flight."""
    if workers <= 1:
        _init_worker(tokenizer, text_field, skip_bad_lines, records)
        for tag, unit in tagged_units:
            yield tag, unit[6], _tokenize_unit(unit)
        return
    # spawn, not fork: the caller may be a training process with threads.
    with mp.get_context("spawn").Pool(
        workers, initializer=_init_pool_worker, initargs=(tokenizer, text_field, skip_bad_lines, records)
    ) as pool:
        pending: deque = deque()
        for tag, unit in tagged_units:
            pending.append((tag, unit[6], pool.apply_async(_tokenize_unit, (unit,))))
            if len(pending) >= 2 * workers + 2:
                tag, nbytes, res = pending.popleft()
                yield tag, nbytes, res.get()
        while pending:
            tag, nbytes, res = pending.popleft()
            yield tag, nbytes, res.get()


# The validation split ---------------------------------------------------------
class ValSplit:
    """Document i -> val? One document per stratum {i : floor(i*f) == j}, chosen with seed (seed, j)."""

    def __init__(self, fraction: float, seed: int, documents: int | None = None):
        """documents: how many the corpus holds, when known; a first stratum cut short by the
        corpus's end then always keeps one document (see the module docstring)."""
        if not 0.0 <= fraction < 1.0:
            raise DataError(f"val fraction must be in [0, 1), got {fraction}")
        self.f, self.seed, self.n = float(fraction), int(seed), documents
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
            if j == 0 and self.n and self._pick >= self.n:  # beyond a short corpus: wrap into it
                self._pick %= self.n
        return i == self._pick


# The driver ---------------------------------------------------------------
def tokenize_file(path: str, tokenizer, text_field: str, skip_bad_lines: bool, records: RecordFormat = TEXT) -> list:
    """One input file's unit results, in order (a Ray task: the file is read where it runs)."""
    _init_worker(tokenizer, text_field, skip_bad_lines, records)
    return [_tokenize_unit(unit) for unit in iter_units(Path(path), text_field)]


def bpe_sample(files: list[Path], text_field: str, sample_bytes: int):
    """Documents to train BPE on: all of them, or (sample_bytes > 0) from each file in
    input order its share of sample_bytes by size, from its start: deterministic."""
    total = max(1, sum(p.stat().st_size for p in files))
    for path in files:
        budget = -(-sample_bytes * path.stat().st_size // total) if sample_bytes else None
        unit_bytes = min(documents.UNIT_BYTES, max(budget, 1 << 16)) if budget else None
        units = iter_units(path, text_field, unit_bytes)
        for text in (t for unit in units for t in unit_texts(unit, text_field, True)[0]):
            if budget is not None:
                raw = text.encode("utf-8", errors="replace")
                if len(raw) > budget:
                    text = raw[:budget].decode("utf-8", errors="ignore")
                budget -= len(raw)
            yield text
            if budget is not None and budget <= 0:
                break  # read no further into this file


def bpe_report(vocab_size: int, asked_vocab: int, text_bytes: int, sample_bytes: int, input_bytes: int) -> str:
    """What BPE training made, as it is: the vocabulary it reached and the bytes of text it read
    (a small corpus runs out of pairs to merge below --bpe-vocab-size, and may be smaller than
    --bpe-sample-bytes)."""
    line = f"BPE: vocabulary of {vocab_size:,} tokens, trained on {text_bytes:,} bytes of text"
    if sample_bytes >= input_bytes:
        line += f" (all of the input: --bpe-sample-bytes {sample_bytes:,} is more than its {input_bytes:,} bytes)"
    if vocab_size < asked_vocab:
        line += (
            f"; fewer than --bpe-vocab-size {asked_vocab:,}: the text has no more pairs to merge "
            f"(more text gives a larger vocabulary; model.vocab_size needs at least {vocab_size:,})"
        )
    return line


def _work_tokenizer(
    work: Path, resumed: bool, tokenizer, files, text_field, bpe_vocab_size, bpe_sample_bytes, progress, log
):
    """The job's tokenizer, saved in the work folder first (so a rerun reuses a trained BPE)."""
    if resumed and (work / "tokenizer.json").is_file():
        return load_tokenizer(work)
    if isinstance(tokenizer, str) and tokenizer == "bpe":
        if log:
            sample = f", sampling about {bpe_sample_bytes:,} bytes" if bpe_sample_bytes else ""
            log(f"training a byte-level BPE (vocab up to {bpe_vocab_size:,}) on {len(files)} files{sample} ...")
        seen = {"bytes": 0}

        def counted(texts):
            for text in texts:
                seen["bytes"] += len(text.encode("utf-8", errors="replace"))
                yield text

        tokenizer = train_bpe(
            counted(bpe_sample(files, text_field, bpe_sample_bytes)),
            bpe_vocab_size,
            show_progress=progress and sys.stderr.isatty(),
        )
        if log:
            input_bytes = sum(p.stat().st_size for p in files)
            log(bpe_report(tokenizer.vocab_size, bpe_vocab_size, seen["bytes"], bpe_sample_bytes, input_bytes))
    tokenizer.save(work)
    return tokenizer


def _write_part(parts: Parts, i: int, results) -> None:
    """Input file i's unit results, in order -> its part, marked complete; on an error the
    half-written part is discarded (the local pool and an executor's tasks alike)."""
    writer, stats = PartWriter(parts, i), zero_stats()
    try:
        for tokens, lengths, cont, open_, st, mask in results:
            stats.update(st)
            writer.add(tokens, lengths, cont, open_, mask)
        writer.finish(stats)
    except BaseException:
        writer.abort()
        raise


def _tokenize_locally(files, todo, parts, tokenizer, text_field, skip_bad_lines, workers, bar, records) -> None:
    """Input files `todo` -> their parts, streaming units through the worker pool in input order;
    a file with no units at all (an empty one) still gets its (empty) part."""
    # Tagged with the file's position: the same file may be given twice.
    units = ((i, unit) for i in todo for unit in iter_units(files[i], text_field))
    results = _ordered_results(units, tokenizer, text_field, skip_bad_lines, workers, records)
    result = next(results, None)

    def file_results(i: int):
        nonlocal result
        while result is not None and result[0] == i:
            yield result[2]
            bar.update(result[1])
            result = next(results, None)

    for i in todo:
        _write_part(parts, i, file_results(i))


def _assemble(
    work: Path, parts: Parts, files, tokenizer, splitter: ValSplit, shard_tokens: int, on_file=None
) -> tuple[dict, dict]:
    """Parts -> shards, in input order; documents numbered across files for the val split.
    on_file(name): each shard set file as it is complete in `work`."""
    clear_assembly(work)
    documents = sum(len(parts.read(i)[1]) for i in range(len(files)))  # lengths only: tokens are mapped
    if splitter.f > 0 and documents == 1:
        raise DataError(
            f"--val-fraction {splitter.f:g}: the input holds one document, which cannot be split into "
            "a training and a validation split; give more documents, or --val-fraction 0"
        )
    splitter = ValSplit(splitter.f, splitter.seed, documents)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: SplitWriter(work, s, dtype, shard_tokens, masked=parts.masked, on_file=on_file) for s in SPLITS}
    stats, doc = zero_stats(), 0
    try:
        for i in range(len(files)):
            tokens, lengths, st = parts.read(i)
            mask = parts.read_mask(i)
            stats.update(st)
            is_val = np.array([splitter.is_val(doc + j) for j in range(len(lengths))], dtype=bool)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            cuts = [0, *(np.flatnonzero(np.diff(is_val)) + 1).tolist(), len(lengths)]
            for a, b in zip(cuts[:-1], cuts[1:]):
                if b > a:
                    span = slice(offsets[a], offsets[b])
                    part_mask = None if mask is None else mask[span]
                    writers["val" if is_val[a] else "train"].write_docs(tokens[span], lengths[a:b], part_mask)
            doc += len(lengths)
            del tokens
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return {s: w.close() for s, w in writers.items()}, {**stats, "documents": doc}


def preprocess_files(
    files: list[Path],
    output: str | os.PathLike,
    tokenizer="byte",
    *,
    text_field: str = "text",
    val_fraction: float = 0.01,
    seed: int = 0,
    workers: int | None = None,
    skip_bad_lines: bool = False,
    bpe_vocab_size: int = 4096,
    bpe_sample_bytes: int = 0,
    progress: bool = True,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    sources: list[str] | None = None,
    overwrite: bool = False,
    executor=None,
    records: RecordFormat | None = None,
    log=print,
) -> dict:
    """Tokenize `files` into the shard directory `output`; returns the index (plus a
    "run" entry, not written: seconds, workers, files resumed). `tokenizer` is "byte",
    "bpe" (trained here on the same files), a tokenizer.json path, or a tokenizer object.
    Works in OUTPUT.partial/ and publishes it with a rename (see staging.py); with
    an `executor`, input files are tokenized as its tasks, and the result is the same.

    executor(jobs, tokenizer, text_field, skip_bad_lines, *, max_in_flight, on_file, log)
    -> tasks kept in flight: runs tokenize_file for each (i, path) of jobs, at most max_in_flight
    (`workers`) at once, and calls on_file(i, results) here as each finishes; `executor.name` ("Ray")
    is named in the summary line. It is passed in, not imported: this package knows no cluster;
    for instruction or chat records it is also given records=RecordFormat.

    records: how JSONL lines are read (records.py); None: detected from the first record.

    `output` may be an object-store URI (s3://bucket/ds, ...): the work folder is then local
    (remote_output.staging_dir), each shard set file goes up as it is complete, index.json last
    (remote_output.py); a URI is never taken for a local path."""
    if not files:
        raise DataError("no input files")
    if not isinstance(shard_tokens, int) or shard_tokens <= 0:
        raise DataError(f"--shard-tokens: expected a positive number of tokens per shard file, got {shard_tokens}")
    if bpe_sample_bytes < 0:
        raise DataError(f"--bpe-sample-bytes: expected >= 0 (0 = all the input), got {bpe_sample_bytes}")
    splitter = ValSplit(val_fraction, seed)
    if records is None:
        records = RecordFormat(detect_format(files, text_field))
    check_format(records, files)
    sink = open_output(output, overwrite)  # a folder (renamed into place) or an object store (uploaded)
    out = sink.staging
    at = Progress(out, files, shown=sink.shown)
    try:
        sink.check()  # before anything is written
        t0 = time.perf_counter()
        sizes = [p.stat() for p in files]
        total_bytes = sum(st.st_size for st in sizes)
        bpe = isinstance(tokenizer, str) and tokenizer == "bpe"  # trained on these files (_work_tokenizer)
        if not bpe and isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        # What the parts depend on about the tokenizer (a rerun with another one starts afresh).
        bpe_settings = {"bpe_vocab_size": bpe_vocab_size, "bpe_sample_bytes": bpe_sample_bytes}
        job = {
            "inputs": [[str(p.resolve()), st.st_size, st.st_mtime_ns] for p, st in zip(files, sizes)],
            "tokenizer": bpe_settings if bpe else tokenizer.hash,
            "text_field": text_field,
            "skip_bad_lines": bool(skip_bad_lines),
        }
        if records.masked:  # a text job's job.json is as before, so its earlier partial output resumes
            job["records"] = dataclasses.asdict(records)
        work, resumed = open_partial(out, job, log)
        at.work = work
        tokenizer = _work_tokenizer(
            work, resumed, tokenizer, files, text_field, bpe_vocab_size, bpe_sample_bytes, progress, log
        )
        parts = at.parts = Parts(work, token_dtype(tokenizer.vocab_size), masked=records.masked)
        todo = [i for i in range(len(files)) if not parts.done(i)]
        if resumed and log:
            log(f"preprocess: resuming {work}: {len(files) - len(todo)} of {len(files)} input files already done")
        if executor is not None:
            workers = executor(
                [(i, str(files[i])) for i in todo],
                tokenizer,
                text_field,
                skip_bad_lines,
                max_in_flight=workers,
                on_file=partial(_write_part, parts),
                log=log,
                **({"records": records} if records.masked else {}),
            )
        else:
            workers = (os.cpu_count() or 1) if workers is None else max(1, int(workers))
            # Starting a pool (~1 s) only pays off for bigger inputs; BPE encodes ~100x slower than bytes.
            todo_bytes = sum(sizes[i].st_size for i in todo)
            if todo_bytes < (
                4 * documents.UNIT_BYTES if isinstance(tokenizer, ByteTokenizer) else documents.UNIT_BYTES // 16
            ):
                workers = 1
            with tqdm(
                total=total_bytes,
                initial=total_bytes - todo_bytes,
                unit="B",
                unit_scale=True,
                desc="preprocess",
                disable=not progress,
                file=sys.stderr,
            ) as bar:
                _tokenize_locally(files, todo, parts, tokenizer, text_field, skip_bad_lines, workers, bar, records)
        at.assembling = True
        sink.begin()
        uploaded = partial(sink.upload, work)  # to an object store, each shard goes up as it is complete
        splits, stats = _assemble(work, parts, files, tokenizer, splitter, shard_tokens, on_file=uploaded)
        if splits["train"]["num_tokens"] == 0 and splits["val"]["num_tokens"] == 0:
            raise DataError(f"inputs hold no text: {', '.join(sources or [str(p) for p in files[:3]])}")
        # Nothing here depends on timing, workers or Ray: the same inputs give the same bytes.
        index = {
            "format": FORMAT,
            "version": VERSION,
            "records": records.format,
            "dtype": parts.dtype.name,
            "tokenizer": {
                "hash": tokenizer.hash,
                "name": tokenizer.name,
                "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id,
                "file": "tokenizer.json",
            },
            "splits": splits,
            "split": {"val_fraction": val_fraction, "seed": seed, "method": "one document per stratum floor(i*f)"},
            "stats": {"files": len(files), "bytes": total_bytes, **stats},
            "sources": sources or [str(p) for p in files],
        }
        atomic_write_json(work / INDEX, index)
        sink.commit(work)
    except KeyboardInterrupt:  # Ctrl-C: what was kept is in OUTPUT.partial, and a rerun resumes from it
        raise at.interrupted() from None
    except OSError as exc:  # an input that cannot be read, a full or read-only output: named with the path
        raise at.os_error(exc) from None
    finally:
        sink.close()
    run = {
        "seconds": round(time.perf_counter() - t0, 3),
        "workers": workers,
        "resumed_files": len(files) - len(todo),
    }
    if log:
        where = f" on {executor.name}" if executor is not None else ""
        n_tok = sum(s["num_tokens"] for s in splits.values())
        secs, doc = run["seconds"], stats["documents"]
        log(
            f"preprocess: {len(files)} files, {doc} documents, {n_tok:,} tokens "
            f"(train {splits['train']['num_tokens']:,} / val {splits['val']['num_tokens']:,}) in {secs:.2f}s "
            f"({n_tok / max(secs, 1e-9):,.0f} tokens/s, {workers} worker(s){where}) -> {sink.shown}"
            + (f"; skipped {stats['bad_lines']} bad lines" if stats["bad_lines"] else "")
            + (f"; replaced {stats['replaced_chars']} invalid UTF-8 sequences" if stats["replaced_chars"] else "")
        )
    return {**index, "run": run}
