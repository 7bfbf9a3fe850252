"""Process-group and device set-up from the environment, the same for every launcher.

Three ways a rank can arrive here, and what we do:

* a process group already exists (Ray Train's worker set it up with gloo or
  nccl, or a test did): use it as it is;
* torchrun (or any launcher) set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
  MASTER_PORT: rendezvous through them;
* a lone process (`loomtrain train ...` on a laptop): pick a free port on
  127.0.0.1 and act as rank 0 of 1 (no MPI discovery).

gloo on CPU, nccl on CUDA; `LOCAL_RANK` picks the GPU. A group made here is destroyed
at exit (an adopted one is left to its launcher). A hung rank is found by the
loop's watchdog after `parallel.timeout_s` (loomtrain.launcher.watchdog); the
collective timeout is a margin above that, so the watchdog's report (which rank,
where) comes first and the library's timeout is only the backstop.

On CUDA the NCCL flight recorder is on unless the environment says otherwise: the
last collectives of every rank are kept in a ring buffer and dumped on a timeout to
RUN_DIR/logs/nccl_trace_rank_N (read with `python -m torch.distributed.flight_recorder.fr_trace`).
"""

from __future__ import annotations

import atexit
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.watchdog import HANG_REPORT_MARGIN_S


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str  # "existing" | "env" | "local"

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


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


def collective_timeout_s(cfg: RunConfig) -> int:
    """The process group's timeout: above the watchdog's, so that the watchdog reports first."""
    return cfg.parallel.timeout_s + HANG_REPORT_MARGIN_S


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
        from loomtrain.launcher import components  # here: components builds on this module

        for key, value in flight_recorder_env(components.run_dir(cfg)).items():
            os.environ.setdefault(key, value)
        (components.run_dir(cfg) / "logs").mkdir(parents=True, exist_ok=True)

    if dist.is_available() and dist.is_initialized():
        launcher = "existing"
        backend = dist.get_backend()
    else:
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            launcher = "env"
        else:
            launcher = "local"
            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        dist.init_process_group(backend=backend, timeout=timeout, init_method="env://")
        atexit.register(_destroy_process_group)  # ours to end (an adopted group is its launcher's)

    # DeepSpeed's comm layer wraps the existing group (no second rendezvous). Imported here:
    # checkpoint readers (export, generate) use this module's rank helpers without DeepSpeed.
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout, verbose=False)
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
        launcher=launcher,
    )


def _destroy_process_group() -> None:
    """End the process group this process made, at exit while the interpreter is still whole.

    Left to interpreter finalization, gloo's worker threads can drop their last tensors after
    Python is gone, and the process aborts on the way out ("terminate called without an active
    exception", SIGABRT): a finished rank would report a failure to torchrun."""
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


def broadcast_str(value: str | None) -> str | None:
    """Rank 0's value on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
