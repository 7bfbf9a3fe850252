"""Tokenizers, `loomtrain preprocess` end to end, the validation split, prepare_data,
and every data error with its message."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loomtrain.data_pipeline import (
    ByteTokenizer,
    DataError,
    TokenStream,
    documents,
    load_tokenizer,
    prepare_data,
    train_bpe,
)
from loomtrain.data_pipeline import preprocess as pp
from loomtrain.data_pipeline.shard_set import ShardSet
from loomtrain.launcher.cli import preprocess as preprocess_cli
from loomtrain.launcher.config import DataConfig

DOCS = [f"def f{i}(x):\n    return x * {i}  # ünïcode {i}\n" for i in range(30)]


def read_docs(shard_dir, split, tok):
    """All documents of a split, decoded (EOS-separated)."""
    s = ShardSet(shard_dir, split)
    toks = s.read(0, s.num_tokens) if s.num_tokens else np.zeros(0, np.int64)
    s.close()
    out, cur = [], []
    for t in toks.tolist():
        if t == tok.eos_id:
            out.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    assert not cur
    return out


def write_inputs(tmp_path):
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS[:10]):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    with open(tmp_path / "a.jsonl", "w") as f:
        for d in DOCS[10:20]:
            f.write(json.dumps({"text": d, "meta": 1}) + "\n")
    pq.write_table(pa.table({"text": DOCS[20:30], "id": list(range(10))}), tmp_path / "b.parquet", row_group_size=4)


def test_byte_tokenizer_roundtrip_and_save(tmp_path):
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eos_id == 256
    ids = tok.encode("héllo\n")
    assert max(ids) < 256 and tok.decode(ids) == "héllo\n"
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(again, ByteTokenizer) and again.hash == tok.hash
    assert load_tokenizer("byte").hash == tok.hash


def test_bpe_train_save_load(tmp_path):
    tok = train_bpe(iter(DOCS * 3), vocab_size=300)
    assert tok.vocab_size == 300 and tok.decode(tok.encode(DOCS[3])) == DOCS[3]
    assert len(tok.encode(DOCS[3])) < len(DOCS[3].encode())  # merges learned
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.hash == tok.hash and again.eos_id == tok.eos_id
    assert again.encode(DOCS[5]) == tok.encode(DOCS[5])
    assert train_bpe(iter(DOCS * 3), vocab_size=300).hash == tok.hash  # deterministic
    with pytest.raises(DataError, match="tokenizer not found: .*nope.json"):
        load_tokenizer(tmp_path / "nope.json")


def test_preprocess_cli_txt_jsonl_parquet(tmp_path):
    write_inputs(tmp_path)
    out = tmp_path / "shards"
    rc = preprocess_cli.main(
        [
            "--input",
            str(tmp_path / "txt/*.txt"),
            str(tmp_path / "*.jsonl"),
            str(tmp_path / "*.parquet"),
            "--output",
            str(out),
            "--val-fraction",
            "0.2",
            "--seed",
            "3",
            "--no-progress",
        ]
    )
    assert rc == 0
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["tokenizer"]["hash"] == ByteTokenizer().hash
    assert index["splits"]["val"]["num_docs"] == 6 and index["splits"]["train"]["num_docs"] == 24
    tok = load_tokenizer(out)
    train, val = read_docs(out, "train", tok), read_docs(out, "val", tok)
    assert sorted(train + val) == sorted(DOCS)
    offsets = np.fromfile(out / "train.docs.bin", dtype=np.uint64)
    assert len(offsets) == 24 and offsets[0] == 0
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    # Same seed -> same split; another seed -> another split; any worker count -> same bytes.
    out2 = tmp_path / "again"
    assert (
        preprocess_cli.main(
            [
                "--input",
                str(tmp_path / "txt/*.txt"),
                str(tmp_path / "*.jsonl"),
                str(tmp_path / "*.parquet"),
                "--output",
                str(out2),
                "--val-fraction",
                "0.2",
                "--seed",
                "4",
                "--no-progress",
            ]
        )
        == 0
    )
    assert sorted(read_docs(out2, "val", tok)) != sorted(val)


def test_preprocess_bpe_and_stream(tmp_path):
    write_inputs(tmp_path)
    out = tmp_path / "bpe"
    from loomtrain.launcher.cli import main as cli_main

    assert (
        cli_main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "*.jsonl"),
                "--output",
                str(out),
                "--tokenizer",
                "bpe",
                "--bpe-vocab-size",
                "280",
                "--val-fraction",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    tok = load_tokenizer(out)
    assert tok.vocab_size == 280
    assert read_docs(out, "train", tok) == DOCS[10:20]
    s = TokenStream(out, seq_len=16, micro_batch_size=2, expected_tokenizer_hash=tok.hash)
    x, y = next(s)
    assert x.shape == (2, 16) and int(x.max()) < 280
    s.close()


def test_bpe_reports_the_vocabulary_and_the_bytes_it_really_had(tmp_path):
    """A small corpus cannot reach --bpe-vocab-size, nor fill --bpe-sample-bytes: preprocess says
    what it made (it printed "vocab 2048 ... 20,000,000 sampled bytes" for a 514-token BPE
    trained on 96 kB)."""
    (tmp_path / "in").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "in" / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    files = documents.expand_inputs([str(tmp_path / "in" / "*.txt")])
    lines: list[str] = []
    index = pp.preprocess_files(
        files,
        tmp_path / "out",
        "bpe",
        bpe_vocab_size=2048,
        bpe_sample_bytes=20_000_000,
        progress=False,
        log=lines.append,
    )
    vocab = load_tokenizer(tmp_path / "out").vocab_size
    assert vocab < 2048 and index["tokenizer"]["vocab_size"] == vocab
    text_bytes = sum(len(d.encode()) for d in DOCS)
    input_bytes = sum(p.stat().st_size for p in files)
    (report,) = [line for line in lines if line.startswith("BPE: ")]
    assert report.startswith(f"BPE: vocabulary of {vocab:,} tokens, trained on {text_bytes:,} bytes of text")
    assert f"is more than its {input_bytes:,} bytes" in report
    assert "fewer than --bpe-vocab-size 2,048" in report and f"model.vocab_size needs at least {vocab:,}" in report
    assert not any("20,000,000 sampled" in line for line in lines)
    assert pp.bpe_report(300, 300, 4000, 0, 9000) == "BPE: vocabulary of 300 tokens, trained on 4,000 bytes of text"


def test_workers_and_small_units_give_identical_shards(tmp_path, monkeypatch):
    big = [("x" * 300 + "\n") * 20 + f"doc {i}\n" for i in range(12)]  # 6 KB documents
    (tmp_path / "in").mkdir()
    for i, d in enumerate(big):
        (tmp_path / "in" / f"{i}.txt").write_text(d)
    monkeypatch.setattr(documents, "UNIT_BYTES", 1000)  # documents span several units; pool used
    files = documents.expand_inputs([str(tmp_path / "in/*.txt")])
    one = pp.preprocess_files(files, tmp_path / "w1", workers=1, val_fraction=0.25, progress=False, log=None)
    two = pp.preprocess_files(files, tmp_path / "w2", workers=2, val_fraction=0.25, progress=False, log=None)
    assert two["run"]["workers"] == 2
    assert one["splits"] == two["splits"]
    for sh in one["splits"]["train"]["shards"]:
        assert (tmp_path / "w1" / sh["file"]).read_bytes() == (tmp_path / "w2" / sh["file"]).read_bytes()
    tok = ByteTokenizer()
    assert sorted(read_docs(tmp_path / "w1", "train", tok) + read_docs(tmp_path / "w1", "val", tok)) == sorted(big)


def test_shards_roll_over(tmp_path):
    write_inputs(tmp_path)
    files = documents.expand_inputs([str(tmp_path / "txt/*.txt")])
    index = pp.preprocess_files(files, tmp_path / "s", shard_tokens=100, val_fraction=0, progress=False, log=None)
    shards = index["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["num_tokens"] == 100 for s in shards[:-1])
    assert read_docs(tmp_path / "s", "train", ByteTokenizer()) == DOCS[:10]


def test_val_split_is_stratified_and_exact():
    for f in (0.01, 0.1, 0.3, 0.7):
        split = pp.ValSplit(f, seed=5)
        n = 1000
        picks = [i for i in range(n) if split.is_val(i)]
        assert abs(len(picks) - n * f) <= 1
        assert picks == [i for i in range(n) if pp.ValSplit(f, seed=5).is_val(i)]
    assert [i for i in range(400) if pp.ValSplit(0.01, 0).is_val(i)] != [
        i for i in range(400) if pp.ValSplit(0.01, 1).is_val(i)
    ]


# Errors ---------------------------------------------------------------------
def test_error_missing_input_names_the_glob(tmp_path):
    with pytest.raises(DataError, match=r"input '.*/nothing\*\.txt' matches no files"):
        documents.expand_inputs([str(tmp_path / "nothing*.txt")])
    assert preprocess_cli.main(["--input", str(tmp_path / "nothing*.txt"), "--output", str(tmp_path / "o")]) == 1


def test_error_empty_input(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="inputs hold no text: .*empty.txt"):
        pp.preprocess_files(
            documents.expand_inputs([str(tmp_path / "*.txt")]), tmp_path / "o", progress=False, log=None
        )


def test_error_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{not json\n{"body": "x"}\n{"text": 3}\n')
    files = [path]
    with pytest.raises(DataError, match=r"bad.jsonl:4: not valid JSON"):
        pp.preprocess_files(files, tmp_path / "o", progress=False, log=None)
    path.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no field 'text'"):
        pp.preprocess_files(files, tmp_path / "o", progress=False, log=None)
    path.write_text('["a list"]\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: a JSON list, not an object with a field 'text'; --skip-bad"):
        pp.preprocess_files(files, tmp_path / "o", progress=False, log=None)
    path.write_text('{"text": "ok"}\n{not json\n{"body": "x"}\n{"text": 3}\n{"text": "fine"}\n')
    index = pp.preprocess_files(files, tmp_path / "o", skip_bad_lines=True, val_fraction=0, progress=False, log=None)
    assert index["stats"]["bad_lines"] == 3 and index["splits"]["train"]["num_docs"] == 2


def test_jsonl_without_the_text_field_lists_its_fields_and_suggests_text_field(tmp_path, capsys):
    """A JSONL written with another field name: the error lists the fields the line has and names
    --text-field with the likeliest one (the longest string), not only --skip-bad-lines (which
    would drop every line)."""
    path = tmp_path / "chat.jsonl"
    path.write_text('{"id": 7, "title": "A title", "body": "the document itself, longer"}\n' * 3)
    argv = ["--input", str(path), "--output", str(tmp_path / "out"), "--no-progress"]
    assert preprocess_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.strip() == (
        f"loomtrain preprocess: error: {path}:1: no field 'text' (fields: 'id', 'title', 'body'); "
        "if the text is in another field, pass --text-field body; --skip-bad-lines skips and counts such lines"
    )
    assert preprocess_cli.main([*argv, "--text-field", "body", "--val-fraction", "0"]) == 0
    assert read_docs(tmp_path / "out", "train", ByteTokenizer()) == ["the document itself, longer"] * 3


def test_error_parquet_without_the_column(tmp_path):
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "x.parquet")
    with pytest.raises(DataError, match=r"x.parquet: no column 'text' \(columns: body\)"):
        pp.preprocess_files([tmp_path / "x.parquet"], tmp_path / "o", progress=False, log=None)


def test_non_utf8_bytes_replaced_and_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"ok \xff\xfe done \xef\xbf\xbd\n")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "bad \xc3 byte"}\n')
    index = pp.preprocess_files(
        [tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "o", val_fraction=0, progress=False, log=None
    )
    assert index["stats"]["replaced_chars"] == 3  # the literal U+FFFD in a.txt is not counted
    assert read_docs(tmp_path / "o", "train", ByteTokenizer())[0] == "ok \ufffd\ufffd done \ufffd\n"


def test_error_shards_from_another_tokenizer_refused(tmp_path):
    write_inputs(tmp_path)
    pp.preprocess_files(documents.expand_inputs([str(tmp_path / "*.jsonl")]), tmp_path / "o", progress=False, log=None)
    other = train_bpe(iter(DOCS), 270)
    other.save(tmp_path / "tok")
    cfg = DataConfig(path=str(tmp_path / "o"), tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    msg = rf"shards were made by tokenizer {ByteTokenizer().hash} \(byte\), but this run's tokenizer is {other.hash}"
    with pytest.raises(DataError, match=msg):
        prepare_data(cfg)
    with pytest.raises(DataError, match=msg):
        TokenStream(tmp_path / "o", seq_len=4, micro_batch_size=1, expected_tokenizer_hash=other.hash)
    shard_dir, tok = prepare_data(replace(cfg, tokenizer="byte"))
    assert shard_dir == tmp_path / "o" and tok.hash == ByteTokenizer().hash


def test_error_truncated_shard_detected(tmp_path):
    write_inputs(tmp_path)
    pp.preprocess_files(
        documents.expand_inputs([str(tmp_path / "txt/*.txt")]), tmp_path / "o", val_fraction=0, progress=False, log=None
    )
    shard = tmp_path / "o" / "train_00000.bin"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(
        DataError,
        match=rf"shard .*train_00000.bin is truncated or corrupt: index says {size // 2} tokens = {size} bytes, "
        rf"the file has {size - 10} bytes",
    ):
        prepare_data(DataConfig(path=str(tmp_path / "o")))
    with pytest.raises(DataError, match="no index.json: not a complete shard directory"):
        prepare_data(DataConfig(path=str(tmp_path / "txt")))


# The embedded corpus ------------------------------------------------------------
CHILD = """
import sys, types
from loomtrain.data_pipeline.corpus import prepare_data
cfg = types.SimpleNamespace(path="", tokenizer="byte", bpe_vocab_size=4096, max_files=30, val_fraction=0.01,
                            split_seed=0, cache_dir="", prefetch=2)
shard_dir, tok = prepare_data(cfg, sys.argv[1])
print(shard_dir, tok.hash)
"""


def test_prepare_data_embedded_corpus_cached_and_concurrent(tmp_path):
    cache = tmp_path / "cache"
    # Three processes at once (light ones: no torch), as ranks on one machine would.
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(cache)], stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        results.append(tuple(out.split()))
    assert len(set(results)) == 1
    shard_dir, tok = prepare_data(DataConfig(max_files=30), cache)
    assert str(shard_dir) == results[0][0]
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [shard_dir.name]
    index = json.loads((shard_dir / "index.json").read_text())
    assert index["stats"]["files"] == 30 and index["splits"]["train"]["num_tokens"] > 10_000
    text = tok.decode(ShardSet(shard_dir, "train").read(0, 2000).tolist())
    assert "import" in text or "def " in text
    other, _ = prepare_data(DataConfig(max_files=31), cache)
    assert other != shard_dir
    with pytest.raises(DataError, match="data.cache_dir"):
        prepare_data(DataConfig(max_files=30))
    assert os.path.isdir(shard_dir)


def test_a_requested_val_split_keeps_a_document_of_a_short_corpus(tmp_path):
    """Fewer documents than 1 / --val-fraction: the one stratum is cut short by the corpus's end,
    and still gives the validation split one document (it had none for most seeds)."""
    write_inputs(tmp_path)
    files = documents.expand_inputs([str(tmp_path / "txt/*.txt")])  # 10 documents
    for seed in range(8):
        index = pp.preprocess_files(
            files, tmp_path / f"s{seed}", val_fraction=0.01, seed=seed, progress=False, log=None
        )
        assert index["splits"]["val"]["num_docs"] == 1, (seed, index["splits"])
        assert index["splits"]["train"]["num_docs"] == 9
    split = pp.ValSplit(0.01, seed=3, documents=250)  # a full first stratum: the choice as before
    assert [i for i in range(250) if split.is_val(i)] == [i for i in range(250) if pp.ValSplit(0.01, 3).is_val(i)]


def test_one_document_cannot_be_split(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(DataError, match=r"^--val-fraction 0\.05: the input holds one document, .*--val-fraction 0$"):
        pp.preprocess_files([tmp_path / "one.txt"], tmp_path / "s", val_fraction=0.05, progress=False, log=None)
    index = pp.preprocess_files([tmp_path / "one.txt"], tmp_path / "s", val_fraction=0, progress=False, log=None)
    assert index["splits"]["train"]["num_docs"] == 1


def test_the_embedded_corpus_summary_names_the_cache_folder_not_the_build(tmp_path):
    lines = []
    shard_dir, _ = prepare_data(DataConfig(max_files=3, tokenizer="byte", cache_dir=str(tmp_path)), log=lines.append)
    summary = [line for line in lines if line.startswith("preprocess: 3 files")]
    assert len(summary) == 1 and summary[0].endswith(f"-> {shard_dir}"), lines
    assert ".tmp-" not in "\n".join(lines)
