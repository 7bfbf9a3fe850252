"""Test driver: one rank's start-up (build_model + build_engine) under torchrun, measured.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/startup_driver.py \
        MODE OUT CONFIG --tiny k=v ... --big k=v ...

MODE params: start up the big config only, counting the bytes of parameter values this
rank holds (materialised shards, ZeRO-3 partitions, anything gathered) at every
materialised parameter and, from a sampling thread, throughout engine creation; writes
OUT/params.rank{R}.json with the peak and the model's size.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.distributed import init_distributed
from loomtrain.launcher.training import engine as engine_mod
from loomtrain.launcher.training import startup
from loomtrain.model import param_count


def _start(cfg):
    env = init_distributed(cfg)
    topology = startup.build_topology(cfg, env)
    model = startup.build_model(cfg, topology, env.device)
    engine, _, _ = engine_mod.build_engine(cfg, model, topology.dp_size, mpu=topology.mpu)
    return env, model, engine


class ParamBytes:
    """Bytes of parameter values this rank holds, over every parameter materialised so far."""

    def __init__(self):
        self.params, self.peak, self.largest, self.where = [], 0, 0, ""
        self._stop = threading.Event()

    def sample(self, where: str = "sampling thread") -> None:
        total = 0
        for p in list(self.params):
            total += p.data.numel() * p.data.element_size()
            ds = getattr(p, "ds_tensor", None)
            if ds is not None:
                total += ds.numel() * ds.element_size()
        if total > self.peak:
            self.peak, self.where = total, where

    def wrap_partitioner(self) -> None:
        make = engine_mod.zero3_partitioner

        def counting(cfg, topology, dtype):
            partition = make(cfg, topology, dtype)

            def step(name, param):
                self.params.append(param)
                self.largest = max(self.largest, param.numel() * param.element_size())
                self.sample(f"{name} materialised")  # this rank's TP shard, before partitioning
                partition(name, param)
                self.sample(f"{name} partitioned")

            return step

        engine_mod.zero3_partitioner = counting

    def run_thread(self) -> threading.Thread:
        def loop():
            while not self._stop.is_set():
                self.sample()
                time.sleep(0.0005)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        return t

    def stop(self, t: threading.Thread) -> None:
        self._stop.set()
        t.join()
        self.sample()


def main(argv: list[str]) -> int:
    mode, out, config = argv[0], Path(argv[1]), argv[2]
    groups, current = {"--tiny": [], "--big": []}, None
    for arg in argv[3:]:
        if arg in groups:
            current = groups[arg]
        else:
            current.append(arg)
    big = load_config(config, groups["--big"])
    model_bytes = 4 * param_count(big.model)
    if mode == "params":
        counter = ParamBytes()
        counter.wrap_partitioner()
        thread = counter.run_thread()
        env, model, engine = _start(big)
        counter.stop(thread)
        assert len(counter.params) == len(list(model.parameters())), "every parameter went through ZeRO-3"
        result = dict(
            peak=counter.peak,
            where=counter.where,
            largest=counter.largest,
            model_bytes=model_bytes,
            partitioned=all(hasattr(p, "ds_tensor") for p in model.parameters()),
        )
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{mode}.rank{env.rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
