"""The one atomic, fsynced write (loomtrain.durable) and the writers that go through it."""

import os
from pathlib import Path

import pytest
import torch
from loomtrain.data_pipeline import ByteTokenizer
from loomtrain.data_pipeline.preprocess import preprocess_files
from loomtrain.durable import AtomicFile, atomic_write, atomic_write_json, replace_dir
from loomtrain.launcher.checkpoints.final import MODEL_CONFIG, write_final
from loomtrain.launcher.checkpoints.store import LATEST, CheckpointStore
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.config_loader import save_config
from loomtrain.model import ModelConfig


@pytest.fixture
def disk_log(monkeypatch):
    """Every fsync (by the path of its file descriptor) and rename, in order."""
    log: list[tuple[str, Path]] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        log.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst, **kw):
        log.append(("rename", Path(dst)))
        real_replace(src, dst, **kw)

    def rename(src, dst, **kw):
        log.append(("rename", Path(dst)))
        real_rename(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    return log


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(".tmp-"))


def test_atomic_write_fsyncs_file_then_renames_then_fsyncs_directory(tmp_path, disk_log):
    target = tmp_path / "a.json"
    atomic_write_json(target, {"x": 1})
    (op1, tmp_file), (op2, renamed), (op3, synced_dir) = disk_log
    assert (op1, op2, op3) == ("fsync", "rename", "fsync")
    assert tmp_file.parent == tmp_path.resolve() and tmp_file.name.startswith(".tmp-a.json.")
    assert renamed == target and synced_dir == tmp_path.resolve()
    assert target.read_text() == '{\n "x": 1\n}\n' and leftovers(tmp_path) == []


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    atomic_write(target, "old\n")
    with pytest.raises(RuntimeError), AtomicFile(target) as f:  # dies mid-write
        f.write(b"half of the new")
        raise RuntimeError("killed")
    assert target.read_text() == "old\n" and leftovers(tmp_path) == []

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        atomic_write(target, "new\n")
    assert target.read_text() == "old\n" and leftovers(tmp_path) == []


def test_replace_dir_swaps_a_whole_directory(tmp_path):
    final, tmp = tmp_path / "out", tmp_path / "out.tmp"
    for d, text in ((final, "old"), (tmp, "new")):
        d.mkdir()
        (d / "f").write_text(text)
        (d / text).write_text(text)  # a file only that version has
    replace_dir(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["f", "new"] and (final / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replace_dir_removes_what_a_crash_between_its_renames_left(tmp_path):
    """A crash after the old `final` was renamed aside and before the new one took its name leaves
    `.tmp-NAME.old` and no `final`: the next replace_dir publishes the new one and removes it."""
    final, tmp = tmp_path / "out", tmp_path / "out.tmp"
    (tmp_path / ".tmp-out.old").mkdir()
    (tmp_path / ".tmp-out.old" / "f").write_text("old")
    tmp.mkdir()
    (tmp / "f").write_text("new")
    replace_dir(tmp, final)
    assert (final / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _fsynced_then_renamed(log, target: Path) -> bool:
    """The file's bytes were fsynced before it got its name, and its directory after."""
    target = target.resolve()
    renamed = [i for i, (op, p) in enumerate(log) if op == "rename" and p.resolve() == target]
    if not renamed:
        return False
    i = renamed[-1]
    before = [p for op, p in log[:i] if op == "fsync" and p.parent == target.parent]
    after = [p for op, p in log[i:] if op == "fsync" and p == target.parent]
    return bool(before) and bool(after)


def test_every_writer_goes_through_the_durable_write(tmp_path, disk_log):
    """Shards, tokenizer, config, checkpoint store and final weights all fsync, rename, fsync the directory."""
    texts = [tmp_path / f"corpus{i}.txt" for i in range(10)]  # a .txt file is one document
    for text in texts:
        text.write_text("hello durable world\n" * 5)
    out = tmp_path / "shards"
    preprocess_files(texts, out, "byte", val_fraction=0.1, workers=1, progress=False, log=lambda *a: None)
    for name in ("index.json", "tokenizer.json", "train_00000.bin", "train.docs.bin"):  # in the work folder
        assert _fsynced_then_renamed(disk_log, tmp_path / "shards.partial" / name), name
    assert _fsynced_then_renamed(disk_log, out)  # which is then published whole

    disk_log.clear()
    ByteTokenizer().save(tmp_path / "tok")
    assert _fsynced_then_renamed(disk_log, tmp_path / "tok" / "tokenizer.json")

    disk_log.clear()
    save_config(RunConfig(), tmp_path / "run" / "config.yaml")
    assert _fsynced_then_renamed(disk_log, tmp_path / "run" / "config.yaml")

    disk_log.clear()
    store = CheckpointStore(tmp_path / "run", log=lambda msg: None)
    part = store.begin(5)
    (part / "w.bin").write_bytes(b"w")  # listed by no rank's part: publish describes it (fsync, sha256)
    store.publish(part, 5, {})
    assert _fsynced_then_renamed(disk_log, store.root / "step_00000005")
    assert _fsynced_then_renamed(disk_log, store.root / LATEST)
    assert any(op == "fsync" and p.name == "w.bin" for op, p in disk_log)  # its files too

    disk_log.clear()
    cfg = ModelConfig(vocab_size=257, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    final = write_final({"tok_emb.weight": torch.zeros(257, 16)}, cfg, ByteTokenizer(), tmp_path / "run" / "final")
    assert _fsynced_then_renamed(disk_log, final)
    assert any(op == "fsync" and p.name == MODEL_CONFIG for op, p in disk_log)
