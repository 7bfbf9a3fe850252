"""Export of a LoRA checkpoint as one model: W + alpha/rank * B A in every adapted layer.

A LoRA checkpoint holds the adapters only (see lora_base.py). `merge_adapters` (which
export.open_source calls) turns export's Source of such a checkpoint into a Source of the
merged model: it rebuilds the base from where the checkpoint says it came from
(model.init_from, or the seeded init), checks it against the checkpoint's sha256
(BaseMismatch, one line, otherwise), and reads each adapted weight merged. The adapters stay
at `source.adapters` ((shapes, read)) for --format peft.
(final/ of a LoRA run is merged when written: lora_final.py.)
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from loomtrain.launcher.checkpoints.lora_base import KEY, compute_reference
from loomtrain.launcher.checkpoints.safetensors_source import model_tensor_names
from loomtrain.launcher.checkpoints.store import read_checkpoint_file
from loomtrain.launcher.checkpoints.weight_source import open_source
from loomtrain.model import init_tensors
from loomtrain.model.lora import is_adapter, merge


class BaseMismatch(ValueError):
    """The base named by model.init_from (or the seed) is not the one the adapters were trained on."""


def _base_tensors(cfg, seed: int, trainer: dict) -> Callable[[str], torch.Tensor]:
    """The base's full tensors by loomtrain name, after checking it against the checkpoint's sha256."""
    try:
        saved, ref = trainer.get(KEY) or {}, compute_reference(cfg, seed)
    except ValueError as exc:  # the base is gone, or a model id not in the cache
        raise BaseMismatch(str(exc)) from None
    if saved.get("sha256") != ref["sha256"]:
        where = f"model.init_from={cfg.init_from}" if cfg.init_from else f"the seeded init (train.seed={seed})"
        raise BaseMismatch(
            f"the checkpoint's LoRA adapters were trained on a base with sha256 {saved.get('sha256', '?')[:12]}; "
            f"{where} now has {ref['sha256'][:12]}"
        )
    if cfg.init_from:
        return open_source(cfg.init_from).read
    tensors = dict(init_tensors(cfg, seed))  # a seeded base is rebuilt whole (small models: tests, tiny runs)
    return tensors.__getitem__


def merge_adapters(source, ckpt, run: dict):
    """export's Source of checkpoint `ckpt` (its config.yaml: `run`), changed in place into a
    Source of the merged model when it holds LoRA adapters; returned as it is otherwise."""
    adapters, read = {n for n in source.shapes if is_adapter(n)}, source.read
    if not adapters:
        return source
    trainer = json.loads(read_checkpoint_file(ckpt, "trainer.json"))
    cfg = source.cfg
    base = _base_tensors(cfg, int(run["train"]["seed"]), trainer)
    scale = cfg.lora.scale
    shapes = {n: list(shape) for n, shape in model_tensor_names(cfg).items()}

    def get(name: str) -> torch.Tensor:
        w = base(name).float()
        layer = name.removesuffix(".weight")
        if f"{layer}.lora_A" in adapters:
            return merge(w, read(f"{layer}.lora_A").float(), read(f"{layer}.lora_B").float(), scale)
        return w

    source.adapters = (dict(source.shapes), source.read)  # for --format peft
    source.shapes, source.read, source.what = shapes, get, f"{source.what} (LoRA adapters merged)"
    return source
