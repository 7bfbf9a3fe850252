"""A Ray cluster across test hosts (tests/hosts.py): one Ray node per network namespace.

    cluster = start_ray_cluster(net, n_hosts=2)      # head on 198.18.0.1, a node on .2
    proc = cluster.head.popen(loomtrain_cmd("train", CFG, f"ray.address={cluster.address}", ...),
                              env=cluster.client_env(), ...)   # the driver runs on the head's host
    cluster.hosts[1].kill()                          # a node crash
    cluster.add_node()                               # a fresh host joins: 198.18.0.3
    cluster.wait_for_nodes(2)                        # until the head sees 2 live nodes

or the `ray_cluster` fixture (module-scoped: one cluster for a test module, 2 hosts x 2 CPUs).
`start_ray_cluster(net, head=host, env={...})` puts the head on a host the test made first (one
that already runs a server, say) and gives `env` to every node, so to every Ray worker (they
inherit their raylet's environment), and to `client_env()`: an S3 endpoint and its credentials,
TMPDIR inside a host's private folder (tests/hosts.py `Hosts(private=...)`).

The head host runs `ray start --head --node-ip-address=198.18.0.1 --block`, every other host
`ray start --address=198.18.0.1:6379 --node-ip-address=198.18.0.N --block`, each with
`--num-cpus` (2: two one-CPU workers per host) and its own `--temp-dir` (the hosts share
this machine's filesystem; Ray's session files and unix sockets must not collide). Ports are
Ray's defaults: each host is its own network namespace, so nothing else (another engineer's
Ray, the session's `ray_head`) can hold them there. Nothing sets GLOO_SOCKET_IFNAME: picking
the interface is loomtrain's job.

Token authentication, as on a real cluster (tests/ray_fixtures.py): a token made per cluster,
`RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN` on every node and in `client_env()`.
The GCS declares a silent node dead after ~3 s (1 s health checks, 3 misses; Ray's default is
~30 s), so a test's node crash is seen quickly.

`live_nodes()` asks the head's dashboard (127.0.0.1 on the head's host; the test process, in
the machine's own namespace, has no route to 198.18.0.0/24) from a short script run there.
Teardown kills each node's `ray start` process group, then the `Hosts` kills whatever is left
in the namespaces and deletes them; nothing else on the machine is touched (never `ray stop`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hosts import Host, Hosts, require_netns

GCS_PORT = 6379
DASHBOARD_PORT = 8265
CPUS_PER_HOST = 2

# Run on the head's host: the addresses of the nodes the head sees alive, as a JSON list.
_LIVE_NODES = """
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]})
with urllib.request.urlopen(req, timeout=5) as r:
    nodes = json.load(r)["data"]["summary"]
print(json.dumps(sorted(n["raylet"]["nodeManagerAddress"] for n in nodes if n["raylet"].get("state") == "ALIVE")))
"""


@dataclass
class RayNode:
    host: Host
    proc: subprocess.Popen
    temp_dir: str
    log: Path


@dataclass
class RayCluster:
    net: Hosts
    token: str
    cpus_per_host: int = CPUS_PER_HOST
    env: dict[str, str] = field(default_factory=dict)  # for every node and client (e.g. an S3 endpoint)
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def head(self) -> Host:
        return self.nodes[0].host

    @property
    def hosts(self) -> list[Host]:
        return [n.host for n in self.nodes]

    @property
    def address(self) -> str:
        """The GCS address, for `ray.address` (the driver runs on the head's host)."""
        return f"{self.head.addr}:{GCS_PORT}"

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) plus what a client of this cluster needs."""
        env = dict(os.environ if base is None else base)
        env.pop("RAY_ADDRESS", None)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0")
        env.update(self.env)
        return env

    def _node_env(self) -> dict[str, str]:
        env = self.client_env()
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.pop(var, None)  # loomtrain must pick the interface itself
        # A crashed node is declared dead after ~3 s instead of Ray's ~30 s.
        env.update(
            RAY_health_check_initial_delay_ms="1000",
            RAY_health_check_period_ms="1000",
            RAY_health_check_timeout_ms="1000",
            RAY_health_check_failure_threshold="3",
        )
        return env

    def _start(self, host: Host, head: bool) -> RayNode:
        temp_dir = tempfile.mkdtemp(prefix="lt-rh-", dir="/tmp")  # short: unix sockets live under it
        ray_bin = str(Path(sys.executable).with_name("ray"))
        cmd = [ray_bin, "start", "--block", f"--node-ip-address={host.addr}"]
        if head:
            cmd += [
                "--head",
                f"--port={GCS_PORT}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={DASHBOARD_PORT}",
            ]
        else:
            cmd += [f"--address={self.address}"]
        cmd += [f"--num-cpus={self.cpus_per_host}", "--num-gpus=0", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        log = Path(temp_dir) / "ray-start.log"
        with open(log, "wb") as out:
            proc = host.popen(cmd, env=self._node_env(), stdout=out, stderr=subprocess.STDOUT)
        node = RayNode(host, proc, temp_dir, log)
        self.nodes.append(node)
        return node

    def live_nodes(self) -> list[str]:
        """The addresses of the nodes the head sees alive ([] while its dashboard is not up)."""
        url = f"http://127.0.0.1:{DASHBOARD_PORT}/nodes?view=summary"
        out = self.head.run([sys.executable, "-c", _LIVE_NODES, url, self.token], timeout=30)
        return json.loads(out.stdout) if out.returncode == 0 else []

    def live_hosts(self, n: int = 2) -> list[Host]:
        """The head's host first, then other live hosts: `n` in all (fresh ones join as needed)."""
        live = self.live_nodes()
        others = [h for h in self.hosts[1:] if h.addr in live]
        while len(others) < n - 1:
            others.append(self.add_node())
        return [self.head, *others[: n - 1]]

    def wait_for_nodes(self, addrs: list[str] | int, timeout_s: float = 120.0) -> list[str]:
        """Wait until the live nodes are exactly `addrs` (or `addrs` many); return them."""
        want = addrs if isinstance(addrs, int) else sorted(addrs)
        return self._wait(lambda live: (len(live) if isinstance(want, int) else live) == want, want, timeout_s)

    def _wait(self, done, what, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            live = self.live_nodes()
            if done(live):
                return live
            for node in self.nodes:
                if node.proc.poll() is not None and node.host in self.net.hosts and node.host.pids():
                    raise RuntimeError(f"ray start on {node.host.addr} exited:\n{node.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n.host.addr}\n{n.log.read_text()[-1500:]}" for n in self.nodes)
                raise RuntimeError(f"the cluster sees {live}, not {what}, after {timeout_s:.0f} s:\n{logs}")
            time.sleep(0.5)

    def add_node(self, host: Host | None = None, wait: bool = True) -> Host:
        """Start a Ray node on `host` (default: a fresh host on the switch) that joins the cluster;
        with `wait`, return once the head sees it alive."""
        host = host or self.net.add()
        self._start(host, head=False)
        if wait:
            self._wait(lambda live: host.addr in live, f"{host.addr} among them", 120.0)
        return host

    def close(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.proc.pid, signal.SIGKILL)  # this node's `ray start` group only
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
        for node in self.nodes:
            if node.host in self.net.hosts:
                node.host.kill()  # raylet children that left the group (workers start sessions)
            shutil.rmtree(node.temp_dir, ignore_errors=True)


def start_ray_cluster(
    net: Hosts,
    n_hosts: int = 2,
    cpus_per_host: int = CPUS_PER_HOST,
    head: Host | None = None,
    env: dict[str, str] | None = None,
) -> RayCluster:
    """A head on `head` (default: a fresh host) and `n_hosts - 1` nodes on fresh hosts; returns
    once all are alive. `env` goes to every node (so to every Ray worker: they inherit their
    raylet's environment) and to `client_env()`, also of nodes that join later."""
    cluster = RayCluster(net, token=secrets.token_hex(32), cpus_per_host=cpus_per_host, env=dict(env or {}))
    try:
        cluster._start(head or net.add(), head=True)
        cluster.wait_for_nodes(1)
        for _ in range(n_hosts - 1):
            cluster.add_node(wait=False)
        cluster.wait_for_nodes([h.addr for h in cluster.hosts])
    except BaseException:
        cluster.close()
        raise
    return cluster


@pytest.fixture(scope="module")
def ray_cluster():
    """2 hosts x 2 CPUs in one Ray cluster for a test module (~12 s to start; gone with the
    module, so that no idle cluster takes CPU from the modules after it); skips (fails in CI)
    where namespaces cannot be made. Tests that kill a host leave the cluster as they changed
    it: a test takes the live hosts it finds (`live_hosts`), adding one where it needs more."""
    require_netns()
    with Hosts() as net:
        cluster = start_ray_cluster(net)
        try:
            yield cluster
        finally:
            cluster.close()
    assert not net.leftovers(), f"namespaces left behind: {net.leftovers()}"
