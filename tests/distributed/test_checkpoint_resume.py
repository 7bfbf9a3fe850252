"""Checkpoint/resume through the real CLI (`loomtrain train`, torchrun for 4 ranks):

* 8 steps straight == 4 steps, exit, the same command again (auto resume), 4 steps
  (bitwise, CPU fp32; the save lands after the 2 warmup steps, so the resumed steps need the
  optimizer's moments and step count, the LR schedule and the data position, each restored):
  one process (ZeRO 0) and TP2 x DP2 at ZeRO 2 (whose straight run and first 4 steps share one
  torchrun, tests/cli_driver.py; the resume is a torchrun of its own);
* the TP2 x DP2 checkpoint resumed at (tp1, dp1), (tp2, dp1), (tp1, dp4): losses within
  1e-5 of the uninterrupted run and the data position exactly where it was;
* SIGKILL while a checkpoint is being written leaves the previous one as latest, and the
  next start resumes from it; a truncated file is detected, named and skipped.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import launch
import pytest
from launch import TINY, Run, checkpoint_saved_on_signal, child_env, loomtrain_cmd, losses, output, run_child

STEPS, GLOBAL_BATCH, SEQ = 8, 8, 32
HALF = STEPS // 2  # where the split runs stop and resume
EVERY = 2  # the single-process runs' checkpoint interval: the sigkill and truncation tests fall back one
# vocab 259: padded to 260 at tp 2, so the export/reshard path has to drop the padding.
SMALL = [
    *launch.SMALL,
    "model.vocab_size=259",
    f"train.seq_len={SEQ}",
    "train.micro_batch_size=2",
    f"train.global_batch_size={GLOBAL_BATCH}",
    f"train.max_steps={STEPS}",
    "data.val_fraction=0.1",
    *launch.QUIET,
]


def train_args(run_dir: Path, data_cache: Path, *overrides: str) -> list:
    return ["train", TINY, *SMALL, f"run.dir={run_dir}", f"data.cache_dir={data_cache}", *overrides]


def train_cmd(run_dir: Path, data_cache: Path, *overrides: str, nproc: int = 1) -> list[str]:
    return loomtrain_cmd(*train_args(run_dir, data_cache, *overrides), nproc=nproc)


def train(run_dir: Path, data_cache: Path, *overrides: str, nproc: int = 1, env=None):
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return run_child(train_cmd(run_dir, data_cache, *overrides, nproc=nproc), cwd=run_dir.parent, env=env)


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def files_and_sizes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def data_position(path: Path) -> set[int]:
    return {json.loads(p.read_text())["global_position"] for p in (path / "data").glob("dp_*.json")}


# Single process ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def straight1(tmp_path_factory, data_cache) -> Path:
    run = tmp_path_factory.mktemp("single") / "straight"
    train(run, data_cache, f"checkpoint.every_steps={EVERY}")
    return run


def test_single_process_8_straight_equals_4_exit_resume_4(tmp_path, data_cache, straight1):
    run = tmp_path / "split"
    first = train(run, data_cache, f"checkpoint.every_steps={EVERY}", f"checkpoint.stop_at_step={HALF}")
    assert "[checkpoint.stop_at_step]" in first.stdout + first.stderr
    assert sorted(losses(run)) == list(range(1, HALF + 1))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{HALF:08d}"
    assert not (run / "final").exists()  # stopped early: no final weights
    second = train(run, data_cache, f"checkpoint.every_steps={EVERY}")  # the same command resumes by itself
    assert f"resumed from {ckpt(run, HALF)}" in second.stdout + second.stderr
    want, got = losses(straight1), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(HALF + 1, STEPS + 1)] == [want[s] for s in range(HALF + 1, STEPS + 1)]  # bitwise
    assert data_position(ckpt(run, STEPS)) == {STEPS * GLOBAL_BATCH}
    # the checkpoint carries the resolved config, tokenizer, counters and RNG
    c = ckpt(run, STEPS)
    assert (c / "config.yaml").is_file() and (c / "tokenizer" / "tokenizer.json").is_file()
    trainer = json.loads((c / "trainer.json").read_text())
    assert trainer["counters"]["state"]["step"] == STEPS
    assert trainer["counters"]["state"]["tokens_seen"] == STEPS * GLOBAL_BATCH * SEQ
    assert (c / "rng" / "rank_00000.safetensors").is_file()


@pytest.mark.slow  # two runs and a kill, ~13 s
def test_sigkill_while_writing_keeps_previous_checkpoint(tmp_path, data_cache, straight1):
    run = tmp_path / "killed"
    # rank 0 sleeps just before publishing step HALF; the one before it, HALF - EVERY, is published
    env = child_env(LOOMTRAIN_TEST_FAULTS=f"ckpt_pause:{HALF}:120")
    before = HALF - EVERY
    with Run(train_cmd(run, data_cache, f"checkpoint.every_steps={EVERY}"), run.parent, env) as child:
        child.wait_for(f"TEST FAULT ckpt_pause at step {HALF}", timeout=300)
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait(timeout=60)
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step_{before:08d}"
    assert (root / f".tmp-step_{HALF:08d}").is_dir() and not ckpt(run, HALF).exists()
    again = train(run, data_cache, f"checkpoint.every_steps={EVERY}")
    out = output(again)
    assert f"resumed from {ckpt(run, before)}" in out
    assert "removed leftover" in out and not (root / f".tmp-step_{HALF:08d}").exists()
    want, got = losses(straight1), losses(run)
    assert [got[s] for s in range(before + 1, STEPS + 1)] == [want[s] for s in range(before + 1, STEPS + 1)]


def test_resume_with_another_model_shape_is_a_config_error(tmp_path, data_cache, straight1):
    proc = run_child(
        train_cmd(tmp_path / "other", data_cache, "model.d_model=32", f"checkpoint.resume={ckpt(straight1, STEPS)}"),
        cwd=tmp_path,
        rc=2,
    )
    err = [line for line in proc.stderr.splitlines() if line.startswith("loomtrain: config error")]
    assert len(err) == 1 and "checkpoint.resume=" in err[0] and "tok_emb.weight" in err[0], proc.stderr[-2000:]
    assert err[0].endswith("; give a checkpoint of this model config, or start without one (checkpoint.resume=never)")


def test_a_run_dir_holding_another_models_run_names_the_way_out(tmp_path, data_cache, straight1):
    """The same run.dir with another model (the README's mixture config after the tiny run): the one
    line says to give this config its own run.dir or start the folder afresh, and changes nothing."""
    import shutil

    run = tmp_path / "taken"
    shutil.copytree(straight1, run)
    metrics = (run / "metrics.jsonl").read_bytes()
    before = files_and_sizes(run)
    proc = run_child(train_cmd(run, data_cache, "model.d_model=32"), cwd=tmp_path, rc=2)
    err = [line for line in proc.stderr.splitlines() if line.startswith("loomtrain: config error")]
    assert len(err) == 1, proc.stderr[-2000:]
    assert err[0].startswith(f"loomtrain: config error: checkpoint.resume=auto: checkpoint {ckpt(run, STEPS)}: ")
    assert err[0].endswith(
        f"; {run} holds a run of another model: train this config in a folder of its own (run.dir=...), "
        f"or start {run} afresh (checkpoint.resume=never; its earlier output is moved aside)"
    ), err[0]
    assert (run / "metrics.jsonl").read_bytes() == metrics and (run / "final").is_dir()  # nothing moved aside
    # refused before the process group, the model or the engine exist (the CLI, right after it
    # takes the run directory): not a byte written, not even the rank log a start writes
    assert files_and_sizes(run) == before
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"


def test_truncated_checkpoint_is_reported_and_skipped(tmp_path, data_cache, straight1):
    import shutil

    run = tmp_path / "trunc"
    shutil.copytree(straight1, run)
    victim = ckpt(run, STEPS) / "optim" / "rank_00000.safetensors"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    shutil.rmtree(run / "final")
    again = train(run, data_cache, f"checkpoint.every_steps={EVERY}")
    out = again.stdout + again.stderr
    lines = [line for line in out.splitlines() if "skipping" in line]
    assert len(lines) == 1 and f"step_{STEPS:08d}" in lines[0] and "optim/rank_00000.safetensors" in lines[0], out[
        -3000:
    ]
    before = STEPS - EVERY
    assert f"resumed from {ckpt(run, before)}" in out
    want, got = losses(straight1), losses(run)
    assert [got[s] for s in range(before + 1, STEPS + 1)] == [want[s] for s in range(before + 1, STEPS + 1)]


def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tmp_path, data_cache):
    run = tmp_path / "term"
    # a long run (so it is still going when the signal lands), no periodic checkpoints
    with Run(train_cmd(run, data_cache, "train.max_steps=100000", "checkpoint.every_steps=0"), run.parent) as child:
        child.wait_for(lambda line: line.startswith("step 3/"), timeout=300)
        child.proc.send_signal(signal.SIGTERM)
        rc = child.finish(timeout=120)
    assert rc == 0, child.text[-3000:]
    step = checkpoint_saved_on_signal(child.lines, run)
    assert step >= 3
    assert not (run / "final").exists()
    assert max(losses(run)) == step


# TP2 x DP2, ZeRO 2 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2dp2(tmp_path_factory, data_cache) -> tuple[Path, Path]:
    """TP2 x DP2 ZeRO 2: 8 steps straight, and the split run's first 4 steps, one after the other
    in one torchrun of 4 ranks (tests/cli_driver.py: the CLI's main per run, start-up paid once);
    then the split run's process exit, and the same command again in a fresh torchrun resumes 4
    more. -> (straight, split)"""
    root = tmp_path_factory.mktemp("tp2dp2")
    straight, split, driver = root / "straight", root / "split", root / "driver"
    common = ("parallel.tp=2", "parallel.zero_stage=2", f"checkpoint.every_steps={HALF}")
    argv = [launch.ROOT / "tests" / "cli_driver.py", driver]
    argv += ["--variant", "straight", *train_args(straight, data_cache, *common)]
    argv += ["--variant", "split", *train_args(split, data_cache, *common, f"checkpoint.stop_at_step={HALF}")]
    run_child(launch.python_cmd(*argv, nproc=4), cwd=root)
    for name in ("straight", "split"):
        rcs = [(driver / f"{name}.rank{r}.rc").read_text() for r in range(4)]
        assert rcs == ["0"] * 4, f"{name}: exit {rcs}: " + (driver / f"{name}.rank0.err").read_text()[-3000:]
    assert sorted(losses(straight)) == list(range(1, STEPS + 1))
    assert sorted(losses(split)) == list(range(1, HALF + 1))
    out = train(split, data_cache, *common, nproc=4)
    assert f"resumed from {ckpt(split, HALF)}" in out.stdout + out.stderr
    return straight, split


@pytest.fixture(scope="module")
def straight4(tp2dp2) -> Path:
    return tp2dp2[0]


@pytest.fixture(scope="module")
def split4(tp2dp2) -> Path:
    """TP2 x DP2 ZeRO 2: 4 steps, process exit, the same command again resumes 4 more."""
    return tp2dp2[1]


@pytest.mark.slow
def test_tp2_dp2_zero2_8_straight_equals_4_exit_resume_4(straight4, split4):
    want, got = losses(straight4), losses(split4)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]  # bitwise
    assert data_position(ckpt(split4, HALF)) == {HALF * GLOBAL_BATCH}
    assert data_position(ckpt(split4, STEPS)) == {STEPS * GLOBAL_BATCH}
    assert len(list((ckpt(split4, STEPS) / "data").glob("dp_*.json"))) == 2  # one per DP rank
    assert len(list((ckpt(split4, STEPS) / "rng").glob("rank_*.safetensors"))) == 4  # one per rank


@pytest.mark.slow
@pytest.mark.parametrize("tp,nproc,zero", [(1, 1, 0), (2, 2, 1), (1, 4, 2)], ids=["tp1dp1", "tp2dp1", "tp1dp4"])
def test_tp2_dp2_checkpoint_resumes_at_another_layout(tmp_path, data_cache, straight4, split4, tp, nproc, zero):
    run = tmp_path / "resharded"
    run.parent.mkdir(parents=True, exist_ok=True)
    src = ckpt(split4, HALF)  # written by a TP2 x DP2 process that then exited
    assert json.loads((src / "trainer.json").read_text())["layout"] == {
        "tp": 2,
        "dp": 2,
        "world_size": 4,
        "zero_stage": 2,
    }
    out = train(
        run,
        data_cache,
        f"parallel.tp={tp}",
        f"parallel.zero_stage={zero}",
        f"checkpoint.every_steps={HALF}",
        f"checkpoint.resume={src}",
        nproc=nproc,
    )
    assert "saved at tp 2 x dp 2 zero 2" in out.stdout + out.stderr
    want, got = losses(straight4), losses(run)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    for s in range(HALF + 1, STEPS + 1):
        assert got[s] == pytest.approx(want[s], abs=1e-5), (s, got[s], want[s])
    # data: step s reads global positions [(s-1)G, sG) at any DP size, so ending at 8 G
    # after starting at 4 G means nothing repeated and nothing skipped
    assert data_position(src) == {HALF * GLOBAL_BATCH}
    assert data_position(ckpt(run, STEPS)) == {STEPS * GLOBAL_BATCH}
    layout = json.loads((ckpt(run, STEPS) / "trainer.json").read_text())["layout"]
    assert (layout["tp"], layout["dp"]) == (tp, nproc // tp)


@pytest.mark.slow
def test_tp2_run_final_weights_and_hf_export_are_consolidated(tmp_path, straight4):
    """The TP2 x DP2 run's final weights (gathered from shards) and its HF export agree."""
    import torch

    transformers = pytest.importorskip("transformers")
    from loomtrain.launcher.checkpoints.weight_source import load_final
    from loomtrain.launcher.cli import export as export_cli

    model, _ = load_final(straight4)
    assert model.tok_emb.weight.shape[0] == 259  # vocabulary unpadded
    out = tmp_path / "hf"
    assert export_cli.main([str(straight4), "--format", "hf", "--output", str(out)]) == 0  # from step_00000008
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, 259, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max().item() < 1e-4
