"""A readable console for `train --ray`: loomtrain's lines on the console, Ray's in the logs.

Left to Ray, the driver's console carries every line every Ray process writes, each behind
`(RayTrainWorker pid=..., ip=...)`: Ray Train's own INFO lines ("Reporting training result
...", "Started training worker group ..."), its placement-group cleaner's "Failed to query Ray
Train Controller actor state" (10x at the end of a run), torch's C++ warnings and DeepSpeed's
start-up warnings from every worker. So the driver connects with `ray.init(log_to_driver=False)`
(Ray's documented switch: no process's output is streamed to the driver), and loomtrain carries
its own lines itself:

* a worker (`route_worker_output`, run on each worker by the backend before Ray makes the
  process group): its file descriptors 1 and 2 go to RUN_DIR/logs/ray_worker_NNNNN.log, so that
  C++ output and the loggers Ray configured (bound to the original streams) land there;
  Python's `sys.stdout` / `sys.stderr` send each complete line to the driver's `ConsoleSink`
  actor (one actor call per line, in order), behind `[ADDRESS rank N] ` on ranks other than 0.
  What loomtrain prints is Python-level, so it is what reaches the console (and the rank logs,
  which tee sys.stdout).
* the driver (`DriverConsole`): makes the sink, on its own node, named so that the workers of
  this job find it, and prints what it holds as it comes (a thread), and all of it before the
  driver says how the run ended (`flush`). Its own `ray` loggers write to
  RUN_DIR/logs/ray_driver.log (only errors reach the console). The one thing Ray still prints on
  a driver without log_to_driver is the GCS's error messages (a node marked dead), which its
  error-listener thread writes to sys.stdout: lines written by a thread of Ray's (named `ray_...`)
  go to ray_driver.log. Ray's other processes (the Train controller, the placement-group
  cleaner, raylets) keep their lines in Ray's own session logs on each node
  (/tmp/ray/session_latest/logs/).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from pathlib import Path

WORKER_LOG = "ray_worker_{rank:05d}.log"
DRIVER_LOG = "ray_driver.log"
SINK_NAME = "loomtrain_console"  # named in the job's namespace: one per driver
POLL_S = 0.2
FLUSH_TIMEOUT_S = 10.0


class _LinePrefix(io.TextIOBase):
    """A text stream that writes each line behind `prefix` (none when it is empty)."""

    def __init__(self, stream, prefix: str) -> None:
        self._stream, self._prefix, self._at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []  # rejoined as they were when the prefix is empty
        for piece in text.splitlines(keepends=True):
            out.append((self._prefix if self._at_line_start else "") + piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


class ConsoleSink:
    """The driver's mailbox for the workers' console lines (a Ray actor: see `sink_actor`)."""

    def __init__(self) -> None:
        self._lines: list[tuple[bool, str]] = []

    def write(self, is_err: bool, text: str) -> None:
        self._lines.append((is_err, text))

    def drain(self) -> list[tuple[bool, str]]:
        lines, self._lines = self._lines, []
        return lines


class _ToDriver(io.TextIOBase):
    """A worker's text stream whose complete lines go to the driver's sink (a partial line waits
    for its end or a flush). A flush waits until the sink has what was written (a process may
    end right after: a hang's report is printed with flush=True, then the rank exits)."""

    def __init__(self, sink, is_err: bool) -> None:
        self._sink, self._is_err, self._pending, self._lock = sink, is_err, "", threading.Lock()
        self._last = None  # the newest write's reference

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            cut = self._pending.rfind("\n") + 1
            if cut:
                self._last = self._sink.write.remote(self._is_err, self._pending[:cut])
                self._pending = self._pending[cut:]
        return len(text)

    def flush(self) -> None:
        import ray

        with self._lock:
            if self._pending:
                self._last = self._sink.write.remote(self._is_err, self._pending)
                self._pending = ""
            last, self._last = self._last, None
        if last is not None:
            with contextlib.suppress(Exception):  # the driver gone or slow: the rank log has the line regardless
                ray.get(last, timeout=FLUSH_TIMEOUT_S)

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self):  # type: ignore[override]
        return "utf-8"


def route_worker_output(run_dir: str, rank: int) -> None:
    """On a Ray Train worker, once: file descriptors to the worker's log, Python's streams to the
    driver's console (see the module docstring)."""
    import ray

    if getattr(sys.stdout, "_loomtrain_routed", False):
        return
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        sink = ray.get_actor(SINK_NAME)
    except ValueError:  # a driver without a DriverConsole: the console Ray streams, if it does
        console = [open(os.dup(fd), "w", buffering=1, closefd=True) for fd in (1, 2)]
    else:
        console = [_ToDriver(sink, is_err=False), _ToDriver(sink, is_err=True)]
    log_fd = os.open(logs / WORKER_LOG.format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    # Ray's console handlers write to whatever sys.stderr is when a record comes: bind them
    # (and any other stream handler) to the original stream, now the log file.
    for logger in (logging.getLogger(), logging.getLogger("ray"), logging.getLogger("ray.train")):
        for handler in list(logger.handlers):
            if type(handler) is not logging.FileHandler and isinstance(handler, logging.StreamHandler):
                to_file = logging.StreamHandler(sys.__stderr__)
                to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
                logger.removeHandler(handler)
                logger.addHandler(to_file)
    # DeepSpeed binds its logger to the sys.stdout of its import: imported now, its start-up
    # warnings go to the log file with the rest of the libraries' noise.
    import deepspeed  # noqa: F401

    prefix = "" if rank == 0 else f"[{ray.util.get_node_ip_address()} rank {rank}] "
    out, err = (_LinePrefix(stream, prefix) for stream in console)
    out._loomtrain_routed = err._loomtrain_routed = True
    sys.stdout, sys.stderr = out, err


class _ByThread(io.TextIOBase):
    """The driver's sys.stdout / sys.stderr while a run is driven: what a thread of Ray's writes
    (its error listener's GCS messages) to the log file, everything else to the console."""

    def __init__(self, console, log) -> None:
        self._console, self._log = console, log

    def _sink(self):
        return (
            self._log if threading.current_thread().name.startswith("ray_") and not self._log.closed else self._console
        )

    def write(self, text: str) -> int:
        return self._sink().write(text)

    def flush(self) -> None:
        self._console.flush()
        if not self._log.closed:
            self._log.flush()

    @property
    def closed(self) -> bool:  # type: ignore[override]
        return self._console.closed

    def isatty(self) -> bool:  # asked after the run too (colorama's atexit, bound to this stream)
        return not self._console.closed and self._console.isatty()

    def fileno(self) -> int:
        return self._console.fileno()

    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self._console, "encoding", "utf-8")


class DriverConsole:
    """While a run is driven: the workers' lines to the console, Ray's to RUN_DIR/logs/ray_driver.log.

    Enter before `ray.init` (its own log lines go to the file), call `start()` once Ray is
    connected (with log_to_driver=False: `connect_kwargs`), `flush()` when the workers are done.
    Leaving prints what is left and restores the loggers and streams."""

    connect_kwargs = {"log_to_driver": False}

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.logs = Path(run_dir) / "logs"
        self._sink = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._print_lock = threading.Lock()

    def __enter__(self) -> DriverConsole:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.log = open(self.logs / DRIVER_LOG, "a", buffering=1)
        self._file_handler = logging.StreamHandler(self.log)
        self._file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        ray_logger = logging.getLogger("ray")
        self._quieted = [(h, h.level) for h in ray_logger.handlers if not isinstance(h, logging.FileHandler)]
        for handler, _ in self._quieted:
            handler.setLevel(logging.ERROR)
        ray_logger.addHandler(self._file_handler)
        self._streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _ByThread(sys.stdout, self.log), _ByThread(sys.stderr, self.log)
        return self

    def start(self) -> None:
        """Make the sink the workers write to (on this node: the driver's) and print from it."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(num_cpus=0, max_concurrency=1)(ConsoleSink)
        self._sink = actor.options(name=SINK_NAME, get_if_exists=True, scheduling_strategy=here).remote()
        ray.get(self._sink.drain.remote())  # an earlier run's late lines in this job are not this run's
        self._thread = threading.Thread(target=self._follow, name="loomtrain-console", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S) and self.flush():
            pass

    def flush(self) -> bool:
        """Print every line the workers have sent so far; False once the sink cannot be reached
        (Ray shut down, the driver's node lost), which is said in the log, never raised."""
        import ray

        if self._sink is None or not ray.is_initialized():  # never connected, or already disconnected
            return False

        with self._print_lock:
            try:
                lines = ray.get(self._sink.drain.remote(), timeout=30)
            except Exception as exc:
                if not self.log.closed:
                    self.log.write(f"loomtrain: the console could not reach the workers' lines: {exc}\n")
                self._sink = None
                return False
            for is_err, text in lines:
                sink = self._streams[1] if is_err else self._streams[0]
                sink.write(text)
                sink.flush()
        return True

    @contextlib.contextmanager
    def to_log(self):
        """Whatever any thread writes meanwhile goes to ray_driver.log. For `ray.shutdown()`: Ray's
        disconnect prints, from the caller's thread, the GCS messages its deduplicator held back
        (a lost node's "(raylet) Raylet is terminated ...")."""
        routed = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self.log
        try:
            yield
        finally:
            sys.stdout, sys.stderr = routed

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=35)
        self.flush()
        sys.stdout, sys.stderr = self._streams
        logging.getLogger("ray").removeHandler(self._file_handler)
        for handler, level in self._quieted:
            handler.setLevel(level)
        self.log.close()
