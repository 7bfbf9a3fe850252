"""Ray Jobs commands and cluster errors against the session's private Ray head.

The head (tests/ray_fixtures.py) listens on loopback with token authentication on;
the client side gets the token through RAY_AUTH_MODE / RAY_AUTH_TOKEN.
"""

from __future__ import annotations

import os
import socket
import time

import launch
import pytest
from launch import ROOT, child_env, run_loomtrain

pytestmark = pytest.mark.slow

CONFIG = "configs/tiny.yaml"
SMALL = [
    *launch.SMALL_MODEL,
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "data.max_files=20",
    "data.val_fraction=0.1",
    "eval.every_steps=0",
    "log.progress=plain",
    "ray.num_workers=1",
]


def jobs(capsys, *argv: str) -> tuple[int, str, str]:
    from loomtrain.launcher.cli import jobs as jobs_mod

    capsys.readouterr()
    rc = jobs_mod.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_submit_status_logs_stop_round_trip(ray_head, tmp_path, capsys):
    run_dir = tmp_path / "job-run"
    job_id = f"loomtrain-test-{os.getpid()}"
    # The real command line, in a fresh process: it must find the token by itself.
    proc = run_loomtrain(
        "submit",
        str(ROOT / CONFIG),
        "--address",
        ray_head.dashboard_url,
        "--submission-id",
        job_id,
        *SMALL,
        "train.max_steps=100000",
        f"run.dir={run_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        env=child_env(**ray_head.env),
        timeout=120,
    )
    assert proc.stdout.strip().splitlines()[0] == job_id
    assert "--ray" in proc.stderr and "loomtrain/configs/tiny.yaml" in proc.stderr

    addr = ["--address", ray_head.dashboard_url]

    def running():
        rc, out, _ = jobs(capsys, "status", job_id, *addr)
        assert rc == 0 and "FAILED" not in out, out
        return "RUNNING" in out

    assert launch.poll(running, timeout_s=90, every_s=1.0), "the job did not run within 90 s"

    def driver_started():
        rc, out, _ = jobs(capsys, "logs", job_id, *addr)
        assert rc == 0
        assert "Traceback" not in out, out[-3000:]
        return "loomtrain: Ray Train: 1 workers" in out

    assert launch.poll(driver_started, timeout_s=120, every_s=1.0), "the driver did not start Ray Train within 120 s"

    def training():
        return "step 2/" in jobs(capsys, "logs", job_id, *addr)[1]

    assert launch.poll(training, timeout_s=180, every_s=1.0), "the workers did not train within 180 s"
    rc, out, _ = jobs(capsys, "stop", job_id, *addr, "--wait", "--wait-timeout", "60")
    assert rc == 0 and "STOPPED" in out, out
    # the driver passed the stop on: the workers saved a checkpoint at the end of their step
    # (rank 0's own log: worker output reaches the job's log asynchronously)
    rank0 = (run_dir / "logs" / "rank_00000.log").read_text()
    assert "[SIGTERM]" in rank0 and "(checkpoint saved)" in rank0, rank0[-3000:]
    assert (run_dir / "checkpoints" / "latest").is_file()
    rc, out, _ = jobs(capsys, "status", job_id, *addr)
    assert rc == 0 and f"{job_id}: STOPPED" in out, out
    # --follow on a finished job prints its logs and ends with its final state.
    rc, out, err = jobs(capsys, "logs", job_id, *addr, "--follow")
    assert rc == 1 and "loomtrain: Ray Train" in out and "STOPPED" in err, (out[-2000:], err)


def test_unknown_job_and_unreachable_address_are_clear_errors(ray_head, capsys, monkeypatch):
    rc, _, err = jobs(capsys, "status", "no-such-job", "--address", ray_head.dashboard_url)
    assert rc == 1 and "no job 'no-such-job'" in err, err
    rc, _, err = jobs(capsys, "logs", "no-such-job", "--address", ray_head.dashboard_url)
    assert rc == 1 and "no job 'no-such-job'" in err, err

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    t0 = time.monotonic()
    rc, _, err = jobs(capsys, "status", "x", "--address", f"http://127.0.0.1:{dead}")
    assert rc == 1 and "cannot reach the Ray dashboard" in err, err
    assert time.monotonic() - t0 < 10

    # A bad config is refused before anything is uploaded.
    rc, _, err = jobs(capsys, "submit", str(ROOT / CONFIG), "train.bogus=1", "--address", ray_head.dashboard_url)
    assert rc == 1 and "train.bogus" in err and "config error" in err, err

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc, _, err = jobs(capsys, "stop", "x")
    assert rc == 1 and "--address" in err and "RAY_ADDRESS" in err, err


def test_submit_without_token_is_refused_clearly(ray_head, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "no-token")  # and no ~/.ray/auth_token used
    env["RAY_AUTH_MODE"] = "disabled"
    proc = run_loomtrain("status", "x", "--address", ray_head.dashboard_url, env=env, timeout=120, rc=1)
    assert "refused our credentials" in proc.stderr and "token" in proc.stderr, proc.stderr


def test_oversized_request_fails_within_start_timeout(ray_head, tmp_path, capsys):
    from loomtrain.launcher.cli import train

    t0 = time.monotonic()
    rc = train.main(
        [
            str(ROOT / CONFIG),
            *SMALL,
            "ray.cpus_per_worker=64",
            "ray.start_timeout_s=3",
            f"ray.address={ray_head.gcs_address}",
            "ray.max_failures=0",
            f"run.dir={tmp_path / 'run'}",
            "--ray",
        ]
    )
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 1
    assert "could not place 1 workers" in err and "ray.start_timeout_s=3" in err, err
    assert took < 60, took
