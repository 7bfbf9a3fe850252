"""LoRA on a tensor-parallel model: adapters on the column- and row-parallel shards.

Applied after `parallelize` (as peft wraps a plain model, this wraps the sharded one), with
factors shaped from the local shard and laid out by `plan.shard_spec`:

    column-parallel (wq, wk, wv, up, gate)   A [r, in] replicated, B [out/tp, r] split like
        the output. The layer's input is already TP-ready (the plan's copy_to_tp / gather_seq
        hook, whose backward sums dx over TP, LoRA's share included); each rank's dA covers its
        own output columns only, so A's gradient is summed over TP.
    row-parallel (wo, down)                  A [r, in/tp] split like the input, B [out, r]
        replicated. x_local A_local^T is a partial sum, so the LoRA term is added to the
        layer's partial output BEFORE its all-reduce (SP: reduce-scatter): one collective
        serves both. B's gradient, computed from the partial u, is summed over TP.

A KV projection replicated on m ranks (fewer KV heads than tp) replicates its B the same way
(gradient summed over those m ranks, only the first owns it for norms).
Replicated factors carry no `tensor_model_parallel`, so DeepSpeed's clip norm counts them
once; split ones carry it (plan.attach_spec). At tp 1 this is loomtrain.model.lora.apply_lora.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loomtrain.model.lora import LoraAdapter, LoraConfig, adapt_layers, apply_lora, init_lora_a
from loomtrain.parallel.layers import ColumnParallelLinear, RowParallelLinear
from loomtrain.parallel.plan import attach_spec, grad_all_reduce_hook, shard_spec, shard_tensor, spec_of
from torch import nn


class LoraColumnParallelLinear(LoraAdapter, ColumnParallelLinear):
    """A ColumnParallelLinear (input_mode "none": the plan's hook made x TP-ready) plus LoRA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_delta(x)


class LoraRowParallelLinear(LoraAdapter, RowParallelLinear):
    """A RowParallelLinear whose partial output includes the LoRA term before the reduction
    (RowParallelLinear.forward with one more addend)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight) + self.lora_delta(x))


def _wrap(layer: nn.Module, name: str, cfg: LoraConfig, model_cfg, topology, seed: int) -> None:
    """Turn a sharded layer into its LoRA kind in place (class swap: its hooks, attributes and
    parameter names stay) and give it this rank's factors."""
    tp, r, rank = topology.tp_size, topology.tp_rank, cfg.rank
    if isinstance(layer, ColumnParallelLinear):
        if layer.input_mode != "none" or layer.gather_output:
            raise ValueError(f"model.lora.targets: {name} is not a plain column-parallel projection")
        in_full, out_full = layer.in_features, layer.full_out_features
        layer.__class__ = LoraColumnParallelLinear
    elif isinstance(layer, RowParallelLinear):
        in_full, out_full = spec_of(layer.weight).full_shape[1], layer.out_features
        layer.__class__ = LoraRowParallelLinear
    else:
        raise TypeError(f"{name}: expected a column- or row-parallel layer, got {type(layer).__name__}")
    spec_a = shard_spec(f"{name}.lora_A", (rank, in_full), model_cfg, tp, r)
    spec_b = shard_spec(f"{name}.lora_B", (out_full, rank), model_cfg, tp, r)
    layer.init_adapter(
        shard_tensor(init_lora_a(name, rank, in_full, seed), spec_a), spec_b.local_shape[0], cfg.scale, cfg.dropout
    )
    attach_spec(layer.lora_A, spec_a)
    attach_spec(layer.lora_B, spec_b)
    tag = f"{name}.lora_grad"
    if isinstance(layer, LoraColumnParallelLinear):
        layer.lora_A.register_hook(grad_all_reduce_hook(topology.tp_group, tag))
        if spec_b.replicas > 1:  # a replicated KV head: keep B's replicas equal, as the weight's
            layer.lora_B.register_hook(grad_all_reduce_hook(topology.tp_subgroup(spec_b.replicas), tag))
    else:
        layer.lora_B.register_hook(grad_all_reduce_hook(topology.tp_group, tag))


def apply_lora_parallel(model: nn.Module, cfg: LoraConfig, topology=None, seed: int = 0) -> nn.Module:
    """Adapters on `model` (plain, or parallelized for `topology`), base frozen; in place.
    Every TP rank must call it. A no-op when cfg.rank is 0."""
    if not cfg.enabled:
        return model
    if topology is None or topology.tp_size == 1:
        return apply_lora(model, cfg, seed)

    def wrap(name: str, parent: nn.Module, attr: str) -> None:
        _wrap(getattr(parent, attr), name, cfg, model.cfg, topology, seed)

    return adapt_layers(model, cfg, wrap)
