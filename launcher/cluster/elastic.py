"""Elastic worker groups: `ray.min_workers < ray.num_workers` lets a run go on at a smaller size.

Ray Train V2 restarts the whole worker group from the newest checkpoint whenever its size
changes: after a lost node it starts again with the workers the cluster still has room for,
and every `ray.elastic_resize_interval_s` it checks whether more would fit now (a new node
joined) and restarts larger. loomtrain keeps the global batch fixed through both: the same
`train.global_batch_size` is split over the new DP size with more (or less) gradient
accumulation, and the data stream resumes at the exact sample (loomtrain.data_pipeline.stream),
so the run follows the one that never lost a node, loss for loss.

Not every worker count is one a config can use: the world size must be a multiple of
`parallel.tp` x `parallel.cp`, and `train.global_batch_size` a multiple of
`train.micro_batch_size` x the data-parallel size. Ray counts workers by free resources alone,
so its elastic policy is wrapped here to round that count down to the largest usable one
(saying so in one line); below `ray.min_workers` it waits, as Ray does, for the cluster to
have room. Two more changes to Ray's count, both for the restart right after a node died: it reads the cluster afresh
(Ray's coordinator refreshes every 20 s) and counts only nodes whose raylet answers (the GCS
declares a crashed node dead only after its health checks fail); else the restart asks for
the lost node's workers too and waits `ray.start_timeout_s` for a placement that never comes.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import ray
from loomtrain.launcher.config import RunConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2._internal.util import time_monotonic


def largest_usable(cfg: RunConfig, workers: int) -> int:
    """The largest usable world size <= `workers` (0 when there is none)."""
    return next((n for n in range(workers, 0, -1) if cfg.usable_world_size(n)), 0)


def reachable_node_ids(timeout_s: float = 1.0) -> set[str]:
    """The Ray nodes alive in the GCS whose raylet accepts a TCP connection now."""

    def answers(node: dict) -> bool:
        try:
            with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s):
                return True
        except OSError:
            return False

    alive = [n for n in ray.nodes() if n.get("Alive")]
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(alive)))) as pool:
        return {n["NodeID"] for n, ok in zip(alive, pool.map(answers, alive)) if ok}


class UsableElasticPolicy(ElasticScalingPolicy):
    """Ray's elastic scaling policy, with worker counts rounded down to usable ones."""

    def __init__(self, scaling_config, cfg: RunConfig) -> None:
        super().__init__(scaling_config)
        self.cfg = cfg
        self._last_said: tuple[int, int] | None = None

    def _get_reserved_resources(self):
        """Ray's reservations, computed from the cluster as it is now.

        Ray's resource coordinator re-reads the cluster every 20 s; read stale, a restart right
        after a node died would count the dead node's CPUs, ask for a group that cannot be
        placed and wait ray.start_timeout_s, and a node that just joined would be missed until
        the next refresh. `recompute=True` is the coordinator's own fresh read."""
        now = time_monotonic()
        if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        reserved = None
        try:
            reserved = ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id, recompute=True),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
            )
        except Exception as exc:  # as Ray's own policy: no decision this time, ask again later
            print(f"loomtrain: elastic: could not read the cluster's resources ({exc}); retrying", flush=True)
        self._latest_reserved_resources_query_time = time_monotonic()
        self._latest_reserved_resources = reserved
        return reserved

    def _count_possible_workers(self, reserved_resources) -> int:
        # The GCS takes its health-check period (seconds; ~30 s by default) to declare a
        # crashed node dead, while the worker group fails at once: count only nodes whose
        # raylet answers now.
        reachable = reachable_node_ids()
        reserved_resources = {node: res for node, res in reserved_resources.items() if node in reachable}
        fits = super()._count_possible_workers(reserved_resources)
        usable = largest_usable(self.cfg, fits)
        if usable != fits and (fits, usable) != self._last_said:
            self._last_said = (fits, usable)  # once per change, not at every check
            t, least = self.cfg.train, self.scaling_config.min_workers
            print(
                f"loomtrain: elastic: the cluster has room for {fits} workers, a size that "
                f"{self.cfg.model_group()} and train.global_batch_size={t.global_batch_size} "
                f"(micro batch {t.micro_batch_size}) cannot use; "
                + (f"using {usable}" if usable >= least else f"waiting for room for ray.min_workers={least}"),
                flush=True,
            )
        return usable


class LoomTorchTrainer(TorchTrainer):
    """TorchTrainer whose controller gets `UsableElasticPolicy` when the group is elastic.

    Ray Train builds its scaling policy inside `fit()` from the ScalingConfig alone and offers
    no parameter for another; `_initialize_and_run_controller` is where the policy is handed
    to the controller actor (pickled by reference: every node imports loomtrain)."""

    def __init__(self, *args, loom_cfg: RunConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loom_cfg = loom_cfg

    def _initialize_and_run_controller(self, **kwargs):
        if self.scaling_config.elasticity_enabled:
            kwargs["scaling_policy"] = UsableElasticPolicy(self.scaling_config, self.loom_cfg)
        return super()._initialize_and_run_controller(**kwargs)
