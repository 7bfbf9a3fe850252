"""Elastic workers across hosts: a lost node costs only speed, and the group grows back.

A Ray cluster of 2 hosts x 2 CPUs (tests/ray_hosts.py) runs `loomtrain train --ray` with
ray.num_workers=4, ray.min_workers=2 and parallel.tp=2 (fp32, global batch 8 in micro batches
of 2; each TP group on one host). Host B is killed after step 5: the group restarts on host A
alone at DP 1 (gradient accumulation 4 instead of 2) from the newest checkpoint; a fresh host
joins and, at the next resize check, the group grows back to DP 2. The losses and the samples
of every step (data/samples_hash) equal those of an uninterrupted one-process run of the same
global batch. Rank 0 waits at the end of every step from GATE_STEP on until the group has grown
back (a fault plugin gate the test opens), so that the run cannot end before the fresh host joins.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from launch import QUIET, SMALL, TINY, child_env, loomtrain_cmd, records, run_loomtrain

pytestmark = pytest.mark.slow

STEPS, GATE_STEP = 18, 9
RUN = [
    *SMALL,
    *QUIET,
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    f"train.max_steps={STEPS}",
    "train.precision=fp32",
    "checkpoint.every_steps=3",
]
# tp 2: each TP group must lie on one host (Ray Train groups a node's workers as consecutive ranks)
ELASTIC = [
    "parallel.tp=2",
    "ray.num_workers=4",
    "ray.min_workers=2",
    "ray.cpus_per_worker=1",
    "ray.elastic_resize_interval_s=5",
]


def _by_step(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in records(run_dir) if "loss" in r}


def _wait(proc, lines: list[str], pattern: str, timeout: float, after: int = 0) -> int:
    """Read the driver's output until a line after index `after` matches; -> its index."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i in range(after, len(lines)):
            if re.search(pattern, lines[i]):
                return i
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + "\n".join(lines[-60:]))


def test_a_lost_node_costs_only_speed_and_the_group_grows_back(ray_cluster, tmp_path):
    cache = tmp_path / "cache"
    reference = tmp_path / "reference"
    run_loomtrain("train", TINY, *RUN, f"run.dir={reference}", f"data.cache_dir={cache}", cwd=tmp_path)

    run_dir = tmp_path / "elastic"
    cmd = loomtrain_cmd(
        "train", TINY, "--ray", *RUN, *ELASTIC, f"ray.address={ray_cluster.address}",
        f"run.dir={run_dir}", f"data.cache_dir={cache}",
    )  # fmt: skip
    gate = tmp_path / "grown"  # made once the group has grown back
    env = ray_cluster.client_env(child_env(LOOMTRAIN_TEST_FAULTS=f"gate:0:{GATE_STEP}:{gate}"))
    host_b = ray_cluster.live_hosts(2)[1]
    lines: list[str] = []
    driver = ray_cluster.head.popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        first = _wait(driver, lines, r"loomtrain: elastic: 4 of 2-4 workers", timeout=240)
        _wait(driver, lines, r"\bstep 5/", timeout=240, after=first)
        host_b.kill()  # a node crash: every process of host B
        shrunk = _wait(driver, lines, r"loomtrain: elastic: 2 of 2-4 workers", timeout=240, after=first)
        _wait(driver, lines, r"\bstep \d+/", timeout=240, after=shrunk)
        ray_cluster.wait_for_nodes([ray_cluster.head.addr])  # the cluster knows host B is gone
        ray_cluster.add_node()  # a fresh host joins: the next resize check grows the group
        grown = _wait(driver, lines, r"loomtrain: elastic: 4 of 2-4 workers", timeout=240, after=shrunk)
        gate.touch()
        _wait(driver, lines, r"\bstep \d+/", timeout=240, after=grown)
        rest, _ = driver.communicate(timeout=300)
        lines += rest.splitlines()
    except BaseException:
        print("\n".join(lines))  # the driver's console, shown with the failure
        raise
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    text = "\n".join(lines)
    assert driver.returncode == 0, text[-5000:]

    want, got = _by_step(reference), _by_step(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step
        assert got[step]["data/samples_hash"] == want[step]["data/samples_hash"], step
    # Three attempts: 4 workers, 2 after the loss of host B, 4 again after the new host joined.
    attempts = [int(m) for m in re.findall(r"loomtrain: elastic: (\d) of 2-4 workers", text)]
    assert attempts == [4, 2, 4], attempts
    # Every attempt's TP groups (ranks 0-1, 2-3) each on one host.
    hosts = [json.loads(line)["hosts"] for line in (run_dir / "ray_attempts.jsonl").read_text().splitlines()]
    assert [len(h) for h in hosts] == [4, 2, 4] and all(h[0] == h[1] and h[-2] == h[-1] for h in hosts), hosts
    a, b = ray_cluster.head.addr, host_b.addr  # Ray orders the nodes as it likes (B first, at times)
    assert set(hosts[0]) == {a, b} and set(hosts[1]) == {a}, hosts
    assert len(set(hosts[2])) == 2 and a in hosts[2] and b not in hosts[2], hosts  # grown onto the new host
    # What each restart cost: the lost host (a fault), then the grow (an elastic resize).
    assert re.search(rf"loomtrain: restart \(attempt 2\): lost host {host_b.addr} \(ranks \d, \d\)", text), text
    assert "loomtrain: restart (attempt 3): the elastic group grew from 2 to 4 workers" in text
    fault = [r for r in records(run_dir) if "fault/recovery_s" in r]
    resize = [r for r in records(run_dir) if "elastic/resize_s" in r]
    assert len(fault) == len(resize) == 1 and fault[0]["step"] < resize[0]["step"]
    assert 0 <= fault[0]["fault/steps_lost"] <= 3 and 0 <= resize[0]["elastic/steps_lost"] <= 3  # every 3 steps
    print(
        f"elastic figures: lost host -> first step {fault[0]['fault/recovery_s']:.1f} s, "
        f"{fault[0]['fault/steps_lost']} steps redone; grow -> first step {resize[0]['elastic/resize_s']:.1f} s, "
        f"{resize[0]['elastic/steps_lost']} steps redone"
    )
