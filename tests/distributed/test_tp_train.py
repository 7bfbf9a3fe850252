"""`torchrun ... -m loomtrain train CONFIG parallel.tp=2` follows the single-process run.

Through the real loop (DeepSpeed engine, data stream per DP rank, grad clipping):
10 steps at tp=2 x dp=2 with sequence parallelism, ZeRO-1 and a model with one KV
head (replicated on both TP ranks) against one process with 2 accumulation steps
on the same global batch: the loss of every step within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import TINY, losses, run_loomtrain
from loomtrain.launcher.config_loader import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "train.max_steps=10",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=1",
    "model.n_layers=2",
    "train.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "data.max_files=50",
    "log.tensorboard=false",
    "log.progress=plain",
]


def _losses(run_dir: Path) -> list[float]:
    return list(losses(run_dir).values())


@pytest.mark.slow
def test_torchrun_tp2_dp2_sp_follows_single_process(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    ref_dir, tp_dir = tmp_path / "ref", tmp_path / "tp2"
    run_loomtrain("train", TINY, f"run.dir={ref_dir}", cache, *COMMON)
    run_loomtrain(
        "train",
        TINY,
        f"run.dir={tp_dir}",
        cache,
        *COMMON,
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.zero_stage=1",
        nproc=4,
    )
    ref, tp = _losses(ref_dir), _losses(tp_dir)
    assert len(ref) == len(tp) == 10
    diff = max(abs(a - b) for a, b in zip(ref, tp))
    print(f"\ntp2 x dp2 (SP, ZeRO-1) vs 1 process: max |loss diff| over 10 steps = {diff:.2e}")
    assert diff <= 1e-5, list(zip(ref, tp))
    assert tp[-1] < tp[0]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["parallel.tp=4"], "parallel.tp=4: model.n_heads=6 is not divisible by tp"),
        (["parallel.tp=3"], "parallel.tp=3: model.n_kv_heads=2"),
        (["parallel.tp=2", "model.ffn_hidden=101"], "parallel.tp=2: FFN hidden size 101"),
        (["parallel.tp=2"], "parallel.tp: expected a divisor of the world size 3"),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=33"], "train.seq_len"),
    ],
)
def test_bad_tp_in_config_fails_before_training(overrides, needle):
    world = 3 if "world size 3" in needle else 4
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/tiny.yaml", [*overrides, "train.global_batch_size=48"], world_size=world)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
