"""LoRA checkpoints: adapters only, with a reference to the base; resume is exact, also at another
layout (tp 1 -> tp 2 x dp 2, ZeRO 2); a checkpoint of another base is refused in one line;
`generate` gives the same text from final/ (merged) and from the checkpoint (base + adapters).

Through `loomtrain train` (fp32, constant LR after warmup so a run cut at step 3 follows the
same schedule as one of 6 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import SMALL, TINY, losses, one_line, run_loomtrain

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,v,o,down]"]
COMMON = [
    *SMALL,
    *LORA,
    "train.global_batch_size=8",
    "train.lr=1e-2",
    "train.lr_schedule=constant",
    "eval.every_steps=0",
    "eval.num_samples=0",
    "log.tensorboard=false",
    "log.progress=plain",
    "checkpoint.every_steps=3",
]
TOL = 1e-5

pytestmark = pytest.mark.slow


def _train(run_dir: Path, cache: Path, *extra: str, nproc: int = 1, rc: int | None = 0):
    return run_loomtrain(
        "train", TINY, *COMMON, f"run.dir={run_dir}", f"data.cache_dir={cache}", *extra, nproc=nproc, rc=rc
    )


def test_adapter_checkpoint_resumes_exactly_and_refuses_another_base(tmp_path):
    cache = tmp_path / "cache"
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    banner = _train(whole, cache, "train.max_steps=6").stdout
    assert "loomtrain: LoRA rank 4 on q, v, o, down: 4,736 adapter params train" in banner, banner[:2000]
    _train(cut, cache, "train.max_steps=3")

    ckpt = cut / "checkpoints" / "step_00000003"
    names = list(json.loads((ckpt / "model" / "index.json").read_text())["params"])
    assert names and all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in names), names
    assert len(names) == 2 * 4 * 2  # 2 layers x targets q, v, o, down x (A, B)
    base = json.loads((ckpt / "trainer.json").read_text())["lora_base"]
    assert base["init_from"] == "" and len(base["sha256"]) == 64

    # another base: the seeded init of another seed
    proc = _train(cut, cache, "train.max_steps=6", "train.seed=7", rc=None)
    assert proc.returncode != 0
    line = one_line(proc.stderr)
    assert "trained on the seeded init" in line and "not on this run's base" in line, line

    # resume at tp 2 x dp 2, ZeRO 2: steps 4-6 as the uninterrupted run's
    _train(cut, cache, "train.max_steps=6", "parallel.tp=2", "parallel.zero_stage=2", nproc=4)
    ref, got = losses(whole), losses(cut)
    assert sorted(got) == [1, 2, 3, 4, 5, 6], got
    diff = max(abs(ref[s] - got[s]) for s in (4, 5, 6))
    print(f"\nLoRA resume at step 3 (tp1 -> tp2 x dp2 ZeRO 2): max |loss diff| steps 4-6 = {diff:.2e}")
    assert diff <= TOL, (ref, got)
    assert ref[6] < ref[1] - 0.1

    # generate reads final/ (written merged at tp 2) and a checkpoint (base + adapters) alike
    argv = ["--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    from_final = run_loomtrain("generate", cut, *argv).stdout
    from_ckpt = run_loomtrain("generate", cut / "checkpoints" / "step_00000006", *argv).stdout
    assert from_final == from_ckpt and from_final.startswith("def "), (from_final, from_ckpt)
