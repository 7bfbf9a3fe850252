"""Fine-tuning runs end to end: the validation loss counts the answers' tokens only, evaluation
samples answer held-out questions (the prompt shown, the answer generated, on the console and in
TensorBoard), a run with document masking resumed mid-epoch continues exactly, and ZeRO-3 gives
the ZeRO-0 run's losses."""

from __future__ import annotations

import json
import random

import pytest
import small_configs
import torch
import torch.nn.functional as F
from loomtrain.data_pipeline.preprocess import preprocess_files

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "alpha beta gamma delta eps zeta eta theta".split()


def chat_jsonl(path, n: int = 64, seed: int = 0):
    """Short one-turn chats; the answer echoes the question's first word, so there is something to learn."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            q = [rng.choice(WORDS) for _ in range(rng.randint(1, 6))]
            a = " ".join([q[0]] + [rng.choice(WORDS) for _ in range(rng.randint(0, 3))])
            turns = [{"role": "user", "content": " ".join(q)}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory):
    work = tmp_path_factory.mktemp("sft_chat")
    preprocess_files(
        [chat_jsonl(work / "chat.jsonl")], work / "shards", "byte", val_fraction=0.25, progress=False, log=None
    )
    return work / "shards"


# A 1-layer model on 96-token windows of chat records (about three records a window).
SFT = [
    *small_configs.SFT,
    "train.micro_batch_size=2",
    "train.warmup_steps=0",
    "train.lr=1e-2",
    "log.progress=plain",
    "log.tensorboard=false",
    "checkpoint.every_steps=0",
]


def sft_cfg(run_dir, shards, *extra):
    from launch import TINY
    from loomtrain.launcher.config_loader import load_config

    return load_config(TINY, [*SFT, f"data.path={shards}", f"run.dir={run_dir}", *extra])


def reference_eval(ctx) -> tuple[float, float]:
    """(mean over every target token, mean of the batches' means) of the eval batches, by hand."""
    from loomtrain.launcher.training import startup

    sums, counts = [], []
    with startup.val_stream(ctx.cfg, ctx.shard_dir, ctx.topology, ctx.tokenizer) as stream, torch.no_grad():
        for _ in range(ctx.cfg.eval.batches):
            x, y, docs = next(stream)
            logits = ctx.model(x, document_ids=docs).float()
            sums.append(float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")))
            counts.append(int((y != -100).sum()))
    return sum(sums) / sum(counts), sum(s / n for s, n in zip(sums, counts)) / len(counts)


def test_eval_loss_is_over_answer_tokens_and_samples_answer_held_out_questions(tmp_path, chat_shards, capsys):
    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training import startup
    from loomtrain.launcher.training.loop import run_training
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Check(Hooks):
        def on_eval_end(self, ctx, ev):
            self.eval_loss = ev["eval/loss"]
            self.target_mean, self.mean_of_means = reference_eval(ctx)
            self.questions = startup.held_out_questions(ctx.cfg, ctx.shard_dir, ctx.topology, ctx.tokenizer, 2)
            self.tok = ctx.tokenizer

    check = Check()
    run_dir = tmp_path / "run"
    overrides = ["train.max_steps=2", "eval.every_steps=2", "eval.batches=3", "eval.num_samples=2"]
    run_training(sft_cfg(run_dir, chat_shards, *overrides, "eval.sample_tokens=12", "log.tensorboard=true"), [check])

    # The eval loss is the mean over the answers' tokens of all eval batches, not a mean of means.
    assert check.eval_loss == pytest.approx(check.target_mean, rel=1e-5)
    # The batches hold unequal numbers of targets: a mean of means differs by 10x the tolerance above.
    assert abs(check.mean_of_means - check.target_mean) > 10 * 1e-5 * check.target_mean

    # Samples: the first two validation records' questions (through the assistant's cue), each answered.
    questions = [check.tok.decode(q) for q in check.questions]
    val = [json.loads(line) for line in (chat_shards.parent / "chat.jsonl").read_text().splitlines()]
    user_texts = {r["messages"][0]["content"] for r in val}
    assert len(questions) == 2
    for q in questions:
        assert q.startswith("<|user|>\n") and q.endswith("\n<|assistant|>\n"), q
        assert q[len("<|user|>\n") : -len("\n<|assistant|>\n")] in user_texts
    out = capsys.readouterr().out
    for i, q in enumerate(questions):
        assert f"sample {i}: prompt {q!r}" in out, out[-3000:]
        assert f"sample {i}: answer '" in out
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    shown = acc.Tensors("samples/0/text_summary")[0].tensor_proto.string_val[0].decode()
    assert shown.startswith(f"prompt:\n```\n{questions[0]}\n```\n\nanswer:\n```\n"), shown


def test_masked_run_resumed_mid_epoch_continues_exactly(tmp_path, chat_shards):
    """4 steps straight == 2 steps, stop, resume, 2 steps: the same losses and eval loss, bitwise
    (document masking on, micro batches of unequal target counts weighted per step)."""
    from loomtrain.data_pipeline import TokenStream
    from loomtrain.launcher.training.loop import run_training

    common = ["train.max_steps=4", "checkpoint.every_steps=2", "eval.every_steps=4", "eval.batches=2"]
    common += ["eval.num_samples=0"]
    with TokenStream(chat_shards, seq_len=96, micro_batch_size=1, prefetch=0) as s:
        assert s.document_masking and s.samples_per_epoch > 4 * 4  # step 2 is mid-epoch, and so is step 4
    straight = run_training(sft_cfg(tmp_path / "straight", chat_shards, *common))
    split = tmp_path / "split"
    first = run_training(sft_cfg(split, chat_shards, *common, "checkpoint.stop_at_step=2"))
    second = run_training(sft_cfg(split, chat_shards, *common))
    assert first.steps == [1, 2] and second.steps == [3, 4]
    assert first.losses + second.losses == straight.losses
    assert second.evals == straight.evals and len(straight.evals) == 1
    state = json.loads((split / "checkpoints" / "step_00000004" / "data" / "dp_00000.json").read_text())
    assert state["global_position"] == 16 and state["document_masking"] is True


def test_a_masked_run_at_zero_3_follows_the_zero_0_run(tmp_path, chat_shards):
    """Document masking and answer-only losses through ZeRO-3's partitioned parameters: the same
    step losses and eval loss as the ZeRO-0 run."""
    from loomtrain.launcher.training.loop import run_training

    common = ["train.max_steps=3", "eval.every_steps=3", "eval.batches=2", "eval.num_samples=0"]
    ref = run_training(sft_cfg(tmp_path / "ref", chat_shards, *common))
    got = run_training(sft_cfg(tmp_path / "zero3", chat_shards, *common, "parallel.zero_stage=3"))
    assert got.losses == pytest.approx(ref.losses, rel=1e-5, abs=0)
    assert got.evals[3] == pytest.approx(ref.evals[3], rel=1e-5, abs=0)


@pytest.mark.slow  # compiles the block with a document mask, ~10 s
def test_a_compiled_run_with_document_masking_follows_the_eager_run(tmp_path, chat_shards):
    """parallel.compile with packed chat records: the blocks compile with the document mask and
    the positions that restart at each record, and give the eager run's losses."""
    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training.loop import run_training

    class Seen(Hooks):
        def on_train_end(self, ctx):
            self.masking = ctx.train_stream.document_masking
            self.compiled = all(b._compiled_call_impl is not None for b in ctx.model.blocks)

    steps = ["train.max_steps=3", "eval.every_steps=0", "eval.num_samples=0"]
    eager = run_training(sft_cfg(tmp_path / "eager", chat_shards, *steps))
    seen = Seen()
    compiled = run_training(sft_cfg(tmp_path / "compiled", chat_shards, *steps, "parallel.compile=true"), [seen])
    assert seen.masking and seen.compiled
    assert compiled.losses == pytest.approx(eager.losses, abs=1e-4)


def test_loss_weights_count_the_global_targets_exactly_past_2_to_the_24():
    """The step's target count is summed in float64: in float32, 2**24 + 1 targets were 2**24,
    and a step of a 2**24-target micro batch and a 1-target one weighed the first 2.0, not 2 - 2**-23."""
    from types import SimpleNamespace

    from loomtrain.launcher.training import loop

    ctx = SimpleNamespace(
        train_stream=SimpleNamespace(loss_masked=True),
        topology=SimpleNamespace(dp_size=1, cp_size=1),
        dist=SimpleNamespace(device=torch.device("cpu")),
    )
    batches = [(None, torch.zeros(1, 2**24, dtype=torch.int8)), (None, torch.zeros(1, 1, dtype=torch.int8))]
    big, small = loop._loss_weights(batches, ctx, grad_accum=2)
    assert big.item() == 2 - 2**-23 and small.item() == pytest.approx(2 / (2**24 + 1), rel=1e-7)
