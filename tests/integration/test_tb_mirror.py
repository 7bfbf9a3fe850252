"""TensorBoard follows a run whose outputs live in object storage.

With run.storage a URI, the logging rank mirrors its event files and metrics.jsonl to
{run.storage}/tb/ (launcher/observe/mirror.py) and TensorBoard reads them there with its own
s3:// reader (boto3, endpoint from AWS_ENDPOINT_URL). Against the local S3 server, in process.
"""

from __future__ import annotations

import json
import time

from launch import poll
from loomtrain.launcher.observe.metrics import MetricsLogger
from loomtrain.launcher.observe.mirror import Mirror, restore_metrics, tb_uri, whole_records_end
from loomtrain.storage import list_objects, read_object, write_object
from torch.utils.tensorboard import SummaryWriter

LATE = "the mirror's thread did not upload in time"


def tensorboard_scalars(uri: str, accumulator=None):
    """What TensorBoard's own loader reads from `uri`: {tag: [(step, value)]}, and the loader
    (Reload it to follow the run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = accumulator or EventAccumulator(uri)
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def test_mirror_uploads_grown_files_whole_and_tensorboard_follows_from_s3(s3_bucket, tmp_path):
    run_dir, uri = tmp_path / "run", tb_uri(f"{s3_bucket}/runs/tiny")
    assert uri == f"{s3_bucket}/runs/tiny/tb"
    writer = SummaryWriter(log_dir=str(run_dir), purge_step=1)
    for step in range(1, 4):
        writer.add_scalar("loss/train", 1.0 / step, step)
    writer.flush()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 4)))
    (run_dir / "config.yaml").write_text("run: {}\n")  # not for TensorBoard: stays local
    (event,) = run_dir.glob("events.out.tfevents.*")

    mirror = Mirror(run_dir, uri, interval_s=0.1).start()
    assert poll(lambda: len(list_objects(uri)) == 2), LATE
    assert sorted(list_objects(uri)) == sorted([event.name, "metrics.jsonl"])
    assert read_object(f"{uri}/{event.name}") == event.read_bytes()
    scalars, acc = tensorboard_scalars(uri)
    assert scalars == {"loss/train": [(1, 1.0), (2, 0.5), (3, 0.333333)]}

    # the files grow: each goes up again, whole; TensorBoard's loader continues where it was
    for step in range(4, 6):
        writer.add_scalar("loss/train", 1.0 / step, step)
    writer.flush()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4}) + "\n" + '{"step": 5')  # a line being written: not sent
    assert poll(lambda: read_object(f"{uri}/{event.name}") == event.read_bytes()), LATE
    assert poll(lambda: read_object(f"{uri}/metrics.jsonl").count(b"\n") == 4), LATE
    assert read_object(f"{uri}/metrics.jsonl").endswith(b'{"step": 4}\n')
    scalars, _ = tensorboard_scalars(uri, acc)
    assert scalars["loss/train"][-2:] == [(4, 0.25), (5, 0.2)]

    # stop: the last pass sends what was written after the thread's last one
    mirror.interval_s = 3600.0
    time.sleep(0.3)  # the thread is now waiting for an hour
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("}\n")
    writer.add_scalar("loss/train", 1.0 / 6, 6)
    writer.close()
    mirror.stop()
    assert read_object(f"{uri}/metrics.jsonl") == (run_dir / "metrics.jsonl").read_bytes()
    assert read_object(f"{uri}/{event.name}") == event.read_bytes()
    scalars, _ = tensorboard_scalars(uri, acc)
    assert [s for s, _ in scalars["loss/train"]] == [1, 2, 3, 4, 5, 6]
    assert mirror.sync() == []  # nothing changed: nothing goes up again


def test_an_event_file_goes_up_only_to_its_last_whole_record(tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_scalar("x", 1.0, 1)
    writer.close()
    (event,) = tmp_path.glob("events.out.tfevents.*")
    data = event.read_bytes()
    assert whole_records_end(data, event.name) == len(data)
    assert whole_records_end(data[:-3], event.name) < len(data) - 3  # a torn last record is left out
    assert whole_records_end(data + data[:10], event.name) == len(data)
    assert whole_records_end(b'{"a": 1}\n{"b"', "metrics.jsonl") == 9


def test_metrics_logger_mirrors_to_run_storage_and_a_resume_on_a_fresh_host_keeps_earlier_records(s3_bucket, tmp_path):
    """The hook (MetricsLogger with storage=run.storage): close() leaves the event file and
    metrics.jsonl in {run.storage}/tb/; an attempt on another host (an empty RUN_DIR) resumed at
    step 2 keeps steps 1-2 from the store, and TensorBoard shows one history of both attempts."""
    storage = f"{s3_bucket}/runs/tiny"
    first = MetricsLogger(tmp_path / "host-a", max_steps=4, progress="plain", storage=storage)
    for step in (1, 2, 3):
        first.log(step, {"loss": 4.0 - step})
    first.close()
    steps = [json.loads(line)["step"] for line in read_object(f"{tb_uri(storage)}/metrics.jsonl").splitlines()]
    assert steps == [1, 2, 3]

    # TensorBoard reads a folder's event files in name order, and a name is events.out.tfevents.
    # {seconds}.{host}.{pid}.{writer count}: in one process within one second, writer 10 would sort
    # before writer 9 (as it once did in CI). Attempts on two hosts are two processes seconds apart.
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.05)
    second = MetricsLogger(tmp_path / "host-b", max_steps=4, progress="plain", start_step=2, storage=storage)
    for step in (3, 4):
        second.log(step, {"loss": 10.0 + step})  # step 3 redone after the resume at step 2
    second.close()
    records = [json.loads(line) for line in read_object(f"{tb_uri(storage)}/metrics.jsonl").splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 3.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    assert len([k for k in list_objects(tb_uri(storage)) if k.startswith("events.out.tfevents.")]) == 2
    scalars, _ = tensorboard_scalars(tb_uri(storage))
    assert scalars["loss/train"] == [(1, 3.0), (2, 2.0), (3, 13.0), (4, 14.0)]  # purge_step hid the first 3


def test_restore_keeps_a_local_file_and_a_store_without_one_is_fine(s3_bucket, tmp_path):
    uri = tb_uri(f"{s3_bucket}/runs/x")
    assert restore_metrics(tmp_path, uri) is False  # nothing in the store
    write_object(f"{uri}/metrics.jsonl", b'{"step": 1}\n{"step": 2')
    assert restore_metrics(tmp_path, uri) is True
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the torn tail stays out
    (tmp_path / "metrics.jsonl").write_text('{"step": 7}\n')
    assert restore_metrics(tmp_path, uri) is False  # this host's own file wins
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 7}\n'


def test_an_unreachable_store_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    mirror = Mirror(tmp_path, "s3://nowhere-bucket/runs/x/tb")
    assert mirror.sync() == [] and mirror.sync() == []
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("loomtrain:")]
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("loomtrain: TensorBoard mirror: s3://nowhere-bucket/runs/x/tb/metrics.jsonl: ")
