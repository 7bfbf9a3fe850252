"""One owner per run.storage (two runs on one prefix overwrote each other): the lease object
`{run.storage}/.loomtrain-lease.json`.

* two `loomtrain train` with different run.dir on the same run.storage (s3:// and a local
  file:// path): the second is refused in one line naming the holder, exit 2, and the first's
  checkpoints, final/ and tb/ are as the first left them (the first runs 2 ranks on S3: only
  rank 0 takes the lease, the other rank is never refused by it);
* a lease not renewed for run.storage_lease_s is taken over (one line); a live one only with
  run.storage_take_over=true; an earlier attempt of the same run.dir on this host at once;
* a prefix holding something that is no loomtrain run (an HF export) is refused as a non-empty
  run.dir is, nothing written;
* the lease itself: a conditional create, renewed in the background, released at exit, and a
  holder that lost it says so.
"""

from __future__ import annotations

import json
import os
import socket
import time

import launch
import pytest
from launch import Run, child_env, loomtrain_cmd, one_line, records
from loomtrain import storage
from loomtrain.launcher.lease import StorageInUse, StorageLease
from loomtrain.launcher.rundir import LEASE, MARKER

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = str(launch.TINY)
SMALL = launch.QUICK
train = launch.train_here


def error_line(out: str) -> str:
    assert "Traceback" not in out, out[-3000:]
    (line,) = [line for line in out.splitlines() if line.startswith("loomtrain: ") and "error" in line]
    return line


def objects(uri: str) -> dict[str, str]:
    """Every object under uri -> its version (ETag, or mtime for a file://)."""
    return {rel: info["version"] for rel, info in storage.list_objects(uri).items()}


def plant_lease(store: str, host: str, run_dir: str, renewed: float, pid: int = 4242) -> None:
    record = {"format": 1, "run_id": "planted", "run_dir": run_dir, "host": host, "pid": pid}
    record |= {"started": renewed - 60, "renewed": renewed, "lease_s": 120.0}
    storage.write_object(storage.join(store, LEASE), json.dumps(record).encode())
    storage.write_object(storage.join(store, MARKER), b'{"format": 1}\n')


@pytest.fixture(params=["s3", "file"])
def store_root(request, tmp_path) -> str:
    """A run.storage root: a fresh S3 bucket (tests/s3_server.py) or a local file:// folder."""
    if request.param == "s3":
        return request.getfixturevalue("s3_bucket")
    return f"file://{tmp_path}/store"


# ------------------------------------------------------------------ two runs, one prefix


@pytest.mark.slow  # two launched runs per backend, ~40 s
def test_a_second_run_on_a_leased_storage_is_refused_in_one_line(tmp_path, data_cache, store_root):
    twin = f"{store_root}/twin"
    first, second = tmp_path / "first", tmp_path / "second"
    gate = tmp_path / "gate"
    nproc = 2 if twin.startswith("s3://") else 1  # only rank 0 leases: rank 1 runs on
    common = [f"run.storage={twin}", f"data.cache_dir={data_cache}", "checkpoint.async_save=false"]
    steps = ["train.max_steps=4", "checkpoint.every_steps=2", f"train.global_batch_size={2 * nproc}"]
    argv = loomtrain_cmd("train", TINY, *SMALL, *common, *steps, f"run.dir={first}", nproc=nproc)
    env = child_env(LOOMTRAIN_TEST_FAULTS=f"gate:0:3:{gate}")  # the first waits after step 3: it holds the lease
    with Run(argv, cwd=tmp_path, env=env) as run:
        run.wait_for(lambda line: "TEST FAULT gate" in line, timeout=300)
        before = objects(twin)
        assert LEASE in before and "checkpoints/step_00000002/manifest.json" in before
        lease = json.loads(storage.read_object(f"{twin}/{LEASE}"))
        assert lease["run_dir"] == str(first) and lease["host"] == socket.gethostname()

        proc = launch.run_loomtrain("train", TINY, *SMALL, *common, f"run.dir={second}", cwd=tmp_path, rc=2)
        line = one_line(proc.stderr)
        assert line.startswith(f"loomtrain: run storage error: run.storage={twin} is in use by another loomtrain run")
        assert f"host {socket.gethostname()}, run.dir {first}, pid {lease['pid']}, since " in line
        assert "run.storage_take_over=true" in line
        after = objects(twin)
        # the second wrote nothing (the mirror of the first may have sent its metrics meanwhile)
        assert {k: v for k, v in after.items() if k != "tb/metrics.jsonl"} == {
            k: v for k, v in before.items() if k != "tb/metrics.jsonl"
        }
        assert not second.exists()
        gate.write_text("")
        assert run.proc.wait(timeout=300) == 0, run.text[-3000:]
    # the first finished as if alone: its final/, its tb/ mirror, its checkpoints, its lease released
    done = objects(twin)
    assert "final/manifest.json" in done and "checkpoints/step_00000004/manifest.json" in done and LEASE not in done
    assert storage.read_object(f"{twin}/tb/metrics.jsonl") == (first / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in records(first) if "loss" in r] == [1, 2, 3, 4]
    assert str(second) not in storage.read_object(f"{twin}/checkpoints/step_00000004/config.yaml").decode()


# ------------------------------------------------------------------ expiry, override, the same run


def test_an_expired_lease_is_taken_over_and_released_at_exit(tmp_path, data_cache, s3_bucket):
    twin = f"{s3_bucket}/twin"
    plant_lease(twin, "gone-host", "/elsewhere/run", renewed=time.time() - 1000)
    out = train(tmp_path / "run", data_cache, f"run.storage={twin}", "train.max_steps=1")
    (line,) = [line for line in out.splitlines() if "took over the lease" in line]
    assert f"run.storage={twin} from host gone-host, run.dir /elsewhere/run" in line
    assert "not renewed for 1" in line
    assert LEASE not in objects(twin)  # released at exit


def test_a_live_lease_needs_the_override(tmp_path, data_cache, s3_bucket):
    twin = f"{s3_bucket}/twin"
    plant_lease(twin, "busy-host", "/elsewhere/run", renewed=time.time())
    before = objects(twin)
    line = error_line(train(tmp_path / "run", data_cache, f"run.storage={twin}", "train.max_steps=1", rc=2))
    assert "is in use by another loomtrain run (host busy-host, run.dir /elsewhere/run, pid 4242, since" in line
    assert "its lease expires in 1" in line and "run.storage_take_over=true" in line
    assert objects(twin) == before and not (tmp_path / "run").exists()
    out = train(tmp_path / "run", data_cache, f"run.storage={twin}", "train.max_steps=1", "run.storage_take_over=true")
    assert "took over the lease" in out and "(run.storage_take_over=true)" in out


def test_an_earlier_attempt_of_the_same_run_on_this_host_is_taken_over_at_once(tmp_path, data_cache):
    twin, run = f"file://{tmp_path}/store", tmp_path / "run"
    plant_lease(twin, socket.gethostname(), str(run), renewed=time.time())  # a crash a moment ago
    out = train(run, data_cache, f"run.storage={twin}", "train.max_steps=1")
    assert "an earlier attempt of this run on this host, which is gone" in out


def test_a_prefix_holding_no_loomtrain_run_is_refused(tmp_path, data_cache, store_root):
    export = f"{store_root}/hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        storage.write_object(f"{export}/{name}", b"{}")
    before = objects(export)
    line = error_line(train(tmp_path / "run", data_cache, f"run.storage={export}", rc=2))
    assert line == (
        f"loomtrain: run storage error: run.storage={export}: not a loomtrain run prefix (it holds 3 entries: "
        f"config.json, model.safetensors, tokenizer.json, and no {MARKER}); pick a new or empty prefix, "
        f"e.g. run.storage={export}/run"
    )
    assert objects(export) == before and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the lease on its own


def test_the_lease_is_exclusive_renewed_and_released(store_root, tmp_path):
    where = f"{store_root}/lease"
    logs: list[str] = []
    one = StorageLease(where, str(tmp_path / "a"), lease_s=6.0, log=logs.append)
    one.acquire()
    first = json.loads(storage.read_object(f"{where}/{LEASE}"))
    other = StorageLease(where, str(tmp_path / "b"), lease_s=6.0, log=logs.append)
    with pytest.raises(StorageInUse, match=f"run.dir {tmp_path / 'a'}"):
        other.acquire()
    renewed = launch.poll(
        lambda: json.loads(storage.read_object(f"{where}/{LEASE}")), lambda r: r["renewed"] > first["renewed"]
    )
    assert renewed["run_id"] == first["run_id"] and renewed["renewed"] > first["renewed"]  # every lease_s / 4
    one.release()
    assert storage.read_object(f"{where}/{LEASE}") is None
    other.acquire()  # free again
    # taken over behind the holder's back (an override elsewhere): the holder says so once
    third = StorageLease(where, str(tmp_path / "c"), lease_s=6.0, take_over=True, log=logs.append)
    third.acquire()
    launch.poll(lambda: logs, lambda seen: any("is no longer this run's" in m for m in seen))  # at its next renewal
    assert any("is no longer this run's" in m and str(tmp_path / "c") in m for m in logs), logs
    other.release()  # not its lease any more: left alone
    assert json.loads(storage.read_object(f"{where}/{LEASE}"))["run_id"] == third.record["run_id"]
    third.release()
    assert not os.path.exists(tmp_path / "lease")  # nothing of a file:// store outside it


def test_the_lease_is_stamped_when_written_not_when_made(store_root, tmp_path):
    """A start slow between making its lease and taking it (a loaded machine: 2.4 s was seen)
    must not write a lease that others find already aged by that long."""
    where = f"{store_root}/lease"
    lease = StorageLease(where, str(tmp_path / "a"), lease_s=6.0, log=lambda _: None)
    time.sleep(1.0)
    before = time.time()
    lease.acquire()
    try:
        assert json.loads(storage.read_object(f"{where}/{LEASE}"))["renewed"] >= before
    finally:
        lease.release()


def test_a_replace_of_a_lease_changed_meanwhile_is_refused(store_root, tmp_path):
    """The conditional replace loses to a write that came first (S3: 412 Precondition Failed)."""
    lease = StorageLease(f"{store_root}/lease", str(tmp_path / "a"), lease_s=60.0)
    assert lease._create()
    _, version = lease.read()
    lease.record["renewed"] += 1
    assert lease._replace(version)
    assert not lease._replace(version)  # the version read before that write


def test_a_lease_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    """A full disk while the lease is written: the error reaches the run, and no half-written lease
    (which would read as another holder for storage_lease_s) stays to refuse the next run."""
    where = str(tmp_path / "store")
    lease = StorageLease(where, str(tmp_path / "a"), lease_s=2.0)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        lease.acquire()
    monkeypatch.undo()
    assert not os.path.exists(f"{where}/{LEASE}")
    again = StorageLease(where, str(tmp_path / "b"), lease_s=2.0)
    again.acquire()
    again.release()
