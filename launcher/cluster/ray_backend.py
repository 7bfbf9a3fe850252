"""The torch backend loomtrain's Ray Train workers start with: Ray's own, after routing the
workers' output and picking their network interface.

Ray Train makes the process group (`_TorchBackend.on_start`: rank 0's node address as
MASTER_ADDR, then `init_process_group` on every worker) before the train function runs, so
the train function is too late to point gloo / NCCL at an interface. Unset, gloo binds the
address the hostname resolves to, which on many hosts is loopback: workers on other nodes are
told to connect to 127.0.0.1 and the group never forms (`ray.train.ControllerError`).
`LoomtrainTorchConfig` runs, on every worker and before Ray's own set-up,
`choose_socket_interface(rank 0's node address)` (loomtrain.launcher.distributed): the
interface that routes to rank 0 becomes GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unless the
user set them (in the worker's environment, e.g. through the raylet's). Before that, each
worker's output is routed (loomtrain.launcher.cluster.ray_console), so that what the set-up
prints lands in RUN_DIR/logs/, not on the console. A worker group whose size changes between
attempts is handled like any other: this runs on the workers of every (re)start.

Its own module (not ray_train.py): Ray pickles the config by reference, and importing
ray.train.torch at the top of ray_train.py would load torch's Ray glue into every `loomtrain`
command that only names Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.train._internal.utils import get_address_and_port
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend


class _LoomtrainBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: LoomtrainTorchConfig) -> None:
        from loomtrain.launcher.cluster.ray_console import route_worker_output
        from loomtrain.launcher.distributed import choose_socket_interface

        if backend_config.run_dir:  # world rank i is worker i, as in Ray's own on_start
            ray.get(
                [
                    worker_group.execute_single_async(i, route_worker_output, backend_config.run_dir, i)
                    for i in range(len(worker_group))
                ]
            )
        # The address Ray's on_start will hand out as MASTER_ADDR: rank 0's node address.
        master_addr, _ = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(choose_socket_interface, master_addr)  # on each worker: its own environment
        super().on_start(worker_group, backend_config)


@dataclass
class LoomtrainTorchConfig(TorchConfig):
    """TorchConfig whose workers write Ray's lines to `run_dir`/logs/ and bind the interface that
    routes to rank 0 (see the module docstring); `run_dir` "" leaves the output as Ray sends it."""

    run_dir: str = ""

    @property
    def backend_cls(self):
        return _LoomtrainBackend
