"""A run directory that fills up or turns read-only mid-run ends the run with one line naming
the file, the cause and the checkpoint that stays `latest` (exit status 1), and nothing on the
way out (TensorBoard's writer thread, the rank log, the run lock, the metrics) prints a traceback.

The disks are real: a small tmpfs mounted as the run's parent (the tests run as root), filled
by the test once the run has saved a checkpoint; and `chmod -R a-w RUN_DIR` under a run started
without root's permission override (setpriv drops CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

import launch
import pytest
from launch import TINY, Run, loomtrain_cmd
from loomtrain.launcher.checkpoints.store import verify

# The tiny config shrunk (launch.SMALL), TensorBoard on (its writer thread is one of the things
# that must stay quiet), a checkpoint every 2 steps, and a schedule long enough that the run is
# still going when its disk fails.
ARGS = [
    *launch.SMALL,
    "eval.every_steps=0",
    "eval.num_samples=0",
    "log.progress=plain",
    "log.tensorboard=true",
    "data.prefetch=0",
    "train.max_steps=1000",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=100",
]
# Without root's permission override, a chmod binds this process as it binds any user.
AS_A_USER = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
SAVED = "checkpoint: step 2 -> "  # the console line of the checkpoint that must stay `latest`


@pytest.fixture
def small_disk(tmpfs):
    """A 16M tmpfs (room for a few of the run's 2.2 MB checkpoints)."""
    return tmpfs("16M")


def fill(disk: Path) -> None:
    """Write a filler file on `disk` until it is full."""
    chunk = b"\0" * (1 << 16)
    with open(disk / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
    assert shutil.disk_usage(disk).free < len(chunk)


def after(lines: list[str], marker: str) -> list[str]:
    """The lines after the first one holding `marker`, progress lines left out."""
    start = next(i for i, line in enumerate(lines) if marker in line)
    return [line.rstrip("\n") for line in lines[start + 1 :] if line.strip() and not line.startswith("step ")]


def assert_one_line_and_latest(text: str, tail: list[str], run_dir: Path, cause: str, step: int = 2) -> None:
    """The run's end is one line naming a file of the run, the cause and the checkpoint that stays
    `latest`; no traceback anywhere; `latest` still names a complete checkpoint."""
    assert "Traceback" not in text and "Exception in thread" not in text, text[-4000:]
    assert len(tail) == 1, "\n".join(tail)
    line, name = tail[0], f"step_{step:08d}"
    kept = run_dir / "checkpoints" / name
    assert line.startswith(f"loomtrain: write error: {run_dir}/") or line.startswith(
        "loomtrain: write error: checkpoint: cannot save step "
    ), line
    assert cause in line and str(kept) in line and f"resume from {name}" in line, line
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == name
    assert verify(kept, checksums=True).ok


@pytest.mark.slow
def test_full_disk_mid_run_and_the_rerun_end_in_one_line(tmp_path, small_disk, data_cache):
    """The disk fills between checkpoints: the metrics, the rank log, TensorBoard and the heartbeats
    fail first (the run ends at the first of them the training thread meets); then the same command
    again on the still full disk (it fails taking the run lock)."""
    run_dir = small_disk / "run"
    argv = loomtrain_cmd(
        "train", TINY, *ARGS, "checkpoint.every_steps=20", f"run.dir={run_dir}", f"data.cache_dir={data_cache}"
    )
    with Run(argv, tmp_path / "cwd", run_dir=run_dir) as run:
        run.wait_for("checkpoint: step 20 -> ", timeout=300)
        fill(small_disk)
        rc = run.finish(timeout=120)
    assert rc == 1, run.text[-4000:]
    tail = after(run.lines, "checkpoint: step 20 -> ")
    assert_one_line_and_latest(run.text, tail, run_dir, "No space left on device", step=20)

    with Run(argv, tmp_path / "cwd", run_dir=run_dir) as rerun:
        rc = rerun.finish(timeout=120)
    assert rc == 1, rerun.text[-4000:]
    tail = [line for line in rerun.text.splitlines() if "error" in line.lower()]
    assert_one_line_and_latest(rerun.text, tail, run_dir, "No space left on device", step=20)


@pytest.mark.slow
def test_read_only_run_dir_mid_run_ends_in_one_line(tmp_path, data_cache):
    """`chmod -R a-w RUN_DIR` while the run goes on: TensorBoard's thread (it reopens its event
    file to append), the next checkpoint and the lock's removal are refused; one line, and the
    lock left behind names a process that is gone, which the next start takes over."""
    run_dir = tmp_path / "run"
    argv = [*AS_A_USER, *loomtrain_cmd("train", TINY, *ARGS, f"run.dir={run_dir}", f"data.cache_dir={data_cache}")]
    with Run(argv, tmp_path / "cwd", run_dir=run_dir) as run:
        run.wait_for(SAVED, timeout=300)
        subprocess.run(["chmod", "-R", "a-w", str(run_dir)], check=True)
        try:
            rc = run.finish(timeout=120)
        finally:
            subprocess.run(["chmod", "-R", "u+w", str(run_dir)], check=True)
    assert rc == 1, run.text[-4000:]
    assert_one_line_and_latest(run.text, after(run.lines, SAVED), run_dir, "Permission denied")


def test_tensorboard_on_a_full_disk_is_quiet_and_named(small_disk, capfd):
    """TensorBoard's writer thread fails on the full disk without a traceback; the training thread
    gets the error at its next call, naming the event file; closing does not raise it again while
    that error is on its way out."""
    from loomtrain.launcher.observe.metrics import MetricsLogger

    log = MetricsLogger(small_disk / "run", max_steps=10, progress="plain")
    log.log(1, {"loss": 1.0})
    log.flush()
    fill(small_disk)
    with pytest.raises(OSError) as failed:
        for step in range(2, 200):  # the thread's first failed write reaches us within a few calls
            log.log(step, {"loss": 1.0})
            log.text("samples/0", "x" * 4096, step)
            log.flush()
    assert failed.value.errno == errno.ENOSPC
    assert os.fsdecode(failed.value.filename).startswith(str(small_disk / "run"))
    try:
        raise failed.value
    except OSError:
        log.close()  # the run is already ending on this error: close does not raise another
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
