"""The own-data guide's example corpus (data_pipeline/example_corpus.py): made with no network,
the same twice, long enough documents for the guide's runs, and never overwriting a user's file."""

from __future__ import annotations

import json

from loomtrain.data_pipeline import example_corpus


def test_example_corpus_is_written_once_and_refuses_other_files(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert example_corpus.main(["--output", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    docs = sorted((out / "docs").glob("*.jsonl"))
    code = sorted((out / "code").glob("*.py"))
    assert [p.name for p in docs] == ["stdlib-a-f.jsonl", "stdlib-g-p.jsonl", "stdlib-q-z.jsonl"]
    texts = [json.loads(x)["text"] for p in docs for x in p.read_text().splitlines()]
    assert len(texts) >= 40 and all(len(t) >= example_corpus.MIN_DOC_CHARS for t in texts)
    assert len(code) == example_corpus.CODE_FILES
    assert all(p.stat().st_size >= example_corpus.MIN_CODE_BYTES for p in code)
    assert (
        line == f"example corpus: {len(texts)} documents in {out / 'docs'} (3 files), 40 Python files in {out / 'code'}"
    )
    # the guide followed twice: the same bytes, nothing to do
    before = {p: p.read_bytes() for p in [*docs, *code]}
    assert example_corpus.main(["--output", str(out)]) == 0
    assert {p: p.read_bytes() for p in before} == before
    # a file of the user's in the way: refused in one line, nothing written or changed
    code[0].write_text("mine")
    (out / "docs" / docs[1].name).unlink()
    assert example_corpus.main(["--output", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"example_corpus: {code[0]}: already there with other contents; choose another --output"
    assert code[0].read_text() == "mine" and not (out / "docs" / docs[1].name).exists()
