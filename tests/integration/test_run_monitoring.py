"""What an on-call engineer reads: TensorBoard per run, profiler traces, per-rank logs, stop signals.

In-process runs of the tiny config (one rank); the multi-rank paths (hangs, stragglers,
SIGTERM under torchrun and Ray) are in tests/distributed/test_hangs_and_signals.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import launch
import pytest
from launch import TINY
from loomtrain.launcher.config_loader import load_config

SMALL = [
    *launch.SMALL,
    "train.global_batch_size=8",
    "data.max_files=20",
    "data.val_fraction=0.1",
    "eval.every_steps=0",
    "eval.num_samples=0",
    "log.progress=plain",
    "checkpoint.every_steps=0",
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """runs/a (4 steps, then resumed to 5) and runs/b (4 steps, steps 2-3 profiled)."""
    from loomtrain.launcher.training.loop import run_training

    root = tmp_path_factory.mktemp("monitoring") / "runs"
    cache = root.parent / "cache"

    def cfg(name, *extra):
        return load_config(
            TINY, [*SMALL, f"run.name={name}", f"run.dir={root / name}", f"data.cache_dir={cache}", *extra]
        )

    run_training(cfg("a", "train.max_steps=4"))
    # The profiled run in a process of its own, as a user starts it: torch's profiler (kineto) once
    # spun for minutes in add_metadata_json in a test worker that other tests had used before.
    b = [*SMALL, "run.name=b", f"run.dir={root / 'b'}", f"data.cache_dir={cache}", "train.max_steps=4"]
    launch.run_loomtrain("train", TINY, *b, "log.profile_steps=[2,3]", timeout=300)
    resumed = run_training(cfg("a", "train.max_steps=5"))
    assert resumed.steps == [5]
    assert 0 < resumed.train_s <= resumed.wall_s  # this call's training, within this call's time
    assert resumed.state.elapsed > resumed.train_s  # the first call's training is in it too
    return root


def test_the_summary_after_a_resume_keeps_training_within_total(tmp_path):
    """A resumed run reported the training time summed since step 0 as its training time, next
    to its own wall time ("36 s training, 11 s total"): the summary's pair is this call's own."""
    from loomtrain.launcher.training.loop import TrainResult, done_line

    result = TrainResult(tmp_path, losses=[2.5, 2.0], steps=[41, 42], train_s=2.2, wall_s=11.4)
    line = done_line(result, start_step=40, elapsed=36.0)
    assert line == (
        "done: step 42, loss 2.5000 -> 2.0000, 2 s training, 11 s total "
        "(resumed at step 40; 36 s training since step 0)"
    )
    assert done_line(result, start_step=0, elapsed=2.2).endswith("2 s training, 11 s total")


def test_each_run_is_one_tensorboard_run_with_grouped_tags(two_runs):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0}).AddRunsFromDirectory(str(two_runs))
    mux.Reload()
    assert set(mux.Runs()) == {"a", "b"}  # `tensorboard --logdir runs/` shows a and b
    scalars = set(mux.GetAccumulator("a").Tags()["scalars"])
    assert launch.TB_SCALARS <= scalars
    assert not launch.TB_RANK_SCALARS & scalars  # one process: no flat-zero slowest rank in TensorBoard
    assert [e.step for e in mux.Scalars("a", "loss/train")] == [1, 2, 3, 4, 5]  # across the resume
    # metrics.jsonl keeps its plain keys (memory in bytes, GiB in TensorBoard) and the job-wide figures
    rec = json.loads((two_runs / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    assert mux.Scalars("a", "memory/mem_gib")[-1].value == pytest.approx(rec["mem_bytes"] / 2**30, rel=1e-6)
    assert {
        "loss",
        "lr",
        "step_time_s",
        "mem_bytes",
        "step_time_max_s",
        "slowest_rank",
        "data_wait_max_s",
        "mem_bytes_max",
        "mem_rank_max",
    } <= set(rec)
    assert rec["slowest_rank"] == 0 and rec["mem_rank_max"] == 0


def test_tensorboard_layout_a_user_reads_at_a_glance(two_runs):
    """The train and eval loss overlaid in one Custom Scalars chart; HPARAMS leads with the model
    size, learning rate, batch and parallel layout; the rank figures only for several ranks."""
    from loomtrain.launcher.observe import metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(two_runs / "a"), size_guidance={"tensors": 0})
    acc.Reload()
    (layout_event,) = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)[:1]
    layout = layout_pb2.Layout.FromString(layout_event.tensor_proto.string_val[0])
    chart = layout.category[0].chart[0]
    assert (layout.category[0].title, chart.title) == ("loss", "train and eval loss")
    assert list(chart.multiline.tag) == ["loss/train", "loss/val"]
    content = acc.PluginTagToContent("hparams")["_hparams_/experiment"]  # the table's columns, in order
    columns = [h.name for h in plugin_data_pb2.HParamsPluginData.FromString(content).experiment.hparam_infos]
    assert columns[:5] == ["model.d_model", "model.n_layers", "model.n_heads", "model.vocab_size", "train.lr"]
    scalars = metrics.tb_scalars({"mem_bytes": 2**31, "slowest_rank": 0, "loss": 1.5, "tag": "x"}, world_size=1)
    assert scalars == {"memory/mem_gib": 2.0, "loss/train": 1.5}
    assert metrics.tb_scalars({"slowest_rank": 1, "mem_bytes_max": 2**30}, world_size=2) == {
        "perf/slowest_rank": 1,
        "memory/mem_gib_max": 1.0,
    }


def test_profiler_writes_chrome_traces_and_a_top_ops_table(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prof = two_runs / "b" / "profile" / "rank_00000"
    traces = list(prof.glob("*.json"))
    assert [t.name for t in traces] == ["trace_steps_2-3.json"]
    trace = json.loads(traces[0].read_text())
    assert trace["traceEvents"] and any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert "aten::" in (prof / "top_ops_steps_2-3.txt").read_text()
    acc = EventAccumulator(str(two_runs / "b"), size_guidance={"tensors": 0})
    acc.Reload()
    assert "profile/top_ops/text_summary" in acc.Tags()["tensors"]
    text = acc.Tensors("profile/top_ops/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "aten::" in text and "steps 2-3" in text
    assert not (two_runs / "a" / "profile").exists()  # off unless asked for


def test_an_error_mid_step_closes_the_prefetch_thread_and_tensorboard(two_runs, tmp_path):
    """Any exception ends a run cleanly: here the test-only `raise` fault strikes in the middle
    of step 3 (prefetch on, a profile running). No prefetch or watchdog thread lives on, the
    signal handlers and stdout are back, no file of the run is left open, and TensorBoard's
    event file reads back with the steps before the failure. The run and the checks of its
    process are tests/error_mid_step_driver.py's, in a process of its own (see there why)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, out = two_runs.parent / "failed", tmp_path / "report.json"
    overrides = [
        *SMALL,
        f"run.dir={run_dir}",
        f"data.cache_dir={two_runs.parent / 'cache'}",
        "train.max_steps=5",
        "data.prefetch=2",
        "log.profile_steps=[2,4]",
    ]
    launch.run_child(launch.python_cmd(launch.ROOT / "tests" / "error_mid_step_driver.py", out, TINY, *overrides))
    report = json.loads(out.read_text())
    assert "test fault: rank 0 raises in the middle of step 3" in report["error"], report
    assert report["traceback_held"], report
    assert {n.split("-dp")[0] for n in report["during"]} == {"TokenStream-prefetch", "loomtrain-watchdog"}, report
    assert report["left"] == [], report  # both ran during the steps; neither lives on
    assert report["handlers_back"] and report["streams_back"], report
    assert report["still_open"] == [], report
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/train")] == [1, 2]
    assert "FaultInjected: test fault: rank 0 raises" in (run_dir / "logs" / "rank_00000.log").read_text()


def test_rank_log_is_appended_across_restarts(two_runs):
    log = (two_runs / "a" / "logs" / "rank_00000.log").read_text()
    headers = [line for line in log.splitlines() if line.startswith("=== loomtrain attempt")]
    assert len(headers) == 2 and headers[0].startswith("=== loomtrain attempt 1:")
    assert headers[1].startswith("=== loomtrain attempt 2:") and f"pid {os.getpid()}" in headers[1]
    assert "step 4/4" in log and "step 5/5" in log  # rank 0's console lines, both attempts


def test_signal_exit_codes_and_stop_file(tmp_path):
    from loomtrain.launcher.training import stopping

    assert stopping.exit_code(signal.SIGTERM) == 0
    assert stopping.exit_code(signal.SIGINT) == 130 and stopping.exit_code(signal.SIGHUP) == 129
    stop = stopping.StopRequest(tmp_path, watch_file=True).install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.pending() == signal.SIGHUP
    finally:
        stop.uninstall()
    other = stopping.StopRequest(tmp_path, watch_file=True)
    stopping.request_stop(tmp_path, signal.SIGINT)  # what the Ray driver does on Ctrl-C
    assert other.pending() == signal.SIGINT
    other.clear_file()
    assert not (tmp_path / stopping.STOP_FILE).exists()


def test_second_ctrl_c_exits_at_once_with_130():
    script = textwrap.dedent("""
        import os, signal, time
        from loomtrain.launcher.training.stopping import StopRequest
        stop = StopRequest().install()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.pending() == signal.SIGINT   # the first one only asks for a checkpoint
        print("first handled", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        print("not reached", flush=True)
    """)
    proc = launch.run_child([sys.executable, "-c", script], timeout=60, rc=130)
    assert "first handled" in proc.stdout and "not reached" not in proc.stdout
    assert "second Ctrl-C" in proc.stderr
