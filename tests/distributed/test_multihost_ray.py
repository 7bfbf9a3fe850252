"""`train --ray` on a Ray cluster across two hosts (network namespaces, tests/ray_hosts.py).

One cluster for the module: a head on 198.18.0.1 and a node on 198.18.0.2 (or a host that
replaced it), 2 CPUs each, so the 4 one-CPU workers (tp 1 x dp 4, fp32) sit 2 per host; the
driver runs on the head's host. No GLOO_SOCKET_IFNAME anywhere: loomtrain's workers pick the
interface that routes to rank 0. Each host has local folders of its own (tests/hosts.py,
`Hosts(private=LOCAL)`: the path LOCAL is a different folder on every host, and TMPDIR and
XDG_CACHE_HOME lie in it), and an S3 server runs on the head's host (moto, at 198.18.0.1:9000),
whose endpoint and test credentials every Ray node (so every worker) and the driver have.

* node loss with a replacement (one run for three tests), with only S3 shared: run.dir is
  LOCAL/run, so each host's own, run.storage is a fresh bucket, and the token shards are
  there too (`preprocess --output s3://...` from the head's host; the reference reads the same
  preprocess's output from disk). Every process of the host beside the head's is killed after
  step 5, a fresh host joins; the run resumes by itself from the last checkpoint, which it reads
  from S3 (no host has one), and its losses equal those of the same job in one process; the
  checkpoints and final/ are in the bucket and nowhere on disk, each host's folder holds the
  files of its own ranks only; its console has loomtrain's lines (the restart and recovery
  lines among them) and none of Ray's, and the fault figures are written once (read from the
  run's TensorBoard mirror in S3);
* node loss without one: the restart waits ray.start_timeout_s and the run exits 1 with one
  line;
* `preprocess --ray` from the head's host: Ray tasks on both hosts, the same bytes as locally;

and, without a cluster, the workers' line prefix, the driver's note on a restart that could
not be placed, and the restart records reaching another host's rank 0 through run.storage.

Rank 0 spends 0.3 s more in every step (a test fault that changes no number), so that the
kill lands within a step or two of step 5 and not after the run has ended.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import launch
import pytest
from hosts import Hosts, require_netns
from launch import losses, records
from ray_hosts import start_ray_cluster
from s3_server import fetch_on, host_env, list_on, make_bucket_on, start_server_on

STEPS, EVERY = 12, 3
TRAIN = [
    *launch.SMALLEST,
    *launch.QUIET,
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "train.warmup_steps=1",
    f"train.max_steps={STEPS}",
    "train.precision=fp32",
    "data.max_files=20",
    "data.prefetch=0",
    f"checkpoint.every_steps={EVERY}",
    "ray.num_workers=4",
    "ray.cpus_per_worker=1",
    "ray.max_failures=2",
]
# Ray's own lines, which belong in RUN_DIR/logs/ and not on the console.
RAY_LINES = (
    "Reporting training result",
    "Failed to query Ray Train Controller",
    "Checkpoint successfully created",
    "Setting up process group",
    "Requesting resources",
    "Started training worker group",
    "(RayTrainWorker",
    "(TrainController",
    "(raylet)",
    "socket.cpp",
    "Connected to Ray cluster",
)


def start_run(cluster, run_dir: Path, data_cache: Path, *extra: str) -> subprocess.Popen:
    """`loomtrain train --ray` on the head's host, output (stdout + stderr) in a pipe."""
    # Rank 0 is paced so that the kill lands mid-run; rank 3's negligible delay is announced
    # on its output: a line of another rank than 0, which the console shows behind host and rank.
    faults = "delay:0:0.3,delay:3:0.001"
    env = cluster.client_env(launch.child_env(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.1", LOOMTRAIN_TEST_FAULTS=faults))
    argv = launch.loomtrain_cmd(
        "train",
        launch.TINY,
        "--ray",
        *TRAIN,
        f"run.dir={run_dir}",
        f"data.cache_dir={data_cache}",
        f"ray.address={cluster.address}",
        *extra,
    )
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return cluster.head.popen(
        argv, env=env, cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def host_of_the_workers(cluster, run_dirs: list[Path]):
    """The host other than the head's that holds workers of the run's current attempt (from its
    ray_attempts.jsonl, written by rank 0 before step 1 into its run.dir: one of `run_dirs`):
    the one to kill."""
    found = [d / "ray_attempts.jsonl" for d in run_dirs if (d / "ray_attempts.jsonl").exists()]
    assert len(found) == 1, found
    hosts = json.loads(found[0].read_text().splitlines()[-1])["hosts"]
    others = [h for h in cluster.hosts[1:] if h.addr in hosts]
    assert len(others) == 1, (hosts, [h.addr for h in cluster.hosts])
    return others[0]


def read_until(proc: subprocess.Popen, lines: list[str], predicate, timeout_s: float) -> str | None:
    """Read the run's output into `lines` until a line satisfies `predicate` (returned) or it ends."""
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        lines.append(line)
        if predicate(line):
            return line
        assert time.monotonic() < deadline, "".join(lines[-40:])
    return None


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """This module's cluster (in place of conftest's): 2 hosts x 2 CPUs whose folder LOCAL
    (`ray_cluster.net.private`) is private to each, and an S3 server on the head's host (the
    head is never the host a test kills); skips (fails in CI) where namespaces cannot be made."""
    require_netns()
    with Hosts(private=tmp_path_factory.mktemp("local")) as net:
        head = net.add()
        _, endpoint = start_server_on(head)
        cluster = start_ray_cluster(net, head=head, env={**host_env(endpoint), **net.private_env()})
        try:
            yield cluster
        finally:
            cluster.close()
    assert not net.leftovers(), f"namespaces left behind: {net.leftovers()}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The embedded corpus's first files (as data.max_files=20 takes them) as preprocess input,
    in a folder every host sees."""
    from loomtrain.data_pipeline.corpus import stdlib_files

    folder = tmp_path_factory.mktemp("corpus")
    for i, path in enumerate(stdlib_files(20)):
        (folder / f"{i:02d}.py").write_bytes(path.read_bytes())
    return folder


def preprocess_args(corpus: Path, output: str | Path) -> list:
    tokenize = ["--tokenizer", "byte", "--workers", "1"]  # no process pool: 2 cores, 3 hosts
    return ["preprocess", "--no-progress", *tokenize, "--input", corpus / "*", "--output", output]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> dict[int, float]:
    """The same job in one process (DP 1, 4 micro batches per step) on the same shards, on disk:
    the losses every run must have."""
    shards = tmp_path_factory.mktemp("shards") / "ds"
    launch.run_loomtrain(*preprocess_args(corpus, shards))
    run_dir = tmp_path_factory.mktemp("one_process") / "run"
    one_process = [arg for arg in TRAIN if not arg.startswith("ray.")]
    launch.run_loomtrain("train", launch.TINY, *one_process, f"run.dir={run_dir}", f"data.path={shards}")
    return losses(run_dir)


@dataclass
class NodeLoss:
    run_dirs: dict[str, Path]  # host address -> that host's own run.dir, as the test process sees it
    stored: Path  # a copy of everything in run.storage after the run
    storage: str  # run.storage: s3://BUCKET/run
    keys: list[str]  # every key in the bucket after the run
    console: str
    returncode: int
    hosts: list  # the head's host and the other one the run started on
    lost: object  # the killed host
    replacement: object  # the host that joined after the kill
    killed_at: float  # time.monotonic()
    seconds: float  # the whole run


@pytest.fixture(scope="module")
def node_loss(ray_cluster, tmp_path_factory, corpus) -> NodeLoss:
    """One run of 12 steps on 2 hosts x 2 workers with run.storage and the token shards in S3
    and run.dir in each host's own folder: after step 5 (and step 3's checkpoint) every process
    of the second host is killed and a fresh host joins."""
    local, head = ray_cluster.net.private, ray_cluster.head
    endpoint = ray_cluster.env["AWS_ENDPOINT_URL"]
    bucket = make_bucket_on(head, endpoint)
    storage, data = f"{bucket}/run", f"{bucket}/ds"
    env = ray_cluster.client_env(launch.child_env())
    made = head.run(launch.loomtrain_cmd(*preprocess_args(corpus, data)), env=env, timeout=300)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    hosts = ray_cluster.live_hosts(2)
    started = time.monotonic()
    extra = ("log.tensorboard=true", f"run.storage={storage}", f"data.path={data}")
    proc = start_run(ray_cluster, local / "run", local / "data_cache", *extra)
    lines: list[str] = []
    try:
        # After step 5 and once step 3's checkpoint is published: it is saved in the background
        # (checkpoint.async_save), and on a loaded machine its upload can outlast step 5.
        assert read_until(proc, lines, lambda line: line.startswith("step 5/"), timeout_s=300)
        if not any(line.startswith(f"checkpoint: step {EVERY} -> ") for line in lines):
            assert read_until(proc, lines, lambda line: line.startswith(f"checkpoint: step {EVERY} -> "), timeout_s=300)
        lost = host_of_the_workers(ray_cluster, [h.local_dir / "run" for h in hosts])
        killed_at = time.monotonic()
        lost.kill()  # a node crash: its raylet, its workers, everything
        replacement = ray_cluster.add_node()
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    seconds = time.monotonic() - started
    stored = tmp_path_factory.mktemp("stored")  # outside LOCAL: the head's process writes it for the test
    fetch_on(head, endpoint, storage, stored)
    keys = list_on(head, endpoint, bucket)
    run_dirs = {h.addr: h.local_dir / "run" for h in [*hosts, replacement]}
    console = "".join(lines) + out
    return NodeLoss(
        run_dirs, stored, storage, keys, console, proc.returncode, hosts, lost, replacement, killed_at, seconds
    )


def stored_attempts(node_loss: NodeLoss) -> list[dict]:
    """The run's ray_attempts.jsonl as kept in run.storage (each attempt's rank 0 may have run on
    another host: RUN_DIR's copy is its host's alone)."""
    return [json.loads(x) for x in (node_loss.stored / "ray_attempts.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_hosts_train_with_loomtrains_lines_on_the_console(ray_cluster, node_loss):
    console = node_loss.console
    assert node_loss.returncode == 0, console[-4000:]
    assert sorted(losses(node_loss.stored / "tb")) == list(range(1, STEPS + 1))
    attempts = stored_attempts(node_loss)
    first = attempts[0]["hosts"]
    assert sorted(set(first)) == sorted(h.addr for h in node_loss.hosts) and len(first) == 4
    # loomtrain's lines: rank 0's progress as it is, the other ranks' behind their host and rank.
    assert f"step {STEPS}/{STEPS} | loss" in console
    assert f"loomtrain: Ray Train run finished: step {STEPS}" in console
    prefixed = set(re.findall(r"^\[(198\.18\.0\.\d+) rank (\d)\] ", console, re.M))
    assert prefixed, console[-3000:]
    assert all(int(rank) > 0 and any(a["hosts"][int(rank)] == addr for a in attempts) for addr, rank in prefixed)
    assert not re.search(r"^\[\S+ rank 0\]", console, re.M)
    # Ray's lines are not there, but in the run's logs (a worker's on its own host).
    shown = [line for line in console.splitlines() if any(noise in line for noise in RAY_LINES)]
    assert not shown, "\n".join(shown[:10])
    logs = [run_dir / "logs" for run_dir in node_loss.run_dirs.values()]
    worker_logs = "".join(p.read_text() for folder in logs for p in folder.glob("ray_worker_*.log"))
    assert "Reporting training result" in worker_logs and "Setting up process group" in worker_logs
    driver_log = (node_loss.run_dirs[ray_cluster.head.addr] / "logs" / "ray_driver.log").read_text()
    assert "Connected to Ray cluster" in driver_log and "Autoscaler status" not in driver_log


@pytest.mark.slow
def test_preprocess_on_ray_across_two_hosts_equals_the_local_command(ray_cluster, tmp_path):
    # Ray tasks, not gloo: no interface to pick, but every task must reach the driver on host A.
    inputs = tmp_path / "in"
    inputs.mkdir()
    for f in range(8):
        (inputs / f"part{f}.txt").write_text(
            "".join(f"document {f}.{d}: " + "words " * (d % 7) + "\n" for d in range(40))
        )
    args = ["preprocess", "--no-progress", "--input", str(inputs / "*"), "--tokenizer", "byte", "--shard-tokens", "900"]
    local = launch.run_loomtrain(*args, "--output", tmp_path / "local", "--workers", "2", timeout=300)
    ray_cluster.live_hosts(2)
    argv = launch.loomtrain_cmd(*args, "--output", tmp_path / "ray", "--ray", "--address", ray_cluster.address)
    on_ray = ray_cluster.head.run(argv, env=ray_cluster.client_env(launch.child_env()), cwd=tmp_path, timeout=300)
    assert on_ray.returncode == 0, on_ray.stdout[-2000:] + on_ray.stderr[-3000:]
    assert "8 input files as Ray tasks, 4 at a time" in on_ray.stdout + on_ray.stderr  # 2 hosts x 2 CPUs
    assert local.returncode == 0

    def tree(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert tree(tmp_path / "ray") == tree(tmp_path / "local")


@pytest.mark.slow
def test_node_loss_resumes_on_a_replacement_host_with_the_same_losses(node_loss, reference):
    console, lost, mirror = node_loss.console, node_loss.lost, node_loss.stored / "tb"
    assert node_loss.returncode == 0, console[-4000:]
    got = losses(mirror)  # rank 0's metrics.jsonl as mirrored to S3: its host may have changed
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - reference[s]) for s in got)
    assert worst <= 1e-5, (got, reference)  # DP 4 across hosts vs 4 micro batches in one process, fp32

    attempts = stored_attempts(node_loss)
    assert len(attempts) == 2
    second = attempts[1]
    assert second["lost_hosts"] == [lost.addr] and node_loss.replacement.addr in second["hosts"]
    failed_after, resumed = second["failed_after_step"], second["resumed_from_step"]
    # Step 3's checkpoint was published before the kill (the fixture waits for it). The failure's
    # step is rank 0's progress as last put to S3 (in the background): it may lag the kill a step.
    # Steps lost: at most two intervals, as an async save publishes up to one interval late.
    assert resumed % EVERY == 0 and resumed >= EVERY and 0 <= failed_after - resumed <= 2 * EVERY
    ranks = ", ".join(str(r) for r, h in enumerate(attempts[0]["hosts"]) if h == lost.addr)
    assert (
        f"loomtrain: restart (attempt 2): lost host {lost.addr} (ranks {ranks}) after step {failed_after}; "
        f"resuming from step {resumed}"
    ) in console
    recovered = re.search(r"^loomtrain: recovered: step (\d+) done ([\d.]+) s after", console, re.M)
    assert recovered and int(recovered.group(1)) == resumed + 1, console[-3000:]
    # ... from its checkpoint in S3: no host has a checkpoint on disk (test_only_s3_is_shared...).
    assert f"resumed from {node_loss.storage}/checkpoints/step_{resumed:08d} (step {resumed}," in console

    # The fault figures, once, at the first step after the recovery: metrics.jsonl and TensorBoard
    # (both as mirrored to S3).
    faults = [r for r in records(mirror) if "fault/recovery_s" in r]
    assert len(faults) == 1 and faults[0]["step"] == resumed + 1
    assert faults[0]["fault/steps_lost"] == failed_after - resumed
    recovery_s = faults[0]["fault/recovery_s"]
    assert 0 < recovery_s < node_loss.seconds
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(mirror), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("fault/recovery_s")] == [resumed + 1]
    assert [e.value for e in events.Scalars("fault/steps_lost")] == [failed_after - resumed]
    print(
        f"\nnode loss: recovery {recovery_s:.1f} s, {failed_after - resumed} steps lost "
        f"(failed after step {failed_after}, resumed from {resumed}), run {node_loss.seconds:.0f} s, "
        f"max |dloss| vs one process {worst:.1e}"
    )


@pytest.mark.slow
def test_only_s3_is_shared_each_host_keeps_its_own_ranks_files_and_no_checkpoint(ray_cluster, node_loss):
    assert node_loss.returncode == 0, node_loss.console[-4000:]
    local = ray_cluster.net.private
    assert not any(local.iterdir())  # the shared path itself: nothing was written through to it
    attempts = stored_attempts(node_loss)
    assert node_loss.replacement.addr not in attempts[0]["hosts"]
    for host, run_dir in node_loss.run_dirs.items():
        # Each rank's files (its log, Ray's worker log, its heartbeat) on the hosts it ran on only.
        placed = {rank for a in attempts for rank, addr in enumerate(a["hosts"]) if addr == host}
        kept = {int(m) for p in run_dir.rglob("*") for m in re.findall(r"^(?:rank|ray_worker)_(\d+)\.", p.name)}
        assert placed and kept == placed, (host, kept, placed)
    # rank 0's records on each host rank 0 ran on; the driver's log on the head's only.
    rank0 = {a["hosts"][0] for a in attempts}
    for host, run_dir in node_loss.run_dirs.items():
        assert (run_dir / "metrics.jsonl").exists() == (host in rank0), host
        assert (run_dir / "logs" / "ray_driver.log").exists() == (host == ray_cluster.head.addr), host
    # Checkpoints and final weights: in S3 only, none on any host's disk (run.dir, data cache, TMPDIR, cache).
    # The one exception: the pointer rank 0 stages for `ray.train.report` (a JSON naming a checkpoint
    # in S3) stays when the kill lands inside that report, on a host the last attempt did not run on
    # (the lost one); every host of an attempt clears its leftovers when it starts.
    idle = [run_dir for host, run_dir in node_loss.run_dirs.items() if host not in attempts[-1]["hosts"]]
    staged = [p for run_dir in idle for p in (run_dir / "ray" / ".pointers").glob("step_*")]
    for p in staged:
        assert [f.name for f in p.iterdir()] == ["loomtrain_pointer.json"], p
        assert json.loads((p / "loomtrain_pointer.json").read_text())["path"].startswith(node_loss.storage), p
    on_disk = [
        p
        for run_dir in node_loss.run_dirs.values()
        for p in run_dir.parent.rglob("*")
        if (p.name in ("checkpoints", "final", "manifest.json") or p.name.startswith("step_")) and p not in staged
    ]
    assert not on_disk, on_disk
    prefix = node_loss.storage.split("/", 3)[3] + "/"
    assert all(k.startswith((prefix, "ds/")) for k in node_loss.keys), node_loss.keys  # the run's and its shards
    assert "ds/index.json" in node_loss.keys
    keys = [k.removeprefix(prefix) for k in node_loss.keys if k.startswith(prefix)]
    complete = sorted(int(k.split("/")[1][5:]) for k in keys if re.fullmatch(r"checkpoints/step_\d+/manifest\.json", k))
    assert complete == [STEPS - 2 * EVERY, STEPS - EVERY, STEPS], keys  # checkpoint.keep_last=3
    assert any(k.startswith("final/") for k in keys), keys
    assert "tb/metrics.jsonl" in keys and "ray_attempts.jsonl" in keys


@pytest.mark.slow
def test_node_loss_without_a_replacement_ends_after_start_timeout_with_one_line(
    ray_cluster,
    tmp_path,
    data_cache,
):
    ray_cluster.live_hosts(2)
    timeout_s = 10
    run_dir = tmp_path / "run"
    extra = (f"ray.start_timeout_s={timeout_s}", "train.max_steps=60")
    proc = start_run(ray_cluster, run_dir, data_cache, *extra)
    lines: list[str] = []
    try:
        assert read_until(proc, lines, lambda line: line.startswith("step 2/"), timeout_s=300)
        lost = host_of_the_workers(ray_cluster, [run_dir])
        lost.kill()
        killed_at = time.monotonic()
        out, _ = proc.communicate(timeout=timeout_s + 120)
    finally:
        if proc.poll() is None:
            proc.kill()
    waited = time.monotonic() - killed_at
    console = "".join(lines) + out
    assert proc.returncode == 1, console[-4000:]
    assert waited >= timeout_s, waited
    errors = [line for line in console.splitlines() if line.startswith("loomtrain: error:")]
    assert len(errors) == 1, console[-3000:]
    assert (
        f"Ray could not place 4 workers x {{'CPU': 1.0}} again after attempt 1 (host {lost.addr} lost, "
        f"not replaced) within ray.start_timeout_s={timeout_s} s" in errors[0]
    )
    assert "Traceback" not in console, console[-3000:]


def test_worker_lines_are_prefixed_line_by_line_also_when_written_in_pieces():
    import io

    from loomtrain.launcher.cluster.ray_console import _LinePrefix

    out = io.StringIO()
    stream = _LinePrefix(out, "[198.18.0.2 rank 3] ")
    for piece in ("step 1", "/12 | loss 5.7\nwarn", "ing: x\n\n", "last"):
        stream.write(piece)
    assert out.getvalue() == (
        "[198.18.0.2 rank 3] step 1/12 | loss 5.7\n[198.18.0.2 rank 3] warning: x\n"
        "[198.18.0.2 rank 3] \n[198.18.0.2 rank 3] last"
    )
    rank0 = io.StringIO()
    _LinePrefix(rank0, "").write("as it is\n")
    assert rank0.getvalue() == "as it is\n"


def test_restart_note_names_the_lost_host_of_this_drivers_last_attempt(tmp_path):
    from loomtrain.launcher.cluster.recovery import restart_note

    attempts = tmp_path / "ray_attempts.jsonl"
    assert restart_note(attempts, 2.0, []) == ""  # no attempt yet: the first placement failed
    earlier = {"attempt": 1, "run_started_at": 1.0, "hosts": ["10.0.0.9"] * 2}
    mine = {"attempt": 2, "run_started_at": 2.0, "hosts": ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]}
    attempts.write_text(json.dumps(earlier) + "\n")
    assert restart_note(attempts, 2.0, ["10.0.0.1"]) == ""  # another driver's attempts
    attempts.write_text(json.dumps(earlier) + "\n" + json.dumps(mine) + "\n")
    assert restart_note(attempts, 2.0, ["10.0.0.1"]) == " again after attempt 2 (host 10.0.0.2 lost, not replaced)"
    assert restart_note(attempts, 2.0, ["10.0.0.1", "10.0.0.2"]) == " again after attempt 2"


def test_restart_records_follow_rank_0_through_run_storage_to_another_host(tmp_path):
    # Rank 0 of attempt 1 ran on host A, whose RUN_DIR is gone with it; attempt 2's rank 0 runs
    # on host C, whose RUN_DIR is empty: the records come from run.storage (file:// here).
    from loomtrain.launcher.cluster.recovery import Recovery, restart_note

    storage = (tmp_path / "store").as_uri()
    a_dir, c_dir = tmp_path / "a" / "run", tmp_path / "c" / "run"
    first = {"attempt": 1, "run_started_at": 2.0, "hosts": ["10.0.0.1", "10.0.0.2"], "start_step": 0, "time": 3.0}
    on_a = Recovery(str(a_dir), "10.0.0.1", 2.0, storage=storage)
    a_dir.mkdir(parents=True)
    (a_dir / "ray_attempts.jsonl").write_text(json.dumps(first) + "\n")
    on_a.publish(a_dir / "ray_attempts.jsonl")
    on_a.attempt = 1

    class Ctx:
        dist = type("D", (), {"rank": 0})()
        state = type("S", (), {"step": 7})()
        metrics = None

    on_a.on_step_end(Ctx())  # progress: attempt 1 at step 7, put by a thread
    # Until the put is whole: on file:// the object exists (empty) before its bytes are written.
    put = tmp_path / "store" / "logs" / "ray_progress.json"
    deadline = time.monotonic() + 10
    while not (put.exists() and put.read_text().endswith("}")):
        assert time.monotonic() < deadline
        time.sleep(0.01)

    on_c = Recovery(str(c_dir), "10.0.0.3", 2.0, storage=storage)
    on_c.restore(c_dir / "ray_attempts.jsonl")
    assert json.loads((c_dir / "ray_attempts.jsonl").read_text()) == first
    assert json.loads((c_dir / "logs" / "ray_progress.json").read_text())["step"] == 7
    # The driver (host B) reads the store's copy too.
    note = restart_note(f"{storage}/ray_attempts.jsonl", 2.0, ["10.0.0.1"])
    assert note == " again after attempt 1 (host 10.0.0.2 lost, not replaced)"
    assert restart_note(f"{storage}/none.jsonl", 2.0, ["10.0.0.1"]) == ""
    # Without run.storage nothing changes: RUN_DIR's records only.
    Recovery(str(tmp_path / "d"), "10.0.0.4", 2.0).restore(tmp_path / "d" / "ray_attempts.jsonl")
    assert not (tmp_path / "d").exists()
