"""Reading preprocess inputs as documents, in work units (see preprocess.py).

Documents: a .jsonl line's text field, a .parquet row's text column, or a
whole .txt (or any other text) file. Work units are ~UNIT_BYTES: text files
are cut at newlines (a huge file is one document spread over several units;
with BPE, merges never span such a cut), JSONL files at line ends, Parquet
files batch by batch.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from pathlib import Path

from loomtrain.data_pipeline.shards import DataError

UNIT_BYTES = 4 << 20
PARQUET_BATCH_ROWS = 1024
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


def iter_units(path: Path, text_field: str, unit_bytes: int | None = None):
    """One input file's work units, in order: (kind, path, where, payload, first, last, nbytes)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:
            raise DataError(f"{path}: cannot read as Parquet: {exc}") from None
        names = pf.schema_arrow.names
        if text_field not in names:
            raise DataError(
                f"{path}: no column {text_field!r} (columns: {', '.join(names)}); choose one with --text-field"
            )
        rows, size, row = max(1, pf.metadata.num_rows), path.stat().st_size, 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            texts = batch.column(0).to_pylist()
            yield ("texts", str(path), row, texts, True, True, size * len(texts) // rows)
            row += len(texts)
    elif name.endswith((".jsonl", ".ndjson")):
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


def jsonl_values(payload, where: int, stats: dict):
    """(line number, value, problem) of each non-blank line of a JSONL unit that starts at line
    `where`: the parsed value and None, or None and why the line is not JSON. Characters that are
    not UTF-8 are replaced and counted in stats["replaced_chars"]."""
    for lineno, raw in enumerate(payload, where):
        if not raw.strip():
            continue
        line, bad = _decode(raw)
        stats["replaced_chars"] += bad
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            yield lineno, None, f"not valid JSON ({exc.msg} at column {exc.colno})"
        except RecursionError:  # a line nested thousands deep: a data error, not a traceback
            yield lineno, None, "JSON nested too deeply (deeper than Python's recursion limit)"
        else:
            yield lineno, value, None


def _missing_field(obj: dict, text_field: str) -> str:
    """A JSONL object without the text field: the fields it has, and the option that picks one
    (before --skip-bad-lines, which would drop every line of a file written with another name)."""
    names = [str(k) for k in obj]
    strings = sorted((k for k, v in obj.items() if isinstance(v, str)), key=lambda k: -len(obj[k]))  # longest first
    listed = ", ".join(repr(n) for n in names[:12]) + (", ..." if len(names) > 12 else "") or "none"
    hint = f"--text-field {strings[0]}" if strings else "--text-field NAME"  # the likeliest text
    return f"no field {text_field!r} (fields: {listed}); if the text is in another field, pass {hint}"


def zero_stats() -> Counter:
    """A unit's (or a file's, or the corpus's) counts of what reading its documents met (update() adds)."""
    return Counter(bad_lines=0, replaced_chars=0, empty_docs=0)


def unit_texts(unit, text_field: str, skip_bad_lines: bool):
    """A unit's documents as strings, plus stats; raises DataError (file:line) on a
    bad JSONL line unless skip_bad_lines."""
    kind, path, where, payload, first, last, _ = unit
    stats = zero_stats()
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
    for lineno, obj, problem in jsonl_values(payload, where, stats):
        if problem is None:
            value = obj.get(text_field) if isinstance(obj, dict) else None
            if isinstance(value, str):
                texts.append(value)
                continue
            if not isinstance(obj, dict):
                problem = f"a JSON {type(obj).__name__}, not an object with a field {text_field!r}"
            elif text_field not in obj:
                problem = _missing_field(obj, text_field)
            else:
                problem = f"field {text_field!r} is {type(value).__name__}, not a string"
        if not skip_bad_lines:
            raise DataError(f"{path}:{lineno}: {problem}; --skip-bad-lines skips and counts such lines")
        stats["bad_lines"] += 1
    return texts, stats
