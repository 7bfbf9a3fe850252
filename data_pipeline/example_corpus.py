"""The own-data guide's example corpus, made here with no network: prose and code from the
Python standard library's own sources (the files `corpus.stdlib_files` lists).

    python -m loomtrain.data_pipeline.example_corpus --output corpus

writes, in the folder OUTPUT (--output):
* `OUTPUT/docs/*.jsonl`: every top-level module's (or package's) docstring of at least
  MIN_DOC_CHARS characters, one `{"text": ...}` document a line, split into three files by
  module name (the guide's "documents" source: prose, for a BPE tokenizer to learn);
* `OUTPUT/code/*.py`: the first CODE_FILES top-level modules of at least MIN_CODE_BYTES bytes
  (the guide's "code" source: one document per file).
The same Python gives the same corpus. A file already there with the same bytes is left as it
is (so the guide can be followed twice); one with other bytes is refused, never overwritten.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

from loomtrain.data_pipeline.corpus import stdlib_files
from loomtrain.durable import atomic_write

MIN_DOC_CHARS = 600  # long enough that a held-out docstring fills a tiny run's window (129 tokens)
MIN_CODE_BYTES = 2000
CODE_FILES = 40
DOC_FILES = ("a-f", "g-p", "q-z")  # module names by first letter


class CorpusError(Exception):
    """A file that is in the way: one line naming it."""


def _top_level(files: list[Path]) -> list[Path]:
    """The standard library's top-level modules and packages' __init__.py, in `stdlib_files` order."""
    top = files[0].parent  # the standard library's own folder
    return [p for p in files if p.parent == top or (p.name == "__init__.py" and p.parent.parent == top)]


def _docstrings(modules: list[Path]) -> list[tuple[str, str]]:
    """(module name, docstring) of each module whose docstring has at least MIN_DOC_CHARS characters."""
    out = []
    for path in modules:
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=True)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file that is not Python 3, or not UTF-8
        if doc and len(doc) >= MIN_DOC_CHARS:
            out.append((path.stem if path.stem != "__init__" else path.parent.name, doc))
    return out


def corpus_files() -> dict[str, bytes]:
    """Relative path -> bytes of every file of the example corpus."""
    modules = _top_level(stdlib_files())
    docstrings = _docstrings(modules)
    files: dict[str, bytes] = {}
    for span in DOC_FILES:
        first, last = span.split("-")
        lines = [json.dumps({"text": doc}) + "\n" for name, doc in docstrings if first <= name.lstrip("_")[:1] <= last]
        files[f"docs/stdlib-{span}.jsonl"] = "".join(lines).encode()
    code = [p for p in modules if p.name != "__init__.py" and p.stat().st_size >= MIN_CODE_BYTES]
    for path in code[:CODE_FILES]:
        files[f"code/{path.name}"] = path.read_bytes()
    return files


def write_corpus(output: Path) -> dict[str, int]:
    """Write the corpus under `output`; -> {"docs": documents, "code": files}. Raises CorpusError
    before writing anything when a file there holds other bytes."""
    files = corpus_files()
    for rel, data in files.items():
        target = output / rel
        if target.exists() and (not target.is_file() or target.read_bytes() != data):
            raise CorpusError(f"{target}: already there with other contents; choose another --output")
    for rel, data in files.items():
        target = output / rel
        if not target.exists():
            atomic_write(target, data)  # (its folder made as needed)
    docs = sum(data.count(b"\n") for rel, data in files.items() if rel.startswith("docs/"))
    return {"docs": docs, "code": sum(rel.startswith("code/") for rel in files)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loomtrain.data_pipeline.example_corpus", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--output", default="corpus", help="folder to write docs/ and code/ into (default: corpus)")
    args = ap.parse_args(argv)
    out = Path(args.output)
    try:
        n = write_corpus(out)
    except (CorpusError, OSError) as exc:
        print(f"example_corpus: {exc}", file=sys.stderr)
        return 1
    print(
        f"example corpus: {n['docs']} documents in {out / 'docs'} ({len(DOC_FILES)} files), "
        f"{n['code']} Python files in {out / 'code'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
