"""The fine-tuning recipe: "complete this function" chats cut from the standard library
(data_pipeline/instructions.py), configs/sft-tiny.yaml training on their answers (the answer-only
validation loss falls), and `generate --chat` asking in the template the records were trained in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loomtrain.data_pipeline.instructions import ASK, corpus_chats, function_chats, main, write_jsonl
from loomtrain.data_pipeline.preprocess import preprocess_files
from loomtrain.data_pipeline.records import question_tokens
from loomtrain.data_pipeline.shard_set import ShardSet
from loomtrain.data_pipeline.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]

SOURCE = '''
def add(a, b):
    """Sum."""
    # the comment goes with the body
    return a + b


class C:
    @property
    def twice(self):
        return 2 * self.x

    def one_line(self): return 1

    def only_doc(self):
        """Nothing else."""


def long(x):
    return x + 1000000000000000000000000000000000000000000000000000000000000000000000000000000000
'''


def test_function_chats_ask_with_the_signature_and_answer_with_the_body():
    chats = list(function_chats(SOURCE, max_bytes=120))
    pairs = [(c["messages"][0]["content"], c["messages"][1]["content"]) for c in chats]
    assert pairs == [
        (ASK + 'def add(a, b):\n    """Sum."""', "    # the comment goes with the body\n    return a + b"),
        (ASK + "def twice(self):", "    return 2 * self.x"),  # a method, dedented, without its decorator
    ]  # a one-line def, a docstring alone and a record over 120 bytes are left out
    assert [c["messages"][0]["role"] for c in chats] == ["user", "user"]
    assert list(function_chats("def broken(:\n", 200)) == []


def test_generate_chat_asks_in_the_template_preprocess_trained(tmp_path, capsys):
    """The helper's JSONL preprocesses as chat; `generate --chat`'s prompt is, token for token,
    a record's prompt as the shards hold it (everything before its first target)."""
    out = tmp_path / "functions.jsonl"
    assert main(["--output", str(out), "--max-files", "12"]) == 0
    assert "'complete this function' chats" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) >= 5 and len({json.dumps(r) for r in records}) == len(records)
    assert all(r["messages"][0]["content"].startswith(ASK) for r in records)
    for _ in range(2):  # a rerun replaces its own earlier output, the loss mask files included
        preprocess_files([out], tmp_path / "shards", "byte", val_fraction=0.0, progress=False, log=None)
    shards = ShardSet(tmp_path / "shards")
    assert shards.records == "chat"
    start, end = int(shards.doc_starts[0]), int(shards.doc_starts[1])
    first_target = int(shards.read_mask(start, end - start).argmax())
    asked = question_tokens(ByteTokenizer(), records[0]["messages"][0]["content"])
    assert asked == shards.read(start, first_target).tolist()


@pytest.mark.slow  # 24 steps of the tiny model on 256-token windows and a generate, ~15 s
def test_sft_tiny_trains_on_answers_and_its_eval_loss_falls(tmp_path, capsys):
    from loomtrain.launcher.cli.generate import main as generate_main
    from loomtrain.launcher.config_loader import load_config
    from loomtrain.launcher.training.loop import run_training

    write_jsonl(corpus_chats(max_files=60), tmp_path / "functions.jsonl")
    preprocess_files(
        [tmp_path / "functions.jsonl"], tmp_path / "functions", "byte", val_fraction=0.1, progress=False, log=None
    )
    run_dir = tmp_path / "sft"
    cfg = load_config(
        ROOT / "configs" / "sft-tiny.yaml",
        [
            "model.init_from=''",  # from scratch here: the recipe starts from the tiny run's final/
            f"data.path={tmp_path / 'functions'}",
            f"run.dir={run_dir}",
            "train.max_steps=24",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "train.warmup_steps=4",
            "eval.every_steps=8",
            "eval.batches=2",
            "eval.num_samples=1",
            "eval.sample_tokens=8",
            "log.progress=plain",
            "log.tensorboard=false",
            "checkpoint.every_steps=0",
        ],
    )
    assert cfg.data.document_masking is None and cfg.train.seq_len == 256
    result = run_training(cfg)
    evals = [result.evals[s] for s in (8, 16, 24)]
    assert evals[0] > evals[1] > evals[2], evals  # the answers' loss on held-out functions falls
    out = capsys.readouterr().out
    assert "sample 0: prompt '<|user|>\\nComplete this function: def " in out, out[-2000:]
    assert "loomtrain: document masking: attention stays inside each packed document" in out  # on for chat data
    assert "(kernel: blocked attention, each query block's mask built from the document ids" in out  # names the kernel

    assert generate_main([str(run_dir), "--chat", ASK + "def add(a, b):", "--max-new-tokens", "8"]) == 0
    reply = capsys.readouterr().out  # the reply alone: 24 steps from scratch say little (often spaces)
    assert reply.endswith("\n") and "<|user|>" not in reply and "Complete this function" not in reply
    assert generate_main([str(run_dir), "--chat", "hi", "--prompt", "def "]) == 2
    assert "--chat and --prompt: give one" in capsys.readouterr().err
