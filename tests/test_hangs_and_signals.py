"""Hangs, stragglers and stop signals on the real multi-rank paths (torchrun world 2, Ray 2 workers).

Faults come from the loop's test-only seam (LOOMTRAIN_TEST_FAULTS, loomtrain.launcher.faults):
`sigstop:RANK:STEP` freezes a rank, `delay:RANK:S` makes one rank slow, `signal:RANK:STEP:SIG`
delivers a real signal to a rank while that step runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loomtrain.launcher.config_loader import load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
# Long schedules (max_steps 1000) so that a run is still going when a signal lands; the
# LR schedule depends on max_steps, so every run here (and the reference) uses the same.
SMALL = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.warmup_steps=2",
    "train.max_steps=1000",
    "data.max_files=20",
    "data.val_fraction=0.1",
    "data.prefetch=0",
    "eval.every_steps=0",
    "eval.num_samples=0",
    "log.progress=plain",
    "log.tensorboard=false",
    "checkpoint.every_steps=0",
]
HANG_TIMEOUT_S = 20


def clean_env(**extra: str) -> dict[str, str]:
    drop = {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RAY_ADDRESS",
        "LOOMTRAIN_TEST_FAULTS",
    }
    base = {k: v for k, v in os.environ.items() if k not in drop}
    return {**base, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def cmd(run_dir: Path, cache: Path, *overrides: str, nproc: int = 1, ray: bool = False) -> list[str]:
    head = [sys.executable, "-m", "loomtrain"]
    if nproc > 1:
        head = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "-m",
            "loomtrain",
        ]
    return [
        *head,
        "train",
        str(TINY),
        *SMALL,
        f"run.dir={run_dir}",
        f"data.cache_dir={cache}",
        *overrides,
        *(["--ray"] if ray else []),
    ]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def heartbeat_pids(run_dir: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in sorted((run_dir / "logs" / "heartbeats").glob("rank_*.json"))]


def headers(run_dir: Path, rank: int) -> list[str]:
    text = (run_dir / "logs" / f"rank_{rank:05d}.log").read_text()
    return [line for line in text.splitlines() if line.startswith("=== loomtrain attempt")]


class Run:
    """A training subprocess whose output is read line by line (stdout + stderr)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, run_dir: Path | None = None) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []

    def wait_for(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            if predicate(line):
                return line
            assert time.monotonic() < deadline, "".join(self.lines[-60:])
        raise AssertionError("ended before the awaited line:\n" + "".join(self.lines[-60:]))

    def finish(self, timeout: float) -> int:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
            self.lines += out.splitlines(keepends=True)
        finally:
            self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # this test's own process group only
            self.proc.wait()
        # torchrun starts each rank in a session of its own: end this run's ranks too
        beats = self.run_dir / "logs" / "heartbeats" if self.run_dir else None
        for pid in heartbeat_pids(self.run_dir) if beats and beats.is_dir() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    @property
    def text(self) -> str:
        return "".join(self.lines)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> dict[int, float]:
    """Losses of steps 1-20 of the uninterrupted schedule (one in-process rank, same global batch)."""
    from loomtrain.launcher.loop import run_training

    run = tmp_path_factory.mktemp("reference") / "run"
    cfg = load_config(TINY, [*SMALL, f"run.dir={run}", f"data.cache_dir={cache}", "checkpoint.stop_at_step=20"])
    out = run_training(cfg)
    assert out.steps == list(range(1, 21))
    return dict(zip(out.steps, out.losses))


def test_torchrun_hang_names_the_stopped_rank_and_dumps_stacks(tmp_path, cache):
    run_dir = tmp_path / "run"
    run = Run(
        cmd(run_dir, cache, f"parallel.timeout_s={HANG_TIMEOUT_S}", nproc=2),
        clean_env(LOOMTRAIN_TEST_FAULTS="sigstop:1:5"),
        tmp_path,
        run_dir,
    )
    try:
        run.wait_for(lambda line: "TEST FAULT sigstop at step 5 on rank 1" in line, timeout=300)
        stopped_at = time.monotonic()
        rc = run.finish(timeout=120)
        took = time.monotonic() - stopped_at
    finally:
        for pid in heartbeat_pids(run_dir) if (run_dir / "logs" / "heartbeats").exists() else []:
            try:  # never leave a stopped rank behind, whatever happened
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
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
    assert 'launcher/loop.py", line' in dump and "in run_training" in dump


def test_torchrun_straggler_sigterm_to_every_rank_then_exact_resume(tmp_path, cache, reference):
    """Rank 1 is slow: slowest_rank == 1 in metrics.jsonl, TensorBoard and the console. SIGTERM
    to both ranks: a checkpoint, exit 0; the same command resumes exactly; logs are appended."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    argv = cmd(run_dir, cache, "log.tensorboard=true", nproc=2)
    run = Run(argv, clean_env(LOOMTRAIN_TEST_FAULTS="delay:1:0.5"), tmp_path, run_dir)
    try:
        run.wait_for(lambda line: line.startswith("step 4/"), timeout=300)
        for pid in heartbeat_pids(run_dir):
            os.kill(pid, signal.SIGTERM)
        rc = run.finish(timeout=120)
    finally:
        run.kill()
    assert rc == 0, run.text[-3000:]
    saved = [line for line in run.lines if "[SIGTERM]" in line]
    assert len(saved) == 1, run.text[-3000:]
    step = int(saved[0].split("checkpoint: step ")[1].split()[0])
    assert 4 <= step <= 8 and latest(run_dir) == f"step_{step:08d}"
    assert f"stopped at step {step} (checkpoint saved)" in run.text
    # the straggler, job-wide: every logged step names rank 1, and the console says so
    recs = [r for r in records(run_dir) if "loss" in r]
    assert [r["slowest_rank"] for r in recs[1:]] == [1] * (len(recs) - 1), recs
    assert all(r["step_time_max_s"] >= r["step_time_min_s"] + 0.4 for r in recs[1:])
    assert any("slowest rank 1:" in line for line in run.lines if line.startswith("step "))
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("perf/slowest_rank")][1:] == [1.0] * (len(recs) - 1)

    again = subprocess.run(
        cmd(run_dir, cache, f"checkpoint.stop_at_step={step + 2}", nproc=2),
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:08d}'}" in again.stdout + again.stderr
    got = losses(run_dir)
    assert sorted(got) == list(range(1, step + 3))
    for s in range(1, step + 3):  # DP 2 vs one rank on the same global batch
        assert got[s] == pytest.approx(reference[s], rel=1e-5, abs=1e-6), (s, got, reference)
    for rank in (0, 1):  # both ranks' logs hold both attempts
        assert [h.split(":")[0] for h in headers(run_dir, rank)] == [
            "=== loomtrain attempt 1",
            "=== loomtrain attempt 2",
        ]


def test_ctrl_c_at_step_16_saves_exits_130_and_the_rerun_resumes_at_16(tmp_path, cache):
    run_dir = tmp_path / "run"
    first = subprocess.run(
        cmd(run_dir, cache),
        env=clean_env(LOOMTRAIN_TEST_FAULTS="signal:0:16:SIGINT"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = first.stdout + first.stderr
    assert first.returncode == 130, out[-3000:]
    assert "stopped at step 16 (checkpoint saved)" in out and "[SIGINT]" in out
    assert latest(run_dir) == "step_00000016"
    again = subprocess.run(
        cmd(run_dir, cache, "checkpoint.stop_at_step=17"),
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000016'} (step 16" in again.stdout + again.stderr
    assert sorted(losses(run_dir)) == list(range(1, 18))


def test_ray_hang_restarts_by_itself_and_sigterm_to_the_driver_saves(ray_head, tmp_path, cache, reference):
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
    env = clean_env(**ray_head.env, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.1")
    # slow steps (0.4 s on rank 0), so that the signal lands a few steps after step 5
    run = Run(
        cmd(run_dir, cache, *ray, ray=True), {**env, "LOOMTRAIN_TEST_FAULTS": "sigstop:1:5,delay:0:0.4"}, tmp_path
    )
    seen = {"hang": False}

    def restarted_and_training(line: str) -> bool:
        seen["hang"] = seen["hang"] or "loomtrain: hang: rank 1 (host" in line
        return seen["hang"] and "step 5/" in line

    try:
        run.wait_for(restarted_and_training, timeout=400)
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish(timeout=180)
    finally:
        run.kill()
    assert rc == 0, run.text[-4000:]
    stopped = [line for line in run.lines if "stopped at step" in line and "checkpoint saved" in line]
    assert stopped, run.text[-4000:]
    step = int(latest(run_dir).split("_")[1])
    assert 5 <= step <= 18, step
    attempts = [json.loads(x) for x in (run_dir / ATTEMPTS_FILE).read_text().splitlines()]
    assert [a["start_step"] for a in attempts] == [0, 4], attempts
    assert attempts[1]["previous_end"].startswith("loomtrain: hang: rank 1 (host "), attempts
    assert "did not reach step 6" in attempts[1]["previous_end"]

    again = subprocess.run(
        cmd(run_dir, cache, *ray, f"checkpoint.stop_at_step={step + 2}", ray=True),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(1, step + 3))
    for s in range(1, step + 3):  # DP 2 on Ray vs one rank on the same global batch
        assert got[s] == pytest.approx(reference[s], rel=1e-5, abs=1e-6), (s, got, reference)
    attempts = [json.loads(x) for x in (run_dir / ATTEMPTS_FILE).read_text().splitlines()]
    assert attempts[2]["start_step"] == step and attempts[2]["previous_end"] == f"stopped by SIGTERM at step {step}"
    for rank in (0, 1):  # three attempts (start, restart after the hang, the rerun) in each log
        assert len(headers(run_dir, rank)) == 3, headers(run_dir, rank)
