"""What only the folder backend of the checkpoint store does (tests/integration/test_checkpoint_store_backends.py
runs the protocol itself on a folder and in an object store alike): a checkpoint is published by
a rename, so a step folder without its manifest is damaged (named, skipped), not a write in
progress; the newest renamed folder is found though the pointer was not yet updated."""

from loomtrain.launcher.checkpoints.store import LATEST, MANIFEST, CheckpointStore


def save(store, step, payload=b"x" * 100, ranks=2):
    tmp = store.begin(step)
    for r in range(ranks):
        rel = f"shard_{r}.bin"
        store.add_part(tmp, r, {rel: store.write_file(tmp, rel, payload + bytes([r]))})
    return store.publish(tmp, step, {"world": {"tp": 1, "dp": ranks}})


def test_a_step_folder_without_its_manifest_is_named_and_skipped(tmp_path):
    logs = []
    store = CheckpointStore(tmp_path, keep_last=0, log=logs.append)
    good = save(store, 10)
    nomanifest = save(store, 40)
    (nomanifest / MANIFEST).unlink()  # as if written by hand or another tool
    assert store.find_resumable() == good
    assert len(logs) == 1 and "step_00000040" in logs[0] and "no manifest.json" in logs[0]


def test_an_interrupted_write_is_a_tmp_folder(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    tmp = store.begin(20)
    assert tmp.name == ".tmp-step_00000020" and [p.name for p in store.clean_temp()] == [".tmp-step_00000020"]


def test_published_but_pointer_not_updated_is_still_found(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    save(store, 10)
    newer = save(store, 20)
    (store.root / LATEST).write_text("step_00000010\n")  # crash between rename and pointer
    assert store.find_resumable() == newer


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
