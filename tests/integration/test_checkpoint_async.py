"""checkpoint.async_save: a background writer holds the same tensors as a synchronous save,
training steps go on while it writes, and a kill or SIGTERM during the write loses nothing.

The test fault `ckpt_slow:STEP:SECONDS` (tests/fault_plugin.py) makes the writer of STEP sleep first."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from pathlib import Path

import fault_plugin
import launch
import pytest
import torch
from launch import TINY, Run, checkpoint_saved_on_signal, child_env, loomtrain_cmd, output, run_child
from loomtrain.launcher.config_loader import load_config

SMALL = [
    *launch.SMALL,
    *launch.QUIET,
    "train.max_steps=9",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=5",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(run_dir: Path, cache: Path, *extra: str):
    return load_config(TINY, [*SMALL, f"run.dir={run_dir}", f"data.cache_dir={cache}", *extra])


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from loomtrain.launcher.checkpoints.state import open_reader

    r = open_reader(ckpt)
    return {f"{n}/{k}": r.full(n, k) for n in r.names() for k in (None, "exp_avg", "exp_avg_sq")}


def _staging_buffers():
    """The checkpoint hook's StagingBuffers of the run in this process (the hook is the loop's own)."""
    from loomtrain.launcher.checkpoints.background import StagingBuffers

    gc.collect()  # an earlier run's hook (never prepared) is gone, or at least told apart below
    found = [o for o in gc.get_objects() if type(o) is StagingBuffers and (o or o._filler is not None)]
    assert len(found) == 1, found
    return found[0]


def test_async_checkpoints_equal_sync_ones_and_steps_overlap_the_writer(tmp_path, data_cache):
    from loomtrain.launcher.checkpoints.background import BACKGROUND_NICE
    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training.loop import run_training

    class StepTimes(Hooks):
        def __init__(self):
            self.ends = {}
            self.buffers: dict = {}
            self.staging = None
            self.nice: dict = {}

        def on_step_end(self, ctx, metrics):
            self.ends[ctx.state.step] = time.time()
            if ctx.state.step == 2:  # before the first save (step 3): its buffers are made (and touched)
                self.staging = _staging_buffers()
                self.staging.ready()
                self.buffers = dict(self.staging)
            if ctx.state.step == 4:  # the step-3 writer sleeps (ckpt_slow): its threads' priorities
                threads = [t for t in threading.enumerate() if t.name.startswith("checkpoint-")]
                self.nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threads}
                self.nice["training"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    sync = run_training(_cfg(tmp_path / "sync", data_cache, "checkpoint.async_save=false"))
    times = StepTimes()
    seen = {}

    class Saves(Hooks):
        def on_train_end(self, ctx):
            seen.update({r["step"]: r for r in ctx.checkpoint_saves})

    with fault_plugin.planned("ckpt_slow:3:2"):
        asyn = run_training(_cfg(tmp_path / "async", data_cache), hooks=[times, Saves()])
    assert asyn.losses == sync.losses  # bitwise
    for step in (3, 6, 9):
        a = _tensors(tmp_path / "async" / "checkpoints" / f"step_{step:08d}")
        s = _tensors(tmp_path / "sync" / "checkpoints" / f"step_{step:08d}")
        assert a.keys() == s.keys() and all(torch.equal(a[k], s[k]) for k in a), step
    # the step-3 writer slept 2 s: steps 4.. ended while it was writing, before it was published
    rec = seen[3]
    assert rec["async"] and rec["error"] is None and rec["blocked_s"] < 1.0
    during = [s for s, t in times.ends.items() if rec["write_start"] < t < rec["write_end"]]
    assert {4, 5} <= set(during), (rec, times.ends)
    # the snapshots copied into the buffers made at the start (none made anew at a save): the
    # weight and both moments of every parameter
    staging = times.staging
    assert len(times.buffers) == len(a) and times.buffers.keys() == staging.keys()
    assert all(staging[k] is buf for k, buf in times.buffers.items())
    # the writer's threads ran nicer than training, which kept its own priority
    base = times.nice.pop("training")
    assert times.nice.get("checkpoint-step-3") == min(19, base + BACKGROUND_NICE), times.nice
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text().strip() == "step_00000009"


def test_an_error_mid_save_leaves_no_writer_thread_and_a_lone_rank_publishes(tmp_path, data_cache):
    """A run that ends on an exception while a save is in flight waits for its writer: a daemon
    thread still inside torch when the interpreter finalizes aborts the process (SIGABRT,
    "terminate called without an active exception"; a read-only run dir mid-run did that).
    A lone rank has every part, so the save it was writing is published, as a sync save was."""
    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training.loop import run_training

    class FailAtStep4(Hooks):
        def on_step_end(self, ctx, metrics):
            if ctx.state.step == 4:  # the step-3 writer sleeps 2 s (ckpt_slow): still writing
                assert any(t.name == "checkpoint-step-3" for t in threading.enumerate())
                raise RuntimeError("injected at step 4")

    with fault_plugin.planned("ckpt_slow:3:2"), pytest.raises(RuntimeError, match="injected at step 4"):
        run_training(_cfg(tmp_path / "run", data_cache), hooks=[FailAtStep4()])
    left = [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-")]
    assert left == [], left
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert (root / "step_00000003" / "manifest.json").is_file()


def _cmd(run: Path, cache: Path, *extra: str) -> list[str]:
    return loomtrain_cmd("train", TINY, *SMALL, f"run.dir={run}", f"data.cache_dir={cache}", *extra)


def _slow_writer_run(run: Path, cache: Path, step: int, seconds: float) -> Run:
    """A long run whose checkpoint writer for `step` first sleeps `seconds`; returns once that
    writer has started."""
    child = Run(
        _cmd(run, cache, "train.max_steps=1000"),
        run.parent,
        child_env(LOOMTRAIN_TEST_FAULTS=f"ckpt_slow:{step}:{seconds}"),
    )
    try:
        child.wait_for(f"TEST FAULT ckpt_slow at step {step}", timeout=300)
    except BaseException:
        child.kill()
        raise
    return child


@pytest.mark.slow
def test_kill_during_background_write_keeps_previous_latest_and_resumes_from_it(tmp_path, data_cache):
    run = tmp_path / "killed"
    with _slow_writer_run(run, data_cache, 6, 120) as child:
        child.wait_for("step 7/", timeout=300)  # training went on past the save
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait(timeout=60)
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert not (root / "step_00000006").exists() and (root / ".tmp-step_00000006").is_dir()
    again = run_child(_cmd(run, data_cache), cwd=tmp_path)
    assert f"resumed from {root / 'step_00000003'}" in output(again)


@pytest.mark.slow
def test_sigterm_during_background_write_waits_for_it_then_exits_0(tmp_path, data_cache):
    run = tmp_path / "term"
    with _slow_writer_run(run, data_cache, 3, 4) as child:
        child.proc.send_signal(signal.SIGTERM)
        rc = child.finish(timeout=120)
    assert rc == 0, child.text[-3000:]
    step = checkpoint_saved_on_signal(child.lines, run)
    root = run / "checkpoints"
    assert (root / "step_00000003" / "manifest.json").is_file()  # the write in flight was finished
    assert json.loads((root / f"step_{step:08d}" / "trainer.json").read_text())["step"] == step
