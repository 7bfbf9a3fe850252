"""Process-group and device set-up from the environment, the same for every launcher.

Three ways a rank can arrive here, and what we do:

* a process group already exists (Ray Train's worker set it up with gloo or
  nccl, or a test did): use it as it is;
* torchrun (or any launcher) set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
  MASTER_PORT: rendezvous through them, over the interface that routes to MASTER_ADDR
  (`choose_socket_interface`; a user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME is kept).
  A rendezvous that fails is a `RendezvousError`: one line naming the address, the
  interface and the variable to set;
* a lone process (`loomtrain train ...` on a laptop): pick a free port on
  127.0.0.1 and act as rank 0 of 1 (no MPI discovery).

gloo on CPU, nccl on CUDA; `LOCAL_RANK` picks the GPU. Once the group exists every rank
all-gathers its host (`host_label`: hostname and the address that routes to the master,
since hostnames alone repeat across containers and namespaces), so `DistEnv.hosts` says
where each rank runs (the TP placement check and the logs use it). A group made here is destroyed
at exit (an adopted one is left to its launcher). A hung rank is found by the
loop's watchdog after its phase's allowance (loomtrain.launcher.timeouts); the
collective timeout is a margin above the longest one, so the watchdog's report (which rank,
where) comes first and the library's timeout is only the backstop.

On CUDA the NCCL flight recorder is on unless the environment says otherwise: the
last collectives of every rank are kept in a ring buffer and dumped on a timeout to
RUN_DIR/logs/nccl_trace_rank_N (read with `python -m torch.distributed.flight_recorder.fr_trace`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loomtrain.launcher import rundir
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.timeouts import HANG_REPORT_MARGIN_S, allowances
from loomtrain.storage import message_line


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str  # "existing" | "env" | "local"
    # Every rank's host_label, by global rank (one entry per rank of the world).
    hosts: tuple[str, ...] = field(default_factory=tuple)
    # The socket interface the group's traffic uses (GLOO/NCCL_SOCKET_IFNAME), and who set it.
    interface: str = ""

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    @property
    def host(self) -> str:
        return self.hosts[self.rank] if self.hosts else host_label(None)

    @property
    def n_hosts(self) -> int:
        return len(set(self.hosts)) or 1


def select_device(requested: str, local_rank: int = 0) -> torch.device:
    """auto -> the GPU named by LOCAL_RANK when CUDA is there, else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device: cuda was requested but torch sees no CUDA device")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def prepare_accelerator_env(device: torch.device) -> None:
    """DeepSpeed picks its accelerator once, at first use: tell it before it looks."""
    if device.type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cuda")


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def socket_ifname_var(backend: str) -> str:
    """The variable that picks the interface of `backend`'s connections."""
    return "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"


def interface_to(peer: str) -> tuple[str | None, str]:
    """(name, address) of this host's interface that routes to `peer` (a host name or address).

    A UDP `connect` sends nothing: it only asks the kernel's routing table which local
    address a packet to `peer` would leave from; the interface holding that address is the
    one gloo and NCCL must bind. The name is None when no interface holds it."""
    import psutil

    peer_ip = socket.gethostbyname(peer)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_ip, 9))
        local = probe.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name, local
    return None, local


def choose_socket_interface(peer: str, environ=os.environ) -> dict[str, str]:
    """Point GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME at the interface that routes to `peer`
    (the master, or the Ray head), unless the user set them; returns what was set.

    Unset, gloo binds the address the machine's hostname resolves to, which on many hosts
    is 127.0.1.1 or 127.0.0.1: peers on other hosts are then told to connect to loopback."""
    if all(environ.get(var) for var in SOCKET_IFNAME_VARS):
        return {}
    name, _ = interface_to(peer)
    if name is None:
        return {}
    chosen = {var: name for var in SOCKET_IFNAME_VARS if not environ.get(var)}
    environ.update(chosen)
    return chosen


class RendezvousError(RuntimeError):
    """The process group could not be formed; the message is one line: the address tried,
    the interface used and the variable that picks it."""


def master_address(environ=os.environ) -> str | None:
    """MASTER_ADDR:MASTER_PORT where a launcher set them."""
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        return f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    return None


def host_label(peer: str | None) -> str:
    """This host's name in logs and placement: hostname/ADDRESS, the address being the one
    that routes to `peer` (the master). The hostname alone does not tell hosts apart: every
    container or network namespace of one machine has the same, and it often resolves to
    loopback."""
    addr = "127.0.0.1"
    if peer:
        with contextlib.suppress(OSError):
            addr = interface_to(peer)[1]
    return f"{socket.gethostname()}/{addr}"


def describe_interface(backend: str, chosen: dict[str, str] | None, environ=os.environ) -> str:
    """e.g. 'GLOO_SOCKET_IFNAME=eth0 (chosen: routes to the master)' or '... (your setting)';
    `chosen` None: a group this process adopted, whoever set the variable."""
    var = socket_ifname_var(backend)
    value = environ.get(var)
    if not value:
        return f"{var} unset"
    if chosen is None:
        return f"{var}={value}"
    return f"{var}={value} ({'chosen: routes to the master' if var in chosen else 'your setting'})"


def rendezvous_failure(cause: BaseException | str, backend: str, chosen: dict[str, str], environ=os.environ) -> str:
    """The one line a failed rendezvous becomes (of the library's message, its first line)."""
    var = socket_ifname_var(backend)
    master = master_address(environ) or "?"
    peer = environ.get("MASTER_ADDR", "")
    try:
        route = interface_to(peer)[0] if peer else None
    except OSError as err:  # the master's name does not resolve
        route, reason = None, f"{peer} does not resolve ({err})"
    else:
        reason = f"the route to {peer} leaves by {route}" if route else f"no interface holds the route to {peer}"
    cause = message_line(cause)[:300]
    return (
        f"could not join the process group at {master} over {describe_interface(backend, chosen, environ)}: "
        f"{cause}; {reason}: set {var} to this host's interface that reaches {peer or 'the master'}"
        + (f" (e.g. {var}={route})" if route and environ.get(var) != route else "")
        + " on every host, and check that the port is open between the hosts"
    )


@contextlib.contextmanager
def _library_output_aside(keep_on_failure: Path):
    """Holds what C++ code prints on stderr during the rendezvous (gloo's retry lines would
    bury the one line that says what to do): replayed on success, else kept in a file.
    Yields the console's stderr (a descriptor)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield saved
            ok = True
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read()
            if ok:
                os.write(2, text)
            elif text:
                with contextlib.suppress(OSError):
                    keep_on_failure.write_bytes(text)


def collective_timeout_s(cfg: RunConfig) -> int:
    """The process group's timeout: above the watchdog's longest allowance (a rank may wait in a
    collective while a peer is in a long evaluation or checkpoint save), so that the watchdog
    reports first."""
    return math.ceil(allowances(cfg).longest) + HANG_REPORT_MARGIN_S


def flight_recorder_env(run_dir: str | os.PathLike) -> dict[str, str]:
    """NCCL flight recorder: a ring buffer of recent collectives, dumped into the rank logs'
    folder when a collective times out (set before the NCCL process group exists)."""
    prefix = str(Path(run_dir).absolute() / "logs" / "nccl_trace_rank_")
    return {  # the TORCH_FR_* names, and the TORCH_NCCL_* ones older releases read
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def init_distributed(cfg: RunConfig) -> DistEnv:
    """Set up (or adopt) the default process group and this rank's device."""
    timeout = timedelta(seconds=collective_timeout_s(cfg))
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    device = select_device(cfg.train.device, local_rank)
    prepare_accelerator_env(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        for key, value in flight_recorder_env(rundir.run_dir(cfg)).items():
            os.environ.setdefault(key, value)
        (rundir.run_dir(cfg) / "logs").mkdir(parents=True, exist_ok=True)

    chosen: dict[str, str] | None = None  # only the "env" launcher chooses (a lone run needs no interface)
    if dist.is_available() and dist.is_initialized():
        launcher = "existing"
        backend = dist.get_backend()
    elif all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        launcher = "env"
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        chosen = {}
        with contextlib.suppress(OSError):  # an unresolvable master fails below, with its name
            chosen = choose_socket_interface(os.environ["MASTER_ADDR"])
        _join_group(backend, timeout, chosen)
    else:
        launcher = "local"
        # The store binds port 0 and the OS picks the port as it binds it: a port picked first
        # and bound later could be taken meanwhile by another process (EADDRINUSE).
        lone_store = dist.TCPStore(
            "127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout, wait_for_workers=False
        )
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(lone_store.port),
        )
        dist.init_process_group(backend=backend, timeout=timeout, store=lone_store, rank=0, world_size=1)
    if launcher != "existing":
        atexit.register(_destroy_process_group)  # ours to end (an adopted group is its launcher's)

    # DeepSpeed's comm layer wraps the existing group (no second rendezvous). Imported here:
    # checkpoint readers (export, generate) use this module's rank helpers without DeepSpeed.
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's shared-memory all-reduce serves only its inference engine (training talks to
    # torch.distributed), yet on a CPU it is a C++ build of 30-80 s at the first start, and
    # again whenever another `ninja` is first on PATH (two ninjas disagree on the build log).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout, verbose=False)
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
        launcher=launcher,
        hosts=tuple(all_gather_objects(host_label(os.environ.get("MASTER_ADDR")))),  # every rank's, by rank
        interface="" if launcher == "local" else describe_interface(backend, chosen),
    )


# Where a rank that failed to join leaves its line, for the ranks still waiting (per torchrun attempt).
RENDEZVOUS_FAILED_KEY = "loomtrain/rendezvous_failed/{attempt}"


def _join_group(backend: str, timeout: timedelta, chosen: dict[str, str]) -> None:
    """The rendezvous at MASTER_ADDR:MASTER_PORT; its failure (a peer told to connect to
    loopback, a wrong interface, a closed port, a timeout) is one RendezvousError line.

    The side that fails (its connect is refused) leaves its line in the launcher's store.
    The side left listening for it would wait inside gloo without a limit; `_bound_rendezvous`
    ends it when that line appears or after the process group's timeout.
    The library's own messages go to a file in the temporary folder, not RUN_DIR: rank 0
    has not necessarily claimed RUN_DIR yet, and a folder made in it first would fail that."""
    rank = os.environ["RANK"]
    held = Path(tempfile.gettempdir()) / f"loomtrain-rendezvous-rank{rank}-pid{os.getpid()}.log"
    key = RENDEZVOUS_FAILED_KEY.format(attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    joined = threading.Event()
    try:
        with _library_output_aside(held) as console:
            give_up = functools.partial(_bound_rendezvous, joined, timeout, console, key, backend, chosen)
            threading.Thread(target=give_up, name="loomtrain-rendezvous-bound", daemon=True).start()
            try:
                dist.init_process_group(backend=backend, timeout=timeout, init_method="env://")
            finally:
                joined.set()
    except RuntimeError as exc:  # torch's DistError family, gloo's connectFullMesh, a bad interface name
        with contextlib.suppress(Exception):  # best effort: the others time out without it
            who = host_label(os.environ["MASTER_ADDR"])
            line = f"rank {rank} ({who}) failed: {message_line(exc)[:300]}"
            _tell_the_others(_store_client(timedelta(seconds=5)), key, line)
        note = f" (the library's messages: {held})" if held.exists() else ""
        raise RendezvousError(rendezvous_failure(exc, backend, chosen) + note) from None


# How long a rank that failed to join waits for the others to read its line before it exits.
RENDEZVOUS_TELL_S = 10.0


def _tell_the_others(store, key: str, line: str) -> None:
    """Leave this rank's failure for the ranks still waiting, and stay until each of them has
    read it or failed too (at most RENDEZVOUS_TELL_S): on the master's host, this rank's exit
    ends torchrun's agent and the store with it, before a waiting rank's next look."""
    store.set(key, line)
    world = int(os.environ["WORLD_SIZE"])
    done = store.add(f"{key}/done", 1)
    deadline = time.monotonic() + RENDEZVOUS_TELL_S
    while done < world and time.monotonic() < deadline:
        time.sleep(0.2)
        done = store.add(f"{key}/done", 0)


def _store_client(timeout: timedelta):
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


def _bound_rendezvous(
    joined: threading.Event, timeout: timedelta, console: int, key: str, backend: str, chosen: dict[str, str]
) -> None:
    """While the main thread is inside the library's rendezvous: once a peer reports that it
    failed, or the timeout passes, print the one line and end the process (the library call
    cannot be interrupted)."""
    deadline = time.monotonic() + timeout.total_seconds()
    store = None
    while not joined.wait(1.0):
        failed = None
        with contextlib.suppress(Exception):  # the store may not be up yet
            store = store or _store_client(timedelta(seconds=5))
            if store.check([key]):
                failed = store.get(key).decode()
                store.add(f"{key}/done", 1)  # read: the failed rank may go
        if failed is None and time.monotonic() < deadline:
            continue
        cause = failed or f"no peer connected within {timeout.total_seconds():.0f} s"
        line = f"loomtrain: rendezvous error: {rendezvous_failure(cause, backend, chosen)}\n"
        if not joined.is_set():
            os.write(console, line.encode())
            os._exit(1)


def _destroy_process_group() -> None:
    """End the process group this process made, at exit while the interpreter is still whole.

    Left to interpreter finalization, gloo's worker threads can drop their last tensors after
    Python is gone, and the process aborts on the way out ("terminate called without an active
    exception", SIGABRT): a finished rank would report a failure to torchrun. This does not
    join those threads (core dumps show them still at work after it), which is why small
    objects go through the store (all_gather_objects, below), not gloo."""
    if is_distributed():
        dist.destroy_process_group()


# The collectives every room uses, all no-ops in a lone process without a process group.
def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def current_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def current_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if current_world_size() > 1:
        dist.barrier()


# Small Python objects travel through the group's key-value store, not gloo's
# all_gather_object / broadcast_object_list: those hand gloo's worker threads tensors made in
# Python, and a worker that drops the last one after the main thread has begun to finalize the
# interpreter needs the GIL it can no longer take: the finished rank aborts on its way out
# (SIGABRT, "terminate called without an active exception"; core dumps show
# ~AsyncAllgatherWork -> take_gil -> pthread_exit). The store is C++ and holds no tensor.
def _next_call(store, kind: str) -> tuple[int, str]:
    """This call's number and key prefix. Every rank counts its own calls of `kind` at the store;
    all ranks make the same calls in the same order (as with any collective), so the counts agree."""
    call = store.add(f"loomtrain/{kind}/calls/{current_rank()}", 1)
    return call, f"loomtrain/{kind}/{call}"


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, by global rank (a collective: every rank calls it)."""
    if current_world_size() == 1:
        return [obj]
    store = dist.distributed_c10d._get_default_store()
    (call, prefix), rank = _next_call(store, "gather"), current_rank()
    store.set(f"{prefix}/{rank}", pickle.dumps(obj))
    got = [pickle.loads(b) for b in store.multi_get([f"{prefix}/{r}" for r in range(current_world_size())])]
    # Every rank has written this call's key, so every rank is done reading the last call's.
    store.delete_key(f"loomtrain/gather/{call - 1}/{rank}")
    return got


def broadcast_str(value: str | None) -> str | None:
    """Rank 0's value on every rank (a collective: every rank calls it)."""
    if current_world_size() == 1:
        return value
    store = dist.distributed_c10d._get_default_store()
    _, prefix = _next_call(store, "broadcast")
    if current_rank() == 0:
        store.set(prefix, pickle.dumps(value))
        return value
    value = pickle.loads(store.get(prefix))
    if store.add(f"{prefix}/read", 1) == current_world_size() - 1:  # the last reader clears
        store.delete_key(prefix)
        store.delete_key(f"{prefix}/read")
    return value
