"""A private Ray head for a test module: loopback only, token auth, own temp dir.

`ray_head` starts `ray start --head --block` in its own process group, on free
ports (GCS, dashboard, client server, agents, metrics) and with its own
`--temp-dir`, so it never collides with another engineer's Ray on this host.
Teardown kills that process group and nothing else (never `ray stop`, which
would end every Ray process on the machine).

Module-scoped, not per session: a head idles at ~5% of a core (its dashboard, agents and
monitors), and a session's head, started by an early module, idled through the rest of
each xdist process's run (~2 x 20 minutes: more CPU than a start per module, ~9 CPU-s).

Token authentication is on, with a token made for this head: the head and
every client in this test process get `RAY_AUTH_MODE=token` and
`RAY_AUTH_TOKEN`; `env` holds the variables a subprocess client needs.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HEAD_CPUS = 4  # the Ray Train tests use 4 one-CPU workers


@dataclass
class RayHead:
    gcs_address: str  # "127.0.0.1:PORT", for ray.init / ray.address
    dashboard_url: str  # "http://127.0.0.1:PORT", for Ray Jobs
    temp_dir: str
    pgid: int
    env: dict[str, str] = field(default_factory=dict)  # what a client needs


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_for_dashboard(url: str, token: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    req = urllib.request.Request(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            # The job API answers once the head (and its JobHead module) is up.
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"Ray head did not come up within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def start_ray_head(num_cpus: int = HEAD_CPUS, timeout_s: float = 120.0) -> RayHead:
    gcs, dash, client, agent_listen, agent_grpc, rt_env, metrics = _free_ports(7)
    # A short path: Ray's unix sockets live under it (107-byte limit).
    temp_dir = tempfile.mkdtemp(prefix="lt-ray-", dir="/tmp")
    token = secrets.token_hex(32)
    client_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env = {**os.environ, **client_env, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cmd = [
        ray_bin,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_listen}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={rt_env}",
        f"--metrics-export-port={metrics}",
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    log = Path(temp_dir) / "ray-start.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    head = RayHead(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", temp_dir, proc.pid, client_env)
    head._proc = proc  # type: ignore[attr-defined]
    try:
        _wait_for_dashboard(head.dashboard_url, token, proc, log, timeout_s)
    except BaseException:
        stop_ray_head(head)
        raise
    return head


def stop_ray_head(head: RayHead) -> None:
    """Kill the head's process group (ours only) and remove its temp dir."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(head.pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(head.pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            continue
        break
    proc = getattr(head, "_proc", None)
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def _reload_ray_auth() -> None:
    """Make this process's Ray read RAY_AUTH_MODE / RAY_AUTH_TOKEN again.

    Ray reads them once, when ray._raylet is first imported, and keeps the token it first loads:
    a module run earlier in the same xdist process that imported Ray (before any head set the
    variables) left it in 'disabled' mode, and every client call here was refused ("Missing
    authentication token"; CI, stop 50); a process that had talked to an earlier module's head
    kept that head's token ("Invalid authentication token"). Ray's own tests reset the same way."""
    if "ray._raylet" in sys.modules:
        from ray._private.authentication_test_utils import reset_auth_token_state

        reset_auth_token_state()


@pytest.fixture(scope="module")
def ray_head():
    """One private Ray head per test module; client env set in this process."""
    head = start_ray_head()
    saved = {k: os.environ.get(k) for k in (*head.env, "RAY_ADDRESS")}
    os.environ.update(head.env)
    os.environ.pop("RAY_ADDRESS", None)
    _reload_ray_auth()
    try:
        yield head
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:
            pass
        stop_ray_head(head)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reload_ray_auth()
