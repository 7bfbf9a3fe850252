"""The kinds of state a checkpoint holds, each saving and loading itself.

    part.take(training, snap, copy)   at a step boundary: this rank's share into the snapshot
    part.put(training, ckpt)          after deepspeed.initialize: back from a checkpoint

`PARTS` lists them in the order a load puts them back. Each owns its files or its key of
trainer.json (the format is state.py's; the parts do not change it), and whatever reaches
into DeepSpeed does so through ds_state.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from loomtrain.launcher.checkpoints.ds_state import (
    MOMENTS,
    engine_counters,
    ensure_optimizer_state,
    full_shape,
    held_range,
    held_values,
    load_target,
    local_box,
    loss_scaler_state,
    named_params,
    optimizer_settings,
    set_engine_counters,
    set_held_values,
    set_loss_scaler_state,
    set_optimizer_settings,
    write_local,
    written_range,
)
from loomtrain.launcher.checkpoints.lora_base import LoraBase
from loomtrain.launcher.checkpoints.shards import Region, safetensors_metadata
from loomtrain.parallel.plan import spec_of
from safetensors.torch import load as load_safetensors

KEYS = (None, *MOMENTS)  # a parameter's tensors in a checkpoint: the fp32 master, then the moments


@dataclass
class Training:
    """What a checkpoint is taken of and put back into."""

    engine: Any
    topology: Any = None
    zero_stage: int = 0
    stream: Any = None  # the data stream (state_dict / load_state_dict)
    lr_scheduler: Any = None  # None: the engine's own
    train_state: Any = None  # the loop's counters (state_dict / load_state_dict)
    # Host buffers an async snapshot copies into, kept from one save to the next ((name, key) ->
    # tensor): fresh memory costs a page fault per page (pinned memory on a GPU host far more),
    # a reused buffer only the copy. None: a new copy each time. The caller lets a save finish
    # before the next snapshot overwrites them.
    staging: dict | None = None

    @property
    def scheduler(self):
        return self.lr_scheduler if self.lr_scheduler is not None else getattr(self.engine, "lr_scheduler", None)

    @property
    def dp(self) -> tuple[int, int]:
        """(dp rank, dp size)."""
        return (self.topology.dp_rank, self.topology.dp_size) if self.topology is not None else (0, 1)


class Part(Protocol):
    def take(self, training: Training, snap, copy: bool) -> None: ...

    def put(self, training: Training, ckpt) -> None: ...


def _to_host(t: torch.Tensor, copy: bool, staging: dict | None, key: tuple) -> torch.Tensor:
    """t on the host: a view of it (copy=False, a CPU tensor) or a copy, into staging's buffer
    for `key` where there is one of its shape."""
    if t.device.type == "cpu" and not copy:
        return t.detach()
    host = staging.get(key) if staging is not None else None
    if host is None or host.shape != t.shape or host.dtype != t.dtype:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        if staging is not None:
            staging[key] = host
    host.copy_(t.detach())
    return host


def saved_shapes(reader) -> dict[str, list[int]]:
    """A checkpoint's trainable parameters, name -> full shape, from its index."""
    return {name: reader.shape(name) for name in reader.params}


def params_mismatch(model: dict[str, list[int]], saved: dict[str, list[int]]) -> str | None:
    """Why a checkpoint (`saved`) is not of this model: their trainable parameters (name -> full
    shape) differ; None when they agree. Said the same by a resume and by the CLI's early check."""
    missing = [n for n in model if n not in saved]
    extra = [n for n in saved if n not in model]
    if missing or extra:
        return (
            f"parameters do not match the model (missing {missing[:5]}, unexpected {extra[:5]}); "
            "was it saved with another model config?"
        )
    for name, shape in model.items():
        if list(saved[name]) != list(shape):
            return f"{name} has full shape {saved[name]}, this model's is {shape}"
    return None


class Tensors:
    """Weights and Adam moments: each rank's held share as tiles (model/, optim/, the index)."""

    def take(self, training: Training, snap, copy: bool) -> None:
        engine, topology = training.engine, training.topology
        ensure_optimizer_state(engine)
        for name, p in named_params(engine):
            snap.shapes[name] = full_shape(p)
            ha, _ = held_range(engine, p)
            a, b = written_range(engine, p, topology)
            if b <= a:
                continue
            values = {
                ("weight" if k is None else k): _to_host(
                    held_values(engine, p, k)[a - ha : b - ha], copy, training.staging, (name, k)
                )
                for k in KEYS
            }
            snap.pieces[name] = (Region(local_box(p), (a, b)), values)

    def put(self, training: Training, ckpt) -> None:
        engine, reader = training.engine, ckpt.tensors
        params = named_params(engine)
        why = params_mismatch({n: full_shape(p) for n, p in params}, saved_shapes(reader))
        if why is not None:
            raise ValueError(f"checkpoint {ckpt.path}: {why}")
        ensure_optimizer_state(engine)
        for name, p in params:
            box = local_box(p)
            held = Region(box, held_range(engine, p))
            for k in KEYS:
                whole = k is None and not hasattr(p, "ds_id")  # ZeRO 0-2 weights: the whole TP shard
                if not whole and not held.numel:
                    continue
                into = load_target(engine, p, k)
                if into is not None:  # DeepSpeed's own buffer, filled in place
                    reader.read(name, k, held, out=into)
                elif whole:
                    value = reader.read(name, None, Region.whole(box)).reshape(spec_of(p).local_shape)
                    write_local(engine, p, value)
                else:  # at ZeRO-3 the weights too: only this rank's partition, never the whole shard
                    set_held_values(engine, p, k, reader.read(name, k, held))


class OptimizerSettings:
    """Adam's step count and the param groups' hyper-parameters (trainer.json)."""

    def take(self, training: Training, snap, copy: bool) -> None:
        if snap.trainer is not None:
            snap.trainer.update(optimizer_settings(training.engine))

    def put(self, training: Training, ckpt) -> None:
        set_optimizer_settings(training.engine, ckpt.trainer["adam_step"], ckpt.trainer.get("param_groups", []))


class Scheduler:
    """The learning-rate schedule's position (trainer.json "lr_scheduler"; its functions come
    from the config, not the file)."""

    def take(self, training: Training, snap, copy: bool) -> None:
        sched = training.scheduler
        if snap.trainer is not None:
            has_state = sched is not None and hasattr(sched, "state_dict")
            snap.trainer["lr_scheduler"] = _jsonable(sched.state_dict()) if has_state else None

    def put(self, training: Training, ckpt) -> None:
        sched, saved = training.scheduler, ckpt.trainer.get("lr_scheduler")
        if sched is None or saved is None:
            return
        state, current = dict(saved), sched.state_dict()
        for k in list(state):
            if k not in current or (current.get(k) is None and state[k] is None):
                state.pop(k)
        if "lr_lambdas" in current:
            state["lr_lambdas"] = current["lr_lambdas"]
        sched.load_state_dict(state)


class EngineCounters:
    """DeepSpeed's step and sample counters (trainer.json "engine")."""

    def take(self, training: Training, snap, copy: bool) -> None:
        if snap.trainer is not None:
            snap.trainer["engine"] = engine_counters(training.engine)

    def put(self, training: Training, ckpt) -> None:
        set_engine_counters(training.engine, ckpt.trainer.get("engine", {}))


class LossScaler:
    """fp16's dynamic loss scale, so that a resume does not restart it from 2^16."""

    def take(self, training: Training, snap, copy: bool) -> None:
        if snap.trainer is not None:
            snap.trainer["loss_scaler"] = loss_scaler_state(training.engine)

    def put(self, training: Training, ckpt) -> None:
        set_loss_scaler_state(training.engine, ckpt.trainer.get("loss_scaler"))


class Rng:
    """Every rank's RNG states (rng/rank_R.safetensors). At another world size the streams
    cannot correspond: the run keeps the seeds it started with (train.seed)."""

    def take(self, training: Training, snap, copy: bool) -> None:
        py, npst = random.getstate(), np.random.get_state()
        meta = {
            "python": json.dumps([py[0], list(py[1]), py[2]]),
            "numpy": json.dumps([npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])]),
        }
        tensors = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"cuda_{i}"] = s
        snap.rng = (tensors, meta)

    def put(self, training: Training, ckpt) -> None:
        rel = f"rng/rank_{ckpt.rank:05d}.safetensors"
        if ckpt.trainer["layout"]["world_size"] != ckpt.world or not ckpt.has(rel):
            return
        data = ckpt.verified(rel)
        tensors = load_safetensors(data)
        meta = safetensors_metadata(data)
        v, state, gauss = json.loads(meta["python"])
        random.setstate((v, tuple(state), gauss))
        name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(tensors["torch_cpu"])
        if torch.cuda.is_available():
            cuda = [tensors[f"cuda_{i}"] for i in range(torch.cuda.device_count()) if f"cuda_{i}" in tensors]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)


class DataStream:
    """Each data-parallel rank's stream position (data/dp_D.json, written by TP rank 0). At
    another DP size every rank starts from DP rank 0's state (the stream re-splits itself)."""

    def take(self, training: Training, snap, copy: bool) -> None:
        tp_rank = training.topology.tp_rank if training.topology is not None else 0
        if training.stream is not None and tp_rank == 0:
            snap.data = (f"data/dp_{training.dp[0]:05d}.json", training.stream.state_dict())

    def put(self, training: Training, ckpt) -> None:
        if training.stream is None:
            return
        dp_rank, dp_size = training.dp
        own = f"data/dp_{dp_rank:05d}.json"
        src = own if ckpt.trainer["layout"]["dp"] == dp_size and ckpt.has(own) else "data/dp_00000.json"
        if ckpt.has(src):
            training.stream.load_state_dict(json.loads(ckpt.verified(src)))


class TrainState:
    """The loop's own counters (step, tokens, time; trainer.json "counters")."""

    def take(self, training: Training, snap, copy: bool) -> None:
        if snap.trainer is not None and training.train_state is not None:
            snap.trainer["counters"] = {"state": training.train_state.state_dict()}

    def put(self, training: Training, ckpt) -> None:
        if training.train_state is None:
            return
        state = ckpt.trainer.get("counters", {}).get("state")
        if state:
            training.train_state.load_state_dict(state)
        else:
            training.train_state.step = int(ckpt.trainer["step"])


PARTS: tuple[Part, ...] = (
    LoraBase(),  # first: a resume onto another base is refused before anything is read
    Tensors(),
    OptimizerSettings(),
    Scheduler(),
    EngineCounters(),
    LossScaler(),
    Rng(),
    DataStream(),
    TrainState(),
)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if torch.is_tensor(obj):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, (np.generic,)):
        return obj.item()
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    return None  # e.g. lr_lambdas functions: rebuilt from the config, not stored
