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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from loomtrain.launcher.checkpoints.state import Snapshot, publish_snapshot, write_snapshot
from loomtrain.launcher.checkpoints.store import CheckpointStore


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
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-step-{snap.step}", daemon=True)

    def start(self) -> BackgroundSave:
        self._thread.start()
        return self

    def _run(self) -> None:
        self.write_start = time.time()
        try:
            write_snapshot(self.snap, self.store, self.tmp)
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
                time.sleep(self.store.poll_s)
            self.path = publish_snapshot(self.store, self.tmp, self.step, self.snap.world)
            self.published_at = time.time()
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
            return
        if self.on_published is not None:
            self.on_published(self)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> BackgroundSave:
        self._thread.join()
        return self

    def record(self) -> dict:
        return {
            "step": self.step,
            "write_start": self.write_start,
            "write_end": self.write_end,
            "published_at": self.published_at,
            "path": None if self.path is None else str(self.path),
            "error": None if self.error is None else str(self.error),
        }
