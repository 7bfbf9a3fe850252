"""A readable console for `train --ray`: loomtrain's lines on the console, Ray's in RUN_DIR/logs/.

Left to Ray, the driver's console carries every line every Ray process writes, each behind
`(RayTrainWorker pid=..., ip=...)`: Ray Train's own INFO lines ("Reporting training result
...", "Started training worker group ..."), its placement-group cleaner's "Failed to query Ray
Train Controller actor state" (10x at the end of a run), torch's C++ warnings and DeepSpeed's
start-up warnings from every worker. What goes where instead:

* a worker (`route_worker_output`, run on each worker by the backend before Ray makes the
  process group): its file descriptors 1 and 2 go to RUN_DIR/logs/ray_worker_NNNNN.log, so that
  C++ output and the loggers Ray configured (bound to the original streams) land there;
  Python's `sys.stdout` / `sys.stderr` write to the console Ray streams to the driver, each
  line behind `[ADDRESS rank N] ` on ranks other than 0. What loomtrain prints is Python-level,
  so it is what stays on the console (and in the rank logs, which tee sys.stdout).
* the driver (`DriverConsole`): Ray's line printer is replaced by one that prints the
  workers' lines as they are (no Ray prefix: the workers prefix their own) and appends every
  other process's lines (controller, cleaner, raylet) to RUN_DIR/logs/ray_driver.log with
  Ray's prefix; the driver's own `ray` loggers write there too (only errors reach the console).

The printer is Ray's private `global_worker_stdstream_dispatcher` and `print_to_stdstream` (in
ray._private.worker: the only place Ray hands a driver the lines of its processes with who
wrote them, and the GCS's messages such as "node ... marked dead"); if a Ray release drops
them, the console falls back to Ray's own output and says so in the log.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from pathlib import Path

WORKER_LOG = "ray_worker_{rank:05d}.log"
DRIVER_LOG = "ray_driver.log"
WORKER_ACTOR = "RayTrainWorker"  # Ray Train V2's worker actor class, as the driver sees it


class _LinePrefix(io.TextIOBase):
    """A text stream that writes each line behind `prefix` (none when it is empty)."""

    def __init__(self, stream, prefix: str) -> None:
        self._stream, self._prefix, self._at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        if self._prefix and text:
            out = []
            for piece in text.splitlines(keepends=True):
                out.append((self._prefix if self._at_line_start else "") + piece)
                self._at_line_start = piece.endswith("\n")
            self._stream.write("".join(out))
        else:
            self._stream.write(text)
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


def route_worker_output(run_dir: str, rank: int) -> None:
    """On a Ray Train worker, once: file descriptors to the worker's log, Python's streams to the
    console (see the module docstring)."""
    import ray

    if getattr(sys.stdout, "_loomtrain_routed", False):
        return
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    console_out, console_err = os.dup(1), os.dup(2)  # Ray's files, streamed to the driver
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
    out = _LinePrefix(open(console_out, "w", buffering=1, closefd=True), prefix)
    err = _LinePrefix(open(console_err, "w", buffering=1, closefd=True), prefix)
    out._loomtrain_routed = err._loomtrain_routed = True
    sys.stdout, sys.stderr = out, err


class DriverConsole:
    """While a run is driven: Ray's lines to RUN_DIR/logs/ray_driver.log, the workers' to the console.

    Enter before `ray.init` (its own log lines go to the file), call `take_over_lines()` after it
    (ray.init installs the printer being replaced). Leaving restores the loggers; the printer
    stays while Ray is connected: Ray's processes still send lines after the run has ended (a
    failed controller's traceback arrives after the driver's one-line error), and they go on
    to the log file."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.logs = Path(run_dir) / "logs"
        self._previous: list = []
        self._dispatcher = None

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
        return self

    def take_over_lines(self) -> None:
        import ray._private.worker as ray_worker

        dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
        has_all = all(hasattr(ray_worker, name) for name in ("print_to_stdstream", "filter_autoscaler_events"))
        if not isinstance(getattr(dispatcher, "handlers", None), list) or not has_all:
            self.log.write("loomtrain: this Ray lacks the line printer loomtrain replaces: Ray prints its lines\n")
            return
        self._dispatcher = dispatcher
        self._previous = [h for name, h in dispatcher.handlers if name == "ray_print_logs"]
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", self._print_lines)
        # The GCS's error messages to the driver ("node ... has been marked dead") bypass the
        # dispatcher: Ray's error listener calls this module function by name.
        self._ray_worker, self._print_to_stdstream = ray_worker, ray_worker.print_to_stdstream
        ray_worker.print_to_stdstream = lambda data, ignore_prefix=False: self._print_lines(data)

    def __exit__(self, *exc) -> None:
        import ray

        if self._dispatcher is not None and not ray.is_initialized():
            self._dispatcher.remove_handler("ray_print_logs")
            for handler in self._previous:
                self._dispatcher.add_handler("ray_print_logs", handler)
            self._ray_worker.print_to_stdstream = self._print_to_stdstream
        logging.getLogger("ray").removeHandler(self._file_handler)
        for handler, level in self._quieted:
            handler.setLevel(level)
        self.log.close()

    def _print_lines(self, data: dict) -> None:
        """Ray's batch of lines from one process: a worker's to the console, any other's to the log."""
        lines = data.get("lines", [])
        if data.get("actor_name") == WORKER_ACTOR:
            sink = sys.stderr if data.get("is_err") else sys.stdout
            for line in lines:
                print(line, file=sink)
            sink.flush()
            return
        pid = data.get("pid")
        if pid == "autoscaler":  # as Ray's printer does: its events, not its periodic status dumps
            lines = list(self._ray_worker.filter_autoscaler_events(lines))
        who = data.get("actor_name") or data.get("task_name")
        prefix = f"({who + ' ' if who else ''}pid={pid}, ip={data.get('ip')}) "
        text = "".join(prefix + line + "\n" for line in lines)
        if self.log.closed:  # a line that came after the run ended
            with open(self.logs / DRIVER_LOG, "a") as late:
                late.write(text)
            return
        self.log.write(text)
