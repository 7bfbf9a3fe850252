"""Hangs, stragglers and stop signals on the real multi-rank paths (torchrun world 2, Ray 2 workers).

Faults come from the test suite's fault plugin (LOOMTRAIN_TEST_FAULTS, tests/fault_plugin.py):
`sigstop:RANK:STEP` freezes a rank, `delay:RANK:S` makes one rank slow, `signal:RANK:STEP:SIG`
delivers a real signal to a rank while that step runs.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import launch
import pytest
from launch import TINY, Run, checkpoint_saved_on_signal, child_env, loomtrain_cmd, losses, output, records, run_child
from loomtrain.launcher.config_loader import load_config

pytestmark = pytest.mark.slow

# Long schedules (max_steps 1000) so that a run is still going when a signal lands; the
# LR schedule depends on max_steps, so every run here (and the reference) uses the same.
SMALL = [
    *launch.SMALL,
    "model.max_seq_len=32",
    "train.micro_batch_size=2",
    "train.max_steps=1000",
    "data.max_files=20",
    "data.val_fraction=0.1",
    "data.prefetch=0",
    *launch.QUIET,
    "checkpoint.every_steps=0",
]
HANG_TIMEOUT_S = 20


def cmd(run_dir: Path, data_cache: Path, *overrides: str, nproc: int = 1, ray: bool = False) -> list[str]:
    argv = ["train", TINY, *SMALL, f"run.dir={run_dir}", f"data.cache_dir={data_cache}", *overrides]
    return loomtrain_cmd(*argv, *(["--ray"] if ray else []), nproc=nproc)


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def headers(run_dir: Path, rank: int) -> list[str]:
    text = (run_dir / "logs" / f"rank_{rank:05d}.log").read_text()
    return [line for line in text.splitlines() if line.startswith("=== loomtrain attempt")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache) -> dict[int, float]:
    """Losses of steps 1-20 of the uninterrupted schedule (one in-process rank, same global batch)."""
    from loomtrain.launcher.training.loop import run_training

    run = tmp_path_factory.mktemp("reference") / "run"
    cfg = load_config(TINY, [*SMALL, f"run.dir={run}", f"data.cache_dir={data_cache}", "checkpoint.stop_at_step=20"])
    out = run_training(cfg)
    assert out.steps == list(range(1, 21))
    return dict(zip(out.steps, out.losses))


def test_torchrun_hang_names_the_stopped_rank_and_dumps_stacks(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    argv = cmd(run_dir, data_cache, f"parallel.timeout_s={HANG_TIMEOUT_S}", nproc=2)
    # leaving the block kills every rank (the stopped one too), whatever happened
    with Run(argv, tmp_path, child_env(LOOMTRAIN_TEST_FAULTS="sigstop:1:5"), run_dir) as run:
        run.wait_for(lambda line: "TEST FAULT sigstop at step 5 on rank 1" in line, timeout=300)
        stopped_at = time.monotonic()
        rc = run.finish(timeout=120)
        took = time.monotonic() - stopped_at
    assert rc != 0, run.text[-3000:]
    assert took < HANG_TIMEOUT_S + 30 and took < 60, (took, run.text[-3000:])
    hang = [line for line in run.lines if line.startswith("loomtrain: hang:")]
    assert len(hang) == 1, run.text[-3000:]
    assert hang[0].startswith("loomtrain: hang: rank 1 (host ") and "did not reach step 6" in hang[0]
    assert "ranks 0 waited in " in hang[0] and f"stacks in {run_dir / 'logs'}/" in hang[0]
    log0 = (run_dir / "logs" / "rank_00000.log").read_text()
    assert hang[0].strip() in log0
    dump = log0[log0.index("loomtrain: watchdog: rank 0 made no progress") :]
    # faulthandler's dump of rank 0 while it waited: its training thread inside the loop
    assert "Thread 0x" in dump and "(most recent call first)" in dump
    assert 'launcher/training/loop.py", line' in dump and "in run_training" in dump


def test_torchrun_straggler_sigterm_to_every_rank_then_exact_resume(tmp_path, data_cache, reference):
    """Rank 1 is slow: slowest_rank == 1 in metrics.jsonl, TensorBoard and the console. SIGTERM
    to both ranks: a checkpoint, exit 0; the same command resumes exactly; logs are appended."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    argv = cmd(run_dir, data_cache, "log.tensorboard=true", nproc=2)
    with Run(argv, tmp_path, child_env(LOOMTRAIN_TEST_FAULTS="delay:1:0.5"), run_dir) as run:
        run.wait_for(lambda line: line.startswith("step 4/"), timeout=300)
        for pid in run.rank_pids():
            os.kill(pid, signal.SIGTERM)
        rc = run.finish(timeout=120)
    assert rc == 0, run.text[-3000:]
    step = checkpoint_saved_on_signal(run.lines, run_dir)
    assert 4 <= step <= 8
    assert f"stopped at step {step} (checkpoint saved)" in run.text
    # the straggler, job-wide: every logged step names rank 1, and the console says so
    recs = [r for r in records(run_dir) if "loss" in r]
    assert [r["slowest_rank"] for r in recs[1:]] == [1] * (len(recs) - 1), recs
    assert all(r["step_time_max_s"] >= r["step_time_min_s"] + 0.4 for r in recs[1:])
    assert any("slowest rank 1:" in line for line in run.lines if line.startswith("step "))
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("perf/slowest_rank")][1:] == [1.0] * (len(recs) - 1)

    again = run_child(
        cmd(run_dir, data_cache, f"checkpoint.stop_at_step={step + 2}", nproc=2), cwd=tmp_path, timeout=300
    )
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:08d}'}" in output(again)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, step + 3))
    for s in range(1, step + 3):  # DP 2 vs one rank on the same global batch
        assert got[s] == pytest.approx(reference[s], rel=1e-5, abs=1e-6), (s, got, reference)
    for rank in (0, 1):  # both ranks' logs hold both attempts
        assert [h.split(":")[0] for h in headers(run_dir, rank)] == [
            "=== loomtrain attempt 1",
            "=== loomtrain attempt 2",
        ]


def test_ctrl_c_at_step_16_saves_exits_130_and_the_rerun_resumes_at_16(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    env = child_env(LOOMTRAIN_TEST_FAULTS="signal:0:16:SIGINT")
    out = output(run_child(cmd(run_dir, data_cache), cwd=tmp_path, env=env, timeout=300, rc=130))
    assert "stopped at step 16 (checkpoint saved)" in out and "[SIGINT]" in out
    assert latest(run_dir) == "step_00000016"
    again = run_child(cmd(run_dir, data_cache, "checkpoint.stop_at_step=17"), cwd=tmp_path, timeout=300)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000016'} (step 16" in output(again)
    assert sorted(losses(run_dir)) == list(range(1, 18))


def test_ray_hang_restarts_by_itself_and_sigterm_to_the_driver_saves(ray_head, tmp_path, data_cache, reference):
    """Ray, 2 workers: worker 1 freezes after step 5; the watchdog ends the attempt, Ray restarts
    the group from step 4's checkpoint. Then SIGTERM to the driver: the workers save, exit 0.
    The same command resumes; every loss equals the uninterrupted run's."""
    from loomtrain.launcher.cluster.ray_train import ATTEMPTS_FILE

    run_dir = tmp_path / "run"
    ray = [
        "ray.num_workers=2",
        "ray.cpus_per_worker=1",
        "ray.max_failures=2",
        f"ray.address={ray_head.gcs_address}",
        "parallel.timeout_s=8",
        "checkpoint.every_steps=2",
    ]
    # slow steps (0.4 s on rank 0), so that the signal lands a few steps after step 5
    env = child_env(
        **ray_head.env, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.1", LOOMTRAIN_TEST_FAULTS="sigstop:1:5,delay:0:0.4"
    )
    seen = {"hang": False}

    def restarted_and_training(line: str) -> bool:
        seen["hang"] = seen["hang"] or "loomtrain: hang: rank 1 (host" in line
        return seen["hang"] and "step 5/" in line

    with Run(cmd(run_dir, data_cache, *ray, ray=True), tmp_path, env) as run:
        run.wait_for(restarted_and_training, timeout=400)
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish(timeout=180)
    assert rc == 0, run.text[-4000:]
    stopped = [line for line in run.lines if "stopped at step" in line and "checkpoint saved" in line]
    assert stopped, run.text[-4000:]
    step = int(latest(run_dir).split("_")[1])
    assert 5 <= step <= 18, step
    attempts = [json.loads(x) for x in (run_dir / ATTEMPTS_FILE).read_text().splitlines()]
    assert [a["start_step"] for a in attempts] == [0, 4], attempts
    assert attempts[1]["previous_end"].startswith("loomtrain: hang: rank 1 (host "), attempts
    assert "did not reach step 6" in attempts[1]["previous_end"]

    run_child(
        cmd(run_dir, data_cache, *ray, f"checkpoint.stop_at_step={step + 2}", ray=True), tmp_path, env, timeout=400
    )
    got = losses(run_dir)
    assert sorted(got) == list(range(1, step + 3))
    for s in range(1, step + 3):  # DP 2 on Ray vs one rank on the same global batch
        assert got[s] == pytest.approx(reference[s], rel=1e-5, abs=1e-6), (s, got, reference)
    attempts = [json.loads(x) for x in (run_dir / ATTEMPTS_FILE).read_text().splitlines()]
    assert attempts[2]["start_step"] == step and attempts[2]["previous_end"] == f"stopped by SIGTERM at step {step}"
    for rank in (0, 1):  # three attempts (start, restart after the hang, the rerun) in each log
        assert len(headers(run_dir, rank)) == 3, headers(run_dir, rank)
