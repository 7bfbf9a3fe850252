"""KV cache for incremental decoding: one preallocated K/V buffer pair per layer."""

from __future__ import annotations

import torch


class LayerKV:
    """Keys and values of one attention layer, [B, n_kv_heads, capacity, head_dim], filled from the left.

    The buffers are allocated on the first `update`, with that call's shapes,
    dtype and device, so a tensor-parallel model (local head counts) needs no
    special handling.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, H_kv, T, D]; return all keys and values so far."""
        b, h, t, d = k.shape
        if self.k is None:
            self.k = k.new_empty(b, h, self.capacity, d)
            self.v = v.new_empty(b, h, self.capacity, v.shape[-1])
        end = self.length + t
        if end > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {t} tokens > capacity {self.capacity}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Per-layer caches for a Transformer; `length` is the number of positions already seen."""

    def __init__(self, n_layers: int, capacity: int) -> None:
        self.layers = [LayerKV(capacity) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def __getitem__(self, i: int) -> LayerKV:
        return self.layers[i]
