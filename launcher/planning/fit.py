"""Does this config fit this machine? `train` asks before it allocates anything.

The estimate is `loomtrain plan`'s (memory_model.make_plan: model states at the ZeRO
stage and TP degree, activations, DeepSpeed's buffers, the CUDA allowance), for one
rank at the run's world size. What it is compared with:

* CUDA: the free memory of this rank's GPU (`torch.cuda.mem_get_info`), since another
  process may already hold part of it;
* CPU: the host RAM available now (psutil), shared by every rank on this host
  (LOCAL_WORLD_SIZE under torchrun), so the need is per rank x local ranks; DeepSpeed's
  reduce bucket counts only as far as gradients fill it (untouched pages stay free).

A config that cannot fit is refused with one line naming needed vs available and
what to change; `train --force` starts it anyway (the estimate is an estimate).
`train --ray` is not checked here: the driver does not run on the workers' machines
(use `loomtrain plan --gpu ...` for a cluster).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch
from loomtrain.launcher.planning import memory_model as mm
from loomtrain.launcher.planning.memory_plan import suggestions

GiB = mm.GiB


@dataclass
class FitVerdict:
    fits: bool
    needed: float  # bytes, on the resource compared (all local ranks on a CPU host)
    available: float  # bytes
    message: str


def available_bytes(device_type: str, local_rank: int) -> tuple[float, str]:
    """(bytes free now, what was measured) on this rank's device."""
    if device_type == "cuda":
        index = local_rank % max(1, torch.cuda.device_count())
        free, _total = torch.cuda.mem_get_info(index)
        return float(free), f"GPU {index} ({torch.cuda.get_device_name(index)}) free memory"
    return float(psutil.virtual_memory().available), "available host RAM"


def check_fits(cfg, world_size: int, local_ranks: int = 1, local_rank: int = 0) -> FitVerdict:
    device_type = cfg.train.device
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    # make_plan's device only sets the memory it is compared with (done here) and the
    # CUDA allowance / activation variant; any CUDA entry stands for "a GPU".
    plan = mm.make_plan(cfg, world_size, "cpu" if device_type == "cpu" else "h100")
    per_rank = plan.total_per_rank
    if device_type == "cpu":
        # DeepSpeed's reduce bucket is allocated at its full size, but on the host only
        # the pages gradients are written to become resident: at most one gradient per
        # parameter. Counting all of it would refuse a tiny model 1.9 GiB per rank at ZeRO >= 1.
        grad_bytes = plan.params.per_rank * (2 if cfg.train.precision in ("bf16", "fp16") else 4)
        per_rank -= plan.ds_bucket - min(plan.ds_bucket, grad_bytes)
    sharers = local_ranks if device_type == "cpu" else 1
    needed = per_rank * sharers
    free, where = available_bytes(device_type, local_rank)
    fits = needed <= free
    ranks = f" x {sharers} ranks on this host" if sharers > 1 else ""
    message = (
        f"needs {per_rank / GiB:.2f} GiB per rank{ranks} (`loomtrain plan` estimate: model states "
        f"{plan.states.total / GiB:.2f}, activations {plan.activations.total / GiB:.2f}, buffers "
        f"{(per_rank - plan.states.total - plan.activations.total) / GiB:.2f}), {where} is {free / GiB:.2f} GiB"
    )
    if not fits:
        message = f"will not fit: {message}; try {'; '.join(suggestions(plan))}; or pass --force to start anyway"
    return FitVerdict(fits, needed, free, message)


def local_ranks_from_env() -> tuple[int, int]:
    """(ranks on this host, this rank's local index) as torchrun sets them, else (1, 0)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), int(os.environ.get("LOCAL_RANK", "0") or 0)
