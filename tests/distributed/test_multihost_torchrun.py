"""torchrun on two hosts (network namespaces, tests/hosts.py): interfaces, placement, partitions.

Each host runs `torchrun --nnodes 2 --node_rank N --master_addr 198.18.0.1 ...` with no
GLOO_SOCKET_IFNAME set, as a user would; inside every host the machine's hostname resolves
to 127.0.0.1, so the run only trains if loomtrain picks the interface that routes to the
master (eth0). Runs on two hosts must equal the same ranks on one host; a user's own wrong
interface is kept and fails as one line; a TP group across hosts is refused unless asked
for; a host cut off mid-run is named by the hang watchdog. Nothing outlives a test: the
`hosts` fixture SIGKILLs every process of every host and removes the namespaces, and each
test asserts that the hosts' processes are gone before that.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import launch
import pytest
from launch import TINY, Run, child_env, losses, run_loomtrain
from loomtrain.launcher.distributed import choose_socket_interface, rendezvous_failure
from loomtrain.launcher.observe import watchdog
from loomtrain.parallel.topology import check_tp_placement

MASTER_PORT = 29400  # each host is a fresh namespace: no other process holds it
# Two ranks per DP group of micro batch 2: a global batch of 4 splits over dp 1 and dp 2.
SMALL = [*launch.SMALL, "train.micro_batch_size=2", "train.global_batch_size=4", *launch.QUIET]


# --- the pieces, without processes -------------------------------------------------------
def test_placement_refuses_a_tp_group_across_hosts_in_one_line():
    check_tp_placement(2, ["n/10.0.0.1"] * 2 + ["n/10.0.0.2"] * 2)  # one TP group per host
    check_tp_placement(2, ["n/10.0.0.1", "n/10.0.0.2"], allow_cross_host=True)
    check_tp_placement(4, ["n/127.0.0.1"] * 4)
    with pytest.raises(ValueError) as refused:
        check_tp_placement(4, ["n/10.0.0.1"] * 2 + ["n/10.0.0.2"] * 2)
    assert str(refused.value) == (
        "parallel.tp=4: the tensor-parallel group of ranks 0-3 would span hosts (2 hosts: n/10.0.0.1 ranks 0-1, "
        "n/10.0.0.2 ranks 2-3; 2 ranks per host); use parallel.tp=2, or start a multiple of 4 ranks on each host "
        "(torchrun --nproc_per_node 4), or set parallel.allow_cross_host_tp=true to run it anyway"
    )
    with pytest.raises(ValueError, match=r"^parallel.tp=2: the tensor-parallel group of ranks 2-3 .* 3 ranks per"):
        check_tp_placement(2, ["n/10.0.0.1"] * 3 + ["n/10.0.0.2"] * 3)


def test_the_users_interface_is_kept_and_named_in_the_rendezvous_line():
    env = {"GLOO_SOCKET_IFNAME": "eth9", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    assert choose_socket_interface("127.0.0.1", env) == {"NCCL_SOCKET_IFNAME": "lo"}
    assert env["GLOO_SOCKET_IFNAME"] == "eth9"
    line = rendezvous_failure(RuntimeError("Unable to find address for: eth9\nmore"), "gloo", {}, env)
    assert line == (
        "could not join the process group at 127.0.0.1:29400 over GLOO_SOCKET_IFNAME=eth9 (your setting): "
        "Unable to find address for: eth9; the route to 127.0.0.1 leaves by lo: set GLOO_SOCKET_IFNAME to this "
        "host's interface that reaches 127.0.0.1 (e.g. GLOO_SOCKET_IFNAME=lo) on every host, and check that the "
        "port is open between the hosts"
    )
    chosen = {"GLOO_SOCKET_IFNAME": "lo"}
    env = {**env, **chosen}
    assert "over GLOO_SOCKET_IFNAME=lo (chosen: routes to the master): " in rendezvous_failure("x", "gloo", chosen, env)


def test_the_ranks_that_cannot_reach_the_master_are_the_ones_cut_off(tmp_path):
    assert watchdog.reaches(None) is None
    assert watchdog.reaches("127.0.0.1:1") is True  # refused: the host answered
    beats = {
        r: {"host": "n/10.0.0.1" if r < 2 else "n/10.0.0.2", "pid": 10 + r, "step": 5, "where": "all_reduce"}
        | {"reaches_master": r < 2}
        for r in range(4)
    }
    assert watchdog._cut_off(beats, [0, 1, 2, 3]) == [2, 3]
    assert watchdog._cut_off({r: {**b, "reaches_master": False} for r, b in beats.items()}, [0, 1, 2, 3]) == []
    line = watchdog._hang_line(tmp_path, [2, 3], [0, 1], beats, master="10.0.0.1:29400")
    assert line == (
        "loomtrain: hang: rank 2 (host n/10.0.0.2, pid 12), rank 3 (host n/10.0.0.2, pid 13) did not reach step 6, "
        "cut off: host n/10.0.0.2 cannot reach the master 10.0.0.1:29400; ranks 0, 1 waited in all_reduce; "
        f"stacks in {tmp_path / 'logs'}/"
    )


# --- two hosts ---------------------------------------------------------------------------
def overrides(run_dir: Path, data_cache: Path, *more: str) -> list[str]:
    return ["train", TINY, *SMALL, f"run.dir={run_dir}", f"data.cache_dir={data_cache}", *more]


def on_hosts(master, node_rank: int, nproc: int, *args) -> list[str]:
    """`torchrun` for node `node_rank` of a 2-host job whose master is host `master`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        str(node_rank),
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        master.addr,
        "--master_port",
        str(MASTER_PORT),
        "-m",
        "loomtrain",
        *map(str, args),
    ]


def user_env(**extra: str) -> dict[str, str]:
    """A launched run's environment without any interface choice of this machine's."""
    env = child_env(**extra)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var not in extra:
            env.pop(var, None)
    return env


def start(a, b, tmp_path: Path, nproc: int, args: list, env: dict[str, str] | None = None):
    """Start the job on hosts A (node 0, output read line by line) and B (node 1, output in a
    file); -> (the run on A, B's process, B's output file)."""
    env = env or user_env()
    b_out = tmp_path / f"host_b_{len(list(tmp_path.glob('host_b_*')))}.out"
    b_proc = b.popen(
        on_hosts(a, 1, nproc, *args), env=env, cwd=tmp_path, stdout=open(b_out, "w"), stderr=subprocess.STDOUT
    )
    run = Run(a.argv(on_hosts(a, 0, nproc, *args)), tmp_path, env)
    return run, b_proc, b_out


def finish_both(run: Run, b_proc: subprocess.Popen, timeout: float) -> tuple[int, int]:
    rc_a = run.finish(timeout=timeout)
    try:
        rc_b = b_proc.wait(timeout=timeout)
    finally:
        if b_proc.poll() is None:
            b_proc.kill()
    return rc_a, rc_b


def assert_nothing_left(*hosts_) -> None:
    for host in hosts_:
        host.kill()  # torchrun's ranks run in sessions of their own: whatever is still there
        assert host.pids() == [], f"{host.name} still runs {host.pids()}"


def ours_in_traceback(text: str) -> list[str]:
    """Frames of Python tracebacks other than torchrun's own report of a failed child."""
    frames = re.findall(r'File "([^"]+)"', text)
    torchrun = re.compile(r"torch/distributed/(run\.py|elastic/|launcher/)|^<frozen runpy>$")
    return [f for f in frames if not torchrun.search(f)]


def reference(tmp_path: Path, data_cache: Path, nproc: int, *more: str) -> dict[int, float]:
    """The same job on one host: `nproc` ranks under torchrun --standalone."""
    run_dir = tmp_path / f"one_host_{nproc}"
    run_loomtrain(*overrides(run_dir, data_cache, *more), nproc=nproc, cwd=tmp_path, timeout=600)
    return losses(run_dir)


@pytest.mark.slow
def test_two_hosts_without_any_variable_train_and_equal_one_host(hosts, tmp_path, data_cache):
    """The issue's first case: 2 hosts x 1 rank, no GLOO_SOCKET_IFNAME: trains, and its losses
    are exactly those of 2 ranks on one host."""
    a, b = hosts.add(), hosts.add()
    run_dir = tmp_path / "two_hosts"
    steps = ["train.max_steps=6"]
    run, b_proc, b_out = start(a, b, tmp_path, 1, overrides(run_dir, data_cache, *steps))
    with run:
        rc = finish_both(run, b_proc, timeout=600)
    assert rc == (0, 0), run.text[-3000:] + b_out.read_text()[-3000:]
    assert "world 2 on 2 hosts (tp 1 x dp 2)" in run.text, run.text[-3000:]
    assert re.search(
        rf"2 hosts: \S+/{a.addr} rank 0, \S+/{b.addr} rank 1; process group over "
        r"GLOO_SOCKET_IFNAME=eth0 \(chosen: routes to the master\)",
        run.text,
    ), run.text[-3000:]
    header = (run_dir / "logs" / "rank_00001.log").read_text().splitlines()[0]
    assert f"/{b.addr} pid" in header and "GLOO_SOCKET_IFNAME=eth0" in header, header
    got = losses(run_dir)
    want = reference(tmp_path, data_cache, 2, *steps)
    assert sorted(got) == list(range(1, 7)) and got == want, (got, want)
    assert_nothing_left(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("ifname", ["eth9", "lo"])
def test_a_wrong_interface_of_the_users_is_kept_and_fails_as_one_line(hosts, tmp_path, data_cache, ifname):
    """eth9 does not exist; lo makes each side tell the other to connect to its own loopback."""
    a, b = hosts.add(), hosts.add()
    run_dir = tmp_path / "run"
    args = overrides(run_dir, data_cache, "train.max_steps=2", "parallel.timeout_s=30")
    run, b_proc, b_out = start(a, b, tmp_path, 1, args, user_env(GLOO_SOCKET_IFNAME=ifname))
    started = time.monotonic()
    with run:
        rc_a, rc_b = finish_both(run, b_proc, timeout=300)
    took = time.monotonic() - started
    for rc, text in ((rc_a, run.text), (rc_b, b_out.read_text())):
        assert rc != 0, text[-3000:]
        ours = [line for line in text.splitlines() if line.startswith("loomtrain:")]
        assert len(ours) == 1, text[-3000:]
        assert ours[0].startswith(
            f"loomtrain: rendezvous error: could not join the process group at {a.addr}:{MASTER_PORT} "
            f"over GLOO_SOCKET_IFNAME={ifname} (your setting)"
        ), ours[0]
        assert "set GLOO_SOCKET_IFNAME to this host's interface" in ours[0] and "GLOO_SOCKET_IFNAME=eth0" in ours[0]
        assert "no peer connected within" not in ours[0], ours[0]  # the failing side told the other
        assert not ours_in_traceback(text), text[-3000:]
    assert took < 90, took  # inside the group's timeout (30 + 60 s) with start-up on a loaded machine
    assert_nothing_left(a, b)


@pytest.mark.slow
def test_a_tp_group_across_hosts_is_refused_unless_asked_for(hosts, tmp_path, data_cache):
    a, b = hosts.add(), hosts.add()
    run_dir = tmp_path / "run"
    args = overrides(run_dir, data_cache, "train.max_steps=2", "parallel.tp=2", "train.global_batch_size=2")
    run, b_proc, b_out = start(a, b, tmp_path, 1, args)
    with run:
        rc_a, rc_b = finish_both(run, b_proc, timeout=300)
    assert rc_a != 0 and rc_b != 0, run.text[-3000:]
    for text in (run.text, b_out.read_text()):
        ours = [line for line in text.splitlines() if line.startswith("loomtrain:")]
        assert len(ours) == 1, text[-3000:]
        assert ours[0].startswith(
            "loomtrain: config error: parallel.tp=2: the tensor-parallel group of ranks 0-1 would span hosts (2 hosts: "
        ), ours[0]
        assert f"/{a.addr} rank 0" in ours[0] and f"/{b.addr} rank 1" in ours[0] and "1 rank per host" in ours[0]
        assert "use parallel.tp=1" in ours[0] and "parallel.allow_cross_host_tp=true" in ours[0], ours[0]
        assert not ours_in_traceback(text), text[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()  # refused before any step
    assert_nothing_left(a, b)

    asked = overrides(
        tmp_path / "asked",
        data_cache,
        "train.max_steps=2",
        "parallel.tp=2",
        "train.global_batch_size=2",
        "parallel.allow_cross_host_tp=true",
    )
    run, b_proc, b_out = start(a, b, tmp_path, 1, asked)
    with run:
        rc = finish_both(run, b_proc, timeout=600)
    assert rc == (0, 0), run.text[-3000:] + b_out.read_text()[-3000:]
    assert "world 2 on 2 hosts (tp 2 x dp 1)" in run.text and sorted(losses(tmp_path / "asked")) == [1, 2]
    assert_nothing_left(a, b)


@pytest.mark.slow
def test_two_hosts_of_two_ranks_equal_one_host_of_four(hosts, tmp_path, data_cache):
    """tp 2 inside each host, dp 2 across them (fp32) == the same 4 ranks on one host."""
    a, b = hosts.add(), hosts.add()
    run_dir = tmp_path / "two_hosts"
    steps = ["train.max_steps=6", "parallel.tp=2"]
    run, b_proc, b_out = start(a, b, tmp_path, 2, overrides(run_dir, data_cache, *steps))
    with run:
        rc = finish_both(run, b_proc, timeout=600)
    assert rc == (0, 0), run.text[-3000:] + b_out.read_text()[-3000:]
    assert "world 4 on 2 hosts (tp 2 x dp 2)" in run.text, run.text[-3000:]
    assert re.search(rf"/{a.addr} ranks 0-1, \S+/{b.addr} ranks 2-3", run.text), run.text[-3000:]
    got = losses(run_dir)
    want = reference(tmp_path, data_cache, 4, *steps)
    assert sorted(got) == list(range(1, 7)), got
    worst = max(abs(got[s] - want[s]) for s in want)
    print(f"2 hosts x 2 ranks vs 1 host x 4: max |dloss| = {worst:.3g}")
    assert worst <= 1e-6, (got, want)
    assert_nothing_left(a, b)


PARTITION_TIMEOUT_S = 20


@pytest.mark.slow
def test_a_partition_is_named_by_the_hang_watchdog(hosts, tmp_path, data_cache):
    """Host B's link goes down after step 5: every rank lives on, waiting in a collective; the
    watchdog's probe of the master tells the sides apart, and the one line names host B's
    ranks, within parallel.timeout_s + 30 s; the run exits non-zero."""
    a, b = hosts.add(), hosts.add()
    run_dir = tmp_path / "run"
    args = overrides(
        run_dir,
        data_cache,
        "train.max_steps=1000",
        "parallel.tp=2",
        "checkpoint.every_steps=0",
        f"parallel.timeout_s={PARTITION_TIMEOUT_S}",
    )
    run, b_proc, b_out = start(a, b, tmp_path, 2, args)
    with run:
        run.wait_for(lambda line: line.startswith("step 5/"), timeout=300)
        b.link_down()
        cut_at = time.time()
        rc_a = run.finish(timeout=PARTITION_TIMEOUT_S + 90)
    hang = [line for line in run.lines if line.startswith("loomtrain: hang:")]
    assert rc_a != 0 and len(hang) == 1, run.text[-3000:]
    reported = json.loads((run_dir / "logs" / "hang.json").read_text())
    took = reported["time"] - cut_at
    print(f"partition to the hang line: {took:.1f} s")
    assert took < PARTITION_TIMEOUT_S + 30, (took, hang[0])
    assert reported["stuck"] == [2, 3], reported
    line = hang[0]
    assert re.match(
        r"loomtrain: hang: rank 2 \(host \S+/198\.18\.0\.2, pid \d+\), rank 3 \(host \S+/198\.18\.0\.2, pid \d+\) "
        r"did not reach step \d+ \(in training step, allowed \d+ s: parallel\.timeout_s\), "
        r"cut off: host \S+/198\.18\.0\.2 cannot reach the master "
        rf"{re.escape(a.addr)}:{MASTER_PORT}; ranks 0(, 1)? waited in ",
        line,
    ), line
    assert re.search(r"; ranks (0, )?1 waited in ", line) and "watchdog.py" not in line, (
        line
    )  # A's ranks: in collectives
    b.kill()  # host B's leftovers: its ranks end themselves, its torchrun may still wait on the store
    b_proc.wait(timeout=30)
    assert_nothing_left(a, b)
