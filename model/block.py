"""One transformer block: self-attention and feed-forward, each with a residual connection.

pre  (GPT-2 and later): x = x + drop(f(norm(x)))
post (the 2017 original): x = norm(x + drop(f(x)))
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .cache import LayerKV
from .config import ModelConfig
from .feedforward import FeedForward
from .masking import MaskSpec
from .norms import build_norm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre = cfg.norm_placement == "pre"
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.attn = Attention(cfg)
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.ffn = FeedForward(cfg)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerKV | None = None,
        mask: MaskSpec | None = None,
    ) -> torch.Tensor:
        if self.pre:
            x = x + self.resid_drop(self.attn(self.attn_norm(x), rope, cache, mask))
            return x + self.resid_drop(self.ffn(self.ffn_norm(x)))
        x = self.attn_norm(x + self.resid_drop(self.attn(x, rope, cache, mask)))
        return self.ffn_norm(x + self.resid_drop(self.ffn(x)))
