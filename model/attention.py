"""Causal multi-head self-attention with grouped KV heads (MHA, GQA, MQA), RoPE or ALiBi.

Which keys each query sees is described, not materialised (loomtrain.model.masking): a
`MaskSpec` of positions and document ids, O(T). Training forwards use SDPA's causal kernel for one
whole window without documents (and no binding window), else `blocked_attention`, which builds
each query block's mask from the description and recomputes scores in backward; generation with a
KV cache uses the dense `causal_mask` ([Tq, Tk], masking's one rule). Positions follow transformers'
sliding_window_causal convention: key j is seen by query i when i - window < j <= i.

Context parallelism hook (set from outside, by loomtrain.parallel.context; default None):
`kv_exchange(k, v) -> (k, v)` of the whole window, in window order, [B, Hkv, T_window, hd].
It is called only when the forward is given a slice of a window (`MaskSpec.sliced`), so the
model holds no rank logic: a plain model given a slice attends within it.

Qwen variants: `qkv_bias` gives wq/wk/wv biases without the other linears'; `qk_norm` is an
RMSNorm over head_dim on every head of q and k before RoPE (`q_norm`, `k_norm`).

Tensor-parallel contract: forward reads the head counts from the attributes
`n_heads`, `n_kv_heads`, `head_dim` and the ALiBi slopes from the buffer
`alibi_slopes` [n_heads], so a plan that swaps wq/wk/wv/wo for sharded
Linears, sets the local head counts and slices the slopes needs nothing else. q_norm and
k_norm act on each head alone, so every rank keeps them whole; the plan sums their gradients.

With the KV cache and a window, keys older than the first new query's window are left out of
the product (the cache itself still holds every position, up to its capacity).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import masking
from .cache import LayerKV
from .config import ModelConfig
from .masking import MaskSpec, causal_mask
from .norms import RMSNorm
from .positions import alibi_bias, alibi_slopes, apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, causal: bool = True) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = hd = cfg.head_width
        # Set `causal = False` to attend to every position (bidirectional; used by tests).
        self.causal = causal
        self.window = cfg.sliding_window
        self.dropout = cfg.dropout
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=cfg.bias)
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        slopes = alibi_slopes(cfg.n_heads) if cfg.positions == "alibi" else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        # Context parallelism sets it (see the module docstring); plain attention never calls it.
        self.kv_exchange = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerKV | None = None,
        mask: MaskSpec | None = None,
    ) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]. `rope` = (cos, sin) sliced to these T positions
        ([T, head_dim], or [B, 1, T, head_dim] for per-document positions); with `cache`, x holds
        the new positions only and earlier keys/values come from the cache. `mask`: which keys
        each query sees (packed documents, a slice of a window); None is one whole causal window."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        if cache is None and self.causal:
            if mask is not None and mask.sliced and self.kv_exchange is not None:
                k, v = self.kv_exchange(k, v)
                mask = mask.whole_window()
            y = self._attend(q, k, v, mask)
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))
        start = key_start = 0
        if cache is not None:
            start = cache.length
            k, v = cache.update(k, v)
            if self.window is not None:  # keys before the first query's window are never seen
                key_start = max(0, start - self.window + 1)
                k, v = k[:, :, key_start:], v[:, :, key_start:]
        s = k.shape[2]
        gqa, k, v = self._kv_heads(q, k, v)
        q_pos = torch.arange(start, start + t, device=x.device)
        k_pos = torch.arange(key_start, key_start + s, device=x.device)
        window_binds = self.window is not None and start + t - key_start > self.window
        allowed = None
        if self.causal and (window_binds or (t > 1 and start > 0)):
            allowed = causal_mask(q_pos, k_pos, self.window)
        mask_t, is_causal = allowed, allowed is None and self.causal and t > 1
        if self.alibi_slopes is not None:  # inside one document i - j is the distance of its own positions
            mask_t, is_causal = alibi_bias(self.alibi_slopes, q_pos, k_pos, self.causal).to(q.dtype), False
            if allowed is not None:
                mask_t = mask_t.masked_fill(~allowed, float("-inf"))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask_t,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            enable_gqa=gqa,
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def _kv_heads(self, q, k, v):
        """Grouped KV heads: on CPU SDPA broadcasts them itself (enable_gqa, no copy); on GPUs the
        memory-efficient kernel (float masks: ALiBi) lacks GQA, so repeat the heads there."""
        gqa = self.n_kv_heads != self.n_heads and q.device.type == "cpu"
        if self.n_kv_heads != self.n_heads and not gqa:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return gqa, k, v

    def _attend(self, q, k, v, mask: MaskSpec | None) -> torch.Tensor:
        """Causal training attention: SDPA's causal kernel for one whole window without documents
        or a binding window or ALiBi; else the described mask, block by block (dense under
        attention dropout, whose random masks a recomputing backward would not replay)."""
        t = q.shape[2]
        gqa, k, v = self._kv_heads(q, k, v)
        dropout = self.dropout if self.training else 0.0
        window = self.window if self.window is not None and self.window < k.shape[2] else None
        if (mask is None or mask.plain) and window is None and self.alibi_slopes is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=t > 1, enable_gqa=gqa)
        if mask is None:
            mask = MaskSpec.for_tokens(t, q.device)
        if dropout == 0.0:
            return masking.blocked_attention(q, k, v, mask, window, self.alibi_slopes, gqa)
        allowed = mask.dense(window)
        attn_mask = allowed
        if self.alibi_slopes is not None:
            bias = alibi_bias(self.alibi_slopes, mask.q_pos, mask.k_pos, True).to(q.dtype)
            attn_mask = bias.masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, enable_gqa=gqa)
