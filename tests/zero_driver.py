"""Test driver: several training runs in one launch (one process, or one torchrun of N).

    python -m torch.distributed.run --nproc_per_node 4 tests/zero_driver.py OUT CONFIG \
        --common k=v ... --variant NAME k=v ... --variant NAME2 k=v ...

Each variant is `run_training(load_config(CONFIG, common + variant + run.dir=OUT/NAME))`
in the same process group, so a test pays for process start-up and the DeepSpeed import
once. A variant argument `faults:SPEC` plans test faults (tests/fault_plugin.py,
e.g. `faults:nan:0:2,nan:0:4-5`) for that variant; a NonFiniteError that stops it is
written to OUT/NAME/stopped.txt. After the first optimizer step a hook measures what this rank holds
(loomtrain.launcher.planning.memory_measure) and writes OUT/NAME/memory.rank{R}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fault_plugin
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.hooks import Hooks
from loomtrain.launcher.planning.memory_measure import GradPeak, measure
from loomtrain.launcher.training.loop import run_training
from loomtrain.launcher.training.nonfinite import NonFiniteError


class MeasureMemory(Hooks):
    def __init__(self, out: Path):
        self.out, self.peak = out, None

    def on_train_start(self, ctx) -> None:
        self.peak = peak = GradPeak(ctx.engine)
        backward = ctx.engine.backward

        def backward_then_sample(*args, **kwargs):  # ZeRO-2/3 partitions fill at the very end
            out = backward(*args, **kwargs)
            peak.sample()
            return out

        ctx.engine.backward = backward_then_sample

    def on_step_end(self, ctx, metrics) -> None:
        if ctx.state.step != 1:
            return
        result = measure(ctx.engine, self.peak)
        result["local_params"] = sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in ctx.engine.module.parameters()
        )
        result["tp"], result["dp"] = ctx.topology.tp_size, ctx.topology.dp_size
        self.peak.remove()
        (self.out / f"memory.rank{ctx.dist.rank}.json").write_text(json.dumps(result))


def parse(argv: list[str]):
    out, config, rest = Path(argv[0]), argv[1], argv[2:]
    common, variants, current = [], [], None
    for arg in rest:
        if arg == "--common":
            current = common
        elif arg == "--variant":
            current = None
        elif current is None:
            variants.append((arg, []))
            current = variants[-1][1]
        else:
            current.append(arg)
    return out, config, common, variants


def main(argv: list[str]) -> int:
    out, config, common, variants = parse(argv)
    for name, overrides in variants:
        run_dir = out / name
        keys = [o for o in overrides if not o.startswith("faults:")]
        cfg = load_config(config, [*common, *keys, f"run.dir={run_dir}"])
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = ",".join(o[len("faults:") :] for o in overrides if o.startswith("faults:"))
        try:
            with fault_plugin.planned(spec):
                run_training(cfg, hooks=[MeasureMemory(run_dir)])
        except NonFiniteError as exc:
            (run_dir / "stopped.txt").write_text(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
