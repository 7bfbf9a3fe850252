"""The test hosts themselves (tests/hosts.py): separate machines as far as the network goes."""

import socket
import subprocess
import sys
import time

import pytest
from hosts import SUBNET, Hosts, netns_pids

# A TCP server on a host: accepts one connection, answers "hello from ADDR", exits.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); c.sendall(("hello from " + sys.argv[1]).encode()); c.close()
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
print(c.recv(100).decode())
"""


def _serve(host):
    proc = host.popen([sys.executable, "-c", SERVER, host.addr], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _connect(host, addr, timeout=5.0):
    return host.run([sys.executable, "-c", CLIENT, addr, str(timeout)], timeout=timeout + 20)


def test_hosts_reach_each_other_over_their_own_interfaces(hosts):
    a, b = hosts.add(), hosts.add()
    assert (a.addr, b.addr) == (f"{SUBNET}.1", f"{SUBNET}.2")
    server = _serve(b)
    out = _connect(a, b.addr)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"hello from {b.addr}"
    server.wait(timeout=10)
    # Each host has its own loopback and one interface, eth0, at its own address.
    addrs = a.run(["ip", "-4", "-o", "addr"]).stdout
    assert f"{a.addr}/24" in addrs and "eth0" in addrs and b.addr not in addrs
    # The machine's hostname resolves to loopback on a host, as on many Debian/Ubuntu machines.
    name = a.run([sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"])
    assert name.stdout.strip().startswith("127.")


def test_kill_is_a_node_crash_and_link_down_a_partition(hosts):
    a, b = hosts.add(), hosts.add()
    sleepers = [b.popen(["sleep", "600"]) for _ in range(2)]
    deadline = time.monotonic() + 30  # `ip netns exec` enters the namespace a moment after it starts
    while len(b.pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(b.pids()) == 2
    b.kill()
    assert b.pids() == [] and all(p.returncode == -9 for p in sleepers)
    server = _serve(b)  # the host itself is still there: a new process serves on it
    assert _connect(a, b.addr).returncode == 0
    server.wait(timeout=10)

    b.link_down()
    server = _serve(b)
    started = time.monotonic()
    cut = _connect(a, b.addr, timeout=2)
    assert cut.returncode != 0 and "timed out" in cut.stderr and time.monotonic() - started < 20
    b.link_up()
    healed = _connect(a, b.addr, timeout=10)
    assert healed.returncode == 0 and healed.stdout.strip() == f"hello from {b.addr}"
    server.wait(timeout=10)


def test_a_host_added_later_joins_and_nothing_is_left_behind():
    with Hosts() as net:
        a, b = net.add(), net.add()
        net.remove(b)
        c = net.add()
        assert c.addr == f"{SUBNET}.3"
        server = _serve(c)
        assert _connect(a, c.addr).stdout.strip() == f"hello from {c.addr}"
        server.wait(timeout=10)
        a.popen(["sleep", "600"])
        names = [h.name for h in net.hosts] + [net.switch]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed.split() for n in names)
    assert not net.leftovers()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert net.prefix + "v" not in links and net.prefix + "p" not in links
    assert all(netns_pids(n) == [] for n in names)


def test_everything_is_removed_when_a_test_fails():
    with pytest.raises(RuntimeError), Hosts() as net:
        net.add().popen(["sleep", "600"])
        raise RuntimeError("a failing test")
    assert not net.leftovers()
    assert socket.gethostname()  # this process is untouched
