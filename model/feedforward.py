"""Position-wise feed-forward network: down(act(up(x))) for ReLU/GELU (exact or tanh),
down(silu(gate(x)) * up(x)) for SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.activation = cfg.activation
        hidden = cfg.ffn_dim
        self.up = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        if cfg.activation == "swiglu":  # Shazeer 2020
            self.gate = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.activation == "relu":
            return self.down(F.relu(self.up(x)))
        if self.activation == "gelu_tanh":
            return self.down(F.gelu(self.up(x), approximate="tanh"))
        return self.down(F.gelu(self.up(x)))  # exact (erf) GELU
