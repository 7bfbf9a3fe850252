"""Causal multi-head self-attention with grouped KV heads (MHA, GQA, MQA), RoPE or ALiBi.

Packed documents: `document_mask(document_ids)` is the boolean [B, 1, T, T] mask that keeps
each query inside its own document (and causal); it is per sequence and broadcast over the
heads, so a TP rank's local heads and sequence parallelism (attention sees the whole
sequence) use it as it is. This is the one place that builds it: a GPU kernel that takes
document lengths instead (FlashAttention's varlen, flex attention's block mask) would be
chosen here, not in the model.

Tensor-parallel contract: forward reads the head counts from the attributes
`n_heads`, `n_kv_heads`, `head_dim` and the ALiBi slopes from the buffer
`alibi_slopes` [n_heads], so a plan that swaps wq/wk/wv/wo for sharded
Linears, sets the local head counts and slices the slopes needs nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import LayerKV
from .config import ModelConfig
from .positions import alibi_bias, alibi_slopes, apply_rope


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> bool [B, 1, T, T]: True where query i may attend key j (the same
    document, j <= i). For SDPA on any device: its math and memory-efficient kernels take it."""
    t = document_ids.shape[1]
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    return same & torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, causal: bool = True) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        # Set `causal = False` to attend to every position (bidirectional; used by tests).
        self.causal = causal
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        slopes = alibi_slopes(cfg.n_heads) if cfg.positions == "alibi" else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerKV | None = None,
        doc_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]. `rope` = (cos, sin) sliced to these T positions
        ([T, head_dim], or [B, 1, T, head_dim] for per-document positions); with `cache`, x holds
        the new positions only and earlier keys/values come from the cache. `doc_mask`: the
        packed documents' mask (`document_mask`), replacing the plain causal one."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        start = 0
        if cache is not None:
            start = cache.length
            k, v = cache.update(k, v)
        s = k.shape[2]
        # Grouped KV heads: on CPU SDPA broadcasts them itself (enable_gqa, no copy); on GPUs
        # the memory-efficient kernel (float masks: ALiBi) lacks GQA, so repeat the heads there.
        gqa = self.n_kv_heads != self.n_heads and x.device.type == "cpu"
        if self.n_kv_heads != self.n_heads and not gqa:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)

        mask, is_causal = None, False
        if self.alibi_slopes is not None:
            q_pos = torch.arange(start, start + t, device=x.device)
            mask = alibi_bias(self.alibi_slopes, q_pos, torch.arange(s, device=x.device), self.causal).to(q.dtype)
            if doc_mask is not None:  # i - j inside one document is the distance of its own positions
                mask = mask.masked_fill(~doc_mask, float("-inf"))
        elif doc_mask is not None:
            mask = doc_mask
        elif self.causal and t > 1:
            if start == 0:
                is_causal = True
            else:  # new queries at positions start.. see every cached key and the new ones up to themselves
                mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=start)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            enable_gqa=gqa,
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))
