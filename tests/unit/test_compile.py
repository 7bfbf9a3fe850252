"""parallel.compile: torch.compile per block trains like eager, and checkpoints move freely
between compiled and eager runs (parameter names unchanged; nanoGPT #325's `_orig_mod.`)."""

from __future__ import annotations

from pathlib import Path

import launch
import pytest
from launch import TINY
from loomtrain.launcher.config_loader import ConfigError, load_config

SMALL = [
    *launch.SMALL,
    *launch.QUIET,
    "train.max_steps=4",
    "checkpoint.every_steps=2",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(run_dir: Path, cache: Path, *extra: str):
    return load_config(TINY, [*SMALL, f"run.dir={run_dir}", f"data.cache_dir={cache}", *extra])


@pytest.mark.slow  # compiles the step, ~11 s
def test_compiled_run_matches_eager_and_its_checkpoint_resumes_eagerly(tmp_path):
    from loomtrain.launcher.hooks import Hooks
    from loomtrain.launcher.training.loop import run_training
    from safetensors import safe_open

    class CountGraphs(Hooks):  # the blocks really ran compiled: dynamo captured their frames
        def on_train_end(self, ctx):
            from torch._dynamo.utils import counters

            self.frames = counters["stats"]["unique_graphs"]
            self.compiled = all(b._compiled_call_impl is not None for b in ctx.model.blocks)

    cache = tmp_path / "cache"
    eager = run_training(_cfg(tmp_path / "eager", cache))
    seen = CountGraphs()
    compiled = run_training(_cfg(tmp_path / "compiled", cache, "parallel.compile=true"), hooks=[seen])
    assert seen.compiled and seen.frames >= 1
    assert compiled.losses == pytest.approx(eager.losses, abs=1e-4)

    ckpt = tmp_path / "compiled" / "checkpoints" / "step_00000002"
    resumed = run_training(_cfg(tmp_path / "resumed", cache, f"checkpoint.resume={ckpt}"))
    assert resumed.steps == [3, 4]
    assert resumed.losses == pytest.approx(compiled.losses[2:], abs=1e-4)

    with safe_open(ckpt / "model" / "rank_00000.safetensors", "pt") as f:
        names = set(f.keys())
    assert "blocks.0.attn.wq.weight" in names and not any("_orig_mod" in n for n in names)


def test_compile_without_a_cxx_compiler_on_cpu_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ConfigError, match="parallel.compile"):
        _cfg(tmp_path, tmp_path, "parallel.compile=true", "train.device=cpu")
