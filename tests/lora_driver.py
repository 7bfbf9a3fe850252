"""Test driver for LoRA runs: tests/zero_driver.py's variants, plus a digest of the frozen base.

    python -m torch.distributed.run --nproc_per_node 4 tests/lora_driver.py OUT CONFIG \
        --common k=v ... --variant NAME k=v ...

Besides what zero_driver writes, each rank writes OUT/NAME/base.rank{R}.json: the sha256 of
every frozen parameter's bytes when training starts (after any resume) and when it ends, the
names of the trainable parameters, the size of Adam's moments on this rank, and the dtypes of
the frozen base and of the moments.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from loomtrain.launcher.checkpoints.ds_state import inner_optimizer
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.hooks import Hooks
from loomtrain.launcher.training.loop import run_training
from zero_driver import parse


def _digests(model) -> dict[str, str]:
    return {
        n: hashlib.sha256(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for n, p in model.named_parameters()
        if not p.requires_grad
    }


class BaseDigest(Hooks):
    def __init__(self, out: Path):
        self.out, self.start = out, {}

    def on_train_start(self, ctx) -> None:
        self.start = _digests(ctx.engine.module)

    def on_train_end(self, ctx) -> None:
        trainable = [n for n, p in ctx.engine.module.named_parameters() if p.requires_grad]
        states = inner_optimizer(ctx.engine.optimizer).state.values()
        record = {"start": self.start, "end": _digests(ctx.engine.module), "trainable": trainable}
        # Adam's moments on this rank (ZeRO >= 1: this DP rank's partition of the flat trainables)
        record["exp_avg_numel"] = sum(s["exp_avg"].numel() for s in states if "exp_avg" in s)
        record["trainable_numel"] = sum(p.numel() for p in ctx.engine.module.parameters() if p.requires_grad)
        record["base_dtypes"] = sorted({str(p.dtype) for p in ctx.engine.module.parameters() if not p.requires_grad})
        record["moment_dtypes"] = sorted({str(s["exp_avg"].dtype) for s in states if "exp_avg" in s})
        (self.out / f"base.rank{ctx.dist.rank}.json").write_text(json.dumps(record))


def main(argv: list[str]) -> int:
    out, config, common, variants = parse(argv)
    for name, overrides in variants:
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = load_config(config, [*common, *overrides, f"run.dir={run_dir}"])
        run_training(cfg, hooks=[BaseDigest(run_dir)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
