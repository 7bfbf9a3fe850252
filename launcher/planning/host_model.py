"""Host RAM per node, checkpoint size and save time: the part of `loomtrain plan` that is
about the machine around the GPUs rather than the GPUs.

Every figure comes from the config and the layout (`loomtrain.parallel.plan`):

* Start-up (`loomtrain.parallel.materialize`): a rank generates one full fp32 parameter
  at a time on the host, keeps its shard (cut in fp32, then cast) and moves it to the
  device. Host peak per rank: the largest full parameter plus two copies of its shard,
  on top of the process itself (HOST_PROCESS_GIB: Python, torch, CUDA/NCCL host buffers,
  DeepSpeed; an allowance, not derived). For comparison a start-up that builds a full fp32
  model per rank is reported next to it. On a CPU "device" the model states live in host RAM
  too and are added.
* Checkpoint: layout-free, fp32 master weights plus Adam's two moments, 12 B per
  parameter of the plain model, written once however many ranks hold it (plus small
  JSON / RNG / data-state files, ignored). Each rank writes its share: its TP shard's DP
  partition, 12 B x (parameters per TP rank) / dp.
* Save / resume host RAM: a rank stages its share in host memory (async save copies all
  of it to pinned memory, then writes in the background; a resume reads its slices
  through host memory), so per rank the share plus the process allowance.
* Save time: the nodes write in parallel, each at the stated storage bandwidth
  (--storage-gbps, GB/s per node): checkpoint bytes / (nodes x bandwidth) for a
  synchronous save: the storage is assumed to set the pace. (On a 2-core machine a save
  measures 1.3-1.6x of `dd conv=fsync`'s rate at world 1, 0.85-0.9x with four ranks sharing
  the two cores: benchmarks/checkpoint_speed.py.) An async save blocks training
  only while each rank copies its share to host memory (HOST_COPY_GBPS per GPU, pinned
  device-to-host over PCIe; on a CPU device a host memcpy, CPU_COPY_GBPS).
* Resume time: each rank reads its share (its TP shard of the weights, whole over DP below
  ZeRO-3, and its partition of the moments), checks the tile checksums of what it reads and
  copies it into the engine, at RESUME_GBPS per rank; the nodes read at the storage bandwidth.
  The slower of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1024**3
HOST_PROCESS_GIB = 3.0  # one rank's process: Python, torch, CUDA/NCCL host buffers, DeepSpeed
DEFAULT_STORAGE_GBPS = 1.0  # GB/s per node to the checkpoint storage (a shared filesystem)
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_NODE_RAM_GIB = 1024.0  # a 1 TB host
HOST_COPY_GBPS = 20.0  # pinned device-to-host per GPU (PCIe Gen4 x16 ~25 GB/s; conservative)
CPU_COPY_GBPS = 5.0  # host memcpy of one rank's share on a CPU "device"
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 master + Adam exp_avg + exp_avg_sq
# a resume's read from the page cache, tile check (XXH3-128) and copy into the engine, one rank
# on one core: 1.2 GB in 0.9 s at world 1 (benchmarks/checkpoint_speed.py, December 2026)
RESUME_GBPS = 1.3


@dataclass
class HostPlan:
    ranks_per_node: int
    nodes: int
    node_ram: float  # bytes of host RAM per node
    largest_param: int  # elements of the largest full parameter
    startup_per_rank: float
    startup_per_node: float
    full_model_startup_per_node: float  # for comparison: the full fp32 model on every rank
    checkpoint_bytes: float
    checkpoint_bytes_per_rank: float
    save_per_rank: float  # host RAM while saving or resuming
    save_per_node: float
    storage_bps: float  # bytes/s per node
    save_sync_s: float
    save_async_blocked_s: float
    resume_bytes_per_rank: float
    resume_s: float
    on_cpu: bool = False  # the ranks are CPU processes ("a node with 2 ranks"), not GPUs

    @property
    def startup_fits(self) -> bool:
        return self.startup_per_node <= self.node_ram

    @property
    def save_fits(self) -> bool:
        return self.save_per_node <= self.node_ram


def host_plan(
    *,
    total_params: int,
    largest_param: int,
    tp: int,
    dp: int,
    world_size: int,
    zero_stage: int = 0,
    device_states_on_host: float = 0.0,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    node_ram_gib: float = DEFAULT_NODE_RAM_GIB,
    storage_gbps: float = DEFAULT_STORAGE_GBPS,
    on_cpu: bool = False,
    checkpoint_params: int,
    checkpoint_per_rank: int,
) -> HostPlan:
    """device_states_on_host: bytes per rank of model states that live in host RAM (a CPU
    device, or an offloaded optimizer). checkpoint_params / checkpoint_per_rank: the parameters a
    checkpoint holds, of the plain model and of one TP rank: every one, or with model.lora the
    adapters (the frozen base is read from model.init_from at a resume, not counted here)."""
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    if storage_gbps <= 0:
        raise ValueError(f"--storage-gbps must be positive, got {storage_gbps}")
    if node_ram_gib <= 0:
        raise ValueError(f"--node-ram-gib must be positive, got {node_ram_gib}")
    per_node = min(world_size, gpus_per_node)
    nodes = math.ceil(world_size / gpus_per_node)
    process = HOST_PROCESS_GIB * GiB
    transient = 4 * largest_param * (1 + 2 / tp)  # one full fp32 parameter + its shard, twice
    startup = process + transient + device_states_on_host
    share = CHECKPOINT_BYTES_PER_PARAM * checkpoint_per_rank / dp
    save = process + share + device_states_on_host
    ckpt = CHECKPOINT_BYTES_PER_PARAM * checkpoint_params
    storage = storage_gbps * 1e9
    copy = (CPU_COPY_GBPS if on_cpu else HOST_COPY_GBPS) * 1e9
    weights_read = 4 * checkpoint_per_rank / (dp if zero_stage == 3 else 1)
    resume_read = weights_read + 8 * checkpoint_per_rank / dp
    return HostPlan(
        ranks_per_node=per_node,
        nodes=nodes,
        node_ram=node_ram_gib * GiB,
        largest_param=largest_param,
        startup_per_rank=startup,
        startup_per_node=per_node * startup,
        full_model_startup_per_node=per_node * (process + 4 * total_params + device_states_on_host),
        checkpoint_bytes=ckpt,
        checkpoint_bytes_per_rank=share,
        save_per_rank=save,
        save_per_node=per_node * save,
        storage_bps=storage,
        save_sync_s=ckpt / (nodes * storage),
        save_async_blocked_s=share / copy,
        resume_bytes_per_rank=resume_read,
        resume_s=max(per_node * resume_read / storage, resume_read / (RESUME_GBPS * 1e9)),
        on_cpu=on_cpu,
    )


def format_bytes(x: float) -> str:
    """GiB below 1 TiB, else TiB."""
    return f"{x / GiB:.1f} GiB" if x < 1024 * GiB else f"{x / 1024 / GiB:.2f} TiB"


def format_node_ram(x: float) -> str:
    """A node's RAM as people name it: 1024 GiB is "1 TB" (memory is sold in binary units)."""
    gib = x / GiB
    return f"{gib / 1024:g} TB" if gib >= 1024 and (gib / 1024) == round(gib / 1024, 2) else f"{gib:g} GiB"


def format_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.3g} s"


def format_host(h: HostPlan) -> list[str]:
    node = f"{h.ranks_per_node} rank{'s' if h.ranks_per_node > 1 else ''}"
    gpus = node if h.on_cpu else f"{h.ranks_per_node} GPUs" if h.ranks_per_node > 1 else "1 GPU"
    lines = [
        f"host RAM per node ({node}; {h.nodes} node{'s' if h.nodes > 1 else ''}; "
        f"{format_node_ram(h.node_ram)} per node)",
        f"  start-up          {format_bytes(h.startup_per_node):>12}   ({format_bytes(h.startup_per_rank)} per rank: "
        f"the process, one full fp32 parameter of {h.largest_param / 1e6:,.1f} M at a time and its shard; "
        f"building the full fp32 model on every rank would need {format_bytes(h.full_model_startup_per_node)})",
        f"  save or resume    {format_bytes(h.save_per_node):>12}   ({format_bytes(h.save_per_rank)} per rank: "
        f"the process and its {format_bytes(h.checkpoint_bytes_per_rank)} share staged in host memory)",
        "checkpoint",
        f"  size              {format_bytes(h.checkpoint_bytes):>12}   (fp32 masters + Adam moments, 12 B/param; "
        f"{format_bytes(h.checkpoint_bytes_per_rank)} written per rank)",
        f"  save at {h.storage_bps / 1e9:g} GB/s per node: synchronous {format_seconds(h.save_sync_s)} "
        f"(all {h.nodes} node{'s' if h.nodes > 1 else ''} writing); async blocks training "
        f"{format_seconds(h.save_async_blocked_s)} (the copy to host memory), then writes in the background",
        f"  resume            {format_seconds(h.resume_s):>12}   (each rank reads "
        f"{format_bytes(h.resume_bytes_per_rank)} at {h.storage_bps / 1e9:g} GB/s per node, checks it "
        f"and places it at {RESUME_GBPS:g} GB/s per rank, the slower of the two)",
    ]
    verdict = "fits" if h.startup_fits else "DOES NOT FIT"
    lines.append(
        f"  start-up {verdict} a node with {gpus} and {format_node_ram(h.node_ram)} of RAM "
        f"({format_bytes(h.startup_per_node)} needed)"
        + ("" if h.save_fits else f"; saving needs {format_bytes(h.save_per_node)}, MORE than the node has")
    )
    return lines
