"""final/ of a LoRA run: the whole model, every adapted weight merged (W + alpha/rank * B A).

`final_params` lists the plain model's parameters, frozen base included, and reads each
adapted weight merged on this rank's shard. A local merge is exact under TP: a column-parallel
shard's rows are B_local A, a row-parallel shard's columns B A_local. So `generate`, `export`
and `model.init_from` read a LoRA run's final/ as a full model (final.save_final_sharded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from loomtrain.launcher.checkpoints.ds_state import named_params, read_local
from loomtrain.model.lora import LoraAdapter, is_adapter, merge


def final_params(engine) -> tuple[list, Callable]:
    """(named parameters final/ holds, read(name, param) -> this rank's fp32 values, whole over DP).
    Without adapters: the trainable parameters and their fp32 masters (read_local), as before.
    read is a collective over DP (ZeRO): every rank reads every parameter in the same order."""
    model = engine.module
    layers = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, LoraAdapter)}
    if not layers:
        return named_params(engine), lambda n, p: read_local(engine, p)

    def read(name: str, p: torch.Tensor) -> torch.Tensor:
        layer = layers.get(name)
        if layer is None:  # frozen: not in the optimizer, the parameter itself is the value
            return p.detach().float().clone()
        a, b = read_local(engine, layer.lora_A), read_local(engine, layer.lora_B)
        return merge(p.detach().float(), a, b, layer.scale)

    return [(n, p) for n, p in model.named_parameters() if not is_adapter(n)], read
