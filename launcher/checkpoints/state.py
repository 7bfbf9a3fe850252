"""Training checkpoints: what goes into one, and how it is put back, at any TP x DP size.

Format choice. We do not store DeepSpeed's own ZeRO partitions
(`engine.save_checkpoint`). They only load at the same DP size; DeepSpeed's way
out (`ds_to_universal` + `load_universal`) is an offline conversion that needs
TP name patterns for every replicated / row-parallel parameter, knows nothing of
our padded vocabulary or of KV heads replicated over TP ranks, and for ZeRO-3+TP
needs extra per-parameter metadata. Instead every checkpoint is written in one
layout-free form, under our control (see shards.py for the piece/tile geometry):

    model/rank_RRRRR.safetensors   the fp32 master values rank R holds: one 1-D piece per
                                   parameter (its TP shard's ZeRO partition, or a slice of it)
    optim/rank_RRRRR.safetensors   the same pieces of the Adam moments "<name>/exp_avg", "<name>/exp_avg_sq"
    model/index.json               per parameter: full shape, and per piece the file, the region
                                   of the full tensor it covers and a sha256 per tile
    trainer.json                   step, tokens, time, Adam step, LR schedule, engine counters,
                                   world layout (tp, dp, zero stage)
    data/dp_DDDDD.json             each data-parallel rank's stream state (global position)
    rng/rank_RRRRR.safetensors     every rank's RNG states (python, numpy, torch CPU, CUDA)
    config.yaml, tokenizer/        the resolved config and the tokenizer
    manifest.json                  sizes + sha256 of all of the above (store.py); for the model/
                                   and optim/ files sizes only: every value in them is covered
                                   by a tile hash in the index, checked by whoever reads it, so
                                   a save hashes each byte once, not twice

Save: each rank writes what DeepSpeed keeps on it (ds_state.py `held_range`; ranks that hold
the same values split them), hashing while it writes; no gather, no re-read. Per-rank index
parts are merged by rank 0, which publishes (store.py protocol). `take_snapshot` (at the step
boundary) and `write_snapshot` (possibly on a background thread, see background.py) are the
two halves.

Load: each rank reads only its slices (its TP shard of the weights, at ZeRO-3 only its
partition; its partition of the moments) and verifies every tile it reads, so no rank hashes
the whole checkpoint. The values are copied, never recomputed: a resume at the same layout is
bitwise exact in fp32, and a resume at another (tp, dp, zero stage) continues from the very
same optimizer state.

Nothing here unpickles: safetensors and JSON only.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from loomtrain.durable import json_bytes, write_durable
from loomtrain.launcher import faults
from loomtrain.launcher.checkpoints.ds_state import (
    MOMENTS,
    adam_step,
    ensure_optimizer_state,
    full_shape,
    held_range,
    held_values,
    inner_optimizer,
    load_target,
    local_box,
    local_full_shape,
    named_params,
    set_adam_step,
    set_held_values,
    write_local,
    written_range,
)
from loomtrain.launcher.checkpoints.shards import (
    GRID_COLS,
    GRID_ROWS,
    CorruptCheckpoint,
    Region,
    ShardedReader,
    matrix_shape,
    real_count,
    tile_hashes,
    write_safetensors,
)
from loomtrain.launcher.checkpoints.store import (
    PARTS_DIR,
    CheckpointStore,
    describe_files,
    read_manifest,
)
from loomtrain.launcher.distributed import barrier, current_rank, current_world_size
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

FORMAT = "loomtrain-sharded-v2"
KEYS = (None, *MOMENTS)


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


@dataclass
class Snapshot:
    """One rank's share of a checkpoint, taken at a step boundary (host copies when `copy`)."""

    step: int
    rank: int
    world: int
    pieces: dict = field(default_factory=dict)  # name -> (Region, {"weight"|moment: 1-D fp32})
    shapes: dict = field(default_factory=dict)  # name -> full shape (rank 0 writes the index)
    rng: tuple = ({}, {})
    data: tuple | None = None  # (relpath, stream state)
    trainer: dict | None = None  # rank 0
    config_yaml: str | None = None
    tokenizer: object = None
    meta: dict = field(default_factory=dict)


def _to_host(t: torch.Tensor, copy: bool) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.detach().clone() if copy else t.detach()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(t.detach())
    return host


def take_snapshot(
    step: int,
    engine,
    topology,
    *,
    copy: bool,
    stream=None,
    counters: dict | None = None,
    lr_scheduler=None,
    config_yaml: str | None = None,
    tokenizer=None,
    zero_stage: int = 0,
) -> Snapshot:
    """This rank's share of the checkpoint of `step`; no collective. With copy=False the pieces
    are views of DeepSpeed's live buffers (the caller writes them before the next step)."""
    rank = current_rank()
    snap = Snapshot(step=int(step), rank=rank, world=current_world_size())
    ensure_optimizer_state(engine)
    for name, p in named_params(engine):
        snap.shapes[name] = full_shape(p)
        ha, _ = held_range(engine, p, topology)
        a, b = written_range(engine, p, topology)
        if b <= a:
            continue
        values = {
            ("weight" if k is None else k): _to_host(held_values(engine, p, k)[a - ha : b - ha], copy) for k in KEYS
        }
        snap.pieces[name] = (Region(local_box(p), (a, b)), values)
    snap.rng = rng_state()
    if stream is not None and (topology is None or topology.tp_rank == 0):
        dp_rank = topology.dp_rank if topology is not None else 0
        snap.data = (f"data/dp_{dp_rank:05d}.json", stream.state_dict())
    snap.meta = {"layout": layout(topology, zero_stage), "checkpoint_format": FORMAT}
    if rank == 0:
        sched = lr_scheduler if lr_scheduler is not None else getattr(engine, "lr_scheduler", None)
        inner = inner_optimizer(engine.optimizer)
        snap.trainer = {
            "format": FORMAT,
            "step": int(step),
            "counters": dict(counters or {}),
            "adam_step": adam_step(engine),
            "lr_scheduler": _jsonable(sched.state_dict())
            if sched is not None and hasattr(sched, "state_dict")
            else None,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params" and _is_plain(v)} for g in inner.param_groups
            ],
            "engine": {
                k: int(getattr(engine, k, 0) or 0)
                for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")
            },
            "loss_scaler": _loss_scaler_state(engine),
            "layout": layout(topology, zero_stage),
        }
        snap.config_yaml = config_yaml
        snap.tokenizer = tokenizer
    return snap


def _write(tmp: Path, rel: str, data: bytes) -> dict:
    """Write `data` durably at tmp/rel -> its file-list entry (size, sha256)."""
    write_durable(tmp / rel, data)
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _compact_json(obj) -> bytes:
    """For the tile index (tens of thousands of hashes): one line, and json's C encoder."""
    return json.dumps(obj, separators=(",", ":")).encode()


def _write_json(tmp: Path, rel: str, obj) -> dict:
    return _write(tmp, rel, json_bytes(obj))


def write_snapshot(snap: Snapshot, store: CheckpointStore, tmp: Path) -> None:
    """Write this rank's files into the temp directory, hashing as it writes, then its index
    part and file list (the list last: its presence says this rank is done)."""
    if faults.ACTIVE:
        faults.at("checkpoint_write", step=snap.step)
    tmp = Path(tmp)
    rank = snap.rank
    files: dict[str, dict] = {}
    index_part: dict = {}
    if snap.pieces:
        model_rel, optim_rel = f"model/rank_{rank:05d}.safetensors", f"optim/rank_{rank:05d}.safetensors"
        weights = {name: values["weight"] for name, (_, values) in snap.pieces.items()}
        moments = {f"{name}/{k}": values[k] for name, (_, values) in snap.pieces.items() for k in MOMENTS}
        # The two files are written (and hashed whole) on their own threads while this one hashes
        # the tiles: the disk, not the hashing, sets the pace.
        with ThreadPoolExecutor(2, thread_name_prefix="checkpoint-write") as writers:
            model_file = writers.submit(write_safetensors, tmp / model_rel, weights, {"format": FORMAT}, False)
            optim_file = writers.submit(write_safetensors, tmp / optim_rel, moments, {"format": FORMAT}, False)
            for name, (region, values) in snap.pieces.items():
                index_part[name] = {
                    "file": f"rank_{rank:05d}.safetensors",
                    **region.to_json(),
                    "tiles": tile_hashes(region, snap.shapes[name], values),
                }
            for rel, written in ((model_rel, model_file), (optim_rel, optim_file)):
                files[rel] = {**written.result(), "tile_sha256": "model/index.json"}
    rng_rel = f"rng/rank_{rank:05d}.safetensors"
    files[rng_rel] = write_safetensors(tmp / rng_rel, *snap.rng)
    if snap.data is not None:
        files[snap.data[0]] = _write_json(tmp, snap.data[0], snap.data[1])
    if snap.trainer is not None:
        files["trainer.json"] = _write_json(tmp, "trainer.json", snap.trainer)
        if snap.config_yaml is not None:
            files["config.yaml"] = _write(tmp, "config.yaml", snap.config_yaml.encode())
        if snap.tokenizer is not None and hasattr(snap.tokenizer, "save"):
            (tmp / "tokenizer").mkdir(exist_ok=True)
            snap.tokenizer.save(str(tmp / "tokenizer"))  # small files the tokenizer writes itself
            files.update(
                describe_files(
                    tmp, [str(p.relative_to(tmp)) for p in sorted((tmp / "tokenizer").rglob("*")) if p.is_file()]
                )
            )
    part = {"pieces": index_part}
    if rank == 0:
        part["shapes"] = snap.shapes
        part["meta"] = snap.meta
    write_durable(tmp / PARTS_DIR / f"index_rank_{rank:05d}.json", _compact_json(part))
    store.add_part(tmp, rank, files)


def parts_done(tmp: Path, world: int) -> bool:
    """Has every rank finished writing (its file list exists)? A rank that failed says so."""
    parts = Path(tmp) / PARTS_DIR
    failed = sorted(parts.glob("rank_*.failed"))
    if failed:
        raise RuntimeError(f"{failed[0]}: {failed[0].read_text().strip()}")
    return all((parts / f"rank_{r:05d}.json").is_file() for r in range(world))


def mark_failed(tmp: Path, rank: int, error: BaseException) -> None:
    try:
        write_durable(Path(tmp) / PARTS_DIR / f"rank_{rank:05d}.failed", f"{error}\n".encode())
    except OSError:
        pass


def publish_snapshot(store: CheckpointStore, tmp: Path, step: int, world: int) -> Path:
    """Rank 0, once every rank's part is there: merge the index parts, then the store's publish."""
    tmp = Path(tmp)
    parts = [json.loads((tmp / PARTS_DIR / f"index_rank_{r:05d}.json").read_text()) for r in range(world)]
    shapes, meta = parts[0]["shapes"], parts[0]["meta"]
    params = {name: {"shape": shape, "pieces": []} for name, shape in shapes.items()}
    for part in parts:
        for name, piece in part["pieces"].items():
            params[name]["pieces"].append(piece)
    for name, entry in params.items():  # every value written exactly once, by someone
        rows, cols = matrix_shape(entry["shape"])
        covered = sum(real_count(Region.from_json(pc), rows, cols) for pc in entry["pieces"])
        if covered != rows * cols:
            raise RuntimeError(f"checkpoint step {step}: {name}: the ranks wrote {covered} of {rows * cols} values")
    index = {"format": FORMAT, "grid": [GRID_ROWS, GRID_COLS], "params": params}
    _write(tmp, "model/index.json", _compact_json(index))
    return store.publish(tmp, step, meta)


def save_checkpoint(store: CheckpointStore, step: int, engine, topology, **what) -> Path:
    """Synchronous save: every rank calls this at the same step boundary; returns the published
    directory. Each rank writes only what it holds (no gather). `what`: take_snapshot's
    keywords (stream, counters, lr_scheduler, config_yaml, tokenizer, zero_stage)."""
    rank = current_rank()
    tmp = store.begin(step) if rank == 0 else store.temp_dir(step)
    barrier()
    snap = take_snapshot(step, engine, topology, copy=False, **what)
    write_snapshot(snap, store, tmp)
    barrier()
    path = publish_snapshot(store, tmp, step, snap.world) if rank == 0 else None
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
        isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str, bool)) for x in v)
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


# Load ---------------------------------------------------------------------------------
FILES = {
    None: ("model", "{name}"),
    "exp_avg": ("optim", "{name}/exp_avg"),
    "exp_avg_sq": ("optim", "{name}/exp_avg_sq"),
}
TILE_KEYS = ["exp_avg", "exp_avg_sq", None]  # the order of the tile hashes (sorted key names)


def verified_bytes(path: Path, rel: str, manifest: dict) -> bytes:
    """A small file of a checkpoint, checked against the manifest's sha256."""
    data = (Path(path) / rel).read_bytes()
    want = manifest["files"].get(rel, {}).get("sha256")
    if want != hashlib.sha256(data).hexdigest():
        raise CorruptCheckpoint(f"{Path(path) / rel}: fails its sha256 checksum")
    return data


def open_reader(path: str | os.PathLike, manifest: dict | None = None) -> ShardedReader:
    """A reader of a checkpoint's weights and moments (verifies the index, then every tile read)."""
    path = Path(path)
    manifest = manifest if manifest is not None else read_manifest(path)
    index = json.loads(verified_bytes(path, "model/index.json", manifest))
    if index.get("format") != FORMAT:
        raise CorruptCheckpoint(
            f"{path / 'model' / 'index.json'}: format {index.get('format')!r}, expected "
            f"{FORMAT!r} (checkpoints of older loomtrain versions do not load)"
        )
    return ShardedReader(path, index, FILES, TILE_KEYS)


class ConsolidatedReader:
    """Full tensors by name from a checkpoint (for export and tools; reads every piece)."""

    def __init__(self, path: str | os.PathLike):
        self.reader = open_reader(path)
        self.index = self.reader.params

    def names(self) -> list[str]:
        return self.reader.names()

    def get(self, name: str, key: str | None = None) -> torch.Tensor:
        return self.reader.full(name, key)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: self.get(n) for n in self.names()}


def load_checkpoint(
    path: str | os.PathLike, engine, topology, *, stream=None, lr_scheduler=None, zero_stage: int = 0
) -> dict:
    """Put a checkpoint back into a freshly built engine at any (tp, dp, zero stage).

    Every rank calls it after deepspeed.initialize and reads only its slices: its TP shard of
    the weights (at ZeRO-3 only its partition) and its partition of the Adam moments, checking
    the sha256 of every tile it reads. Returns trainer.json (step, counters, ...) plus
    "bytes_read" (tensor bytes this rank read) and "files_read" (the tensor files it opened).
    A damaged file raises CorruptCheckpoint."""
    path = Path(path)
    manifest = read_manifest(path)
    trainer = json.loads(verified_bytes(path, "trainer.json", manifest))
    reader = open_reader(path, manifest)
    params = named_params(engine)
    missing = [n for n, _ in params if n not in reader.params]
    extra = [n for n in reader.params if n not in dict(params)]
    if missing or extra:
        raise ValueError(
            f"checkpoint {path}: parameters do not match the model "
            f"(missing {missing[:5]}, unexpected {extra[:5]}); was it saved with another model config?"
        )
    for name, p in params:
        if reader.shape(name) != full_shape(p):
            raise ValueError(
                f"checkpoint {path}: {name} has full shape {reader.shape(name)}, this model's is {full_shape(p)}"
            )
    ensure_optimizer_state(engine)
    for name, p in params:
        box = local_box(p)
        held = Region(box, held_range(engine, p, topology))
        for k in KEYS:
            whole = k is None and not hasattr(p, "ds_id")  # ZeRO 0-2 weights: the whole TP shard
            if not whole and not held.numel:
                continue
            into = load_target(engine, p, k)
            if into is not None:  # DeepSpeed's own buffer, filled in place
                reader.read(name, k, held, out=into)
            elif whole:
                write_local(engine, p, None, reader.read(name, None, Region.whole(box)).reshape(local_full_shape(p)))
            else:  # at ZeRO-3 the weights too: only this rank's partition, never the whole shard
                set_held_values(engine, p, k, reader.read(name, k, held))
    files_read = reader.files_read()
    reader.close()
    set_adam_step(engine, trainer["adam_step"])

    inner = inner_optimizer(engine.optimizer)
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
    rank = current_rank()
    rng_rel = f"rng/rank_{rank:05d}.safetensors"
    if trainer["layout"]["world_size"] == current_world_size() and (path / rng_rel).exists():
        raw = verified_bytes(path, rng_rel, manifest)
        with safe_open(str(path / rng_rel), framework="pt") as f:
            meta = f.metadata()
        set_rng_state(load_safetensors(raw), meta)

    if stream is not None:
        dp_rank = topology.dp_rank if topology is not None else 0
        own = f"data/dp_{dp_rank:05d}.json"
        same_dp = trainer["layout"]["dp"] == (topology.dp_size if topology is not None else 1)
        src = own if same_dp and (path / own).exists() else "data/dp_00000.json"
        if (path / src).exists():
            stream.load_state_dict(json.loads(verified_bytes(path, src, manifest)))
    barrier()
    trainer["bytes_read"], trainer["files_read"] = reader.bytes_read, files_read
    return trainer
