"""The layout-free sharded format on its own (no engine): pieces written at one (tp, dp) layout
read back at another, exactly, reading about a rank's share, and corruption named; the reader's
tests run on a local folder (memory-mapped) and in the local S3 server (ranged GETs) alike."""

from __future__ import annotations

import itertools

import pytest
import torch
from loomtrain import storage
from loomtrain.launcher.checkpoints.shards import (
    CorruptCheckpoint,
    Region,
    ShardedReader,
    shard_box,
    tile_hashes,
    write_safetensors,
)
from safetensors import safe_open


def padded_shard(full: torch.Tensor, dim, n, i):
    """What a TP rank holds: shard i of n along dim after zero-padding dim to a multiple of n."""
    if dim is None:
        return full, shard_box(full.shape, None)
    size = full.shape[dim]
    padded = -(-size // n) * n
    pad = list(full.shape)
    pad[dim] = padded - size
    t = torch.cat([full, full.new_zeros(pad)], dim=dim) if pad[dim] else full
    length = padded // n
    return t.chunk(n, dim=dim)[i].contiguous(), shard_box(full.shape, dim, i * length, length)


def dp_parts(numel, k):
    cuts = [round(j * numel / k) for j in range(k + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def save(root, tensors, dims, tp, dp):
    """Every (tp rank, dp rank) writes its DP part of its TP shard of every tensor, under the
    location `root` (a folder, or a prefix in an object store)."""
    files = storage.location(root).child("m")
    index = {"params": {}}
    for name, full in tensors.items():
        index["params"][name] = {"shape": list(full.shape), "pieces": []}
    for t, d in itertools.product(range(tp), range(dp)):
        rank = t * dp + d
        out, pieces = {}, {}
        for name, full in tensors.items():
            dim = dims[name] if tp > 1 else None
            shard, box = padded_shard(full, dim, tp, t)
            a, b = dp_parts(shard.numel(), dp)[d]
            region = Region(box, (a, b))
            out[name] = shard.reshape(-1)[a:b].clone()
            pieces[name] = {
                "file": f"rank_{rank}.safetensors",
                **region.to_json(),
                "tiles": tile_hashes(region, full.shape, {"w": out[name]}),
            }
        where, stream = files.sink(f"rank_{rank}.safetensors")  # a path and no stream, or an upload
        write_safetensors(where, out, sink=stream)
        for name in tensors:
            index["params"][name]["pieces"].append(pieces[name])
    return ShardedReader(root, index, {None: ("m", "{name}")}, [None])


TENSORS = {"emb": torch.randn(67, 12), "row": torch.randn(10, 24), "col": torch.randn(20, 9), "bias": torch.randn(33)}
DIMS = {"emb": 0, "row": 1, "col": 0, "bias": 0}


@pytest.mark.parametrize("saved,target", [((1, 4), (2, 2)), ((2, 2), (2, 2)), ((2, 2), (1, 3)), ((4, 1), (2, 3))])
def test_any_layout_reads_its_exact_share(backend_root, saved, target):
    reader = save(backend_root, TENSORS, DIMS, *saved)
    tp, dp = target
    want_bytes = 0
    for name, full in TENSORS.items():
        for t, d in itertools.product(range(tp), range(dp)):
            shard, box = padded_shard(full, DIMS[name] if tp > 1 else None, tp, t)
            a, b = dp_parts(shard.numel(), dp)[d]
            got = reader.read(name, None, Region(box, (a, b)))
            assert torch.equal(got, shard.reshape(-1)[a:b]), (name, t, d)
            want_bytes += (b - a) * 4
        assert torch.equal(reader.full(name), full)
    # every tile touched at an edge may be read whole: a little over the exact share
    exact_full = sum(t.numel() * 4 for t in TENSORS.values())
    assert reader.bytes_read <= 1.35 * (want_bytes + exact_full)
    if not storage.location(backend_root).local:  # ranged GETs: the tiles read and the files' headers
        assert 0 < reader.bytes_fetched <= reader.bytes_read + 4096 * len(reader.files_read())


def test_files_are_plain_safetensors_with_the_hash_computed_while_writing(tmp_path):
    import hashlib

    t = {"a": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16()}
    info = write_safetensors(tmp_path / "x.safetensors", t, metadata={"format": "test"})
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert info == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "test"}
        for k, v in t.items():
            assert torch.equal(f.get_tensor(k), v)


def test_a_flipped_value_is_named_by_the_rank_reading_it(backend_root):
    reader = save(backend_root, TENSORS, DIMS, 1, 2)
    files = storage.location(backend_root).child("m")
    raw = bytearray(files.read("rank_1.safetensors"))
    raw[-3] ^= 0xFF  # the last tensor's last value
    files.write("rank_1.safetensors", bytes(raw))
    last = list(TENSORS)[-1]
    # a target that does not touch the damaged tile reads fine
    assert torch.equal(reader.read(last, None, Region(shard_box([33], None), (0, 4))), TENSORS[last][:4])
    with pytest.raises(CorruptCheckpoint, match="rank_1.safetensors.*fails its xxh3_128 checksum"):
        reader.full(last)


def tiny_run(tmp_path, *overrides: str, hooks=()):
    """The tiny config shrunk to a few seconds, checkpoints every 2 steps, run in this process."""
    from pathlib import Path

    from loomtrain.launcher.config_loader import load_config
    from loomtrain.launcher.training.loop import run_training

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    over = [
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.max_seq_len=32",
        "train.seq_len=32",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "data.max_files=20",
        "eval.every_steps=0",
        "eval.num_samples=0",
        "log.progress=plain",
        "log.tensorboard=false",
        "checkpoint.every_steps=2",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    return run_training(load_config(tiny, [*over, *overrides]), hooks=hooks)


def test_a_damaged_tile_is_found_by_the_rank_reading_it_and_resume_takes_the_previous(tmp_path, one_thread):
    """Rank 0 checks only sizes before a resume; the reader checks the checksum of every tile it
    reads, so one flipped bit in a moment names the file, and the previous checkpoint is used."""
    tiny_run(tmp_path, "train.max_steps=4")
    victim = tmp_path / "run" / "checkpoints" / "step_00000004" / "optim" / "rank_00000.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0x10  # the last moment's last value: same size, so only its checksum can tell
    victim.write_bytes(bytes(raw))
    seen = {}

    from loomtrain.launcher.hooks import Hooks

    class Resumed(Hooks):
        def on_train_start(self, ctx):
            seen["from"] = str(ctx.resumed_from)

    result = tiny_run(tmp_path, "train.max_steps=5", hooks=[Resumed()])
    assert seen["from"] == str(tmp_path / "run" / "checkpoints" / "step_00000002")
    assert result.steps == [3, 4, 5]


def test_tile_hashes_are_the_formats_own():
    """The tile geometry and hashing are part of the format: checkpoints saved before (same
    values, same tiles) must keep verifying. v2's sha256 tiles recorded from the first writer,
    v3's XXH3-128 ones from the first v3 writer."""
    import hashlib
    import json

    values = torch.arange(630, dtype=torch.float32) * 0.5 - 100
    piece = {"w": values[13:500].clone(), "m": (values[13:500] * 2).clone()}
    region = Region(shard_box([70, 9], None), (13, 500))
    v2 = tile_hashes(region, [70, 9], piece, "sha256")
    assert hashlib.sha256(json.dumps(v2).encode()).hexdigest() == (
        "89640b1f8dd529ef4daad8a90a148abcc160f42617a3176c1dc8ffd8f25c6d79"
    )
    v3 = tile_hashes(region, [70, 9], piece)
    assert [row[:2] for row in v3] == [row[:2] for row in v2] and len(v3[0][2]) == 32
    assert hashlib.sha256(json.dumps(v3).encode()).hexdigest() == (
        "598a462af18a0b89f2b0ffbbd8c127954d5a5ebeb5b32ebaf53a23f4bbbac75e"
    )


def as_v2(step_dir):
    """Rewrite a checkpoint as format v2 wrote it: the same files, sha256 tile checksums."""
    import json

    from loomtrain.storage import sha256_file
    from safetensors.torch import load_file

    index_path, manifest_path = step_dir / "model" / "index.json", step_dir / "manifest.json"
    index = json.loads(index_path.read_text())
    files = {}
    for name, entry in index["params"].items():
        for piece in entry["pieces"]:
            f = piece["file"]
            if f not in files:
                files[f] = {**load_file(step_dir / "model" / f), **load_file(step_dir / "optim" / f)}
            values = {"weight": files[f][name], **{k: files[f][f"{name}/{k}"] for k in ("exp_avg", "exp_avg_sq")}}
            piece["tiles"] = tile_hashes(Region.from_json(piece), entry["shape"], values, "sha256")
    index["format"] = "loomtrain-sharded-v2"
    index_path.write_text(json.dumps(index))
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["model/index.json"] = {"size": index_path.stat().st_size, "sha256": sha256_file(index_path)}
    manifest_path.write_text(json.dumps(manifest))


def test_a_checkpoint_with_v2s_sha256_tiles_resumes_the_same_and_names_a_damaged_tile(tmp_path, one_thread):
    """Format v3 changed only the tile checksum (sha256 -> XXH3-128); a v2 checkpoint resumes
    to the very same step as its v3 twin, and a flipped byte in it is named as failing sha256."""
    import shutil

    from loomtrain.launcher.hooks import Hooks

    tiny_run(tmp_path / "v3", "train.max_steps=4")
    shutil.copytree(tmp_path / "v3", tmp_path / "v2")
    as_v2(tmp_path / "v2" / "run" / "checkpoints" / "step_00000004")
    seen = []

    class Resumed(Hooks):
        def on_train_start(self, ctx):
            seen.append(ctx.resumed_from.name)

    v3 = tiny_run(tmp_path / "v3", "train.max_steps=5", hooks=[Resumed()])
    v2 = tiny_run(tmp_path / "v2", "train.max_steps=5", hooks=[Resumed()])
    assert seen == ["step_00000004", "step_00000004"] and v2.steps == v3.steps == [5]
    assert v2.losses == v3.losses
    victim = tmp_path / "v2" / "run" / "checkpoints" / "step_00000004" / "model" / "rank_00000.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0x10
    victim.write_bytes(bytes(raw))
    from loomtrain.launcher.checkpoints.state import open_reader

    reader = open_reader(victim.parents[1])
    with pytest.raises(CorruptCheckpoint, match=rf"{victim}: .* fails its sha256 checksum"):
        for name in reader.names():
            reader.full(name)
