"""Where `loomtrain preprocess` writes before it publishes: OUTPUT.partial/.

Preprocess never writes into OUTPUT itself. It works in the sibling folder
OUTPUT.partial/ and, when the dataset is complete, renames that folder onto
OUTPUT. So a failed or killed run leaves an earlier OUTPUT as it was, and a
folder preprocess did not make is never written into (or, without --overwrite,
replaced).

OUTPUT.partial/ holds
  job.json                  what the parts depend on (inputs with size and mtime,
                            tokenizer, text field, ...); written first
  tokenizer.json            the tokenizer (a trained BPE is saved before tokenizing)
  parts/NNNNNN.tokens       input file N's tokens, documents EOS-terminated
  parts/NNNNNN.docs         its documents' lengths (uint64)
  parts/NNNNNN.json         written last: input file N is complete
A rerun with the same job.json skips every input whose part is complete; with
another job.json the folder (recognised as ours by job.json) is started afresh.
The shards are then assembled from the parts in input order, so the result
does not depend on which run, process or Ray task tokenized which file.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
from loomtrain.data_pipeline.shards import FORMAT, INDEX, DataError
from loomtrain.durable import TMP_PREFIX, AtomicFile, atomic_write_json, replace_dir

PARTIAL_FORMAT = "loomtrain-preprocess-partial"
JOB = "job.json"


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _written_by_preprocess(out: Path) -> set[str] | None:
    """The names in `out` an earlier preprocess wrote, or None if it is not a preprocess output."""
    try:
        index = json.loads((out / INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return None
    return output_names(index) | {JOB, "parts"}  # these two only if a publish was cut short


def output_names(index: dict) -> set[str]:
    """The files of the preprocess output this index describes (read defensively: maybe not ours)."""
    names = {INDEX, "tokenizer.json", "tokenizer_config.json"}  # the last: a chat template, when there is one
    for split, info in (index.get("splits") or {}).items():
        if isinstance(info, dict):
            names.add(str(info.get("doc_offsets") or f"{split}.docs.bin"))
            if info.get("loss_mask"):  # instruction and chat data (index version 2)
                names.add(str(info["loss_mask"]))
            names.update(str(s.get("file")) for s in info.get("shards") or [] if isinstance(s, dict))
    return names


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an --output that is a file, or a non-empty folder that is not wholly an
    earlier preprocess output (unless overwrite)."""
    if out.exists() and not out.is_dir():
        raise DataError(
            f"--output {out} is a file; expected a directory to create (or an earlier preprocess output to replace)"
        )
    if not out.is_dir() or overwrite:
        return
    present = {p.name for p in out.iterdir()}
    if not present:
        return
    ours = _written_by_preprocess(out)
    if ours is None:
        raise DataError(
            f"--output {out} is not empty and is not a loomtrain preprocess output (no valid {INDEX}); "
            "refusing to replace it: choose another directory, or pass --overwrite to replace it"
        )
    foreign = sorted(present - ours)
    if foreign:
        raise DataError(
            f"--output {out} holds {foreign[0]!r}, which preprocess did not write; refusing to replace it: "
            "move it away, or pass --overwrite to replace the whole directory"
        )


def open_partial(out: Path, job: dict, log=None) -> tuple[Path, bool]:
    """-> (OUTPUT.partial, resumed). Resumes a work folder of the same job; starts
    afresh in one of another job; refuses a folder of that name that is not ours."""
    work = partial_dir(out)
    job = {"format": PARTIAL_FORMAT, **job}
    if work.exists() and not work.is_dir():
        raise DataError(f"{work} is a file; preprocess needs that name for its work folder: move it away")
    if work.is_dir():
        try:
            found = json.loads((work / JOB).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            found = None
        if found == job:
            return work, True
        if isinstance(found, dict) and found.get("format") == PARTIAL_FORMAT:
            if log:
                log(f"preprocess: {work} is from another job (inputs or settings changed); starting afresh")
            shutil.rmtree(work)
        elif any(work.iterdir()):
            raise DataError(
                f"{work} exists and is not a preprocess work folder (no valid {JOB}); "
                "preprocess needs that name: move it away"
            )
    (work / "parts").mkdir(parents=True, exist_ok=True)
    atomic_write_json(work / JOB, job)
    return work, False


class Parts:
    """Per-input-file token parts in OUTPUT.partial/parts/ (see the module docstring)."""

    def __init__(self, work: Path, dtype: np.dtype, masked: bool = False):
        self.dir = work / "parts"
        self.dtype = np.dtype(dtype)
        self.masked = masked  # a uint8 loss mask per token beside the tokens (instruction and chat records)

    def _path(self, i: int, ext: str) -> Path:
        return self.dir / f"{i:06d}.{ext}"

    def done(self, i: int) -> bool:
        try:
            meta = json.loads(self._path(i, "json").read_text(encoding="utf-8"))
            return (
                self._path(i, "tokens").stat().st_size == meta["num_tokens"] * self.dtype.itemsize
                and self._path(i, "docs").stat().st_size == meta["num_docs"] * 8
                and (not self.masked or self._path(i, "mask").stat().st_size == meta["num_tokens"])
            )
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def read_mask(self, i: int) -> np.ndarray | None:
        """Part i's loss mask (uint8 per token), None for text."""
        if not self.masked:
            return None
        return np.fromfile(self._path(i, "mask"), dtype=np.uint8)

    def read(self, i: int) -> tuple[np.ndarray, np.ndarray, dict]:
        meta = json.loads(self._path(i, "json").read_text(encoding="utf-8"))
        tokens = (
            np.memmap(self._path(i, "tokens"), dtype="<" + self.dtype.str[1:], mode="r")
            if meta["num_tokens"]
            else np.zeros(0, self.dtype)
        )
        lengths = np.fromfile(self._path(i, "docs"), dtype="<u8").astype(np.int64)
        return tokens, lengths, meta["stats"]


class PartWriter:
    """Streams one input file's tokenized pieces into its part; `finish` marks it complete."""

    def __init__(self, parts: Parts, i: int):
        self.parts, self.i = parts, i
        # Fixed temp names: a rerun after a kill overwrites the half-written part's files.
        exts = ("tokens", "docs", "mask") if parts.masked else ("tokens", "docs")
        self._files = {ext: AtomicFile(parts._path(i, ext), tmp=parts._path(i, f"{ext}.tmp")) for ext in exts}
        self._tok, self._doc, self._mask = self._files["tokens"], self._files["docs"], self._files.get("mask")
        self.num_tokens, self.num_docs, self._open_len = 0, 0, None

    def add(self, tokens: np.ndarray, lengths, cont: bool, open_: bool, mask: np.ndarray | None = None) -> None:
        """Pieces in order: `lengths` per piece; the first continues the open document
        when `cont`, the last stays open (its document goes on in the next unit) when `open_`.
        `mask`: the tokens' loss mask, for parts of masked records."""
        dtype = self.parts.dtype
        if self._mask is not None:
            self._mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self._tok.write(np.asarray(tokens).astype("<" + dtype.str[1:], copy=False).tobytes())
        self.num_tokens += int(np.asarray(tokens).size)
        lengths = [int(n) for n in lengths]
        if cont and lengths and self._open_len is not None:
            self._open_len += lengths.pop(0)
            if lengths or not open_:
                self._close_doc()
        elif self._open_len is not None:
            self._close_doc()
        for j, n in enumerate(lengths):
            self._open_len = n
            if not (open_ and j == len(lengths) - 1):
                self._close_doc()

    def _close_doc(self) -> None:
        self._doc.write(np.array([self._open_len], dtype="<u8").tobytes())
        self.num_docs += 1
        self._open_len = None

    def finish(self, stats: dict) -> None:
        if self._open_len is not None:
            self._close_doc()
        for f in self._files.values():
            f.commit()
        atomic_write_json(
            self.parts._path(self.i, "json"), {"num_tokens": self.num_tokens, "num_docs": self.num_docs, "stats": stats}
        )

    def abort(self) -> None:
        for f in self._files.values():
            f.discard()


def clear_assembly(work: Path) -> None:
    """Remove what an interrupted assembly left at the top of the work folder (all ours)."""
    for p in work.iterdir():
        if p.is_file() and (p.suffix == ".bin" or p.name == INDEX or ".tmp-" in p.name):
            p.unlink()


def publish(work: Path, out: Path) -> None:
    """Rename the finished work folder onto OUTPUT; an earlier OUTPUT (checked by
    check_output) is moved aside first and removed only after the new one is in place.
    The parts go last: killed before the rename, a rerun still resumes (and assembles
    again); killed after it, OUTPUT is complete and its leftover parts are known as ours."""
    replace_dir(work, out)
    (out / JOB).unlink(missing_ok=True)
    shutil.rmtree(out / "parts", ignore_errors=True)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during preprocess; the message says what was kept and that a rerun resumes. Still a
    KeyboardInterrupt, for callers that stop on one."""


class OutputError(OSError):
    """An OS error on preprocess's output (full, read-only, ...): still the OSError it was (errno,
    strerror, filename: a caller's disk-error handling applies), with `line`: the one line the
    preprocess command ends with (the path, the cause, what to do, what a rerun resumes from)."""

    def __init__(self, exc: OSError, filename: str, line: str):
        super().__init__(exc.errno, exc.strerror, filename)
        self.line = line


class Progress:
    """How far a run got: what the one line that ends it early (Ctrl-C, an OS error) says was kept."""

    def __init__(self, out: Path, files: list[Path], shown: str | None = None):
        self.out, self.files = out, files
        self.shown = shown or str(out)  # --output as given (a URI's work folder is local: `out`)
        self.work: Path | None = None  # OUTPUT.partial, once opened
        self.parts: Parts | None = None  # once the tokenizer is saved there
        self.assembling = False

    def kept(self) -> str | None:
        """What a rerun of the same command starts from; None: nothing yet."""
        if self.work is None:
            return None
        if self.parts is None:
            return f"no input file was tokenized yet (the work folder {self.work} is kept)"
        n = len(self.files)
        done = sum(self.parts.done(i) for i in range(n))
        if self.assembling and done == n:
            return f"all {n} input files are tokenized and kept in {self.work}; the shards were not finished"
        return f"{done} of {n} input files are tokenized and kept in {self.work}"

    def interrupted(self) -> Interrupted:
        kept = self.kept()
        if kept is None:
            return Interrupted("interrupted before anything was written; run the same command again to start")
        return Interrupted(f"interrupted: {kept}; run the same command again to resume from there")

    def _on_output(self, path: Path) -> bool:
        """`path` is OUTPUT, OUTPUT.partial or inside them, a folder above OUTPUT, or the
        .tmp-OUTPUT.old beside it that an earlier output is moved to when replaced."""
        out, path = self.out.absolute(), path.absolute()
        ours = {out, partial_dir(out), out.with_name(f"{TMP_PREFIX}{out.name}.old")}
        return path in out.parents or any(p in ours for p in (path, *path.parents))

    def os_error(self, exc: OSError) -> DataError | OutputError:
        """A DataError naming an input (or another path) that could not be read; an OutputError
        for the output."""
        cause = exc.strerror or str(exc)
        path = Path(exc.filename) if exc.filename else (self.work or self.out)
        if not self._on_output(path):
            is_input = any(path.absolute() == f.absolute() for f in self.files)
            return DataError(f"{'input ' if is_input else ''}{path}: {cause}")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space there, or choose another --output"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = "make it writable, or choose another --output"
        else:
            fix = "check that location, or choose another --output"
        kept = self.kept()
        resume = f"; {kept}, where a rerun of the same command resumes" if kept else ""
        return OutputError(exc, str(path), f"--output {self.shown}: {path}: {cause}; {fix}{resume}")
