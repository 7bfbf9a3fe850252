"""A small instruction set made from the embedded corpus, with no network: "complete this function"
chats cut from the Python standard library's own sources (the files `corpus.stdlib_files` lists).

    python -m loomtrain.data_pipeline.instructions --output data/functions.jsonl

writes one chat a line, ready for `loomtrain preprocess --format chat`:

    {"messages": [{"role": "user", "content": "Complete this function: def f(a, b):\\n    \\"\\"\\"Doc.\\"\\"\\""},
                  {"role": "assistant", "content": "    return a + b"}]}

The user's message is a function's `def` line(s) and its docstring, if it has one; the reply is
the rest of its body. Functions and methods (dedented) are taken in file order, each once (the
same text twice is kept once), and only those whose two texts together are at most --max-bytes
bytes, so that a record fits a short training window (configs/sft-tiny.yaml: 256 byte tokens, of
which the built-in chat template takes 25).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

from loomtrain.data_pipeline.corpus import stdlib_files
from loomtrain.durable import AtomicFile

ASK = "Complete this function: "  # then the def line: one line to type for `generate --chat`


def function_chats(source: str, max_bytes: int) -> Iterator[dict]:
    """The "complete this function" chats of one module's source (nothing where it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        first = body[0]
        has_doc = ast.get_docstring(node, clean=False) is not None
        rest = body[1:] if has_doc else body
        head_end = first.end_lineno if has_doc else rest[0].lineno - 1  # the question's last line (1-based)
        if not rest or rest[0].lineno <= head_end or head_end < node.lineno:
            continue  # a one-line def, or nothing after the docstring: no body to ask for
        text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])).splitlines()
        n_head = head_end - node.lineno + 1
        head, answer = "\n".join(text[:n_head]), "\n".join(text[n_head:]).rstrip()
        if not head.lstrip().startswith(("def ", "async def ")) or not answer.strip():
            continue
        if len((ASK + head + answer).encode("utf-8")) > max_bytes:
            continue
        yield {"messages": [{"role": "user", "content": ASK + head}, {"role": "assistant", "content": answer}]}


def corpus_chats(max_files: int = 0, max_bytes: int = 200) -> Iterator[dict]:
    """The chats of the first `max_files` standard-library files (0 = all), each text once."""
    seen: set[str] = set()
    for path in stdlib_files(max_files):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for chat in function_chats(source, max_bytes):
            key = json.dumps(chat, sort_keys=True)
            if key not in seen:
                seen.add(key)
                yield chat


def write_jsonl(records: Iterator[dict], output: Path) -> int:
    """The records as JSONL at `output` (written whole, then renamed) -> how many."""
    n = 0
    with AtomicFile(output) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loomtrain.data_pipeline.instructions",
        description="Write 'complete this function' chats cut from the standard library's sources as JSONL.",
    )
    p.add_argument("--output", required=True, help="the JSONL file to write")
    p.add_argument("--max-files", type=int, default=400, help="standard-library files read (0 = all)")
    p.add_argument("--max-bytes", type=int, default=200, help="the most UTF-8 bytes of a record's two texts together")
    args = p.parse_args(argv)
    if args.max_files < 0 or args.max_bytes <= len(ASK):
        print(f"{p.prog}: expected --max-files >= 0 and --max-bytes > {len(ASK)}", file=sys.stderr)
        return 2
    try:
        n = write_jsonl(corpus_chats(args.max_files, args.max_bytes), Path(args.output))
    except OSError as exc:
        print(f"{p.prog}: {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"instructions: {n} 'complete this function' chats from the standard library -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
