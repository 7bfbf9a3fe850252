"""The training loop end to end: CLI run, metrics + TensorBoard, falling loss, determinism, generate."""

from __future__ import annotations

from pathlib import Path

import launch
import pytest
from launch import TINY, records, run_loomtrain
from loomtrain.launcher.config_loader import load_config

# tiny.yaml shrunk to seconds: a 2-layer d=64 model, 32-token sequences, grad_accum 2.
SMALL = [
    *launch.SMALL,
    "train.global_batch_size=8",
    "data.val_fraction=0.1",
    "eval.batches=2",
    "eval.sample_tokens=16",
    "log.progress=plain",
    "checkpoint.every_steps=0",
]
TRAIN_TAGS = {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "mem_bytes"}
EVAL_TAGS = {"loss/val", "loss/val_ppl"}
# TensorBoard groups the same metrics (metrics.jsonl keeps the plain keys above).
TB_TAGS = launch.TB_SCALARS


# Tiny models gain nothing from threads; on a shared 2-core box they only spin.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, data_cache):
    """`loomtrain train` as a user runs it: 4 steps, eval at 2 and 4."""
    work = tmp_path_factory.mktemp("cli")
    run_dir = work / "runs" / "small"
    proc = run_loomtrain(
        "train",
        TINY,
        *SMALL,
        "train.max_steps=4",
        "eval.every_steps=2",
        f"run.dir={run_dir}",
        f"data.cache_dir={data_cache}",
        cwd=work,
    )
    return run_dir, proc


def test_cli_run_writes_metrics_jsonl(cli_run):
    run_dir, proc = cli_run
    rows = records(run_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [2, 4]
    for r in train:
        assert TRAIN_TAGS <= set(r)
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["mem_bytes"] > 0
        assert 0 < r["mfu"] <= 1  # the CPU peak holds under any load (launcher/observe/metrics.py)
    assert evals[-1]["eval/ppl"] == pytest.approx(2.718281828 ** evals[-1]["eval/loss"], rel=1e-6)
    # the run directory and TensorBoard location are printed; the resolved config is saved
    assert f"run directory: {run_dir}" in proc.stdout
    assert f"TensorBoard logs: {run_dir}  (tensorboard --logdir {run_dir.parent})" in proc.stdout
    assert load_config(run_dir / "config.yaml").train.max_steps == 4


def test_cli_run_writes_tensorboard_events(cli_run):
    """Grouped tags, and `tensorboard --logdir runs/` shows the run under its own name."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    run_dir, _ = cli_run
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert TB_TAGS | EVAL_TAGS <= set(tags["scalars"]), tags["scalars"]
    assert not TRAIN_TAGS & set(tags["scalars"])  # no ungrouped duplicates
    assert [e.step for e in acc.Scalars("loss/train")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("loss/val")] == [2, 4]
    # TensorBoard orders the groups by name: the losses' group is the first a user sees
    assert sorted({t.split("/")[0] for t in tags["scalars"]})[0] == "loss", tags["scalars"]
    assert any(t.startswith("samples/") for t in tags["tensors"])  # text samples
    assert acc.PluginTagToContent("hparams")  # the resolved config as hyperparameters
    runs = EventMultiplexer().AddRunsFromDirectory(str(run_dir.parent)).Runs()
    assert set(runs) == {run_dir.name}, runs  # "small", not "small/tb"


def test_generate_on_the_saved_run(cli_run):
    run_dir, _ = cli_run
    final = run_dir / "final"
    assert {p.name for p in final.iterdir()} >= {"model.safetensors", "model_config.json", "tokenizer"}
    proc = run_loomtrain("generate", run_dir, "--prompt", "import ", "--max-new-tokens", "12", cwd=run_dir)
    out = proc.stdout.rstrip("\n")
    assert out.startswith("import ")
    # greedy (temperature 0) is deterministic
    again = run_loomtrain("generate", run_dir, "--prompt", "import ", "--max-new-tokens", "12", cwd=run_dir)
    assert again.stdout == proc.stdout


def test_generate_takes_a_checkpoint_where_a_run_has_no_final(cli_run, tmp_path, capsys):
    """A run stopped early (checkpoint.stop_at_step) has no final/: generate used to say 'no
    final/ directory ... (did the run finish?)' while export took the same checkpoint. It reads
    the run's newest complete checkpoint, or a checkpoint directory given directly, and says so."""
    import shutil

    from loomtrain.launcher.cli import generate

    run_dir, _ = cli_run
    args = ["--prompt", "import ", "--max-new-tokens", "12", "--device", "cpu"]
    assert generate.main([str(run_dir), *args]) == 0
    final = capsys.readouterr()
    assert "using" not in final.err
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    stopped = tmp_path / "stopped"
    shutil.copytree(run_dir, stopped, ignore=lambda d, names: ["final"] if Path(d) == run_dir else [])
    assert not (stopped / "final").exists()
    for source, ckpt in ((newest, newest), (stopped, stopped / "checkpoints" / newest.name)):
        assert generate.main([str(source), *args]) == 0
        got = capsys.readouterr()
        assert got.out == final.out  # fp32: the checkpoint's masters are the final weights
        assert got.err.strip() == f"loomtrain generate: no final/ weights: using checkpoint {ckpt}"


def test_samples_continue_a_held_out_document_unless_eval_prompt_is_set(cli_run, data_cache):
    """The samples started from 'def ' whatever the data (English text, a chat model): with
    eval.prompt empty (the default) they continue the start of a held-out document."""
    import ast

    from loomtrain.data_pipeline import prepare_sources
    from loomtrain.launcher.planning.dryrun import OneRankTopology
    from loomtrain.launcher.training import startup

    eos = 9
    assert startup.held_out_prompt([1, 2, eos, 5, 6, 7, 8, eos, 3], eos, 16) == [5, 6, 7, 8]
    assert startup.held_out_prompt([1, 2, 3, 4, 5], eos, 3) == [1, 2, 3]  # mid-document: from its start
    assert startup.held_out_prompt([1, 2, eos, 5], eos, 16) == [1, 2]  # too little after the end-of-text
    assert startup.held_out_prompt([eos, eos], eos, 16) == [eos]

    run_dir, proc = cli_run
    cfg = load_config(run_dir / "config.yaml", [f"data.cache_dir={data_cache}"])
    assert cfg.eval.prompt == ""
    shard_dir, tok = prepare_sources(cfg.data, data_cache, log=None)
    ids = startup.sample_prompt(cfg, shard_dir, OneRankTopology(1), tok)
    assert 0 < len(ids) <= startup.PROMPT_TOKENS and tok.eos_id not in ids
    prompt = tok.decode(ids)
    shown = [
        ast.literal_eval(line[len("sample: ") :]) for line in proc.stdout.splitlines() if line.startswith("sample: ")
    ]
    assert shown and all(text.startswith(prompt) for text in shown), (prompt, shown)
    cfg.eval.prompt = "class "
    assert tok.decode(startup.sample_prompt(cfg, shard_dir, OneRankTopology(1), tok)) == "class "


def small_cfg(tmp_path: Path, data_cache: Path, *extra: str):
    return load_config(TINY, [*SMALL, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}", *extra])


def test_same_seed_same_losses_and_loss_falls(tmp_path, data_cache):
    from loomtrain.launcher.training.loop import run_training

    extra = ("train.max_steps=30", "train.lr=3e-3", "train.min_lr=3e-4", "eval.every_steps=0", "log.tensorboard=false")
    a = run_training(small_cfg(tmp_path / "a", data_cache, *extra))
    b = run_training(small_cfg(tmp_path / "b", data_cache, *extra))
    assert len(a.losses) == 30
    assert a.losses == b.losses  # bitwise, on CPU
    first, last = sum(a.losses[:3]) / 3, sum(a.losses[-3:]) / 3
    assert last < first - 1.0, (first, last)
    other = run_training(small_cfg(tmp_path / "c", data_cache, *extra[:1], "train.seed=7", *extra[1:]))
    assert other.losses != a.losses


def test_hooks_see_every_step_and_can_stop_the_run(tmp_path, data_cache):
    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training.loop import run_training

    class Recorder(Hooks):
        def __init__(self):
            self.calls = []

        def on_train_start(self, ctx):
            self.calls.append(("start", ctx.state.step, ctx.engine is not None, ctx.train_stream is not None))

        def on_step_end(self, ctx, metrics):
            self.calls.append(("step", ctx.state.step, round(metrics["loss"], 6)))
            if ctx.state.step == 2:
                ctx.stop_requested = True

        def on_train_end(self, ctx):
            self.calls.append(("end", ctx.state.step, ctx.state.tokens_seen))

    rec = Recorder()
    result = run_training(small_cfg(tmp_path, data_cache, "train.max_steps=5", "eval.every_steps=0"), hooks=[rec])
    assert result.steps == [1, 2]
    assert rec.calls == [
        ("start", 0, True, True),
        ("step", 1, round(result.losses[0], 6)),
        ("step", 2, round(result.losses[1], 6)),
        ("end", 2, 2 * 8 * 32),
    ]
    assert result.final_dir is None  # stopped early: no final weights


def test_train_context_is_typed():
    """TrainContext's annotations resolve to real classes (through the module's TYPE_CHECKING
    imports), and none is Any."""
    import ast
    import typing

    from loomtrain.launcher import hooks

    tree = ast.parse(Path(hooks.__file__).read_text())
    only_for_types: dict = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            exec(compile(ast.Module(body=node.body, type_ignores=[]), hooks.__file__, "exec"), only_for_types)
    hints = typing.get_type_hints(hooks.TrainContext, localns=only_for_types)
    assert {"engine", "model", "tokenizer", "train_stream", "metrics", "topology"} <= set(hints)
    assert typing.Any not in hints.values()


@pytest.mark.slow
def test_two_data_parallel_ranks_follow_one_process(tmp_path, data_cache):
    """torchrun with dp=2 (micro 4, no accumulation) == one process (micro 4, grad_accum 2)."""
    from loomtrain.launcher.training.loop import run_training

    extra = ["train.max_steps=4", "eval.every_steps=0", "log.tensorboard=false"]
    single = run_training(small_cfg(tmp_path / "one", data_cache, *extra)).losses
    single_hashes = [r["data/samples_hash"] for r in records(tmp_path / "one") if "loss" in r]
    run_loomtrain(
        "train",
        TINY,
        *SMALL,
        *extra,
        f"run.dir={tmp_path / 'two'}",
        f"data.cache_dir={data_cache}",
        nproc=2,
        cwd=tmp_path,
    )
    two = [r["loss"] for r in records(tmp_path / "two") if "loss" in r]
    assert two == pytest.approx(single, abs=1e-5)
    # the same samples at each step, read by one rank or two (data/samples_hash)
    two_hashes = [r["data/samples_hash"] for r in records(tmp_path / "two") if "loss" in r]
    assert two_hashes == single_hashes and len(set(single_hashes)) == 4
