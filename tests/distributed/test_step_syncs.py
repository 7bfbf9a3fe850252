"""A training step between log steps reads nothing back from the device and adds no collective.

Counted in-process (world 1, the tiny config, log.every_steps=4): every device-to-host read
(Tensor.item / __float__ / __int__ / __bool__ / tolist / cpu / numpy) and every
torch.distributed collective, each put down to the file that made the call, step by step
(between two on_step_end calls). Calls from DeepSpeed (and torch, which DeepSpeed calls) are the
engine's own: the test measures them on a plain DeepSpeed step of the same model
(`engine(x, targets=y); engine.backward(loss); engine.step()`) and asks the loop's step for no
more. Calls from loomtrain's own files on a step between log steps must be none, at fp32 ZeRO-0
(the default precision) too, where the non-finite guard skips a NaN step on the device (the fused
AdamW's found_inf) and counts it there (launcher/training/nonfinite.py). On a log step the loop
reads the pending losses and norms (one read back, one all-reduce at DP > 1) and the guard's counts.

DeepSpeed 0.19.8 on CPU, measured here: its fp32 ZeRO-0 step (gradient clipping on) makes no
read back; ZeRO 1 reads its overflow check and grad norm on the host (counted as its own).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import SMALL, TINY
from loomtrain.launcher.config_loader import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "reduce_scatter_tensor")


def _who(filename: str) -> str:
    """'ours' for loomtrain's files (their path below the repository), else 'engine' (DeepSpeed, torch)."""
    path = Path(filename).resolve()
    if ".venv" in path.parts or "site-packages" in path.parts or REPO not in path.parents:
        return "engine"
    return "ours:" + str(path.relative_to(REPO))


class SyncCounter:
    """Wraps the reads and the collectives (monkeypatch undoes it); counts calls by caller."""

    def __init__(self, monkeypatch) -> None:
        self.counts: Counter[str] = Counter()
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), f"read {name}"))
        for name in COLLECTIVES:
            if hasattr(dist, name):
                monkeypatch.setattr(dist, name, self._wrap(getattr(dist, name), f"collective {name}"))

    def _wrap(self, fn, what: str):
        counts = self.counts

        def counted(*args, **kwargs):
            counts[f"{_who(sys._getframe(1).f_code.co_filename)} {what}"] += 1
            return fn(*args, **kwargs)

        return counted

    def take(self) -> Counter[str]:
        taken = Counter(self.counts)
        self.counts.clear()
        return taken


def _ours(counts: Counter[str]) -> Counter[str]:
    return Counter({k: v for k, v in counts.items() if k.startswith("ours:") and "data_pipeline" not in k})


def _engine(counts: Counter[str]) -> Counter[str]:
    return Counter({k: v for k, v in counts.items() if k.startswith("engine")})


def _config(tmp_path: Path, data_cache: Path, *extra: str):
    return load_config(
        TINY,
        [
            *SMALL,
            "train.global_batch_size=8",  # grad_accum 2
            f"run.dir={tmp_path}",
            f"data.cache_dir={data_cache}",
            "train.max_steps=6",
            "log.every_steps=4",
            "train.stop_check_every_steps=100",
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            "log.tensorboard=false",
            "log.progress=plain",
            *extra,
        ],
    )


def _plain_engine_step_counts(cfg, mpu, monkeypatch) -> Counter[str]:
    """What DeepSpeed's own optimizer step (grad_accum micro steps) reads and sends, with the
    loop's topology: the baseline."""
    from loomtrain.launcher.training.engine import build_engine
    from loomtrain.model import Transformer

    engine, _, _ = build_engine(cfg, Transformer(cfg.model, seed=1), 1, mpu=mpu)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))
    counter = SyncCounter(monkeypatch)
    per_step = []
    for _ in range(2):
        for _ in range(cfg.train.global_batch_size // cfg.train.micro_batch_size):
            loss = engine(x, targets=x)
            engine.backward(loss)
            engine.step()
        per_step.append(_engine(counter.take()))
    monkeypatch.undo()
    return per_step[-1]


@pytest.mark.parametrize("zero", [0, 1], ids=["fp32-zero0", "fp32-zero1"])
def test_a_step_between_log_steps_reads_nothing_back_and_sends_nothing(tmp_path, data_cache, monkeypatch, zero):
    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training import loop
    from loomtrain.launcher.training.stopping import StopRequest

    cfg = _config(tmp_path, data_cache, f"parallel.zero_stage={zero}")
    calls: Counter[str] = Counter()
    for owner, name in ((loop, "dp_reduce"), (StopRequest, "agree")):
        real = getattr(owner, name)

        def called(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, called)

    per_step: dict[int, Counter[str]] = {}
    per_step_calls: dict[int, Counter[str]] = {}

    class Count(Hooks):
        counter: SyncCounter | None = None

        def on_train_start(self, ctx):  # from here on: the steps only
            self.mpu = ctx.topology.mpu
            self.counter = SyncCounter(monkeypatch)
            calls.clear()

        def on_step_end(self, ctx, metrics):
            per_step[ctx.state.step] = self.counter.take()
            per_step_calls[ctx.state.step] = Counter(calls)
            calls.clear()

    count = Count()
    result = loop.run_training(cfg, hooks=[count])
    monkeypatch.undo()
    assert result.steps == [1, 2, 3, 4, 5, 6] and len(result.losses) == 6

    baseline = _plain_engine_step_counts(cfg, count.mpu, monkeypatch)
    for step in (2, 3, 5):  # between log steps (step 1 is the first: DeepSpeed's one-off set-up reads)
        assert _ours(per_step[step]) == Counter(), (step, per_step[step])
        assert _engine(per_step[step]) == baseline, (step, per_step[step], baseline)
        assert per_step_calls[step] == Counter(), (step, per_step_calls[step])
    # A log step reads the four steps' losses and norms back: one dp_reduce, one vote.
    assert per_step_calls[4] == Counter({"dp_reduce": 1, "agree": 1})
    assert per_step_calls[6] == Counter({"dp_reduce": 1, "agree": 1})  # the last step is a log step


def test_a_signal_between_votes_stops_at_the_next_vote_with_every_loss_read(tmp_path, data_cache):
    """SIGTERM at step 2, votes every 3 steps (log every 100): the run saves and stops at step 3,
    and the losses of the steps no log step read are read on the way out."""
    import os
    import signal

    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training import loop

    class SignalAtStep2(Hooks):
        def on_step_end(self, ctx, metrics):
            if ctx.state.step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    cfg = _config(tmp_path, data_cache, "train.max_steps=8", "log.every_steps=100", "train.stop_check_every_steps=3")
    result = loop.run_training(cfg, hooks=[SignalAtStep2()])
    assert result.stopped_by == signal.SIGTERM
    assert result.steps == [1, 2, 3] and len(result.losses) == 3 and all(0 < x < 10 for x in result.losses)
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()
    assert result.final_dir is None


@pytest.mark.slow
def test_two_ranks_read_back_on_log_steps_the_losses_one_process_reads_every_step(tmp_path, data_cache):
    """torchrun dp=2 logging every 2nd step (the steps between read nothing back; a log step
    all-reduces two steps at once) logs the losses and samples hashes of one process that reads
    every step (micro 4 x grad_accum 2 = 2 ranks x micro 4)."""
    from launch import records, run_loomtrain
    from loomtrain.launcher.training.loop import run_training

    extra = ["train.max_steps=4", "eval.every_steps=0", "log.tensorboard=false", "checkpoint.every_steps=0"]
    one = _config(tmp_path / "one", data_cache, *extra, "log.every_steps=1")
    single = run_training(one).losses
    single_rows = {r["step"]: r for r in records(tmp_path / "one") if "loss" in r}
    run_loomtrain(
        "train",
        TINY,
        *SMALL,
        "train.global_batch_size=8",
        *extra,
        "log.every_steps=2",
        f"run.dir={tmp_path / 'two'}",
        f"data.cache_dir={data_cache}",
        nproc=2,
        cwd=tmp_path,
    )
    two = {r["step"]: r for r in records(tmp_path / "two") if "loss" in r}
    assert sorted(two) == [2, 4]
    for step in (2, 4):
        assert two[step]["loss"] == pytest.approx(single[step - 1], abs=1e-5)
        assert two[step]["data/samples_hash"] == single_rows[step]["data/samples_hash"]
