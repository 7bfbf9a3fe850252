"""Test driver: an error in the middle of a step ends a run cleanly (tests/integration/test_run_monitoring.py).

    python tests/error_mid_step_driver.py OUT CONFIG [key=value ...]

Runs CONFIG in this process, as `loomtrain train` does, with the test-only `raise` fault striking
rank 0 in the middle of step 3, and writes OUT (JSON): the error, which of the run's own threads
ran during the steps and which live on, whether the signal handlers and stdout/stderr are back,
and the run's files still open while the error (its traceback, every frame's locals) is held, as
a caller reporting it holds it. A fresh process, as a user's run is: torch's profiler (kineto,
with_stack) spun for 20+ minutes starting a trace in a pytest worker that other tests had used
before (the cause of CI's 900 s timeouts on 2026-12-06), and this run has a profile running.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import fault_plugin
import psutil
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.hooks import Hooks
from loomtrain.launcher.training.loop import run_training

OURS = ("TokenStream-prefetch", "loomtrain-watchdog")


def main(out: str, config: str, *overrides: str) -> None:
    cfg = load_config(config, list(overrides))
    during: set[str] = set()

    class Threads(Hooks):
        def on_step_end(self, ctx, metrics):
            during.update(t.name for t in threading.enumerate() if t.name.startswith(OURS))

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    stdout, stderr = sys.stdout, sys.stderr
    failed = None
    with fault_plugin.planned("raise:0:3"):
        try:
            run_training(cfg, hooks=[Threads()])
        except fault_plugin.FaultInjected as exc:
            failed = exc  # held: what is closed below was closed by the run, not by the collector
    report = {
        "error": str(failed),
        "traceback_held": failed is not None and failed.__traceback__ is not None,
        "during": sorted(during),
        "left": [t.name for t in threading.enumerate() if t.name.startswith(OURS)],
        "handlers_back": {s: signal.getsignal(s) for s in handlers} == handlers,
        "streams_back": sys.stdout is stdout and sys.stderr is stderr,
        "still_open": [f.path for f in psutil.Process().open_files() if f.path.startswith(cfg.run.dir)],
    }
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
