"""One checkpoint written in the background while training goes on (checkpoint.async_save).

At the step boundary every rank takes a snapshot of its share (host copies: pinned memory
on GPU) and hands it to a writer thread, which writes and hashes the files and then drops
its file list into the temp directory's `.parts/`. Rank 0's thread goes on to wait until
every rank's list is there (or one reports a failure) and publishes: index merged, manifest,
rename, `latest` last. So the ranks agree that the save is complete through the files they
already share, without a collective at a step boundary; a rank only ever waits for a save in
flight when the next one starts, or when the run stops (SIGTERM, checkpoint.stop_at_step, end).

A crash while a save is in flight leaves only its `.tmp-*` directory: the previous
checkpoint stays `latest`.

So that the steps a save overlaps go at their own pace, the writer's threads run
at a lower scheduling priority (BACKGROUND_NICE, per thread: the training thread is not
touched), back to the process's own once a rank waits for the save (then nothing else runs);
and the snapshot's host buffers (StagingBuffers) are allocated and first touched on a thread
of their own after the first step (the checkpoint hook), not in the first save's stall.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from loomtrain.launcher.checkpoints.state import Snapshot, publish_snapshot, staging_specs, write_snapshot
from loomtrain.launcher.checkpoints.store import CheckpointStore

# How much nicer than the training thread the background checkpoint threads run. On a machine
# with a core or two this is what keeps the writer (page-cache copies, hashing) from taking
# the training thread's core; with a spare core the writer runs there at full speed anyway.
BACKGROUND_NICE = 10


class _Niced:
    """The threads of one background task, run BACKGROUND_NICE nicer than the process (threads a
    niced thread starts inherit it); `restore()` sets them back, where the OS allows (raising a
    priority again needs CAP_SYS_NICE or RLIMIT_NICE: without them the threads stay niced)."""

    def __init__(self) -> None:
        self.base = _nice_of(0)  # the creating (training) thread's
        self.tids: set[int] = set()
        self.restored = False
        self._lock = threading.Lock()

    def enter(self) -> None:
        """Nice the calling thread (a background one)."""
        with self._lock:
            tid = threading.get_native_id()
            self.tids.add(tid)
            if not self.restored:
                _set_nice(tid, min(19, self.base + BACKGROUND_NICE))

    def restore(self) -> None:
        with self._lock:
            if not self.restored:
                self.restored = True
                for tid in self.tids:
                    _set_nice(tid, self.base)


def _nice_of(tid: int) -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (OSError, AttributeError):
        return 0


def _set_nice(tid: int, value: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, value)  # Linux: a thread id names that thread alone
    except (OSError, AttributeError):  # no permission to raise it again, a thread gone, no such call
        pass


class StagingBuffers(dict):
    """The async snapshots' host buffers, (name, key) -> tensor (parts.Training.staging), kept
    from one save to the next. `prepare()` allocates them on a niced thread and writes zeros
    into them: a first touch costs a page fault per 4 KiB page (~7 us here, 2.6 s for 1.2 GB),
    paid then, while training goes on, instead of in the first save's stall (the hook calls it
    after the first step: start-up's memory peak stays the model's). A snapshot's
    first `get` waits for that thread (restored to full priority first)."""

    def __init__(self) -> None:
        super().__init__()
        self._filler: threading.Thread | None = None
        self.started = False  # prepare() was called
        self._niced = _Niced()

    def prepare(self, training) -> None:
        """Start filling buffers of the shapes the snapshot will copy into (read here, on the
        calling thread: the engine is not touched from the filler)."""
        self.started = True
        try:
            specs = staging_specs(training)
        except Exception:  # noqa: BLE001  (an engine this cannot read: the snapshot makes its buffers, as before)
            return
        if specs:
            self._filler = threading.Thread(target=self._fill, args=(specs,), name="checkpoint-staging", daemon=True)
            self._filler.start()

    def _fill(self, specs: dict) -> None:
        self._niced.enter()
        for key, (shape, dtype, pin) in specs.items():
            buf = torch.empty(shape, dtype=dtype, pin_memory=pin)
            buf.zero_()  # the first touch (torch releases the GIL while it writes)
            self[key] = buf

    def ready(self) -> None:
        filler, self._filler = self._filler, None
        if filler is not None:
            self._niced.restore()
            filler.join()

    def get(self, key, default=None):
        self.ready()
        return super().get(key, default)


class BackgroundSave:
    def __init__(
        self,
        snap: Snapshot,
        store: CheckpointStore,
        tmp: Path | str,
        on_published: Callable[[BackgroundSave], None] | None = None,
    ):
        # tmp: a temp folder, or (run.storage) the step's prefix in the object store
        self.snap, self.store, self.tmp = snap, store, tmp if isinstance(tmp, str) else Path(tmp)
        self.on_published = on_published
        self.step = snap.step
        self.error: BaseException | None = None
        self.path: Path | str | None = None
        self.write_start = self.write_end = self.published_at = None
        self._niced = _Niced()
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-step-{snap.step}", daemon=True)

    def start(self) -> BackgroundSave:
        self._thread.start()
        return self

    def _run(self) -> None:
        self._niced.enter()
        self.write_start = time.time()
        try:
            write_snapshot(self.snap, self.store, self.tmp, on_thread=self._niced.enter)
        except BaseException as exc:  # noqa: BLE001  (reported by wait(); the others see the marker)
            self.error = exc
            self.store.mark_failed(self.tmp, self.snap.rank, exc)
            return
        finally:
            self.write_end = time.time()
            self.snap.pieces.clear()  # the host copies go as soon as they are written
        if self.snap.rank != 0:
            return
        try:
            while not self.store.parts_done(self.tmp, self.snap.world):
                if self._abandoned.is_set():  # the run is ending on an error: no one else may finish
                    self.error = RuntimeError(f"checkpoint step {self.step}: abandoned as the run ended")
                    return
                time.sleep(self.store.poll_s)
            self.path = publish_snapshot(self.store, self.tmp, self.step, self.snap.world)
            self.published_at = time.time()
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
            return
        if self.on_published is not None:
            self.on_published(self)

    def wait(self) -> BackgroundSave:
        self._niced.restore()  # the rank waits for it: nothing to yield to any more
        self._thread.join()
        return self

    def abandon(self) -> None:
        """The run is ending on an error: let this rank's writing finish (its files are whole, or
        the step stays a `.tmp-*` the next start tidies), rank 0 publishing only if every rank's
        part is already there, and wait for the thread. Never leave it running: a daemon thread
        inside torch when the interpreter finalizes aborts the process (pthread_exit's forced
        unwind through a noexcept frame: "terminate called without an active exception")."""
        self._abandoned.set()
        self.wait()

    def record(self) -> dict:
        return {
            "step": self.step,
            "write_start": self.write_start,
            "write_end": self.write_end,
            "published_at": self.published_at,
            "path": None if self.path is None else str(self.path),
            "error": None if self.error is None else str(self.error),
        }
