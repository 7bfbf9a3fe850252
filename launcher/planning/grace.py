"""How long a pod needs between SIGTERM and SIGKILL: finish the step, save, exit.

On SIGTERM every rank finishes the step it is in, writes its checkpoint shard and
exits (loomtrain.launcher.stopping). Kubernetes kills the pod after
`terminationGracePeriodSeconds` (default 30 s), so the pods' value must cover

    one optimizer step  +  one checkpoint save  (x SAFETY)  +  MARGIN_S

* the save: each rank writes its model-state shard (loomtrain.launcher.planning.memory_model's
  bytes per rank: parameters, optimizer states, at the config's ZeRO stage and TP) at
  WRITE_BYTES_PER_S, a conservative figure for a shared (RWX) volume under many writers;
* the step: its FLOPs on the GPU at the plan's assumed MFU (CPU runs: CPU_STEP_S).

`k8s/check.py` requires the Ray pods of a RayJob to declare at least
`grace_period_s(config)` (rule [grace-period]).
"""

from __future__ import annotations

import math
from typing import Any

WRITE_BYTES_PER_S = 200e6
SAFETY = 2.0
MARGIN_S = 30.0
CPU_STEP_S = 60.0


def checkpoint_bytes_per_rank(cfg: Any, world_size: int) -> float:
    """Bytes one rank writes per checkpoint: its parameters' and optimizer states' shard."""
    from loomtrain.launcher.planning import memory_model as mm

    tp = cfg.parallel.tp
    dp = max(1, world_size // tp)
    per_tp_rank = mm.analytic_param_count(cfg.model) / tp
    states = mm.model_state_bytes(per_tp_rank, cfg.parallel.zero_stage, dp, cfg.train.precision,
                                  cfg.parallel.offload_optimizer)
    return states.params + states.optimizer + states.offloaded


def save_seconds(cfg: Any, world_size: int) -> float:
    return checkpoint_bytes_per_rank(cfg, world_size) / WRITE_BYTES_PER_S


def step_seconds(cfg: Any, world_size: int, gpu: str = "h100") -> float:
    if not cfg.ray.use_gpu:
        return CPU_STEP_S
    from loomtrain.launcher.planning import memory_model as mm

    t = cfg.train
    flops = mm.flops_per_token(mm.analytic_param_count(cfg.model), cfg.model, t.seq_len) * t.global_batch_size * t.seq_len
    dev = mm.device_spec(gpu)
    peak = (dev.fp32_tflops if t.precision == "fp32" else dev.bf16_tflops) * 1e12
    return flops / (world_size * peak * mm.DEFAULT_MFU)


def grace_period_s(cfg: Any, world_size: int | None = None) -> int:
    """terminationGracePeriodSeconds for the pods of a run of `cfg` (whole seconds)."""
    world = world_size or cfg.ray.num_workers
    return int(math.ceil(step_seconds(cfg, world) + SAFETY * save_seconds(cfg, world) + MARGIN_S))
