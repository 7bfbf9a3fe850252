"""TensorBoard and metrics.jsonl of a run whose durable outputs live in object storage.

With `run.storage` a URI, RUN_DIR is a folder private to each host (on Kubernetes an emptyDir
that dies with its pod), so TensorBoard cannot read it from elsewhere. The logging rank mirrors
the files TensorBoard and people read to `{run.storage}/tb/`, and TensorBoard follows the run
there with its own `s3://` reader (`tensorboard --logdir s3://BUCKET/runs --load_fast=false`:
its gfile reads through boto3, which takes the endpoint from AWS_ENDPOINT_URL like s3fs).

    mirror = Mirror(run_dir, tb_uri(cfg.run.storage))
    mirror.start()      # a thread: every INTERVAL_S, the mirrored files that changed go up
    mirror.sync_metrics()   # metrics.jsonl now (the loop, at each checkpoint step)
    ...
    mirror.stop()       # the thread ends, then one last pass (after the writers are closed)

An object store has no append: a file that grew goes up whole again (event files of scalars and
text grow by kilobytes per logged step, so a pass moves little). Each upload is a prefix of the
file that ends on a whole record (an event file's last complete TFRecord, metrics.jsonl's last
full line), so a reader never meets a torn record, and a reader that read the previous copy
continues from its offset: the new copy starts with the same bytes. Nothing in the store is ever
deleted: the event files of earlier attempts (another pod, before a restart) stay beside this
attempt's, and TensorBoard joins them (the writer's purge_step hides the steps redone).

`restore_metrics` puts the store's metrics.jsonl into a RUN_DIR that lacks one before a resumed
run trims and extends it, so that the mirrored file keeps the steps of earlier attempts.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from pathlib import Path

from loomtrain.durable import atomic_write
from loomtrain.storage import StorageError, join, read_object, write_object

INTERVAL_S = 30.0  # between two passes: TensorBoard follows the run this much later than the files
TB_PREFIX = "tb"  # under run.storage
METRICS = "metrics.jsonl"
EVENT_FILES = "events.out.tfevents.*"


def tb_uri(storage: str) -> str:
    """Where the mirror of a run with run.storage=`storage` lives."""
    return join(storage, TB_PREFIX)


def mirrored_files(run_dir: Path) -> list[Path]:
    """What TensorBoard and people read: the event files TensorBoard writes in RUN_DIR itself
    (see MetricsLogger), and metrics.jsonl."""
    return [p for p in [*sorted(run_dir.glob(EVENT_FILES)), run_dir / METRICS] if p.is_file()]


def whole_records_end(data: bytes, name: str) -> int:
    """The length of the longest prefix of `data` made of whole records: TFRecords (8-byte
    length, 4-byte CRC, payload, 4-byte CRC) in an event file, lines in anything else."""
    if not name.startswith("events.out.tfevents."):
        return data.rfind(b"\n") + 1
    end = 0
    while end + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, end)
        if end + 12 + length + 4 > len(data):
            break
        end += 12 + length + 4
    return end


class Mirror:
    """Copies RUN_DIR's mirrored files to `uri`/NAME on a background thread, each time one of
    them changed. A failed upload is retried at the next pass and said once in one line naming
    the object (the run goes on: its checkpoints do not depend on this copy)."""

    def __init__(self, run_dir: str | os.PathLike, uri: str, interval_s: float = INTERVAL_S) -> None:
        self.run_dir = Path(run_dir)
        self.uri = uri
        self.interval_s = interval_s
        self._sent: dict[str, tuple[int, int]] = {}  # name -> (inode, bytes) of the copy in the store
        self._seen: dict[str, tuple[int, int, int]] = {}  # name -> (inode, size, mtime) read last
        self._said: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one pass at a time: the thread's and stop()'s last one

    def start(self) -> Mirror:
        self._thread = threading.Thread(target=self._run, name="loomtrain-tb-mirror", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sync()

    def sync(self) -> list[str]:
        """One pass: upload each mirrored file whose whole records differ from the copy in the
        store. Returns the names uploaded."""
        with self._lock:
            return [path.name for path in mirrored_files(self.run_dir) if self._upload_if_changed(path)]

    def sync_metrics(self) -> bool:
        """Upload metrics.jsonl now, on the caller's thread (one small object): the loop calls it
        at each checkpoint step, so the store holds every step a resume on another host keeps
        (a host lost between two passes would take the steps since the last pass with it)."""
        with self._lock:  # (no metrics.jsonl yet: its stat fails, nothing goes up)
            return self._upload_if_changed(self.run_dir / METRICS)

    def _upload_if_changed(self, path: Path) -> bool:
        try:
            st = path.stat()
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._seen.get(path.name) == seen:
                return False
            data = path.read_bytes()
        except OSError:  # rotated or moved aside meanwhile: the next pass sees what is there
            return False
        end = whole_records_end(data, path.name)
        if end == 0 or self._sent.get(path.name) == (st.st_ino, end):
            self._seen[path.name] = seen  # a torn tail changes the file again when it completes
            return False
        target = join(self.uri, path.name)
        try:
            write_object(target, data[:end])
        except StorageError as exc:
            line = f"loomtrain: TensorBoard mirror: {exc} (retried at the next pass)"
            if line not in self._said:
                self._said.add(line)
                print(line, file=sys.stderr, flush=True)
            return False
        self._sent[path.name] = (st.st_ino, end)
        self._seen[path.name] = seen
        return True

    def stop(self) -> None:
        """End the thread, then one last pass (call it after the writers flushed and closed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sync()


def restore_metrics(run_dir: str | os.PathLike, uri: str) -> bool:
    """Put `uri`/metrics.jsonl into RUN_DIR when RUN_DIR has none (a resume on a fresh host):
    the resumed run keeps its records up to the resumed step, as on a shared disk. True when
    a copy was put there; a store that cannot be read is said in one line, and the run goes on
    without the earlier records."""
    local = Path(run_dir) / METRICS
    if local.exists():
        return False
    try:
        data = read_object(join(uri, METRICS))
    except StorageError as exc:
        line = f"loomtrain: TensorBoard mirror: {exc}; metrics.jsonl starts without the earlier records"
        print(line, file=sys.stderr, flush=True)
        return False
    if not data:
        return False
    local.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(local, data[: whole_records_end(data, METRICS)])
    return True
