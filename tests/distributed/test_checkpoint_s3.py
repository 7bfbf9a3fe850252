"""Checkpoints in object storage (run.storage=s3://...), against the tests' local S3 server
(tests/s3_server.py: one bucket per test):

* the store on its own (in-process): the manifest is the commit point and `latest` follows it;
  a step prefix without a manifest is invisible to the scan and removed at the next start;
  keep_last / keep_every prune whole prefixes, manifest first, never the newest; a missing or
  short object is named; checkpoint.resume takes the URI of a checkpoint or of a run storage;
* uploads: a large file goes up in parts, several in flight; the bytes arrive whole;
* reads: a rank fetches only its tiles (ranged GETs) and checks them; a flipped byte is named;
* a run (in-process, one rank): `run.storage=s3://...` saves there, resumes with the same
  command, losses equal those of the same run on disk; a flipped byte in the newest checkpoint is
  named and the previous one is resumed; no credential reaches config.yaml or metrics.jsonl;
* launched (torchrun, 4 ranks): tp 2 x dp 2 writing to S3 is killed (-9) in the middle of an
  upload: `latest` stays the previous checkpoint; the same command at tp 1 x dp 4 removes the
  leftover, resumes from it and gives the same losses as resuming a disk copy of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import launch
import pytest
import torch
from launch import TINY, child_env, loomtrain_cmd, losses, output, run_child
from loomtrain.launcher.checkpoints.shards import CorruptCheckpoint, Region, ShardedReader, tile_hashes
from loomtrain.launcher.checkpoints.store import MANIFEST, CheckpointStore
from loomtrain.storage import Objects, Upload, object_store

pytestmark = pytest.mark.usefixtures("one_thread")


def _publish(store: CheckpointStore, step: int, files: dict[str, bytes], world: int = 2) -> str:
    """A checkpoint of `files`, written as `world` ranks do (each its share, then its part)."""
    tmp = store.begin(step)
    names = sorted(files)
    for rank in range(world):
        mine = {rel: store.write_file(tmp, rel, files[rel]) for rel in names[rank::world]}
        store.add_part(tmp, rank, mine)
    assert store.parts_done(tmp, world)
    return store.publish(tmp, step, {"layout": {"tp": 1, "dp": world}})


def _objects(uri: str) -> dict[str, int]:
    return Objects(uri).sizes()


def test_object_store_protocol_scan_retention_and_resume_targets(s3_bucket):
    storage = f"{s3_bucket}/runs/a"
    logs: list[str] = []
    store = CheckpointStore(storage, keep_last=2, keep_every=4, log=logs.append)
    assert not store.objects.local and store.root == f"{storage}/checkpoints"
    assert store.published() == [] and store.find_resumable() is None and store.latest_pointer() is None
    files = {"trainer.json": b'{"step": 1}', "model/rank_00000.bin": os.urandom(3000), "rng/r.bin": b"x" * 10}

    # the manifest is the commit point; `latest` follows it
    for step in (2, 4, 6):
        _publish(store, step, files)
    ckpts = f"{storage}/checkpoints"
    assert store.latest_pointer() == "step_00000006"
    manifest = json.loads(Objects(f"{ckpts}/step_00000006").read(MANIFEST))
    assert manifest["files"]["model/rank_00000.bin"] == {
        "size": 3000,
        "sha256": hashlib.sha256(files["model/rank_00000.bin"]).hexdigest(),
    }
    assert not any(k.startswith(".parts/") for k in _objects(f"{ckpts}/step_00000006"))  # folded into the manifest
    # keep_last=2 plus every 4th: 2 went (manifest first, then its objects), 4 and 6 stay
    from loomtrain.launcher.checkpoints.store import wait_for_deletions

    wait_for_deletions()
    assert [s for s, _ in store.published()] == [4, 6]
    assert not any(k.startswith("step_00000002") for k in _objects(ckpts))
    _publish(store, 8, files)
    wait_for_deletions()
    assert [s for s, _ in store.published()] == [4, 6, 8]  # 4: keep_every

    # an interrupted write (objects, parts, no manifest) is invisible, then cleaned up at start
    tmp = store.begin(10)
    store.add_part(tmp, 0, {"trainer.json": store.write_file(tmp, "trainer.json", b"{}")})
    assert [s for s, _ in store.published()] == [4, 6, 8] and store.find_resumable() == f"{ckpts}/step_00000008"
    assert store.clean_temp() == [f"{ckpts}/step_00000010"]
    assert not any(k.startswith("step_00000010") for k in _objects(ckpts))
    assert "removed leftover" in logs[-1]

    # a missing or short object: named, and the previous checkpoint is taken
    Objects(f"{ckpts}/step_00000008").delete("rng/r.bin")
    Objects(f"{ckpts}/step_00000006").write("model/rank_00000.bin", b"short")
    logs.clear()
    assert store.find_resumable() == f"{ckpts}/step_00000004"
    assert any("step_00000008: missing object rng/r.bin" in m for m in logs), logs
    assert any("model/rank_00000.bin has 5 bytes, manifest says 3000" in m for m in logs), logs

    # checkpoint.resume: a checkpoint's URI, or a run storage's (its newest complete one)
    other = CheckpointStore(f"{s3_bucket}/runs/b", log=logs.append)
    assert other.resolve_resume(f"{ckpts}/step_00000004") == f"{ckpts}/step_00000004"
    assert other.resolve_resume(storage + "/") == f"{ckpts}/step_00000004"
    with pytest.raises(ValueError, match=r"checkpoint.resume='.*step_00000008'.*missing object rng/r.bin"):
        other.resolve_resume(f"{ckpts}/step_00000008")
    with pytest.raises(ValueError, match=r"unknown storage scheme nosuch://"):
        other.resolve_resume("nosuch://x/y")
    # a bucket that is not there stops the start in one line (not the first save, N steps later)
    store.check_reachable()
    with pytest.raises(ValueError, match=r"^run.storage=s3://loomtrain-no-such-bucket/x: bucket 'loomtrain-no-such"):
        CheckpointStore("s3://loomtrain-no-such-bucket/x").check_reachable()
    # never the newest good one: keep_last=1 with the newest (8) broken keeps `latest`'s
    pruned = CheckpointStore(storage, keep_last=1).apply_retention()
    assert f"{ckpts}/step_00000008" not in pruned
    wait_for_deletions()


def test_ray_finds_the_newest_checkpoint_in_run_storage(tmp_path, s3_bucket):
    """Ray's worker function resumes from (and reports pointers to) what newest_complete finds:
    with run.storage a URI, a URI (the pointer {"path", "step"} carries it as it is)."""
    import time

    from loomtrain.launcher.cluster.ray_train import newest_complete
    from loomtrain.launcher.config_loader import load_config

    storage = f"{s3_bucket}/ray"
    cfg = load_config(TINY, [f"run.dir={tmp_path / 'run'}", f"run.storage={storage}"])
    store = CheckpointStore(storage, keep_last=0)
    assert newest_complete(cfg) is None
    _publish(store, 2, {"trainer.json": b"{}"})
    started = time.time()
    _publish(store, 4, {"trainer.json": b"{}"})
    tmp = store.begin(6)  # an upload in flight: not a checkpoint yet
    store.write_file(tmp, "trainer.json", b"{}")
    assert newest_complete(cfg) == f"{storage}/checkpoints/step_00000004"
    assert newest_complete(cfg, since=started + 3600) is None  # written by an earlier attempt only
    # checkpoint.resume=never: the checkpoints are moved aside (copied, then deleted manifest first)
    aside = store.set_aside()
    assert aside.startswith(f"{storage}/checkpoints/superseded-") and newest_complete(cfg) is None
    assert {"latest", "step_00000002/manifest.json", "step_00000004/manifest.json"} <= set(Objects(aside).sizes())


def test_large_upload_goes_in_parts_and_arrives_whole(s3_bucket):
    fs, path = object_store(f"{s3_bucket}/big")
    data = os.urandom(11 << 20)
    up = Upload(fs, path, part_bytes=5 << 20, in_flight=2)
    for i in range(0, len(data), 1 << 20):  # written in 1 MiB pieces, as a writer makes them
        up.write(memoryview(data)[i : i + (1 << 20)])
    assert len(up._parts) == 2  # two full parts already on their way before close
    assert up.close() == len(data)
    assert fs.cat_file(path) == data
    # a failed write leaves nothing behind
    up = Upload(fs, path + "-failed", part_bytes=5 << 20)
    up.write(data[: 6 << 20])
    up.abort()
    assert not fs.exists(path + "-failed")


def _tiled(s3_bucket: str):
    """A 64 x 48 matrix stored as 4 pieces (dp 4) in S3, and a reader of it."""
    full = torch.randn(64, 48)
    flat, index = full.reshape(-1), {"params": {"w": {"shape": [64, 48], "pieces": []}}}
    root = f"{s3_bucket}/ckpt"
    from loomtrain.launcher.checkpoints.shards import write_safetensors

    quarter = flat.numel() // 4
    for r in range(4):
        region = Region((0, 64, 0, 48), (r * quarter, (r + 1) * quarter))
        values = flat[r * quarter : (r + 1) * quarter].clone()
        _, sink = Objects(root).sink(f"m/rank_{r}.safetensors")
        write_safetensors(f"{root}/m/rank_{r}.safetensors", {"w": values}, sink=sink)
        index["params"]["w"]["pieces"].append(
            {"file": f"rank_{r}.safetensors", **region.to_json(), "tiles": tile_hashes(region, [64, 48], {"w": values})}
        )
    return full, root, index


def test_ranged_reads_fetch_only_the_wanted_tiles_and_check_them(s3_bucket):
    full, root, index = _tiled(s3_bucket)
    reader = ShardedReader(root, index, {None: ("m", "{name}")}, [None])
    # rows 16..32 (a quarter): in piece 1 only, and only those tiles travel
    want = Region((0, 64, 0, 48), (16 * 48, 32 * 48))
    assert torch.equal(reader.read("w", None, want), full[16:32].reshape(-1))
    assert reader.files_read() == ["m/rank_1.safetensors"]
    assert reader.bytes_fetched == 16 * 48 * 4  # exactly the share: the tiles are whole rows here
    assert torch.equal(ShardedReader(root, index, {None: ("m", "{name}")}, [None]).full("w"), full)
    # a flipped byte in one object: the tile reading it is named
    objs = Objects(root)
    raw = bytearray(objs.read("m/rank_2.safetensors"))
    raw[-100] ^= 0xFF
    objs.write("m/rank_2.safetensors", bytes(raw))
    reader = ShardedReader(root, index, {None: ("m", "{name}")}, [None])
    with pytest.raises(CorruptCheckpoint, match=rf"{root}/m/rank_2.safetensors: w \(tile \d+,\d+\) fails its xxh3_128"):
        reader.full("w")
    objs.delete("m/rank_3.safetensors")
    with pytest.raises(CorruptCheckpoint, match=rf"{root}/m/rank_3.safetensors: missing"):
        ShardedReader(root, index, {None: ("m", "{name}")}, [None]).read(
            "w", None, Region((0, 64, 0, 48), (2400, 2500))
        )


# A run in-process (one rank) -----------------------------------------------------------------
RUN = [
    *launch.SMALL,
    *launch.QUIET,
    "train.max_steps=6",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",
]


def _cfg(run_dir: Path, cache: Path, *extra: str):
    from loomtrain.launcher.config_loader import load_config

    return load_config(TINY, [*RUN, f"run.dir={run_dir}", f"data.cache_dir={cache}", *extra])


def test_a_run_saves_to_s3_resumes_from_it_and_skips_a_damaged_object(tmp_path, data_cache, s3_bucket, monkeypatch):
    import contextlib
    import io

    import fsspec
    from loomtrain.launcher.checkpoints.store import wait_for_deletions
    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training.loop import run_training

    # credentials no other string of the run contains (the bucket is named loomtrain-test-...)
    secrets = ["AKIASECRETLOOMTRAIN7", "wJalrXUtnFEMI-never-written-anywhere"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", secrets[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secrets[1])
    fsspec.get_filesystem_class("s3").clear_instance_cache()

    storage, run = f"{s3_bucket}/tiny", tmp_path / "run"
    ckpts = f"{storage}/checkpoints"
    run_training(_cfg(run, data_cache, f"run.storage={storage}"))
    wait_for_deletions()
    assert Objects(ckpts).read("latest").decode().strip() == "step_00000006"
    assert [n for n in Objects(ckpts).entries() if n.startswith("step_")] == ["step_00000004", "step_00000006"]
    assert not (run / "checkpoints").exists()  # run.dir keeps logs, metrics, config, TensorBoard
    sizes = _objects(f"{ckpts}/step_00000006")
    assert {MANIFEST, "trainer.json", "config.yaml", "model/index.json", "model/rank_00000.safetensors"} <= set(sizes)
    assert "tokenizer/tokenizer.json" in sizes and not any(k.startswith(".parts") for k in sizes)
    # no credential in what the run wrote, here or in the store
    assert f"storage: {storage}" in (run / "config.yaml").read_text()
    for p in [*run.rglob("*"), *(f"{ckpts}/step_00000006/{k}" for k in ("config.yaml", MANIFEST, "trainer.json"))]:
        data = Objects(p.rsplit("/", 1)[0]).read(p.rsplit("/", 1)[1]) if isinstance(p, str) else None
        if data is None and p.is_file():
            data = p.read_bytes()
        assert data is None or not any(s.encode() in data for s in secrets), p

    first = losses(run)
    assert sorted(first) == [1, 2, 3, 4, 5, 6]
    # another model's start against this run.storage is refused before anything is built (by the
    # CLI, and by a Ray driver: it reads run.storage as its workers do); this model's is not
    from loomtrain.launcher.checkpoints.hook import refuse_another_models_checkpoint
    from loomtrain.launcher.config_loader import ConfigError

    refuse_another_models_checkpoint(_cfg(run, data_cache, f"run.storage={storage}"))
    with pytest.raises(ConfigError) as refused:
        refuse_another_models_checkpoint(_cfg(run, data_cache, f"run.storage={storage}", "model.n_layers=3"))
    assert str(refused.value).startswith(f"checkpoint.resume=auto: checkpoint {ckpts}/step_00000006: ")
    assert "unexpected []" in str(refused.value) and "blocks.2." in str(refused.value), refused.value
    # `train --ray`: its driver says it before Ray is started or any worker placed (no Ray here)
    ray_run = run_child(
        loomtrain_cmd(
            "train",
            "--ray",
            TINY,
            *RUN,
            f"run.dir={run}",
            f"data.cache_dir={data_cache}",
            f"run.storage={storage}",
            "model.n_layers=3",
        ),
        env=child_env(RAY_ADDRESS=""),
        rc=2,
    )
    assert ray_run.stderr.strip() == f"loomtrain: config error: {refused.value}", ray_run.stderr[-3000:]
    # a flipped byte in the newest checkpoint: named in one line; the same command resumes the
    # previous one, replays steps 5-6 exactly as the first run did them, and saves step 6 anew
    objs = Objects(f"{ckpts}/step_00000006")
    raw = bytearray(objs.read("optim/rank_00000.safetensors"))
    raw[len(raw) // 2] ^= 0x01
    objs.write("optim/rank_00000.safetensors", bytes(raw))
    resumed: list = []

    class ResumedFrom(Hooks):
        def on_train_start(self, ctx):
            resumed.append(ctx.resumed_from)

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        run_training(_cfg(run, data_cache, f"run.storage={storage}"), hooks=[ResumedFrom()])
    lines = [line for line in err.getvalue().splitlines() if "skipping" in line]
    assert len(lines) == 1, err.getvalue()[-3000:]
    assert f"{ckpts}/step_00000006/optim/rank_00000.safetensors" in lines[0]
    assert "fails its xxh3_128 checksum" in lines[0]
    assert resumed == [f"{ckpts}/step_00000004"]
    assert losses(run) == first  # steps 5-6 again, bitwise
    assert CheckpointStore(storage).verify(f"{ckpts}/step_00000006").ok  # saved anew over the damaged one
    wait_for_deletions()


# Launched: tp 2 x dp 2 killed mid-upload, resumed at tp 1 x dp 4 from S3 -----------------------
# A plugin (LOOMTRAIN_PLUGIN) that SIGKILLs rank 1 while it uploads its optimizer file of step 6.
KILL_MID_UPLOAD = """
import os, signal
from loomtrain.storage import Upload

def hooks(cfg):
    if os.environ.get("RANK") == "1":
        write = Upload.write

        def write_or_die(self, data):
            if "/step_00000006/optim/" in self.key:
                print("loomtrain: TEST kill -9 while uploading " + self.key, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, data)

        Upload.write = write_or_die
    return []
"""
LAUNCHED = [
    *launch.SMALL,
    *launch.QUIET,
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.max_steps=8",
    "parallel.zero_stage=1",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=5",
]


def _launched(run_dir: Path, cache: Path, *extra: str, env=None, rc: int | None = 0):
    cmd = loomtrain_cmd("train", TINY, *LAUNCHED, f"run.dir={run_dir}", f"data.cache_dir={cache}", *extra, nproc=4)
    return run_child(cmd, cwd=run_dir.parent, env=env, rc=rc)


def _dp4_shares_equal(uri: str, folder: Path) -> list[int]:
    """Every tensor's four DP shares (what tp 1 x dp 4 ranks read) from S3 and from disk: equal.
    Returns the bytes each share's reader fetched from S3."""
    from loomtrain.launcher.checkpoints.shards import matrix_shape
    from loomtrain.launcher.checkpoints.state import open_reader

    local, fetched = open_reader(folder), []
    for rank in range(4):
        remote = open_reader(uri)
        for name in local.names():
            rows, cols = matrix_shape(local.shape(name))
            a, b = (round(j * rows * cols / 4) for j in (rank, rank + 1))
            share = Region((0, rows, 0, cols), (a, b))
            for key in (None, "exp_avg", "exp_avg_sq"):
                assert torch.equal(remote.read(name, key, share), local.read(name, key, share)), (name, key, rank)
        fetched.append(remote.bytes_fetched)
    return fetched


@pytest.mark.slow  # two launches of 4 ranks, ~30 s
def test_kill_mid_upload_then_resume_at_another_layout_from_s3(tmp_path, data_cache, s3_bucket):
    storage = f"{s3_bucket}/launched"
    ckpts = f"{storage}/checkpoints"
    plugin = tmp_path / "kill_mid_upload.py"
    plugin.write_text(KILL_MID_UPLOAD)
    run = tmp_path / "run"
    killed = _launched(
        run, data_cache, "parallel.tp=2", f"run.storage={storage}", env=child_env(LOOMTRAIN_PLUGIN=str(plugin)), rc=None
    )
    assert killed.returncode != 0 and "TEST kill -9 while uploading" in output(killed), output(killed)[-3000:]
    store = CheckpointStore(storage)
    assert store.latest_pointer() == "step_00000004"
    assert [s for s, _ in store.published()] == [2, 4]
    assert any(k.startswith("step_00000006/") for k in _objects(ckpts))  # the upload's leftovers
    uninterrupted = losses(run)
    assert {5, 6} <= set(uninterrupted)
    # what tp 1 x dp 4 ranks read of the tp 2 x dp 2 checkpoint, from S3 and from a disk copy: the same
    fs, path = object_store(f"{ckpts}/step_00000004")
    fs.get(path, str(tmp_path / "disk_copy"), recursive=True)
    fetched = _dp4_shares_equal(f"{ckpts}/step_00000004", tmp_path / "disk_copy")
    on_disk = sum(p.stat().st_size for p in (tmp_path / "disk_copy").glob("[mo]*/rank_*.safetensors"))
    assert all(f < on_disk / 2 for f in fetched), (fetched, on_disk)  # ranged reads: about a quarter each

    # the same command at tp 1 x dp 4: the leftover goes, step 4 is resumed from S3, and the
    # steps after it follow the tp 2 x dp 2 run (as test_checkpoint_resume checks from disk)
    again = _launched(run, data_cache, "parallel.tp=1", f"run.storage={storage}")
    out = output(again)
    assert f"removed leftover {ckpts}/step_00000006" in out
    assert f"resumed from {ckpts}/step_00000004 (step 4, saved at tp 2 x dp 2 zero 1)" in out, out[-3000:]
    assert store.latest_pointer() == "step_00000008" and not (run / "checkpoints").exists()
    resumed = losses(run)
    for s in (5, 6):
        assert resumed[s] == pytest.approx(uninterrupted[s], abs=1e-5), (s, resumed[s], uninterrupted[s])
    assert sorted(resumed) == list(range(1, 9))
