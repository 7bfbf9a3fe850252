"""Training checkpoints: what goes into one, and how it is put back, at any TP x DP size.

Format choice. We do not store DeepSpeed's own ZeRO partitions
(`engine.save_checkpoint`). They only load at the same DP size; DeepSpeed's way
out (`ds_to_universal` + `load_universal`) is an offline conversion that needs
TP name patterns for every replicated / row-parallel parameter, knows nothing of
our padded vocabulary or of KV heads replicated over TP ranks, and for ZeRO-3+TP
needs extra per-parameter metadata. Instead every checkpoint is written in one
layout-free ("consolidated") form, under our control:

    model/rank_RRRRR.safetensors   full fp32 master weights, one tensor per parameter
                                   name, vocabulary unpadded (params spread over ranks)
    optim/rank_RRRRR.safetensors   full fp32 Adam moments "<name>/exp_avg", "<name>/exp_avg_sq"
    model/index.json               name -> file, full shape, TP split dim
    trainer.json                   step, tokens, time, Adam step, LR schedule, engine counters,
                                   world layout (tp, dp, zero stage)
    data/dp_DDDDD.json             each data-parallel rank's stream state (global position)
    rng/rank_RRRRR.safetensors     every rank's RNG states (python, numpy, torch CPU, CUDA)
    config.yaml, tokenizer/        the resolved config and the tokenizer
    manifest.json                  sizes + sha256 of all of the above (checkpoint_store.py)

The fp32 masters and moments (see reshard.py) are read out of whatever DeepSpeed holds (ZeRO 0-3,
fp32 or bf16) with its `safe_get_full_*` API, gathered over the TP group with the
`tp_meta` the TP plan attaches to each shard, and on load re-sliced for the new
TP rank and written back with `safe_set_full_*`. The values are copied, never
recomputed, so a resume at the same layout is bitwise exact in fp32, and a resume
at another (tp, dp, zero stage) continues from the very same optimizer state.
The price: a save moves every parameter through a DP all-reduce and a TP
all-gather (one parameter at a time, so memory stays at one full parameter).

Nothing here unpickles: safetensors and JSON only.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loomtrain.launcher.checkpoints.store import CheckpointStore, write_json_durable
from loomtrain.launcher.checkpoints.reshard import (  # noqa: F401  (broadcast_str, consolidated_weights: re-exported)
    MOMENTS,
    _adam_step,
    _inner_optimizer,
    _local_full_shape,
    _rank,
    _set_adam_step,
    _set_zero3_model_weights,
    _tp_meta,
    _world,
    barrier,
    broadcast_str,
    consolidated_weights,
    ensure_optimizer_state,
    gather_tp,
    named_params,
    read_local,
    shard_tp,
    write_local,
)

FORMAT = "loomtrain-consolidated-v1"


# RNG --------------------------------------------------------------------------------
def rng_state() -> tuple[dict, dict]:
    py = random.getstate()
    npst = np.random.get_state()
    meta = {
        "python": json.dumps([py[0], list(py[1]), py[2]]),
        "numpy": json.dumps([npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])]),
    }
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = s
    return tensors, meta


def set_rng_state(tensors: dict, meta: dict) -> None:
    v, state, gauss = json.loads(meta["python"])
    random.setstate((v, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [tensors[f"cuda_{i}"] for i in range(torch.cuda.device_count()) if f"cuda_{i}" in tensors]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# Save ---------------------------------------------------------------------------------
def layout(topology, zero_stage: int) -> dict:
    tp = topology.tp_size if topology is not None else 1
    dp = topology.dp_size if topology is not None else 1
    return {"tp": tp, "dp": dp, "world_size": tp * dp, "zero_stage": int(zero_stage)}


def save_checkpoint(store: CheckpointStore, step: int, engine, topology, *, stream=None,
                    counters: dict | None = None, lr_scheduler=None, config_yaml: str | None = None,
                    tokenizer=None, zero_stage: int = 0) -> Path:
    """Every rank calls this at the same step boundary; returns the published directory."""
    rank, world = _rank(), _world()
    tmp = store.begin(step) if rank == 0 else store.temp_dir(step)
    barrier()
    written: list[str] = []

    # Weights and Adam moments: every rank takes part in every gather; parameter i is
    # written by rank i % world so the files (and the memory) are spread over ranks.
    ensure_optimizer_state(engine)
    weights, moments, index = {}, {}, {}
    for i, (name, p) in enumerate(named_params(engine)):
        meta = _tp_meta(p)
        full = gather_tp(read_local(engine, p, None), meta, topology).cpu()
        moms = [gather_tp(read_local(engine, p, k), meta, topology).cpu() for k in MOMENTS]
        owner = i % world
        if rank == owner:
            weights[name] = full.contiguous()
            for k, m in zip(MOMENTS, moms):
                moments[f"{name}/{k}"] = m.contiguous()
        index[name] = {"file": f"rank_{owner:05d}.safetensors", "shape": list(full.shape),
                       "tp_dim": None if meta is None else meta["partition_dim"]}
    if weights:
        (tmp / "model").mkdir(exist_ok=True)
        (tmp / "optim").mkdir(exist_ok=True)
        save_file(weights, str(tmp / "model" / f"rank_{rank:05d}.safetensors"), metadata={"format": FORMAT})
        save_file(moments, str(tmp / "optim" / f"rank_{rank:05d}.safetensors"), metadata={"format": FORMAT})
        written += [f"model/rank_{rank:05d}.safetensors", f"optim/rank_{rank:05d}.safetensors"]

    # RNG: every rank.
    (tmp / "rng").mkdir(exist_ok=True)
    tensors, meta = rng_state()
    save_file(tensors, str(tmp / "rng" / f"rank_{rank:05d}.safetensors"), metadata=meta)
    written.append(f"rng/rank_{rank:05d}.safetensors")

    # Data position: the first rank of each TP group speaks for its DP rank.
    if stream is not None and (topology is None or topology.tp_rank == 0):
        dp_rank = topology.dp_rank if topology is not None else 0
        rel = f"data/dp_{dp_rank:05d}.json"
        write_json_durable(tmp / rel, stream.state_dict())
        written.append(rel)

    adam_step = _adam_step(engine)
    if rank == 0:
        write_json_durable(tmp / "model" / "index.json", {"format": FORMAT, "params": index})
        written.append("model/index.json")
        sched = lr_scheduler if lr_scheduler is not None else getattr(engine, "lr_scheduler", None)
        inner = _inner_optimizer(engine.optimizer)
        trainer = {
            "format": FORMAT,
            "step": int(step),
            "counters": dict(counters or {}),
            "adam_step": adam_step,
            "lr_scheduler": _jsonable(sched.state_dict()) if sched is not None and hasattr(sched, "state_dict") else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params" and _is_plain(v)} for g in inner.param_groups],
            "engine": {k: int(getattr(engine, k, 0) or 0) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")},
            "loss_scaler": _loss_scaler_state(engine),
            "layout": layout(topology, zero_stage),
        }
        write_json_durable(tmp / "trainer.json", trainer)
        written.append("trainer.json")
        if config_yaml is not None:
            (tmp / "config.yaml").write_text(config_yaml)
            written.append("config.yaml")
        if tokenizer is not None and hasattr(tokenizer, "save"):
            (tmp / "tokenizer").mkdir(exist_ok=True)
            tokenizer.save(str(tmp / "tokenizer"))
            written += [str(p.relative_to(tmp)) for p in sorted((tmp / "tokenizer").rglob("*")) if p.is_file()]
    store.add_part(tmp, rank, written)
    barrier()
    path = None
    if rank == 0:
        path = store.publish(tmp, step, {"layout": layout(topology, zero_stage), "checkpoint_format": FORMAT})
    barrier()
    return store.final_dir(step) if path is None else path


_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _loss_scaler_state(engine) -> dict | None:
    """fp16's dynamic loss scale (so a resume does not restart it from 2^16); None otherwise."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    out = {}
    for k in _SCALER_FIELDS:
        v = getattr(scaler, k, None)
        if torch.is_tensor(v):
            v = v.item()
        if isinstance(v, (int, float)) or v is None:
            out[k] = v
    return out


def _is_plain(v) -> bool:
    return isinstance(v, (int, float, str, bool, type(None))) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str, bool)) for x in v))


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


# Load ---------------------------------------------------------------------------------
class ConsolidatedReader:
    """Read tensors by name from a checkpoint's model/ and optim/ files (safetensors only)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.index = json.loads((self.path / "model" / "index.json").read_text())["params"]

    def names(self) -> list[str]:
        return list(self.index)

    def get(self, name: str, key: str | None = None) -> torch.Tensor:
        sub, tensor_name = ("model", name) if key is None else ("optim", f"{name}/{key}")
        with safe_open(str(self.path / sub / self.index[name]["file"]), framework="pt") as f:
            return f.get_tensor(tensor_name)

    def weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for file in sorted({v["file"] for v in self.index.values()}):
            with safe_open(str(self.path / "model" / file), framework="pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
        return out


def load_checkpoint(path: str | os.PathLike, engine, topology, *, stream=None, lr_scheduler=None,
                    zero_stage: int = 0) -> dict:
    """Put a checkpoint back into a freshly built engine at any (tp, dp, zero stage).

    Every rank calls it after deepspeed.initialize. Returns trainer.json (step, counters, ...).
    """
    path = Path(path)
    trainer = json.loads((path / "trainer.json").read_text())
    reader = ConsolidatedReader(path)
    params = named_params(engine)
    missing = [n for n, _ in params if n not in reader.index]
    extra = [n for n in reader.index if n not in dict(params)]
    if missing or extra:
        raise ValueError(f"checkpoint {path}: parameters do not match the model "
                         f"(missing {missing[:5]}, unexpected {extra[:5]}); was it saved with another model config?")
    ensure_optimizer_state(engine)
    z3 = []
    for name, p in params:
        meta = _tp_meta(p)
        full = reader.get(name)
        want = list(reader.index[name]["shape"])
        local = shard_tp(full, meta)
        if tuple(local.shape) != _local_full_shape(p):
            raise ValueError(f"checkpoint {path}: {name} has full shape {want}, which does not fit this "
                             f"model's shard {tuple(_local_full_shape(p))}")
        write_local(engine, p, None, local)
        if hasattr(p, "ds_id"):
            z3.append((p, local))
        for k in MOMENTS:
            write_local(engine, p, k, shard_tp(reader.get(name, k), meta))
    _set_zero3_model_weights(z3)
    _set_adam_step(engine, trainer["adam_step"])

    inner = _inner_optimizer(engine.optimizer)
    for g, saved in zip(inner.param_groups, trainer.get("param_groups", [])):
        for k, v in saved.items():
            if k in g and k != "params":
                g[k] = tuple(v) if isinstance(g[k], tuple) else v
    sched = lr_scheduler if lr_scheduler is not None else getattr(engine, "lr_scheduler", None)
    if sched is not None and trainer.get("lr_scheduler") is not None:
        state = dict(trainer["lr_scheduler"])
        current = sched.state_dict()
        for k in list(state):
            if current.get(k) is None and state[k] is None:
                state.pop(k)
            elif k not in current:
                state.pop(k)
        if "lr_lambdas" in current:
            state["lr_lambdas"] = current["lr_lambdas"]
        sched.load_state_dict(state)
    for k, v in trainer.get("engine", {}).items():
        if hasattr(engine, k) and k != "micro_steps":
            setattr(engine, k, v)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and trainer.get("loss_scaler"):
        for k, v in trainer["loss_scaler"].items():
            if hasattr(scaler, k) and not torch.is_tensor(getattr(scaler, k)):
                setattr(scaler, k, v)
    if hasattr(engine, "micro_steps"):
        # Micro steps count in this layout's gradient accumulation (it changes with DP size);
        # a saved count from another layout would put the accumulation boundary mid-step.
        engine.micro_steps = int(getattr(engine, "global_steps", 0)) * int(engine.gradient_accumulation_steps())

    # RNG: each rank's own states when the world has the same size; at another size the
    # streams cannot correspond, and the run keeps the seeds it started with (train.seed).
    rank = _rank()
    rng_file = path / "rng" / f"rank_{rank:05d}.safetensors"
    if trainer["layout"]["world_size"] == _world() and rng_file.exists():
        with safe_open(str(rng_file), framework="pt") as f:
            set_rng_state({k: f.get_tensor(k) for k in f.keys()}, f.metadata())

    if stream is not None:
        dp_rank = topology.dp_rank if topology is not None else 0
        own = path / "data" / f"dp_{dp_rank:05d}.json"
        same_dp = trainer["layout"]["dp"] == (topology.dp_size if topology is not None else 1)
        src = own if same_dp and own.exists() else path / "data" / "dp_00000.json"
        if src.exists():
            stream.load_state_dict(json.loads(src.read_text()))
    barrier()
    return trainer
