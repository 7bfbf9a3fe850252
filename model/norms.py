"""Normalisation layers: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed by torch's fused F.rms_norm."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(kind: str, dim: int, eps: float, bias: bool) -> nn.Module:
    """`layernorm` (with a bias only when the model has linear biases) or `rmsnorm`."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"model.norm: {kind!r} is not one of layernorm, rmsnorm")
