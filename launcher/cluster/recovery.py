"""What a failure cost a Ray run: the hosts lost, the steps redone, the time to the first step after it.

Ray Train restarts the worker group by itself after a worker or a whole node dies; the new
attempt's rank 0 works out what happened from two records in the run directory:

* RUN_DIR/ray_attempts.jsonl (ray_train.py): one line per attempt, which now also holds the
  address of the node each rank ran on (`hosts`, all-gathered at the attempt's start) and the
  driver's start time (`run_started_at`: attempts of one `loomtrain train --ray` share it);
* RUN_DIR/logs/ray_progress.json: rank 0's last completed step and its time, rewritten after
  every step (not fsynced: it is a liveness record, as the watchdog's heartbeats are).

With `run.storage` a URI, RUN_DIR is private to each host and the new attempt's rank 0 may run
on another host than the last one's (the lost one, or a replacement), so both records also
live in the store, at the same relative paths ({run.storage}/ray_attempts.jsonl, .../logs/
ray_progress.json): rank 0 takes the store's copies into its RUN_DIR before reading them
(`restore`), puts the attempts file back whole after adding its line (`publish`), and hands
each step's progress to a thread that puts the newest one (a step never waits on the store;
on a failure the record may be a step behind). The driver reads the store's attempts file.

When the previous attempt belongs to the same driver, it failed (a clean end ends the driver's
run). Then: the hosts lost are those of the previous attempt's ranks that no rank of this
attempt runs on (a replacement host has another address; a host that comes back with its old
address counts as a worker that died); the steps redone are the previous attempt's last step
minus this attempt's start step; and the recovery time runs from the last completed step
before the failure (the failure itself is not observed: it came at most one step later) to
the end of this attempt's first step. Rank 0 prints one line at the restart (which host was
lost, from which step it resumes) and one after that first step (how long recovery took),
and writes `fault/recovery_s` and `fault/steps_lost` once, at that step, into metrics.jsonl and
TensorBoard (a record of its own: the step's training record is already written). An elastic
group that grew (more ranks, no host lost) was restarted by Ray on purpose: the same figures
go to `elastic/resize_s` and `elastic/steps_lost`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from loomtrain.durable import atomic_write
from loomtrain.launcher.distributed import all_gather_objects
from loomtrain.launcher.hooks import TrainContext
from loomtrain.storage import StorageError, join, read_object, write_object

PROGRESS_FILE = "ray_progress.json"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _json_bytes(data: bytes | None) -> dict | None:
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


def _ranks_by_host(hosts: list[str], lost: list[str]) -> str:
    return "; ".join(f"host {h} (ranks {', '.join(str(r) for r, x in enumerate(hosts) if x == h)})" for h in lost)


class _NewestPut:
    """Puts the newest bytes handed to it into one object, from a thread of its own: bytes
    handed over while a put is in flight replace each other, and a failed put is dropped (the
    next step's record follows)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._next: bytes | None = None
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="loomtrain-progress-put", daemon=True).start()

    def put(self, data: bytes) -> None:
        with self._ready:
            self._next = data
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while self._next is None:
                    self._ready.wait()
                data, self._next = self._next, None
            with contextlib.suppress(StorageError):
                write_object(self.uri, data)


class Recovery:
    """Rank 0's account of a restart, called from RayReportHook (see the module docstring)."""

    def __init__(self, run_dir: str, node_ip: str, run_started_at: float, storage: str = "") -> None:
        self.progress_path = Path(run_dir) / "logs" / PROGRESS_FILE
        self.storage = storage  # run.storage: the records' shared copies live there when set
        self.node_ip = node_ip
        self.run_started_at = run_started_at
        self.attempt = 0
        self.pending: dict[str, Any] | None = None  # a failure whose recovery is not yet measured
        self._progress_put: _NewestPut | None = None

    def restore(self, attempts: Path) -> None:
        """Rank 0, before reading the records: with run.storage, the store's attempts file
        replaces RUN_DIR's (this host's may be missing or an older attempt's), and the newer
        of the two progress records is kept."""
        if not self.storage:
            return
        shared = read_object(join(self.storage, attempts.name))
        if shared is not None:
            atomic_write(attempts, shared.decode(), fsync=False)
        theirs = _json_bytes(read_object(join(self.storage, "logs", PROGRESS_FILE)))
        mine = _read_json(self.progress_path)
        if theirs is not None and (mine is None or theirs.get("time", 0) > mine.get("time", 0)):
            atomic_write(self.progress_path, json.dumps(theirs), fsync=False)

    def publish(self, attempts: Path) -> None:
        """Rank 0, after adding this attempt's line: the store's copy, whole (no append there)."""
        if self.storage:
            write_object(join(self.storage, attempts.name), attempts.read_bytes())

    def attempt_fields(self, ctx: TrainContext, attempt: int, previous: dict | None) -> dict[str, Any]:
        """Every rank (one all-gather): the fields this attempt adds to its ray_attempts.jsonl line
        (rank 0's are the ones written); on rank 0 after a failure, the restart line."""
        hosts = all_gather_objects(self.node_ip)
        self.attempt = attempt
        fields: dict[str, Any] = {"hosts": hosts, "run_started_at": self.run_started_at}
        if ctx.dist.rank != 0 or not previous or previous.get("run_started_at") != self.run_started_at:
            return fields
        progress = _read_json(self.progress_path)
        if progress and progress.get("attempt") == previous.get("attempt"):
            failed_after, since = int(progress["step"]), float(progress["time"])
        else:  # the previous attempt died before its first step
            failed_after, since = int(previous.get("start_step", 0)), float(previous.get("time", time.time()))
        resumed = ctx.state.step
        lost = sorted(set(previous.get("hosts", [])) - set(hosts))
        # An elastic group that grew (a node joined) was restarted by Ray on purpose: not a fault.
        grew = not lost and len(hosts) > len(previous.get("hosts", []))
        self.pending = {
            "since": since,
            "steps_lost": max(0, failed_after - resumed),
            "prefix": "elastic/resize" if grew else "fault/recovery",
        }
        fields.update(failed_after_step=failed_after, resumed_from_step=resumed, lost_hosts=lost)
        if grew:
            what = f"the elastic group grew from {len(previous['hosts'])} to {len(hosts)} workers"
        else:
            what = f"lost {_ranks_by_host(previous['hosts'], lost)}" if lost else "a worker process died"
        print(
            f"loomtrain: restart (attempt {attempt}): {what} after step {failed_after}; "
            f"resuming from step {resumed} ({failed_after - resumed} steps to redo)",
            flush=True,
        )
        return fields

    def on_step_end(self, ctx: TrainContext) -> None:
        """Rank 0, after every step: the progress record; after the first step since a failure,
        the recovery figures."""
        if ctx.dist.rank != 0:
            return
        now = time.time()
        step = ctx.state.step
        record = json.dumps({"attempt": self.attempt, "step": step, "time": now})
        atomic_write(self.progress_path, record, fsync=False)
        if self.storage:
            if self._progress_put is None:
                self._progress_put = _NewestPut(join(self.storage, "logs", PROGRESS_FILE))
            self._progress_put.put(record.encode())
        if self.pending is None:
            return
        recovery_s, steps_lost, prefix = now - self.pending["since"], self.pending["steps_lost"], self.pending["prefix"]
        self.pending = None
        if ctx.metrics is not None:  # fault/recovery_s, fault/steps_lost (elastic/resize_s, ... for a grow)
            ctx.metrics.log(step, {f"{prefix}_s": recovery_s, f"{prefix.split('/')[0]}/steps_lost": steps_lost})
        print(
            f"loomtrain: {'resized' if prefix.startswith('elastic') else 'recovered'}: step {step} done "
            f"{recovery_s:.1f} s after the last step before the restart; {steps_lost} steps redone",
            flush=True,
        )


def restart_note(attempts: Path | str, run_started_at: float, alive: list[str]) -> str:
    """For the driver's error when a restart could not be placed: ' again after attempt N (host H
    lost, not replaced)', or '' when this driver's run never started an attempt. `attempts`:
    RUN_DIR's file, or with run.storage its copy there (a URI)."""
    try:
        text = (read_object(attempts) or b"").decode()
        mine = [json.loads(line) for line in text.splitlines()]
    except (OSError, ValueError):  # StorageError included: the note is an aside to the error
        return ""
    mine = [rec for rec in mine if rec.get("run_started_at") == run_started_at]
    if not mine:
        return ""
    last = mine[-1]
    gone = sorted(set(last.get("hosts", [])) - set(alive))
    lost = f" ({', '.join(f'host {h}' for h in gone)} lost, not replaced)" if gone else ""
    return f" again after attempt {last['attempt']}{lost}"
