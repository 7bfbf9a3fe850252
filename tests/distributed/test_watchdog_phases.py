"""The hang watchdog knows what a rank is doing, and throughput is the world's.

* A healthy run is not killed for a long evaluation, nor for compiling inside its samples: each
  phase the loop announces (start-up, training step, evaluation, samples, checkpoint I/O) has its
  own allowance (launcher/observe/watchdog.py), and a real hang's line names the phase it was in.
* Under a straggler (torchrun world 2, rank 1 slowed by the `delay` test fault after its share
  of the step), tok/s and MFU are the world's rate, not rank 0's own compute.

The in-process runs swap the watchdog's exit (os._exit, which would end pytest) for a record.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from launch import QUIET, SMALL, SMALLEST, TINY, child_env, output, records, run_loomtrain
from loomtrain.launcher.config_loader import ConfigError, load_config
from loomtrain.launcher.observe import watchdog
from loomtrain.launcher.observe.watchdog import Watchdog
from loomtrain.launcher.timeouts import (
    EVALUATION,
    HANG_REPORT_MARGIN_S,
    SAMPLES,
    START_UP,
    STEP,
    Allowances,
    allowances,
)
from loomtrain.launcher.training import loop

pytestmark = pytest.mark.usefixtures("one_thread")

# The run, shrunk: 2 steps, an evaluation at step 2, a step allowance of 2 s.
EVAL_RUN = [
    *SMALL,
    "data.val_fraction=0.1",  # 40 files: the default 1% leaves no validation split
    "log.progress=plain",
    "log.tensorboard=false",
    "train.max_steps=2",
    "eval.every_steps=2",
    "eval.num_samples=1",
    "eval.sample_tokens=8",
    "checkpoint.every_steps=0",
    "parallel.timeout_s=2",
]


@pytest.fixture
def hangs(monkeypatch) -> list[Watchdog]:
    """The loop's watchdog records a hang (its line is in RUN_DIR/logs/hang.json) instead of
    ending the process; the list holds the watchdogs that fired."""
    fired: list[Watchdog] = []

    class Recording(Watchdog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

            def record(code: int) -> None:
                assert code == watchdog.HANG_EXIT_CODE
                fired.append(self)
                self._stop.set()

            self.exit = record

    monkeypatch.setattr(loop, "Watchdog", Recording)
    return fired


def timed(monkeypatch, name: str) -> list[float]:
    """Seconds each call of loop.`name` (evaluate, samples) took."""
    took: list[float] = []
    inner = getattr(loop, name)

    def wrapper(ctx):
        start = time.perf_counter()
        try:
            return inner(ctx)
        finally:
            took.append(time.perf_counter() - start)

    monkeypatch.setattr(loop, name, wrapper)
    return took


def hang_line(run_dir) -> str | None:
    path = run_dir / "logs" / "hang.json"
    return json.loads(path.read_text())["line"] if path.exists() else None


def test_a_long_evaluation_is_not_a_hang(tmp_path, data_cache, hangs, monkeypatch):
    """A run with `eval.batches=300 parallel.timeout_s=8` was killed as hung inside `evaluate`."""
    took = timed(monkeypatch, "evaluate")
    run = tmp_path / "run"
    overrides = [*EVAL_RUN, "eval.batches=800", "parallel.timeout_s=1"]  # ~3 s of evaluation on one core
    cfg = load_config(TINY, [*overrides, f"run.dir={run}", f"data.cache_dir={data_cache}"])
    result = loop.run_training(cfg)
    assert took and took[0] > cfg.parallel.timeout_s, took  # the evaluation outlasted a step's allowance
    assert hangs == [] and hang_line(run) is None, hang_line(run)
    assert result.steps == [1, 2] and 2 in result.evals and result.final_dir.is_dir()
    assert "hang:" not in (run / "logs" / "rank_00000.log").read_text()


@pytest.mark.slow
def test_compiling_inside_samples_is_not_a_hang(tmp_path, data_cache, hangs, monkeypatch):
    """`parallel.compile=true` with evaluation: the first step, the first evaluation and the
    first samples compile (samples recompile for each new shape); each gets the compile allowance."""
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # compile now, as a first run does
    took = timed(monkeypatch, "samples")
    run = tmp_path / "run"
    # samples' own allowance kept small (1 s + 8 tokens x 0.01 s), so that their compiling outlasts it
    overrides = [*EVAL_RUN, "eval.batches=2", "parallel.compile=true", "parallel.timeout_s=1"]
    overrides += ["parallel.forward_timeout_s=0.01", f"run.dir={run}", f"data.cache_dir={data_cache}"]
    cfg = load_config(TINY, overrides)
    result = loop.run_training(cfg)
    allow = allowances(cfg)
    assert took and took[0] > allow.samples and allow.compile == 600, (took, allow)
    assert hangs == [] and hang_line(run) is None, hang_line(run)
    assert result.steps == [1, 2] and result.final_dir.is_dir()


def test_a_hang_in_evaluation_names_its_phase(tmp_path, data_cache, hangs, monkeypatch):
    """A real hang still ends the run, and its line says the rank was in evaluation, with the
    allowance and the knob that sets it."""
    inner = loop.evaluate

    def stuck(ctx):
        time.sleep(7)  # far past evaluation's allowance: 2 s + 1 batch x 0.1 s
        return inner(ctx)

    monkeypatch.setattr(loop, "evaluate", stuck)
    run = tmp_path / "run"
    overrides = [*EVAL_RUN, "eval.batches=1", "parallel.forward_timeout_s=0.1", "parallel.startup_timeout_s=60"]
    cfg = load_config(TINY, [*overrides, f"run.dir={run}", f"data.cache_dir={data_cache}"])
    loop.run_training(cfg)
    assert len(hangs) == 1
    line = hang_line(run)
    assert re.match(
        r"loomtrain: hang: rank 0 \(host \S+, pid \d+\) did not reach step 3 "
        r"\(in evaluation, allowed 2 s: parallel\.forward_timeout_s\); no other rank was waiting; stacks in ",
        line,
    ), line


def test_each_phase_has_its_allowance_and_the_line_names_each_ranks_phase(tmp_path):
    cfg = load_config(TINY, ["parallel.timeout_s=30", "eval.batches=300", "eval.sample_tokens=64"])
    allow = allowances(cfg)
    assert (allow.step, allow.start_up, allow.io, allow.compile) == (30, 90, cfg.checkpoint.timeout_s, 0)
    assert allow.evaluation == 30 + 300 * 10 and allow.samples == 30 + 64 * 10  # a forward: timeout_s / 3
    knobs = ["parallel.startup_timeout_s=5", "parallel.forward_timeout_s=0.5", "parallel.compile=true"]
    allow = allowances(load_config(TINY, ["parallel.timeout_s=30", "eval.batches=300", *knobs]))
    assert (allow.start_up, allow.evaluation, allow.compile) == (5, 30 + 150, 600)
    # the process group waits longer than any phase may, so the watchdog reports first
    from loomtrain.launcher.distributed import collective_timeout_s

    assert collective_timeout_s(cfg) == 30 + 3000 + HANG_REPORT_MARGIN_S
    with pytest.raises(ConfigError, match=r"^parallel\.forward_timeout_s: expected a non-negative number, got -1"):
        load_config(TINY, ["parallel.forward_timeout_s=-1"])

    # compile is allowed once per phase; a phase's end is progress and restores the step's allowance
    dog = Watchdog(tmp_path, 0, 1, Allowances(step=1, start_up=3, evaluation=5, samples=2, io=9, compile=100))
    assert (dog.phase_name, dog.limit) == ("start-up", 103)
    dog.beat(1)
    limits = []
    for _ in range(2):
        with dog.phase(EVALUATION):
            limits.append(dog.limit)
        assert (dog.phase_name, dog.limit, dog.knob) == (STEP, 1, "parallel.timeout_s")
    assert limits == [105, 5]
    with dog.phase(SAMPLES):
        assert (dog.limit, dog.knob) == (102, "parallel.forward_timeout_s + parallel.compile_timeout_s")
    with dog.phase("checkpoint save"):  # I/O compiles nothing: its allowance is checkpoint.timeout_s alone
        assert (dog.limit, dog.knob) == (9, "checkpoint.timeout_s")

    beats = {
        0: {"host": "h", "pid": 1, "step": 4, "phase": SAMPLES, "allowed_s": 102.0, "knob": "k", "where": "generate"},
        1: {"host": "h", "pid": 2, "step": 4, "phase": STEP, "allowed_s": 1.0, "knob": "parallel.timeout_s"},
    }
    line = watchdog._hang_line(tmp_path, [0, 1], [], beats)
    assert "did not reach step 5 (rank 0 in samples, allowed 102 s: k; rank 1 in training step, allowed 1 s: " in line
    # a rank stopped between heartbeats: its last one (start-up, step 0) predates the steps it made since
    beats = {
        0: {"host": "h", "pid": 1, "step": 3, "phase": STEP, "where": "all_reduce (from dp_reduce, loop.py:62)"},
        1: {"host": "h", "pid": 2, "step": 0, "phase": START_UP, "allowed_s": 90.0, "knob": "k"},
    }
    line = watchdog._hang_line(tmp_path, [1], [0], beats)
    assert "rank 1 (host h, pid 2) did not reach step 4; ranks 0 waited in all_reduce" in line, line
    assert START_UP not in line


@pytest.mark.slow
def test_a_straggler_sets_the_worlds_throughput(tmp_path, data_cache):
    """torchrun world 2, rank 1 slowed by DELAY s per step after its share of the step:
    tok/s and MFU follow the world's real rate (at most one step per DELAY s), not rank 0's own
    compute (the console showed 4,255 tok/s for a real ~164)."""
    delay = 1.0
    run = tmp_path / "run"
    argv = [
        "train",
        TINY,
        *SMALLEST,
        "train.micro_batch_size=1",  # dp 2, one micro batch each
        *QUIET,
        "train.max_steps=5",
        "checkpoint.every_steps=0",
        f"run.dir={run}",
        f"data.cache_dir={data_cache}",
    ]
    proc = run_loomtrain(*argv, nproc=2, env=child_env(LOOMTRAIN_TEST_FAULTS=f"delay:1:{delay}"), cwd=tmp_path)
    real = 2 * 16 / delay  # tokens per step / the least a step can take: the fastest real rate
    recs = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    for r in recs[1:]:  # from step 2 on (step 1 ends before rank 1's first delay)
        assert real / 3 < r["tokens_per_s"] <= real * 1.05, recs
        assert r["mfu"] == pytest.approx(recs[1]["mfu"] * r["tokens_per_s"] / recs[1]["tokens_per_s"])
        assert r["slowest_rank"] == 1 and r["step_time_s"] >= r["step_time_max_s"], r
    print(f"straggler: real rate at most {real:.0f} tok/s; reported {[round(r['tokens_per_s']) for r in recs]}")
    console = [float(m) for m in re.findall(r"\| ([\d,.]+) tok/s", output(proc).replace(",", ""))]
    assert len(console) == 5 and all(real / 3 < tps <= real * 1.05 for tps in console[1:]), console


def test_only_the_function_a_rank_is_in_tells_a_collective():
    """The innermost function's name, by whole words: a rank sleeping in its own `await_batch`
    or under a caller named like a collective is not in one (substrings counted it as waiting)."""
    beats = {
        0: {"where": "all_reduce (from dp_reduce, loop.py:62)"},
        1: {"where": "all_gather_into_tensor (from gather_rank_stats, metrics.py:9)"},
        2: {"where": "sleep (from await_batch, stream.py:10)"},
        3: {"where": "sleep (from _report_pending, loop.py:500)"},
        4: {"where": "reporting"},
        5: {"where": "wait"},
    }
    assert watchdog._not_in_collective(beats, list(beats)) == [2, 3, 4]
