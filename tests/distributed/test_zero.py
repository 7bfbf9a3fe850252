"""ZeRO over the data-parallel group with tensor parallelism: the numbers do not change,
the memory per rank is the ZeRO arithmetic, non-finite steps are skipped and stop the run.

Two launches of tests/zero_driver.py (one process; one torchrun of 4 on gloo) run every
variant through the real loop (DeepSpeed engine, data stream per DP rank, clipping):

* fp32, same global batch (8 sequences of 32 tokens; one process accumulates 2 micro
  batches of 4): TP2 x DP2 at ZeRO 0-3 and DP4 at ZeRO 2 and 3 follow the single-process
  losses for 6 steps within 1e-5.
* the same with the optimizer offloaded to the CPU (ZeRO 2 and 3, client torch AdamW) and
  with activation checkpointing per block (ZeRO 1);
* bf16: TP2 x DP2 at ZeRO 1 against one bf16 ZeRO-1 process within BF16_TOL (see there).
* after step 1 each rank's measured params / grads / optimizer states at TP2 x DP2 equal
  the ZeRO paper's split of DeepSpeed's bytes per parameter, and `plan`'s model-state
  figure is within 10% of the measured one;
* a forced NaN loss (the test-only fault `nan:RANK:N-M`) is skipped and counted
  (DeepSpeed's path at ZeRO 2; ours at fp32 ZeRO 0 through the CLI); K in a row stop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import SMALL_MODEL, child_env, records, run_loomtrain, run_variants
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.planning import memory_model as mm

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
STEPS = 6  # a wrong shard, a missing all-reduce or a wrong scale shows from step 1
COMMON = [
    f"train.max_steps={STEPS}",
    *SMALL_MODEL,
    "train.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=1e-3",
    "train.warmup_steps=2",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "checkpoint.resume=never",
    "data.max_files=50",
    "log.tensorboard=false",
    "log.progress=plain",
]
TP2 = ["parallel.tp=2"]
VARIANTS_4 = {
    "z0": [*TP2, "parallel.zero_stage=0"],
    "z1": [*TP2, "parallel.zero_stage=1"],
    "z2": [*TP2, "parallel.zero_stage=2"],
    "z3": [*TP2, "parallel.zero_stage=3"],
    "dp4_z2": ["parallel.zero_stage=2", "train.micro_batch_size=2"],
    # tp 1 at ZeRO 3: the fused output layer (loomtrain.model.loss) with its weight partitioned
    "dp4_z3": ["parallel.zero_stage=3", "train.micro_batch_size=2"],
    "z2_offload": [*TP2, "parallel.zero_stage=2", "parallel.offload_optimizer=true"],
    "z3_offload": [*TP2, "parallel.zero_stage=3", "parallel.offload_optimizer=true"],
    "z1_ckpt": [*TP2, "parallel.zero_stage=1", "parallel.activation_checkpointing=true"],
    "bf16_z1": [*TP2, "parallel.zero_stage=1", "train.precision=bf16"],
    "nan_z2": [
        *TP2,
        "parallel.zero_stage=2",
        "faults:nan:0:2,nan:0:4-5",
        "train.max_consecutive_skips=2",
        "train.max_steps=6",
    ],
}
# The bf16 reference runs at ZeRO-1 too: at ZeRO-0 DeepSpeed routes bf16 through its
# FP16_UnfusedOptimizer, whose updates differ from the ZeRO optimizers' (its first update is
# ~16% smaller in mean |dw| here; its 10-step losses sit ~0.04 above both the fp32 run and
# bf16 at ZeRO 1-3, which agree within 2e-3). At dp=1 ZeRO-1 holds the same bytes as ZeRO-0.
VARIANTS_1 = {"ref": [], "bf16_ref": ["train.precision=bf16", "parallel.zero_stage=1"]}
FP32_TOL = 1e-5
# bf16 keeps 8 significant bits: each product or sum carries a relative rounding error of
# up to 2^-9 ~ 2e-3, and TP x DP changes the order of the reductions (row-parallel partial
# sums, the TP and DP all-reduces), so the two runs' logits differ in the last bits from
# step 1 and the trajectories drift apart a little each step. The loss is computed in fp32
# from bf16 logits. 5e-3 (0.1% of a loss of ~5.5, a sixth of one bf16 ULP at that magnitude,
# 2^-5) is rounding (measured over 10 steps: ~3e-4); a real bug -- a missing all-reduce, a
# wrong shard, a wrong gradient scale -- moves the loss by 1e-1 or more.
BF16_TOL = 5e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return run_variants("zero_driver.py", tmp_path_factory.mktemp("zero"), COMMON, {1: VARIANTS_1, 4: VARIANTS_4})


def _metrics(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _metrics(run_dir)]


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) for x, y in zip(a, b))


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["z0", "z1", "z2", "z3", "dp4_z2", "dp4_z3", "z2_offload", "z3_offload", "z1_ckpt"])
def test_fp32_follows_single_process(runs, name):
    ref, got = _losses(runs / "ref"), _losses(runs / name)
    diff = _max_diff(ref, got)
    print(f"\n{name} vs 1 process (fp32): max |loss diff| over {STEPS} steps = {diff:.2e}")
    assert diff <= FP32_TOL, list(zip(ref, got))
    assert got[-1] < got[0] - 0.1  # it trains


def test_bf16_follows_single_process(runs):
    ref, got = _losses(runs / "bf16_ref"), _losses(runs / "bf16_z1")
    diff = _max_diff(ref, got)
    print(f"\nbf16_z1 vs 1 process (bf16): max |loss diff| over {STEPS} steps = {diff:.2e}")
    assert diff <= BF16_TOL, list(zip(ref, got))
    assert got[-1] < got[0] - 0.1


# DeepSpeed's bytes per parameter in fp32: params 4, grads 4, optimizer 8 at stage 0 (the
# client AdamW's m and v) and 12 at stages 1-3 (plus DeepSpeed's fp32 master partition).
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_follows_zero_arithmetic(runs, stage):
    run = runs / f"z{stage}"
    dp = 2
    for rank in range(4):
        m = json.loads((run / f"memory.rank{rank}.json").read_text())
        psi = m["local_params"]
        assert (m["tp"], m["dp"]) == (2, dp)
        want_params = 4 * psi / (dp if stage >= 3 else 1)
        want_grads = 4 * psi / (dp if stage >= 2 else 1)
        want_optim = (8 if stage == 0 else 12) * psi / (dp if stage >= 1 else 1)
        # Flat buffers are padded to the DP alignment; Adam's step counters add a few bytes.
        assert m["params"] == pytest.approx(want_params, rel=0.01), m
        assert m["optimizer"] == pytest.approx(want_optim, rel=0.01), m
        # ZeRO 2-3: the gradients of the parameters whose reduction is in flight at the
        # peak come on top of the partition (here up to one large embedding/FFN matrix).
        assert want_grads * 0.99 <= m["grads"] <= want_grads * (1.35 if stage >= 2 else 1.01), m


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plan_model_states_within_10_percent(runs, stage):
    cfg = load_config(ROOT / TINY, [*COMMON, *TP2, f"parallel.zero_stage={stage}"], world_size=4)
    plan = mm.make_plan(cfg, 4, "cpu")
    for rank in range(4):
        m = json.loads((runs / f"z{stage}" / f"memory.rank{rank}.json").read_text())
        assert plan.params.per_rank == m["local_params"]
        rel = abs(plan.states.total - m["model_states"]) / m["model_states"]
        print(
            f"\nZeRO-{stage} rank {rank}: plan {plan.states.total:,.0f} B, measured {m['model_states']:,} B ({rel:.1%})"
        )
        assert rel <= 0.10


def test_nonfinite_skipped_counted_and_stops_deepspeed_path(runs):
    rows = _metrics(runs / "nan_z2")
    skipped = {r["step"]: r["skipped_steps"] for r in rows}
    assert skipped == {1: 0, 2: 1, 3: 1, 4: 2, 5: 3}
    assert rows[1]["loss"] is None  # NaN is written as null
    stop = (runs / "nan_z2" / "stopped.txt").read_text()
    assert "train.max_consecutive_skips=2: optimizer steps 4-5" in stop


def test_nonfinite_cli_fp32_zero0_path(runs, tmp_path):
    run_dir = tmp_path / "nan0"
    env = child_env(LOOMTRAIN_TEST_FAULTS="nan:0:2,nan:0:4-6")
    proc = run_loomtrain(
        "train",
        TINY,
        *COMMON,
        "train.max_steps=8",
        "train.max_consecutive_skips=3",
        f"run.dir={run_dir}",
        f"data.cache_dir={runs / 'cache'}",
        env=env,
        rc=1,
    )
    assert "loomtrain: training stopped: train.max_consecutive_skips=3: optimizer steps 4-6" in proc.stderr
    rows = _metrics(run_dir)
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 2, 3, 4]
    # The skipped step changed no weight: step 3 continues from step 1's weights, so its
    # loss is finite and the run resumed training normally.
    assert rows[2]["loss"] is not None and rows[0]["loss"] is not None
