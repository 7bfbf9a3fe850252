"""LoRA (Hu et al. 2021): a frozen Linear plus a trainable low-rank update, in plain PyTorch.

    y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T        A [rank, in], B [out, rank]

B starts at zero, so a fresh adapter leaves the model's output unchanged; A starts as peft
initialises it (Kaiming-uniform, a = sqrt(5)), from a generator seeded per layer so every
rank (and every TP degree) draws the same full A.

`LoraConfig` is `model.lora` in the run config. Adapters are applied from outside the model,
as peft and torchtitan do (`apply_lora`; under tensor parallelism loomtrain.parallel.lora
wraps the sharded layers instead): `LoraLinear` keeps the wrapped layer's `weight` and `bias`
as its own attributes, so parameter names (`blocks.0.attn.wq.weight`) -- and with them
checkpoints, the TP layout and export -- are unchanged; the adapters add `<layer>.lora_A`
and `<layer>.lora_B`.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from .lora_config import PARENTS, TARGETS, LoraConfig

__all__ = ["TARGETS", "LoraConfig", "LoraLinear", "apply_lora"]


def init_lora_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The full A [rank, in_features] of the layer named `name` (plain-model name, e.g.
    blocks.0.attn.wq): peft's Kaiming-uniform (a = sqrt(5)) init, from a generator seeded by
    (seed, name) so every rank and every TP degree draws the same tensor."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on a [rank, in] matrix
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound


class LoraAdapter:
    """The adapter half of a LoRA layer, mixed into a layer that has `weight` (and `bias`):
    `lora_A` [rank, in], `lora_B` [out, rank] (zeros), `scale` and the adapter's dropout.
    Shared by `LoraLinear` and the tensor-parallel layers of loomtrain.parallel.lora, which
    pass their local shapes."""

    def init_adapter(self, lora_a: torch.Tensor, out_features: int, scale: float, dropout: float) -> None:
        dev = self.weight.device
        self.lora_A = nn.Parameter(lora_a.to(dev, torch.float32).contiguous())
        self.lora_B = nn.Parameter(torch.zeros(out_features, lora_a.shape[0], device=dev, dtype=torch.float32))
        self.scale = scale
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * dropout(x) A^T B^T, in x's dtype."""
        u = F.linear(self.lora_dropout(x).to(self.lora_A.dtype), self.lora_A)
        return (F.linear(u, self.lora_B) * self.scale).to(x.dtype)


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A, in W's dtype (computed in fp32): the weight a merged export holds."""
    delta = (lora_b.float() @ lora_a.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


class LoraLinear(LoraAdapter, nn.Module):
    """A frozen `nn.Linear`'s weight and bias plus a trainable rank-r update."""

    def __init__(self, base: nn.Linear, lora_a: torch.Tensor, scale: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.init_adapter(lora_a, self.out_features, scale, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_delta(x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.shape[0]}, scale={self.scale}"


def lora_layers(model: nn.Module, cfg: LoraConfig):
    """(plain-model name, parent module, attribute) of every Linear `cfg.targets` names in
    `model.blocks` (gate skipped where the FFN has none)."""
    for i, block in enumerate(model.blocks):
        for attr in cfg.modules():
            parent = getattr(block, PARENTS[attr])
            if hasattr(parent, attr):
                yield f"blocks.{i}.{PARENTS[attr]}.{attr}", parent, attr


def adapt_layers(model: nn.Module, cfg: LoraConfig, wrap) -> nn.Module:
    """`wrap(name, parent, attr)` on every layer `cfg.targets` names that has no adapter yet, then
    every parameter but the adapters stops taking gradients; in place, returns the model. Shared by
    `apply_lora` and loomtrain.parallel.lora, which wrap a layer each their own way."""
    wrapped = 0
    for name, parent, attr in lora_layers(model, cfg):
        if not isinstance(getattr(parent, attr), LoraAdapter):
            wrap(name, parent, attr)
            wrapped += 1
    if not wrapped and not any(isinstance(m, LoraAdapter) for m in model.modules()):
        raise ValueError(f"model.lora.targets: {cfg.targets!r} names no layer of this model")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> nn.Module:
    """Wrap the targeted Linears of a plain (unsharded) Transformer with `LoraLinear` and freeze
    everything else, in place; returns the model. A no-op when cfg.rank is 0."""
    if not cfg.enabled:
        return model

    def wrap(name: str, parent: nn.Module, attr: str) -> None:
        base = getattr(parent, attr)
        a = init_lora_a(name, cfg.rank, base.in_features, seed)
        setattr(parent, attr, LoraLinear(base, a, cfg.scale, cfg.dropout))

    return adapt_layers(model, cfg, wrap)


def is_adapter(name: str) -> bool:
    """Whether a parameter name (`blocks.0.attn.wq.lora_A`) is a LoRA factor."""
    return name.rsplit(".", 1)[-1] in ("lora_A", "lora_B")
