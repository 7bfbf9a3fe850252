"""The atomic checkpoint directory protocol, without torch or DeepSpeed."""

import json

import pytest
from loomtrain.launcher.checkpoints.store import (
    LATEST,
    MANIFEST,
    CheckpointStore,
    verify,
)


def save(store, step, payload=b"x" * 100, ranks=2):
    tmp = store.begin(step)
    for r in range(ranks):
        rel = f"shard_{r}.bin"
        (tmp / rel).write_bytes(payload + bytes([r]))
        store.add_part(tmp, r, [rel])
    (tmp / "extra.json").write_text("{}")  # written without a part: rank 0 describes it
    return store.publish(tmp, step, {"world": {"tp": 1, "dp": ranks}})


def test_publish_layout_manifest_and_latest(tmp_path):
    logs = []
    store = CheckpointStore(tmp_path, keep_last=0, log=logs.append)
    path = save(store, 100)
    assert path.name == "step_00000100"
    assert (store.root / LATEST).read_text().strip() == "step_00000100"
    m = json.loads((path / MANIFEST).read_text())
    assert m["step"] == 100 and m["world"] == {"tp": 1, "dp": 2}
    assert set(m["files"]) == {"shard_0.bin", "shard_1.bin", "extra.json"}
    assert m["files"]["shard_0.bin"]["size"] == 101
    assert not any(p.name.startswith(".") for p in store.root.iterdir())
    assert verify(path).ok
    assert store.find_resumable() == path
    assert logs == []


def test_partial_and_corrupt_checkpoints_are_skipped_with_a_message(tmp_path):
    logs = []
    store = CheckpointStore(tmp_path, keep_last=0, log=logs.append)
    good = save(store, 10)
    truncated = save(store, 20)
    # a truncated shard
    with open(truncated / "shard_1.bin", "r+b") as f:
        f.truncate(50)
    # a same-size bit flip in a newer one
    flipped = save(store, 30)
    data = bytearray((flipped / "shard_0.bin").read_bytes())
    data[3] ^= 1
    (flipped / "shard_0.bin").write_bytes(bytes(data))
    # a directory published without its manifest (as if written by hand/other tool)
    nomanifest = save(store, 40)
    (nomanifest / MANIFEST).unlink()
    assert store.find_resumable() == good
    assert len(logs) == 3
    assert "step_00000040" in logs[0] and "manifest" in logs[0]
    assert "step_00000030" in logs[1] and "checksum" in logs[1]
    assert "step_00000020" in logs[2] and "shard_1.bin" in logs[2] and "truncated" in logs[2]
    assert all("\n" not in line for line in logs)


def test_interrupted_write_is_invisible_and_cleaned(tmp_path):
    logs = []
    store = CheckpointStore(tmp_path, keep_last=0, log=logs.append)
    good = save(store, 10)
    tmp = store.begin(20)  # a writer that died before publishing
    (tmp / "shard_0.bin").write_bytes(b"half")
    assert store.find_resumable() == good
    assert store.latest_pointer() == "step_00000010"
    removed = store.clean_temp()
    assert [p.name for p in removed] == [".tmp-step_00000020"]
    assert not tmp.exists() and good.exists()


def test_published_but_pointer_not_updated_is_still_found(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    save(store, 10)
    newer = save(store, 20)
    (store.root / LATEST).write_text("step_00000010\n")  # crash between rename and pointer
    assert store.find_resumable() == newer


def test_retention_keep_last_and_keep_every(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=50)
    for step in range(10, 130, 10):
        save(store, step)
    steps = [s for s, _ in store.published()]
    assert steps == [50, 100, 110, 120]
    assert store.latest_pointer() == "step_00000120"


def test_resave_same_step_replaces(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    save(store, 10, payload=b"a")
    path = save(store, 10, payload=b"bb")
    assert verify(path).ok and (path / "shard_0.bin").read_bytes() == b"bb\x00"


def test_resolve_resume_modes(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    assert store.resolve_resume("auto") is None
    path = save(store, 10)
    assert store.resolve_resume("auto") == path
    assert store.resolve_resume("never") is None
    assert store.resolve_resume(str(path)) == path
    assert store.resolve_resume(str(tmp_path)) == path  # a run directory
    (path / "shard_0.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="checkpoint.resume.*shard_0.bin"):
        store.resolve_resume(str(path))


def test_pause_fault_only_at_named_step(tmp_path):
    import time

    import fault_plugin

    store = CheckpointStore(tmp_path, keep_last=0)
    with fault_plugin.planned("ckpt_pause:20:0.3"):
        t = time.time()
        save(store, 10)
        assert time.time() - t < 0.25
        t = time.time()
        save(store, 20)
        assert time.time() - t >= 0.3
    assert fault_plugin.striking("checkpoint_publish", 20, None) == []  # the plan before the block (none) is back


def test_set_aside_for_a_fresh_start(tmp_path):
    logs = []
    store = CheckpointStore(tmp_path, keep_last=0, log=logs.append)
    save(store, 10)
    save(store, 20)
    dest = store.set_aside()
    assert store.published() == [] and store.find_resumable() is None and store.latest_pointer() is None
    assert sorted(p.name for p in dest.iterdir()) == ["latest", "step_00000010", "step_00000020"]
    assert "moved 2" in logs[-1]
    save(store, 5)
    assert [s for s, _ in store.published()] == [5]
