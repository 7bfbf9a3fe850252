"""Per-rank logs: RUN_DIR/logs/rank_NNNNN.log, one per global rank, kept across restarts.

Every rank (torchrun, Ray Train worker, lone process) copies what its Python code
writes to stdout and stderr into its own file, opened for appending; each start adds
a header line (time, host, pid, attempt), so one file holds a rank's whole history.
The console sees exactly what it saw before (rank 0's progress; other ranks' warnings),
and on Kubernetes the files live on the run's PVC, so they outlive the pods.
The hang watchdog (loomtrain.launcher.observe.watchdog) dumps stacks into the same file.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from pathlib import Path

from loomtrain.durable import naming

HEADER = "=== loomtrain attempt"


def logs_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "logs"


def rank_log_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return logs_dir(run_dir) / f"rank_{rank:05d}.log"


class _Tee(io.TextIOBase):
    """Writes to the original stream and to the rank log; the stream's own attributes
    (isatty, fileno, encoding) stay those of the console, so tqdm and friends behave.
    A log that cannot be written (a full or read-only disk) is left alone from then on: a
    print never fails for it (the run ends, with one line, at the next write it needs)."""

    def __init__(self, stream, owner: RankLog) -> None:
        self._stream, self._owner = stream, owner

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        self._owner.append(text)
        return n if n is not None else len(text)

    def flush(self) -> None:
        self._stream.flush()
        self._owner.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")

    def __getattr__(self, name):
        return getattr(self._stream, name)


class RankLog:
    """The open rank log; `install` tees stdout/stderr into it, `close` undoes that."""

    def __init__(
        self, run_dir: str | os.PathLike, rank: int, world_size: int, launcher: str, host: str, interface: str
    ) -> None:
        """`host`: where this rank runs (DistEnv.host: hostname/address);
        `interface`: the socket interface its process group uses (DistEnv.interface; "" if none set)."""
        self.path = rank_log_path(run_dir, rank)
        self.host, self.pid, self.rank = host, os.getpid(), rank
        self.error: OSError | None = None  # the first failed write; the log is left alone after it
        with naming(self.path):  # the start fails here, naming the log, on a full or read-only disk
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.attempt = _count_headers(self.path) + 1
            self.file = open(self.path, "a", buffering=1, encoding="utf-8", errors="replace")
            self.file.write(
                f"{HEADER} {self.attempt}: {time.strftime('%Y-%m-%d %H:%M:%S %z')} host {self.host} "
                f"pid {self.pid} rank {rank} of {world_size} ({launcher}{'; ' + interface if interface else ''}) ===\n"
            )
        self._saved = None

    def install(self) -> RankLog:
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)
        return self

    def append(self, text: str) -> None:
        """`text` into the log as it is, unless the log is closed or failed before."""
        self._on_file(self.file.write, text)

    def flush(self) -> None:
        self._on_file(self.file.flush)

    def _on_file(self, operation, *args) -> None:
        """`operation(*args)` on the open log, unless it is closed or failed before; its first
        failure is kept (naming the log), not raised."""
        if self.error is None and not self.file.closed:
            try:
                operation(*args)
            except OSError as exc:
                exc.filename = exc.filename or str(self.path)
                self.error = exc

    def write(self, text: str) -> None:
        """Into the log only (not the console)."""
        self.append(text if text.endswith("\n") else text + "\n")
        self.flush()

    def close(self) -> None:
        if self._saved is not None:
            for tee in (sys.stdout, sys.stderr):
                if isinstance(tee, _Tee):
                    tee.flush()
            sys.stdout, sys.stderr = self._saved
            self._saved = None
        if not self.file.closed:
            with contextlib.suppress(OSError):  # its last lines could not be written: the console had them
                self.file.close()


def _count_headers(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.startswith(HEADER.encode()))
    except FileNotFoundError:
        return 0
