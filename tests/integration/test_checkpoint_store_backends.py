"""The checkpoint protocol is one code path on a local folder and in an object store.

Each test runs the same calls on both backends (a run directory; run.storage in the local S3
server of tests/s3_server.py) and asserts the same outcome: what a reader sees, what is
skipped and why, what retention keeps, what a fresh start moves aside. The behaviours that once
differed between the two copies of the store (resume=never moved final/ on disk only; a step
re-saved; a leftover of an interrupted write) are here once, for both.
"""

import json

import pytest
from loomtrain.launcher.checkpoints.shards import CorruptCheckpoint
from loomtrain.launcher.checkpoints.state import load_checkpoint, verified_bytes
from loomtrain.launcher.checkpoints.store import LATEST, MANIFEST, CheckpointStore, verify, wait_for_deletions


@pytest.fixture
def run_location(backend_root) -> str:
    return f"{backend_root}/run"


def name_of(location) -> str:
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def save(store, step, payload=b"x" * 100, ranks=2):
    tmp = store.begin(step)
    for r in range(ranks):
        rel = f"shard_{r}.bin"
        store.add_part(tmp, r, {rel: store.write_file(tmp, rel, payload + bytes([r]))})
    store.write_raw(tmp, "extra.json", b"{}")  # written without a part: rank 0 describes it
    return store.publish(tmp, step, {"world": {"tp": 1, "dp": ranks}})


def overwrite(store, checkpoint, rel, data: bytes) -> None:
    """Damage a published checkpoint's file, as a disk or another writer could."""
    store.objects.child(name_of(checkpoint)).write(rel, data)


def test_publish_writes_every_file_a_manifest_and_the_pointer(run_location):
    logs = []
    store = CheckpointStore(run_location, keep_last=0, log=logs.append)
    path = save(store, 100)
    assert name_of(path) == "step_00000100" and store.latest_pointer() == "step_00000100"
    manifest = json.loads(store.objects.read(f"step_00000100/{MANIFEST}"))
    assert manifest["step"] == 100 and manifest["world"] == {"tp": 1, "dp": 2}
    assert set(manifest["files"]) == {"shard_0.bin", "shard_1.bin", "extra.json"}
    assert manifest["files"]["shard_0.bin"]["size"] == 101
    assert sorted(store.objects.entries()) == [LATEST, "step_00000100"]  # no part lists, no leftovers
    assert verify(path).ok and store.find_resumable() == path and logs == []


def test_damaged_checkpoints_are_skipped_newest_first_each_named_in_one_line(run_location):
    logs = []
    store = CheckpointStore(run_location, keep_last=0, log=logs.append)
    good = save(store, 10)
    truncated = save(store, 20)
    overwrite(store, truncated, "shard_1.bin", b"x" * 50)
    flipped = save(store, 30)
    overwrite(store, flipped, "shard_0.bin", b"x" * 100 + b"\x01")  # same size, other bytes
    gone = save(store, 40)
    store.objects.child(name_of(gone)).delete("shard_0.bin")
    assert store.find_resumable() == good
    assert [name_of(p) for p in (gone, flipped, truncated)] == ["step_00000040", "step_00000030", "step_00000020"]
    assert "step_00000040" in logs[0] and "missing" in logs[0] and "shard_0.bin" in logs[0]
    assert "step_00000030" in logs[1] and "fails its sha256 checksum" in logs[1]
    assert "step_00000020" in logs[2] and "shard_1.bin has 50 bytes" in logs[2] and "truncated" in logs[2]
    assert len(logs) == 3 and all("\n" not in line for line in logs)


def test_an_interrupted_write_is_invisible_and_removed_at_the_next_start(run_location):
    logs = []
    store = CheckpointStore(run_location, keep_last=0, log=logs.append)
    good = save(store, 10)
    tmp = store.begin(20)  # a writer that died before publishing
    store.write_raw(tmp, "shard_0.bin", b"half")
    assert [s for s, _ in store.published()] == [10]
    assert store.find_resumable() == good and store.latest_pointer() == "step_00000010"
    assert store.clean_temp() == [tmp]
    assert "removed leftover" in logs[-1] and sorted(store.objects.entries()) == [LATEST, "step_00000010"]


def test_retention_keeps_the_newest_and_every_kth(run_location):
    store = CheckpointStore(run_location, keep_last=2, keep_every=50)
    for step in range(10, 130, 10):
        save(store, step)
    wait_for_deletions()
    assert [s for s, _ in store.published()] == [50, 100, 110, 120]
    assert store.latest_pointer() == "step_00000120"
    assert sorted(store.objects.entries()) == [
        LATEST,
        "step_00000050",
        "step_00000100",
        "step_00000110",
        "step_00000120",
    ]


def test_a_step_saved_again_replaces_the_earlier_one(run_location):
    store = CheckpointStore(run_location, keep_last=0)
    save(store, 10, payload=b"a")
    path = save(store, 10, payload=b"bb")
    assert verify(path).ok and store.objects.read("step_00000010/shard_0.bin") == b"bb\x00"
    assert [s for s, _ in store.published()] == [10]


def test_resume_modes_name_the_same_checkpoints(run_location):
    store = CheckpointStore(run_location, keep_last=0)
    assert store.resolve_resume("auto") is None
    path = save(store, 10)
    assert store.resolve_resume("auto") == path and store.resolve_resume("never") is None
    assert store.resolve_resume(str(path)) == path
    assert store.resolve_resume(run_location) == path  # the run itself
    other = CheckpointStore(run_location + "-other", keep_last=0)
    assert other.resolve_resume(run_location) == path  # another run: its newest complete checkpoint
    overwrite(store, path, "shard_0.bin", b"")
    with pytest.raises(ValueError, match="checkpoint.resume.*shard_0.bin"):
        other.resolve_resume(str(path))


def test_a_fresh_start_moves_every_checkpoint_aside_and_deletes_nothing(run_location):
    logs = []
    store = CheckpointStore(run_location, keep_last=0, log=logs.append)
    save(store, 10)
    save(store, 20)
    dest = store.set_aside()
    assert store.published() == [] and store.find_resumable() is None and store.latest_pointer() is None
    aside = store.objects.child(name_of(dest))
    assert sorted(aside.entries()) == [LATEST, "step_00000010", "step_00000020"]
    assert verify(aside.name("step_00000020")).ok and "moved 2" in logs[-1]
    save(store, 5)
    assert [s for s, _ in store.published()] == [5]


def test_a_file_gone_after_the_checks_is_a_damaged_checkpoint_on_both_backends(run_location):
    """A file the manifest names, or the manifest itself, gone between the verification and the
    load (another writer, a disk): CorruptCheckpoint naming it, which every rank hears of and which
    the hook answers with the next older checkpoint; on disk it once was a plain FileNotFoundError
    on that rank alone."""
    store = CheckpointStore(run_location, keep_last=0)
    path = save(store, 10)
    manifest = json.loads(store.objects.read(f"step_00000010/{MANIFEST}"))
    assert verified_bytes(path, "extra.json", manifest) == b"{}"
    store.objects.child("step_00000010").delete("extra.json")
    with pytest.raises(CorruptCheckpoint, match=r"step_00000010/extra.json: missing \(named by the manifest\)"):
        verified_bytes(path, "extra.json", manifest)
    store.objects.child("step_00000010").delete(MANIFEST)
    with pytest.raises(CorruptCheckpoint, match=r"step_00000010/manifest.json: missing"):
        load_checkpoint(path, training=None)  # refused before the engine is touched
