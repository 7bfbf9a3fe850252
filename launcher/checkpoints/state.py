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
                                   of the full tensor it covers and a checksum per tile
                                   (XXH3-128; sha256 in v2 checkpoints, which still load)
    trainer.json                   step, tokens, time, Adam step, LR schedule, engine counters,
                                   world layout (tp, dp, zero stage)
    data/dp_DDDDD.json             each data-parallel rank's stream state (global position)
    rng/rank_RRRRR.safetensors     every rank's RNG states (python, numpy, torch CPU, CUDA)
    config.yaml, tokenizer/        the resolved config and the tokenizer
    manifest.json                  sizes + sha256 of all of the above (store.py); for the model/
                                   and optim/ files sizes only: every value in them is covered
                                   by a tile hash in the index, checked by whoever reads it, so
                                   a save hashes each byte once, not twice

What each kind of state puts into a checkpoint and takes back is its own (parts.py: weights
and moments, optimizer settings, LR schedule, engine counters, loss scale, RNG, data stream,
the loop's counters); this module writes, publishes and opens checkpoints around them.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from loomtrain.durable import json_bytes
from loomtrain.launcher.checkpoints.ds_state import MOMENTS, held_values, named_params, written_range
from loomtrain.launcher.checkpoints.parts import KEYS, PARTS, Training
from loomtrain.launcher.checkpoints.shards import (
    GRID_COLS,
    GRID_ROWS,
    TILE_CHECKSUM,
    CorruptCheckpoint,
    Region,
    ShardedReader,
    matrix_shape,
    real_count,
    tile_hashes,
    write_safetensors,
)
from loomtrain.launcher.checkpoints.store import (
    CHECKPOINT_FORMAT,
    PARTS_DIR,
    CheckpointStore,
    format_problem,
    read_checkpoint_file,
    read_manifest,
)
from loomtrain.launcher.distributed import barrier, current_rank, current_world_size
from loomtrain.storage import below

FORMAT = CHECKPOINT_FORMAT  # "loomtrain-sharded-v3" (store.py: the manifest's format check knows it too)
# The formats a resume reads -> their tile checksum: v2 (before December 2026's faster save) had
# sha256 tiles, v3 XXH3-128 ones; the layout of both is the same.
READS = {"loomtrain-sharded-v2": "sha256", FORMAT: TILE_CHECKSUM}


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


def take_snapshot(
    step: int, training: Training, *, copy: bool, config_yaml: str | None = None, tokenizer=None
) -> Snapshot:
    """This rank's share of the checkpoint of `step` (every part's); no collective. With
    copy=False the tensors are views of DeepSpeed's live buffers (the caller writes them
    before the next step)."""
    rank = current_rank()
    snap = Snapshot(step=int(step), rank=rank, world=current_world_size())
    layout_now = layout(training.topology, training.zero_stage)
    snap.meta = {"layout": layout_now, "checkpoint_format": FORMAT}
    if rank == 0:
        snap.trainer = {"format": FORMAT, "step": int(step), "layout": layout_now}
        snap.config_yaml, snap.tokenizer = config_yaml, tokenizer
    for part in PARTS:
        part.take(training, snap, copy)
    return snap


def _compact_json(obj) -> bytes:
    """For the tile index (tens of thousands of hashes): one line, and json's C encoder."""
    return json.dumps(obj, separators=(",", ":")).encode()


def _write_tensors(store: CheckpointStore, tmp, rel: str, tensors: dict, *how) -> dict:
    """A safetensors file streamed to the store (a local file, or an upload with parts in flight)."""
    path, sink = store.tensor_sink(tmp, rel)
    return write_safetensors(path, tensors, *how, sink=sink)


def staging_specs(training: Training) -> dict:
    """(name, key) -> (shape, dtype, pinned) of the host buffers an async snapshot of this rank
    copies its weights and moments into (parts.Tensors.take's keys); read from the fp32 master
    values only (the moments are made like them, and Adam's lazily made state is not touched
    here). A buffer that turns out not to fit is made anew at the snapshot (parts._to_host)."""
    engine, topology = training.engine, training.topology
    specs = {}
    for name, p in named_params(engine):
        a, b = written_range(engine, p, topology)
        if b <= a:
            continue
        master = held_values(engine, p, None)
        for k in KEYS:
            specs[(name, k)] = ((b - a,), master.dtype, master.device.type == "cuda")
    return specs


def write_snapshot(snap: Snapshot, store: CheckpointStore, tmp, on_thread=None) -> None:
    """Write this rank's files into the temp directory (on an object store: straight into the
    step's prefix), hashing as it writes, then its index part and file list (the list last:
    its presence says this rank is done). `on_thread`: called first on each helper thread
    (background.py lowers their priority with it)."""
    rank = snap.rank
    files: dict[str, dict] = {}
    index_part: dict = {}
    if snap.pieces:
        model_rel, optim_rel = f"model/rank_{rank:05d}.safetensors", f"optim/rank_{rank:05d}.safetensors"
        weights = {name: values["weight"] for name, (_, values) in snap.pieces.items()}
        moments = {f"{name}/{k}": values[k] for name, (_, values) in snap.pieces.items() for k in MOMENTS}
        # The two files are written (and hashed whole) on their own threads while this one hashes
        # the tiles: the disk, not the hashing, sets the pace.
        with ThreadPoolExecutor(2, thread_name_prefix="checkpoint-write", initializer=on_thread) as writers:
            model_file = writers.submit(_write_tensors, store, tmp, model_rel, weights, {"format": FORMAT}, False)
            optim_file = writers.submit(_write_tensors, store, tmp, optim_rel, moments, {"format": FORMAT}, False)
            for name, (region, values) in snap.pieces.items():
                index_part[name] = {
                    "file": f"rank_{rank:05d}.safetensors",
                    **region.to_json(),
                    "tiles": tile_hashes(region, snap.shapes[name], values),
                }
            for rel, written in ((model_rel, model_file), (optim_rel, optim_file)):
                files[rel] = {**written.result(), "tile_checksums": "model/index.json"}
    rng_rel = f"rng/rank_{rank:05d}.safetensors"
    files[rng_rel] = _write_tensors(store, tmp, rng_rel, *snap.rng)
    if snap.data is not None:
        files[snap.data[0]] = store.write_file(tmp, snap.data[0], json_bytes(snap.data[1]))
    if snap.trainer is not None:
        files["trainer.json"] = store.write_file(tmp, "trainer.json", json_bytes(snap.trainer))
        if snap.config_yaml is not None:
            files["config.yaml"] = store.write_file(tmp, "config.yaml", snap.config_yaml.encode())
        if snap.tokenizer is not None and hasattr(snap.tokenizer, "save"):
            # small files the tokenizer writes itself
            files.update(store.write_folder(tmp, "tokenizer", snap.tokenizer.save))
    part = {"pieces": index_part}
    if rank == 0:
        part["shapes"] = snap.shapes
        part["meta"] = snap.meta
    store.write_raw(tmp, f"{PARTS_DIR}/index_rank_{rank:05d}.json", _compact_json(part))
    store.add_part(tmp, rank, files)


def publish_snapshot(store: CheckpointStore, tmp, step: int, world: int) -> Path | str:
    """Rank 0, once every rank's part is there: merge the index parts, then the store's publish."""
    parts = [json.loads(store.read_file(tmp, f"{PARTS_DIR}/index_rank_{r:05d}.json")) for r in range(world)]
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
    index = {"format": FORMAT, "grid": [GRID_ROWS, GRID_COLS], "params": params}  # the format names the checksum
    store.write_raw(tmp, "model/index.json", _compact_json(index))
    return store.publish(tmp, step, meta)


def save_checkpoint(store: CheckpointStore, step: int, training: Training, **what) -> Path | str:
    """Synchronous save: every rank calls this at the same step boundary; returns the published
    directory. Each rank writes only what it holds (no gather). `what`: take_snapshot's
    keywords (config_yaml, tokenizer)."""
    rank = current_rank()
    tmp = store.begin(step) if rank == 0 else store.temp_dir(step)
    barrier()
    return write_and_publish(take_snapshot(step, training, copy=False, **what), store, tmp)


def write_and_publish(snap: Snapshot, store: CheckpointStore, tmp) -> Path | str:
    """A synchronous save's second half, on every rank: write this rank's share, then rank 0
    publishes once every rank has. Returns the published directory."""
    write_snapshot(snap, store, tmp)
    barrier()
    path = publish_snapshot(store, tmp, snap.step, snap.world) if snap.rank == 0 else store.final_dir(snap.step)
    barrier()
    return path


# Load ---------------------------------------------------------------------------------
FILES = {
    None: ("model", "{name}"),
    "exp_avg": ("optim", "{name}/exp_avg"),
    "exp_avg_sq": ("optim", "{name}/exp_avg_sq"),
}
TILE_KEYS = ["exp_avg", "exp_avg_sq", None]  # the order of the tile hashes (sorted key names)


def verified_bytes(path: Path | str, rel: str, manifest: dict) -> bytes:
    """A small file of a checkpoint, checked against the manifest's sha256."""
    path = below(path)  # a folder (Path) or a URI (str, never a Path: `s3://` is no path)
    try:
        data = read_checkpoint_file(path, rel)
    except FileNotFoundError:  # on every backend alike: every rank hears of it, the next older one is tried
        raise CorruptCheckpoint(f"{below(path, rel)}: missing (named by the manifest)") from None
    want = manifest["files"].get(rel, {}).get("sha256")
    if want != hashlib.sha256(data).hexdigest():
        raise CorruptCheckpoint(f"{below(path, rel)}: fails its sha256 checksum")
    return data


def open_reader(path: str | os.PathLike, manifest: dict | None = None) -> ShardedReader:
    """A reader of a checkpoint's weights and moments (verifies the index, then every tile read)."""
    path = below(path)
    manifest = manifest if manifest is not None else read_manifest(path)
    index = json.loads(verified_bytes(path, "model/index.json", manifest))
    found = index.get("format")
    if found not in READS:
        if "newer" in format_problem({"format": 1, "checkpoint_format": found}):
            why = "a newer loomtrain wrote it: upgrade loomtrain"
        else:
            why = "checkpoints of older loomtrain versions do not load"
        raise CorruptCheckpoint(
            f"{below(path, 'model/index.json')}: format {found!r}, expected one of "
            f"{', '.join(map(repr, READS))} ({why})"
        )
    return ShardedReader(path, index, FILES, TILE_KEYS, READS[found])


@dataclass
class OpenCheckpoint:
    """A published checkpoint as the parts read it: its manifest, trainer.json, its tiles."""

    path: Path | str  # a folder, or a URI (run.storage)
    manifest: dict
    trainer: dict
    tensors: ShardedReader
    rank: int
    world: int

    def verified(self, rel: str) -> bytes:
        return verified_bytes(self.path, rel, self.manifest)

    def has(self, rel: str) -> bool:
        return rel in self.manifest.get("files", {})  # the published manifest lists every file


def load_checkpoint(path: str | os.PathLike, training: Training) -> dict:
    """Put a checkpoint back into a freshly built engine at any (tp, dp, zero stage): every
    part in turn (parts.PARTS).

    Every rank calls it after deepspeed.initialize and reads only its slices: its TP shard of
    the weights (at ZeRO-3 only its partition) and its partition of the Adam moments, checking
    the checksum of every tile it reads. Returns trainer.json (step, counters, ...) plus
    "bytes_read" (tensor bytes this rank read) and "files_read" (the tensor files it opened).
    A damaged file raises CorruptCheckpoint; another model's checkpoint ValueError."""
    path = below(path)
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{below(path, 'manifest.json')}: missing") from None
    trainer = json.loads(verified_bytes(path, "trainer.json", manifest))
    ckpt = OpenCheckpoint(path, manifest, trainer, open_reader(path, manifest), current_rank(), current_world_size())
    try:
        for part in PARTS:
            part.put(training, ckpt)
    finally:
        files_read = ckpt.tensors.files_read()
        ckpt.tensors.close()
    barrier()
    return {**trainer, "bytes_read": ckpt.tensors.bytes_read, "files_read": files_read}
