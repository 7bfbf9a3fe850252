"""How long a pod needs between SIGTERM and SIGKILL: finish the step, save, exit.

On SIGTERM every rank finishes the step it is in, writes its checkpoint shard and
exits (loomtrain.launcher.training.stopping). Kubernetes kills the pod after
`terminationGracePeriodSeconds` (default 30 s), so the pods' value must cover

    one optimizer step  +  SAFETY x one synchronous checkpoint save  +  MARGIN_S

with both figures from `loomtrain plan` (loomtrain.launcher.planning.memory_model's
step time at the assumed MFU, host_model's save time at the default storage bandwidth
per node), on an H100 for `ray.use_gpu` configs and on this kind of CPU otherwise.
`k8s/check.py` requires the Ray pods of a RayJob to declare at least
`grace_period_s(config)` (rule [grace-period]).
"""

from __future__ import annotations

import math
from typing import Any

from loomtrain.launcher.planning.memory_model import Plan, make_plan

SAFETY = 2.0  # a shared filesystem under a whole job's writers is slower than its datasheet
MARGIN_S = 30.0  # process exit, Ray's report of the checkpoint, the driver's own exit
FALLBACK_S = 300  # when the plan cannot size a config (used by `loomtrain submit`)


def sizing_plan(cfg: Any) -> Plan:
    """The plan the grace period is sized by: `cfg` on its Ray workers."""
    return make_plan(cfg, cfg.ray.num_workers, gpu="h100" if cfg.ray.use_gpu else "cpu")


def grace_period_s(cfg: Any) -> int:
    """terminationGracePeriodSeconds for the pods of a run of `cfg` (whole seconds)."""
    plan = sizing_plan(cfg)
    return int(math.ceil(plan.step_time_s + SAFETY * plan.host.save_sync_s + MARGIN_S))
