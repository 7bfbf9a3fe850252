"""Instruction and chat data: `loomtrain preprocess --format`, shards with a loss mask beside the
tokens (index version 2; version 1 shards still read, every token a target), bad records named
by file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from loomtrain.data_pipeline.preprocess import preprocess_files
from loomtrain.data_pipeline.records import RecordFormat, record_tokens
from loomtrain.data_pipeline.shard_set import ShardSet
from loomtrain.data_pipeline.shards import INDEX
from loomtrain.data_pipeline.tokenizer import ByteTokenizer, train_bpe
from loomtrain.launcher.cli.preprocess import main as preprocess_main
from stream_support import write_arrays

CHAT = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6"},
        ]
    },
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def targets_text(tok, tokens, mask) -> list[str]:
    """The runs of target tokens, decoded."""
    runs, cur = [], []
    for t, m in zip(tokens.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_chat_is_detected_and_only_the_replies_are_targets(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    preprocess_files([src], tmp_path / "out", "byte", val_fraction=0.0, progress=False, log=None)
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert index["version"] == 2 and index["records"] == "chat"
    shards = ShardSet(tmp_path / "out")
    tokens, mask = shards.read(0, shards.num_tokens), shards.read_mask(0, shards.num_tokens)
    tok = ByteTokenizer()
    assert targets_text(tok, tokens, mask) == ["hello!<|endoftext|>", "4<|endoftext|>", "6<|endoftext|>"]
    # Every record is one document that ends with EOS (the docs file keeps the boundaries).
    starts = shards.doc_starts
    assert starts.tolist()[0] == 0 and len(starts) == 2
    assert tokens[starts[1] - 1] == tok.eos_id and tokens[-1] == tok.eos_id
    assert tok.decode(tokens[: starts[1]]).startswith("<|user|>\nhi\n<|assistant|>\nhello!")


def test_prompt_response_detected_and_train_on_prompt(tmp_path):
    src = write_jsonl(tmp_path / "pr.jsonl", [{"prompt": "Q: x?", "response": "A: y."}])
    preprocess_files([src], tmp_path / "a", "byte", val_fraction=0.0, progress=False, log=None)
    shards = ShardSet(tmp_path / "a")
    assert shards.records == "prompt-response"
    tok = ByteTokenizer()
    assert targets_text(tok, shards.read(0, shards.num_tokens), shards.read_mask(0, shards.num_tokens)) == [
        "A: y.<|endoftext|>"
    ]
    fmt = RecordFormat("prompt-response", train_on_prompt=True)
    preprocess_files([src], tmp_path / "b", "byte", val_fraction=0.0, progress=False, log=None, records=fmt)
    shards = ShardSet(tmp_path / "b")
    assert shards.read_mask(0, shards.num_tokens).all()


def test_text_shards_have_no_mask_and_version_1_shards_read_as_all_targets(tmp_path):
    info = {"hash": "h", "name": "byte", "vocab_size": 257, "eos_id": 256}
    write_arrays(tmp_path / "v1", {"train": np.arange(100, dtype=np.uint16)}, info)
    index = json.loads((tmp_path / "v1" / INDEX).read_text())
    index["version"] = 1
    del index["records"]
    (tmp_path / "v1" / INDEX).write_text(json.dumps(index))
    shards = ShardSet(tmp_path / "v1")
    assert shards.records == "text" and shards.mask is None
    assert shards.read_mask(10, 20).tolist() == [1] * 20
    assert shards.doc_starts.tolist() == [0]


def test_hf_chat_template_marks_the_assistant_turns(tmp_path):
    tok = train_bpe(iter(["hello there, how are you? fine thanks"] * 20), 300)
    tok.chat = {
        "chat_template": "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}",
        "bos_token": "",
        "eos_token": "<|endoftext|>",
    }
    ids, mask = record_tokens(CHAT[1], RecordFormat("chat"), tok)
    assert targets_text(tok, ids, mask) == ["4\n", "6\n"]
    assert tok.decode(ids.tolist()).startswith("<|endoftext|>system: be brief\n")
    assert ids[-1] == tok.eos_id and mask[-1] == 0  # EOS added to end the document, not a target


@pytest.mark.parametrize(
    "record, extra, expected",
    [
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
            [],
            "messages[1].role is 'tool', expected system, user or assistant",
        ),
        (
            {"messages": [{"role": "user", "content": "only a question"}]},
            [],
            "the record has no target tokens (no assistant message)",
        ),
        (
            {"messages": [{"role": "user", "content": "q" * 40}, {"role": "assistant", "content": "a"}]},
            ["--seq-len", "32"],
            "the record is 66 tokens, more than train.seq_len + 1 = 33 (--seq-len 32)",
        ),
    ],
    ids=["role", "no-targets", "too-long"],
)
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, capsys, record, extra, expected):
    src = write_jsonl(tmp_path / "data.jsonl", [CHAT[0], record])
    rc = preprocess_main(["--input", str(src), "--output", str(tmp_path / "out"), "--no-progress", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"loomtrain preprocess: error: {src}:2: {expected}"), err
    assert not (tmp_path / "out").exists()


def test_truncate_cuts_a_long_record_to_seq_len_plus_one(tmp_path, capsys):
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 60}]}
    src = write_jsonl(tmp_path / "data.jsonl", [record])
    argv = ["--input", str(src), "--output", str(tmp_path / "out"), "--no-progress", "--val-fraction", "0"]
    assert preprocess_main([*argv, "--seq-len", "32", "--truncate"]) == 0, capsys.readouterr().err
    shards = ShardSet(tmp_path / "out")
    assert shards.num_tokens == 33 and shards.read_mask(0, 33)[-1] == 1
