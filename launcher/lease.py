"""One owner per run.storage: a lease object that one run holds while it writes there.

    with claim_storage(cfg):     # the process that owns RUN_DIR (global rank 0, or the Ray driver)
        ...                      # train: checkpoints, final/, tb/ go to run.storage

RUN_DIR's lock (rundir.py) covers a local folder only; two runs with different run.dir and the
same run.storage would otherwise overwrite each other's checkpoints, final/ and tb/. So the owner
of a run also takes `{run.storage}/.loomtrain-lease.json` (LEASE):

* taken by a conditional create: on S3 a PUT with `If-None-Match: *` (412 when the object exists),
  on a local path or file:// an O_CREAT|O_EXCL open; it holds the run's identity (run id, run.dir,
  host, pid, when it started, when it was last renewed, the lease length);
* renewed every `run.storage_lease_s / 4` by a background thread (a conditional replace: S3
  `If-Match: ETAG`, on disk a compare under a lock of the folder), released (deleted) at exit;
* held by a run that is not this one and renewed less than `run.storage_lease_s` ago: the start
  is refused in one line naming the holder (host, run.dir, since when) and the two ways on;
* not renewed for `run.storage_lease_s` (its host or process died): taken over, said in one line;
* `run.storage_take_over=true`: taken over whatever its age (the user knows that run is dead).

"The same run" is the same run.dir (absolute path) on the same run.storage. A crashed earlier
attempt of it on this host is taken over at once: this process already holds RUN_DIR's lock, so
no other live process on this host is that run. One on another host (a Kubernetes retry in a
fresh pod, a resubmitted Ray job) cannot be checked from here: the start waits until that lease
expires (at most `run.storage_lease_s`, said in one line) and takes it over then, unless it was
renewed meanwhile (then that run is alive and the start is refused). Ray Train's restarts of the
worker group never meet the lease: the driver holds it for the whole run.

Expiry is judged by this host's clock against the holder's renewal time: hosts sharing a
storage prefix need clocks within a few seconds (NTP), far below the lease length.

A prefix that holds something that is not a loomtrain run (an HF export, other files) is refused
by the same rule as a non-empty run.dir (rundir.check_marker), and the marker is written there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from loomtrain.durable import atomic_write, create_durable
from loomtrain.launcher.rundir import LEASE, RunDirError, check_marker, run_dir, write_marker
from loomtrain.storage import filesystem, first_line, is_local, join, store_failure

if TYPE_CHECKING:
    from loomtrain.launcher.config import RunConfig


class StorageInUse(RunDirError):
    """run.storage is held by another run, or is no loomtrain run's (one line, naming the holder)."""


def describe(holder: dict) -> str:
    since = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if since else "an unknown time"
    return (
        f"host {holder.get('host', '?')}, run.dir {holder.get('run_dir', '?')}, pid {holder.get('pid', '?')}, "
        f"since {when}"
    )


class StorageLease:
    """The lease object of one run.storage (a URI, or a local path)."""

    def __init__(self, storage: str, run_dir: str, lease_s: float, take_over: bool = False, log=None):
        self.storage = str(storage).rstrip("/")
        self.uri = join(self.storage, LEASE)
        self.fs, self.path = filesystem(self.uri)
        self.local = is_local(self.fs)
        self.lease_s = float(lease_s)
        self.take_over = take_over
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        now = time.time()
        self.record = {
            "format": 1,
            "run_id": uuid.uuid4().hex,
            "run_dir": os.path.abspath(run_dir),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": now,
            "renewed": now,
            "lease_s": self.lease_s,
        }
        self.held = False
        self._stop = threading.Event()

    # The store: a conditional create, a read with its version, a conditional replace ---------
    def _body(self) -> bytes:
        return (json.dumps(self.record, sort_keys=True) + "\n").encode()

    def _create(self) -> bool:
        """Create the lease object only where there is none (True: it is ours now)."""
        if self.local:
            self.fs.makedirs(self.fs._parent(self.path), exist_ok=True)
            return create_durable(self.path, self._body())
        try:
            self.fs.pipe_file(self.path, self._body(), mode="create")  # S3: If-None-Match: *
        except FileExistsError:
            return False
        return True

    def read(self) -> tuple[dict | None, str | None]:
        """(holder, version) of the lease object, (None, None) when there is none. A garbled one
        reads as an unknown holder renewed when it was written, so that it is never taken for free."""
        self.fs.invalidate_cache()
        try:
            if self.local:
                data = Path(self.path).read_bytes()
                version = data.decode(errors="replace")
            else:
                version = self.fs.info(self.path).get("ETag")  # before the bytes: a newer body fails If-Match
                data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None
        try:
            holder = json.loads(data)
        except ValueError:
            holder = None
        if not isinstance(holder, dict) or not holder:  # half-written or garbled: aged by its write time
            holder = {"renewed": self._written_at()}
        return holder, version

    def _written_at(self) -> float:
        try:
            info = self.fs.info(self.path)
        except FileNotFoundError:
            return 0.0
        when = info.get("LastModified") or info.get("mtime") or time.time()
        return when.timestamp() if hasattr(when, "timestamp") else float(when)

    def _replace(self, version: str | None) -> bool:
        """Write our record over the lease object only if it is still at `version`."""
        if self.local:
            folder = os.open(self.fs._parent(self.path), os.O_RDONLY)
            try:
                fcntl.flock(folder, fcntl.LOCK_EX)  # one compare-and-replace at a time on this folder
                if self.read()[1] != version:  # (None when there is none)
                    return False
                atomic_write(self.path, self._body())
                return True
            finally:
                os.close(folder)
        try:
            self.fs.pipe_file(self.path, self._body(), IfMatch=version)  # S3: If-Match: ETAG
        except FileNotFoundError:
            return False
        except OSError as exc:  # 412 Precondition Failed: changed meanwhile (s3fs keeps S3's error as the cause)
            if getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code") not in ("PreconditionFailed", "412"):
                raise
            return False
        return True

    # Taking, renewing, releasing -----------------------------------------------------------
    def acquire(self) -> None:
        waited = False
        for _ in range(8):
            self.record["renewed"] = time.time()  # stamped as it is written (a slow start must not age it)
            if self._create():
                return self._held()
            holder, version = self.read()
            if holder is None:
                continue  # released meanwhile
            why = self._may_take(holder, waited)
            if why == "wait":
                waited = True
                time.sleep(max(0.0, self._expires(holder) - time.time()) + 0.5)
                continue
            if why and self._replace(version):
                self.log(
                    f"loomtrain: took over the lease of run.storage={self.storage} from {describe(holder)} ({why})"
                )
                return self._held()
        raise StorageInUse(
            f"run.storage={self.storage}: could not take its lease {self.uri} (other starts race for it)"
        )

    def _expires(self, holder: dict) -> float:
        lease_s = holder.get("lease_s")
        lease_s = float(lease_s) if isinstance(lease_s, (int, float)) else self.lease_s
        renewed = holder.get("renewed")
        return (float(renewed) if isinstance(renewed, (int, float)) else 0.0) + lease_s

    def _may_take(self, holder: dict, waited: bool) -> str:
        """Why the lease `holder` holds may be taken over ("" when it may not; "wait": the same
        run's lease from another host, which expires soon)."""
        left = self._expires(holder) - time.time()
        if self.take_over:
            return "run.storage_take_over=true"
        if left <= 0:
            return f"not renewed for {self.lease_s - left:.0f} s: that run is gone"
        same_run = holder.get("run_dir") == self.record["run_dir"]
        if same_run and holder.get("host") == self.record["host"]:
            # this process holds RUN_DIR's lock: no other live process here runs this run
            return "an earlier attempt of this run on this host, which is gone"
        if same_run and not waited:
            self.log(
                f"loomtrain: run.storage={self.storage} is leased by an earlier attempt of this run.dir on "
                f"host {holder.get('host', '?')}; waiting {left:.0f} s for that lease to expire"
            )
            return "wait"
        raise StorageInUse(
            f"run.storage={self.storage} is in use by another loomtrain run ({describe(holder)}; lease "
            f"{self.uri}, renewed {max(0.0, time.time() - float(holder.get('renewed') or 0)):.0f} s ago); "
            "wait for it to finish or pick another run.storage; if that run is dead, its lease expires in "
            f"{left:.0f} s, or take it over now with run.storage_take_over=true"
        )

    def _held(self) -> None:
        self.held = True
        threading.Thread(target=self._renew_loop, name="loomtrain-storage-lease", daemon=True).start()

    def _renew_loop(self) -> None:
        failing = False
        while not self._stop.wait(self.lease_s / 4):
            try:
                holder, version = self.read()
                if not holder or holder.get("run_id") != self.record["run_id"]:
                    self.log(
                        f"loomtrain: warning: the lease of run.storage={self.storage} is no longer this run's "
                        f"({describe(holder) if holder else 'deleted'}): another run may be writing there"
                    )
                    return
                self.record["renewed"] = time.time()
                self._replace(version)
                failing = False
            except Exception as exc:  # noqa: BLE001  (the store is down: said once, retried next time)
                if not failing:
                    self.log(f"loomtrain: warning: cannot renew the lease {self.uri} ({first_line(exc)}); retrying")
                failing = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._stop.set()
        with contextlib.suppress(Exception):  # a store that is down: the lease expires by itself
            holder, _ = self.read()
            if holder and holder.get("run_id") == self.record["run_id"]:
                self.fs.rm_file(self.path)


@contextlib.contextmanager
def claim_storage(cfg: RunConfig) -> Iterator[StorageLease | None]:
    """run.storage's lease for the run (nothing to do without run.storage): refuse a prefix that
    is no loomtrain run, take the lease, write the marker; release the lease on the way out.
    The store's own errors (unreachable, no bucket, no credentials) are one line too."""
    storage = cfg.run.storage
    if not storage:
        yield None
        return
    lease = StorageLease(storage, str(run_dir(cfg)), cfg.run.storage_lease_s, cfg.run.storage_take_over)
    try:
        check_marker(storage, "run.storage")
        lease.acquire()
        check_marker(storage, "run.storage")  # a prefix filled between the check and the lease
        write_marker(storage)
    except Exception as exc:
        lease.release()
        if isinstance(exc, StorageInUse):
            raise
        if isinstance(exc, RunDirError):  # no loomtrain run's prefix (check_marker): said as run.storage's
            raise StorageInUse(str(exc)) from None
        why = store_failure(exc) or first_line(exc)  # the store's own errors
        raise StorageInUse(f"run.storage={storage}: cannot take its lease {lease.uri} ({why})") from None
    try:
        yield lease
    finally:
        lease.release()
