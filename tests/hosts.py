"""Test hosts: several "machines" on this one, made of Linux network namespaces on a bridge.

    with Hosts() as net:                     # or the `hosts` fixture
        a, b = net.add(), net.add()          # 198.18.0.1, 198.18.0.2, each on its own eth0
        proc = b.popen([sys.executable, "-c", "..."], env=env)
        b.link_down(); b.link_up()           # a partition (the switch port goes down), healed
        b.kill()                             # a node crash: SIGKILL to every process of host b
        c = net.add()                        # a fresh host that joins later: 198.18.0.3

Each host is a namespace `<prefix>hN` with its own loopback and one interface, `eth0`, at
198.18.0.N/24 (RFC 2544's benchmarking range; the tests use no other), whose veth peer sits
on a bridge in a switch namespace `<prefix>sw`. Nothing is added to the machine's own
namespace: the veth pairs are made there for a moment and moved out at once. As on many
Debian/Ubuntu machines, the hostname resolves to loopback inside every host, which is what
makes gloo advertise 127.0.0.1 unless loomtrain picks the interface.

Everything made here is removed when the `Hosts` closes, also when a test fails: every process
of every host is SIGKILLed and the namespaces are deleted (their veths go with them). A
session killed before it could clean up leaves namespaces named after its PID; the next
`Hosts` removes those whose PID is gone.

Private folders (`Hosts(private=FOLDER)`): hosts that share nothing on disk but what a test
shares on purpose. Every command a host runs (its `ray start` and all it forks, a driver, a
script) sees its own folder `host.local_dir` (FOLDER.hN, made with the host) at the path FOLDER,
bound there in a mount namespace of its own (`unshare --mount --propagation private`, inside
`ip netns exec`), so one configuration (run.dir=FOLDER/run) names a different folder on each
host, and what a host writes there is visible to no other host; FOLDER itself stays empty.
`net.private_env()` points TMPDIR and XDG_CACHE_HOME into it (tmp/, cache/ of each host's
folder), so temporary files and caches are the host's own too. The test process reads a host's
files at `host.local_dir`. Without `private`, every host sees the machine's filesystem.

Root and iproute2 are needed. Where namespaces cannot be made, the fixture skips with the
reason; with LOOMTRAIN_REQUIRE_NETNS=1 (set by .ci/run) it fails instead, so CI never passes
by skipping them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SUBNET = "198.18.0"  # RFC 2544 test range: 198.18.0.0/24, never another
PRIVATE_SUBDIRS = ("tmp", "cache")  # of each host's own folder: TMPDIR and XDG_CACHE_HOME (private_env)
PREFIX_RE = re.compile(r"^lt(\d+)(?:sw|h\d+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    if shutil.which("ip") is None:
        return "network-namespace hosts need iproute2 (`ip`)"
    name = f"lt{os.getpid()}probe"[:15]
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process of a namespace until none is left (children may be forking)."""
    for _ in range(50):
        pids = netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _our_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip() and PREFIX_RE.match(line.split()[0])]


def sweep_stale() -> None:
    """Remove the namespaces of earlier sessions whose process is gone."""
    for ns in _our_namespaces():
        pid = int(PREFIX_RE.match(ns).group(1))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # alive: another session's
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _kill_namespace(ns)
        _ip("netns", "del", ns, check=False)


@dataclass
class Host:
    net: Hosts
    index: int
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.net.prefix}h{self.index}"

    @property
    def addr(self) -> str:
        return f"{SUBNET}.{self.index}"

    ifname = "eth0"

    @property
    def _port(self) -> str:  # the veth end on the switch's bridge
        return f"{self.net.prefix}p{self.index}"

    @property
    def local_dir(self) -> Path:
        """This host's own folder, which its processes see at the Hosts' `private` path."""
        assert self.net.private is not None, "a host has a folder of its own only with Hosts(private=...)"
        return self.net.private.with_name(f"{self.net.private.name}.h{self.index}")

    def argv(self, argv: list[str]) -> list[str]:
        netns = ["ip", "netns", "exec", self.name]
        if self.net.private is None:
            return [*netns, *argv]
        # A mount namespace of its own (ip netns exec already makes one, as a slave of the
        # machine's; private, so that nothing mounted in it could leak back) with this host's
        # folder over the shared path.
        # `cd "$PWD"`: a working directory under the shared path now resolves to the host's own.
        bind = 'mount --bind "$1" "$2" && { cd "$PWD" 2>/dev/null || true; } && shift 2 && exec "$@"'
        unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, "sh"]
        return [*netns, *unshare, str(self.local_dir), str(self.net.private), *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on this host (its own session, so a test can signal its group)."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(list(map(str, argv))), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(list(map(str, argv))), **kwargs)

    def pids(self) -> list[int]:
        return netns_pids(self.name)

    def kill(self) -> None:
        """A node crash: SIGKILL to every process running on this host."""
        _kill_namespace(self.name)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def link_down(self) -> None:
        """A partition: this host's switch port goes down; its processes live on, cut off."""
        _ip("-n", self.net.switch, "link", "set", self._port, "down")

    def link_up(self) -> None:
        _ip("-n", self.net.switch, "link", "set", self._port, "up")


class Hosts:
    """A private switch and the hosts on it; a context manager that removes all it made."""

    def __init__(self, private: str | os.PathLike | None = None) -> None:
        self.private = Path(private).absolute() if private is not None else None
        self.prefix = f"lt{os.getpid()}"
        self.switch = f"{self.prefix}sw"
        self.hosts: list[Host] = []
        self._next = 1

    def __enter__(self) -> Hosts:
        if self.private is not None:
            self.private.mkdir(parents=True, exist_ok=True)  # the mount point
        sweep_stale()
        # One Hosts per process at a time: a leftover of this process (a failed teardown) goes.
        for ns in _our_namespaces():
            if ns.startswith(self.prefix) and PREFIX_RE.match(ns).group(1) == str(os.getpid()):
                _kill_namespace(ns)
                _ip("netns", "del", ns, check=False)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def add(self) -> Host:
        """A fresh host on the switch, with the next address (also after others were removed)."""
        host = Host(self, self._next)
        self._next += 1
        veth = f"{self.prefix}v{host.index}"
        _ip("netns", "add", host.name)
        self.hosts.append(host)
        _ip("link", "add", veth, "type", "veth", "peer", "name", host._port)
        _ip("link", "set", veth, "netns", host.name)
        _ip("link", "set", host._port, "netns", self.switch)
        _ip("-n", host.name, "link", "set", veth, "name", host.ifname)
        _ip("-n", self.switch, "link", "set", host._port, "master", "br0")
        _ip("-n", self.switch, "link", "set", host._port, "up")
        _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
        _ip("-n", host.name, "link", "set", host.ifname, "up")
        _ip("-n", host.name, "link", "set", "lo", "up")
        if self.private is not None:
            for sub in PRIVATE_SUBDIRS:
                (host.local_dir / sub).mkdir(parents=True, exist_ok=True)
        return host

    def private_env(self) -> dict[str, str]:
        """TMPDIR and XDG_CACHE_HOME inside the private folder: each host's own ({} without one)."""
        if self.private is None:
            return {}
        return {"TMPDIR": str(self.private / "tmp"), "XDG_CACHE_HOME": str(self.private / "cache")}

    def remove(self, host: Host) -> None:
        """Kill the host's processes and take it off the switch for good."""
        host.kill()
        _ip("netns", "del", host.name, check=False)
        self.hosts.remove(host)

    def close(self) -> None:
        for host in list(self.hosts):
            self.remove(host)
        _kill_namespace(self.switch)
        _ip("netns", "del", self.switch, check=False)

    def __exit__(self, *exc) -> None:
        self.close()

    def leftovers(self) -> list[str]:
        """This object's namespaces still on the machine (none after close)."""
        return [ns for ns in _our_namespaces() if ns == self.switch or ns.startswith(f"{self.prefix}h")]


def require_netns() -> None:
    """Skip the calling test where namespaces cannot be made; fail it instead under
    LOOMTRAIN_REQUIRE_NETNS=1 (CI), so that CI never passes by skipping."""
    reason = netns_unavailable()
    if reason:
        if os.environ.get("LOOMTRAIN_REQUIRE_NETNS") == "1":
            pytest.fail(f"LOOMTRAIN_REQUIRE_NETNS=1 but {reason}")
        pytest.skip(reason)


@pytest.fixture
def hosts():
    """A `Hosts` for one test; skips (fails in CI) where namespaces cannot be made."""
    require_netns()
    with Hosts() as net:
        yield net
    assert not net.leftovers(), f"namespaces left behind: {net.leftovers()}"
