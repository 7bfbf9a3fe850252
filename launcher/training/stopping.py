"""Stop requests: a signal (or `loomtrain stop`) saves a checkpoint at the next step and exits.

    SIGTERM   preemption, `kill`, torchrun / Ray / Kubernetes shutting the job down -> exit 0
    SIGINT    Ctrl-C                                                                 -> exit 130
    SIGHUP    the terminal went away                                                 -> exit 129

A handler only records the signal. At the end of a vote step (a log step, and every
train.stop_check_every_steps steps: the vote is a collective and a read back, which the
steps between skip) the ranks agree on it (`StopRequest.agree`: one tiny all-reduce, so
ranks that got the signal at different steps still stop at the same one); the checkpoint
hook then saves, the loop ends, and
rank 0 prints `stopped at step N (checkpoint saved)`. SIGTERM exits 0 because a
scheduler that preempts a job asked for exactly that; Ctrl-C and SIGHUP exit
128 + signal number, so a script can tell an interrupted run from a finished one (0)
and from a failure (1, 2, 3). A second Ctrl-C exits at once (130), without saving.

`loomtrain stop` on Ray and SIGTERM/SIGINT to the Ray driver reach the workers through
a file, RUN_DIR/STOP (its text: the signal's name), that rank 0 looks for at most
once a second; the run removes it when it starts and when it stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from loomtrain.durable import atomic_write

STOP_FILE = "STOP"
SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
POLL_S = 1.0


def exit_code(signum: int) -> int:
    """0 for SIGTERM (a requested shutdown), 128 + signum for an interrupt."""
    return 0 if signum in (0, signal.SIGTERM) else 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _handle_signals(handler) -> dict[int, object]:
    """`handler` for each of SIGNALS this platform has -> the handlers it replaced."""
    signums = [getattr(signal, name) for name in SIGNALS if hasattr(signal, name)]
    return {signum: signal.signal(signum, handler) for signum in signums}


def request_stop(run_dir: str | os.PathLike, signum: int = signal.SIGTERM) -> Path:
    """Ask a running job (every rank, wherever it runs) to save and stop, through its run dir."""
    return atomic_write(Path(run_dir) / STOP_FILE, signal_name(signum) + "\n")


class StoppedDuringStartUp(BaseException):
    """A stop signal that came before the loop's StopRequest was in place (config, run lock,
    imports, process group): there is nothing to save yet. A BaseException, as KeyboardInterrupt
    is, so that library code's `except Exception` lets it through and every `finally` on the
    way out runs (the run lock is released)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum

    def line(self) -> str:
        return (
            f"loomtrain: {signal_name(self.signum)}: stopped during start-up, before the first step: "
            f"nothing saved; run the same command to start again"
        )


@contextlib.contextmanager
def stop_during_start_up() -> Iterator[None]:
    """Until a StopRequest takes over: SIGTERM, Ctrl-C and SIGHUP raise StoppedDuringStartUp
    in the main thread (Python's default for SIGTERM and SIGHUP ends the process on the spot,
    leaving its run lock behind; Ctrl-C's is a KeyboardInterrupt traceback). Once only: a
    second signal does not interrupt the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def on_signal(signum, frame) -> None:
        if not raised:
            raised.append(signum)
            raise StoppedDuringStartUp(signum)

    old = _handle_signals(on_signal)
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


class StopRequest:
    def __init__(self, run_dir: str | os.PathLike | None = None, watch_file: bool = False, on_signal=None) -> None:
        self.signum = 0
        self.on_signal = on_signal  # called with the first signal (the Ray driver passes it on)
        self.stop_file = Path(run_dir) / STOP_FILE if run_dir is not None else None
        self.watch_file = watch_file and self.stop_file is not None
        self._next_poll = 0.0
        self._old: dict[int, object] = {}

    # --- handlers (main thread only: Python delivers signals there) --------------------
    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._old = _handle_signals(self._on_signal)
        return self

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, old in self._old.items():
            signal.signal(signum, old)
        self._old.clear()

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            sys.stderr.write("\nloomtrain: second Ctrl-C: exiting now, without a checkpoint\n")
            sys.stderr.flush()
            os._exit(exit_code(signal.SIGINT))
        if not self.signum:
            self.signum = signum
            if self.on_signal is not None:
                self.on_signal(signum)
            if signum == signal.SIGINT:
                sys.stderr.write(
                    "\nloomtrain: Ctrl-C: saving a checkpoint at the end of this step (Ctrl-C again to exit at once)\n"
                )
                sys.stderr.flush()

    # --- the stop file ---------------------------------------------------------------------
    def clear_file(self) -> None:
        if self.stop_file is not None:
            self.stop_file.unlink(missing_ok=True)

    def _from_file(self) -> int:
        now = time.monotonic()
        if not self.watch_file or now < self._next_poll:
            return 0
        self._next_poll = now + POLL_S
        try:
            name = self.stop_file.read_text().strip()
        except OSError:
            return 0
        return int(getattr(signal, name, signal.SIGTERM))

    # --- at a step boundary ---------------------------------------------------------------
    def pending(self) -> int:
        if not self.signum:
            self.signum = self._from_file()
        return self.signum

    def agree(self, device) -> int:
        """The signal every rank stops for (0: none); all ranks call it at the same (vote) step."""
        import torch  # loaded by then; not at import: the CLI's start-up signals need no torch
        import torch.distributed as dist

        signum = self.pending()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([signum], dtype=torch.int32, device=device)  # NCCL: on the GPU
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            signum = int(t.item())
        # A signal that arrived during the all-reduce (its handler runs when the collective
        # returns) stays pending for the next step: only an agreed stop overwrites it.
        if signum:
            self.signum = signum
        return signum
