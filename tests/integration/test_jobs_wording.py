"""`loomtrain status` tells a finished job from a running one, and `stop --wait` says when it gave up.

Against a stand-in for Ray's JobSubmissionClient (the real one is exercised end to end in
tests/distributed/test_ray_jobs.py): what the commands print for each state is the subject here.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from loomtrain.launcher.cli import jobs as jobs_cli
from loomtrain.launcher.cluster import jobs


class FakeClient:
    def __init__(self, status: str, start_ms: float, end_ms: float | None = None, stops: bool = True):
        self.state, self.start_ms, self.end_ms, self.stops = status, start_ms, end_ms, stops

    def get_job_info(self, job):
        return SimpleNamespace(
            status=self.state,
            message="",
            entrypoint="python -m loomtrain train loomtrain/configs/tiny.yaml --ray",
            start_time=self.start_ms,
            end_time=self.end_ms,
            driver_exit_code=None,
        )

    def get_job_status(self, job):
        return self.state

    def stop_job(self, job):
        if self.stops:
            self.state = "STOPPED"
        return True


@pytest.fixture
def client(monkeypatch):
    holder = {}
    monkeypatch.setattr(jobs, "make_client", lambda address=None: holder["client"])
    return holder


def test_status_of_a_finished_job_says_ran_for_not_running_for(client, capsys):
    now = time.time() * 1000
    client["client"] = FakeClient("SUCCEEDED", now - 90_000, now - 30_000)
    assert jobs_cli.main(["status", "raysubmit_x"]) == 0
    out = capsys.readouterr().out
    assert "raysubmit_x: SUCCEEDED" in out and "ran for: 60.0 s" in out and "running for" not in out


def test_status_of_a_running_job_says_running_for(client, capsys):
    client["client"] = FakeClient("RUNNING", time.time() * 1000 - 12_000)
    assert jobs_cli.main(["status", "raysubmit_x"]) == 0
    out = capsys.readouterr().out
    assert "raysubmit_x: RUNNING" in out and "running for: 1" in out and "ran for" not in out


def test_stop_wait_that_runs_out_says_so_with_the_state(client, capsys):
    client["client"] = FakeClient("RUNNING", time.time() * 1000, stops=False)
    rc = jobs_cli.main(["stop", "raysubmit_x", "--wait", "--wait-timeout", "1"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "raysubmit_x: stop requested" in captured.out
    line = captured.err.strip()
    assert len(line.splitlines()) == 1, line
    assert "did not stop within 1 s" in line and "it is RUNNING" in line, line


def test_stop_wait_that_sees_the_job_end_prints_its_state(client, capsys):
    client["client"] = FakeClient("RUNNING", time.time() * 1000)
    assert jobs_cli.main(["stop", "raysubmit_x", "--wait", "--wait-timeout", "5"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "raysubmit_x: STOPPED"


def test_stop_wait_for_a_job_that_disappears_says_so_in_one_line(client, capsys):
    fake = FakeClient("RUNNING", time.time() * 1000, stops=False)
    client["client"] = fake
    asked = []

    def gone_after_the_stop(job):
        asked.append(job)
        if len(asked) > 1:
            raise RuntimeError(f"Job {job} does not exist")
        return fake.state

    fake.get_job_status = gone_after_the_stop
    assert jobs_cli.main(["stop", "raysubmit_x", "--wait", "--wait-timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert err == "loomtrain stop: error: no job 'raysubmit_x' on this cluster (see `ray job list`)\n"
