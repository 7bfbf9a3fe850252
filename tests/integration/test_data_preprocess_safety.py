"""`loomtrain preprocess` deletes nothing it did not write: it works in OUTPUT.partial/
and publishes by rename; it refuses outputs that are not its own; a failed rerun
leaves the earlier dataset loadable; and bad shards or indexes are one-line errors
naming the file, key or offset."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from launch import run_loomtrain
from loomtrain.data_pipeline import DataError, TokenStream, prepare_data
from loomtrain.data_pipeline import preprocess as pp
from loomtrain.launcher.config import DataConfig

DOCS = [f"def f{i}(x):\n    return x * {i}\n" for i in range(40)]


def jsonl(path: Path, docs=DOCS) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def run_cli(*args) -> subprocess.CompletedProcess:
    return run_loomtrain("preprocess", "--no-progress", *args, timeout=120, rc=None)


def tree(path: Path) -> dict[str, str]:
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def one_error_line(proc, *words):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_user_bin_files_in_output_are_refused_and_kept(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "train_00001.bin").write_bytes(b"user data 1")
    (out / "scores_00001.bin").write_bytes(b"user data 2")
    before = tree(out)
    proc = run_cli("--input", jsonl(tmp_path / "a.jsonl"), "--output", out)
    one_error_line(proc, str(out), "not a loomtrain preprocess output", "--overwrite")
    assert tree(out) == before
    assert not (tmp_path / "mine.partial").exists() or not any((tmp_path / "mine.partial").rglob("*.bin"))


def test_non_empty_foreign_output_needs_overwrite(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "readme.txt").write_text("mine")
    one_error_line(
        run_cli("--input", jsonl(tmp_path / "a.jsonl"), "--output", out), "not a loomtrain preprocess output"
    )
    assert (out / "readme.txt").read_text() == "mine"
    proc = run_cli("--input", tmp_path / "a.jsonl", "--output", out, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "readme.txt").exists() and (out / "index.json").is_file()
    prepare_data(DataConfig(path=str(out)))


def test_rerun_replaces_its_own_output_but_not_files_it_did_not_write(tmp_path):
    out = tmp_path / "o"
    pp.preprocess_files([jsonl(tmp_path / "a.jsonl")], out, shard_tokens=100, progress=False, log=None)
    many = len(list(out.glob("train_*.bin")))
    pp.preprocess_files([jsonl(tmp_path / "b.jsonl", DOCS[:5])], out, shard_tokens=100, progress=False, log=None)
    index = json.loads((out / "index.json").read_text())
    assert sorted(p.name for p in out.glob("train_*.bin")) == [s["file"] for s in index["splits"]["train"]["shards"]]
    assert len(index["splits"]["train"]["shards"]) < many  # the earlier, longer dataset's shards are gone
    assert not (tmp_path / "o.partial").exists()
    (out / "my_notes.txt").write_text("keep")
    with pytest.raises(DataError, match="my_notes.txt.*which preprocess did not write"):
        pp.preprocess_files([tmp_path / "a.jsonl"], out, progress=False, log=None)
    assert (out / "my_notes.txt").read_text() == "keep"


def test_a_rerun_with_a_chat_template_tokenizer_replaces_its_own_output(tmp_path, bpe):
    """tokenizer_config.json (the chat template, written beside tokenizer.json) is preprocess's own:
    a rerun into the same folder replaces it without --overwrite, as it does on object storage."""
    (tmp_path / "tok").mkdir()
    bpe.save(str(tmp_path / "tok" / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|endoftext|>{% endfor %}"
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    out, tok = tmp_path / "o", str(tmp_path / "tok" / "tokenizer.json")
    for docs in (DOCS, DOCS[:5]):
        pp.preprocess_files([jsonl(tmp_path / "a.jsonl", docs)], out, tok, progress=False, log=None)
        assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template
    assert prepare_data(DataConfig(path=str(out), tokenizer=tok))[1].chat


def test_failed_rerun_leaves_the_earlier_dataset_loadable(tmp_path):
    out = tmp_path / "o"
    pp.preprocess_files([jsonl(tmp_path / "a.jsonl")], out, progress=False, log=None)
    before = tree(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        pp.preprocess_files([tmp_path / "a.jsonl", bad], out, progress=False, log=None)
    assert tree(out) == before
    shard_dir, tok = prepare_data(DataConfig(path=str(out)))
    s = TokenStream(shard_dir, seq_len=8, micro_batch_size=2, expected_tokenizer_hash=tok.hash)
    assert next(s)[0].shape == (2, 8)
    s.close()


def test_a_part_an_executor_fails_to_write_is_discarded(tmp_path):
    """As on the local path, a part whose writing fails is discarded (no half-written temp files
    in OUTPUT.partial/parts), and a rerun writes it afresh."""

    class BrokenTasks:  # RayTasks' interface; the file's last result cannot be written
        name = "broken"

        def __call__(self, jobs, tokenizer, text_field, skip_bad_lines, *, max_in_flight, on_file, log=None):
            for i, path in jobs:
                results = pp.tokenize_file(path, tokenizer, text_field, skip_bad_lines)
                on_file(i, [*results, (np.zeros(3, np.uint16), ["not a length"], False, False, {}, None)])
            return 1

    src, out = jsonl(tmp_path / "a.jsonl"), tmp_path / "o"
    with pytest.raises(ValueError):
        pp.preprocess_files([src], out, executor=BrokenTasks(), progress=False, log=None)
    assert not list((tmp_path / "o.partial" / "parts").iterdir())
    pp.preprocess_files([src], out, progress=False, log=None)
    assert (out / "index.json").is_file()


def test_shard_tokens_must_be_positive(tmp_path):
    jsonl(tmp_path / "a.jsonl")
    for n in (0, -5):
        with pytest.raises(DataError, match=rf"--shard-tokens: expected a positive number.*got {n}"):
            pp.preprocess_files([tmp_path / "a.jsonl"], tmp_path / "o", shard_tokens=n, progress=False, log=None)
    one_error_line(
        run_cli("--input", tmp_path / "a.jsonl", "--output", tmp_path / "o", "--shard-tokens", "0"), "--shard-tokens"
    )
    assert not (tmp_path / "o").exists()


def test_output_that_is_a_file_is_one_line(tmp_path):
    target = tmp_path / "data.bin"
    target.write_bytes(b"precious")
    one_error_line(run_cli("--input", jsonl(tmp_path / "a.jsonl"), "--output", target), str(target), "is a file")
    assert target.read_bytes() == b"precious"


def test_token_id_beyond_the_vocabulary_is_caught_at_load_naming_file_and_offset(tmp_path):
    out = tmp_path / "o"
    pp.preprocess_files([jsonl(tmp_path / "a.jsonl")], out, val_fraction=0, progress=False, log=None)
    shard = out / "train_00000.bin"
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[123] = 300  # the byte tokenizer's vocabulary is 257
    tokens.tofile(shard)
    msg = rf"{shard}: token id 300 at token offset 123 \(byte 246\) is >= the vocabulary size 257"
    with pytest.raises(DataError, match=msg):
        prepare_data(DataConfig(path=str(out)))
    s = TokenStream(out, seq_len=8, micro_batch_size=64, prefetch=0, shuffle=False)
    with pytest.raises(DataError, match=msg):
        next(s)
    s.close()


def test_index_with_a_missing_key_is_one_line_naming_file_and_key(tmp_path):
    out = tmp_path / "o"
    pp.preprocess_files([jsonl(tmp_path / "a.jsonl")], out, progress=False, log=None)
    index = json.loads((out / "index.json").read_text())
    del index["tokenizer"]["vocab_size"]
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=rf"{out / 'index.json'} is missing the key 'tokenizer.vocab_size'"):
        prepare_data(DataConfig(path=str(out)))
    del index["splits"]["train"]["shards"][0]["num_tokens"]
    index["tokenizer"]["vocab_size"] = 257
    (out / "index.json").write_text(json.dumps(index))
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  path: {out}\n")
    proc = run_loomtrain("data-stats", config, "--steps", "1", timeout=120, rc=None)
    one_error_line(proc, str(out / "index.json"), "splits.train.shards[0].num_tokens")
