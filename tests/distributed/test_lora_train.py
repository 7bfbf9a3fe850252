"""LoRA through the real training path (DeepSpeed engine, data stream per DP rank, clipping):

* tp 2 x dp 2 at ZeRO 1 and ZeRO 2, and ZeRO 1 with sequence parallelism and activation
  checkpointing, follow one process (2 accumulation steps, same global batch) within 1e-5
  over 6 fp32 steps; a model with one KV head (replicated on both TP ranks) too;
* the frozen base is bitwise the same after training, only lora_A / lora_B train, and the
  optimizer's moments cover the adapters alone, split over the DP ranks (ZeRO 1/2); in bf16
  the base is held in bf16 and the adapters' moments in fp32.

Two launches of tests/lora_driver.py (one process; one torchrun of 4) run every variant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import SMALL_MODEL, records, run_variants

STEPS = 6
RANK = 4
COMMON = [
    f"train.max_steps={STEPS}",
    *SMALL_MODEL,
    "train.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=1e-2",  # adapters start at B = 0: a large rate makes 6 steps move the loss
    "train.warmup_steps=2",
    "eval.every_steps=0",
    "eval.num_samples=0",
    "checkpoint.every_steps=0",
    "checkpoint.resume=never",
    "data.max_files=50",
    "log.tensorboard=false",
    "log.progress=plain",
    f"model.lora.rank={RANK}",
    "model.lora.alpha=8",
]
TP2 = ["parallel.tp=2"]
KV1 = ["model.n_kv_heads=1"]
VARIANTS_1 = {"ref": [], "ref_kv1": KV1, "bf16": ["train.precision=bf16", "parallel.zero_stage=1"]}
VARIANTS_4 = {
    "z1": [*TP2, "parallel.zero_stage=1"],
    "z2": [*TP2, "parallel.zero_stage=2"],
    "z1_sp_ac": [
        *TP2,
        "parallel.zero_stage=1",
        "parallel.sequence_parallel=true",
        "parallel.activation_checkpointing=true",
    ],
    "z2_kv1": [*TP2, "parallel.zero_stage=2", *KV1],
}
REFERENCE = {"z1": "ref", "z2": "ref", "z1_sp_ac": "ref", "z2_kv1": "ref_kv1"}
FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return run_variants("lora_driver.py", tmp_path_factory.mktemp("lora"), COMMON, {1: VARIANTS_1, 4: VARIANTS_4})


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir) if "loss" in r]


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(VARIANTS_4))
def test_tp2_dp2_follows_single_process(runs, name):
    ref, got = _losses(runs / REFERENCE[name]), _losses(runs / name)
    assert len(ref) == len(got) == STEPS
    diff = max(abs(a - b) for a, b in zip(ref, got))
    print(f"\nLoRA {name} vs 1 process (fp32): max |loss diff| over {STEPS} steps = {diff:.2e}")
    assert diff <= FP32_TOL, list(zip(ref, got))
    assert got[-1] < got[0] - 0.05  # the adapters train (6 steps from B = 0: a small drop)


@pytest.mark.parametrize("name", ["ref", "z1", "z2", "bf16"])
def test_base_frozen_bitwise_and_only_adapters_optimized(runs, name):
    ranks = sorted((runs / name).glob("base.rank*.json"))
    assert len(ranks) == (1 if name in VARIANTS_1 else 4)
    held = []
    for path in ranks:
        got = json.loads(path.read_text())
        assert got["start"] and got["start"] == got["end"], f"{path.name}: a frozen parameter changed"
        assert any(n.endswith("attn.wq.weight") for n in got["start"])  # the base is among them
        assert got["trainable"] and all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in got["trainable"])
        # 2 layers x 7 targets (SwiGLU: gate, up, down; q, k, v, o) x (A, B)
        assert len(got["trainable"]) == 2 * 7 * 2
        held.append((got["exp_avg_numel"], got["trainable_numel"]))
    if name in VARIANTS_1:
        assert held[0][0] == held[0][1]  # Adam's moments: the adapters', nothing else
    else:  # ranks 0, 1 are DP rank 0 at TP ranks 0, 1 (topology: TP groups are consecutive ranks)
        for tp_rank in (0, 1):
            dp_ranks = [held[tp_rank], held[tp_rank + 2]]
            trainable = dp_ranks[0][1]
            assert sum(m for m, _ in dp_ranks) >= trainable  # the partitions cover the adapters
            assert max(m for m, _ in dp_ranks) <= trainable // 2 + 64  # each DP rank holds about half


def test_bf16_holds_the_base_in_bf16_and_the_adapters_moments_in_fp32(runs):
    got = json.loads((runs / "bf16" / "base.rank0.json").read_text())
    assert got["base_dtypes"] == ["torch.bfloat16"]
    assert got["moment_dtypes"] == ["torch.float32"]
    assert got["start"] == got["end"]
    assert got["exp_avg_numel"] == got["trainable_numel"]
    bf16, fp32 = _losses(runs / "bf16"), _losses(runs / "ref")
    assert max(abs(a - b) for a, b in zip(bf16, fp32)) < 5e-2  # the same run, in bf16 rounding
