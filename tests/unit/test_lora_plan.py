"""`plan` and `dryrun` count LoRA's memory: a frozen base (its parameters only) and the adapters'
gradients and optimizer states.

* an 8B Llama shape (Llama 3 8B: d 4096, 32 layers, GQA 32/8, SwiGLU 14336, vocabulary 128,256)
  at tp 2 x dp 4, ZeRO-1, bf16: model states with model.lora.rank=16 are at most 0.35x of full
  fine-tuning's;
* `dryrun` of a shrunk LoRA shape measures model states within 10% of its plan.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import run_loomtrain
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.planning import memory_model as mm

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = [
    "model.d_model=4096",
    "model.n_layers=32",
    "model.ffn_hidden=14336",
    "model.tie_embeddings=false",
    "model.max_seq_len=8192",
    "model.rope_scaling.type=none",
    "model.rope_scaling.factor=1.0",
]


def _plan(*overrides: str) -> mm.Plan:
    cfg = load_config(ROOT / "configs" / "llama3.2-1b.yaml", [*LLAMA_8B, *overrides], world_size=8)
    return mm.make_plan(cfg, 8, "h100", 0.4)


def test_plan_of_8b_lora_rank16_model_states_at_most_035_of_full():
    full, lora = _plan(), _plan("model.lora.rank=16")
    assert full.params.total == pytest.approx(8.03e9, rel=0.01)
    # q, k, v, o, gate, up, down of 32 layers: r * (in + out) each
    per_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    assert lora.params.adapters == 32 * per_layer
    ratio = lora.states.total / full.states.total
    print(
        f"\n8B, tp 2 x dp 4, ZeRO-1, bf16: model states full {full.states.total / 2**30:.2f} GiB, "
        f"LoRA r16 {lora.states.total / 2**30:.2f} GiB ({ratio:.3f}x)"
    )
    assert ratio <= 0.35
    # the base: 2 B/param; no gradient or optimizer state but the adapters'
    assert lora.states.params == pytest.approx(2 * (full.params.per_rank + lora.params.adapters_per_rank))
    assert lora.states.optimizer == pytest.approx(12 * lora.params.adapters_per_rank / 4)
    assert any("LoRA rank 16" in note for note in lora.notes)
    # a checkpoint holds the adapters: their fp32 masters and Adam moments, 12 B each
    assert lora.host.checkpoint_bytes == pytest.approx(12 * lora.params.adapters)
    assert full.host.checkpoint_bytes == pytest.approx(12 * full.params.total)


def _gib_cells(out: str, label: str) -> list[float]:
    row = next(line for line in out.splitlines() if line.strip().startswith(label))
    return [float(x) * (1 if unit == "GiB" else 2**-10) for x, unit in re.findall(r"([\d.]+) (GiB|MiB)", row)]


@pytest.mark.slow
def test_dryrun_of_a_shrunk_lora_shape_measures_within_10pct_of_plan():
    shrink = [
        "model.n_layers=2",
        "model.d_model=128",
        "model.n_heads=4",
        "model.n_kv_heads=4",
        "model.vocab_size=1000",
        "train.seq_len=32",
        "train.micro_batch_size=2",
    ]
    proc = run_loomtrain("dryrun", "configs/gpt-1b.yaml", *shrink, "model.lora.rank=8", "--steps", "2", cwd=ROOT)
    _, local, measured = _gib_cells(proc.stdout, "model states")
    _, local_opt, measured_opt = _gib_cells(proc.stdout, "optimizer states")
    print(f"\ndryrun LoRA r8: model states plan {local * 1024:.3f} MiB, measured {measured * 1024:.3f} MiB")
    assert measured == pytest.approx(local, rel=0.10)
    assert measured_opt == pytest.approx(local_opt, rel=0.10)
