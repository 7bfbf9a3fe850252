"""The dense [B, 1, T, T] mask of packed documents: the reference MaskSpec's description is
compared with (the model itself never builds it)."""

from __future__ import annotations

import torch
from loomtrain.model.masking import causal_mask


def document_mask(document_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, T] document ids -> bool [B, 1, T, T]: True where query i may attend key j (the same
    document, j <= i, and i - j < window when there is one)."""
    pos = torch.arange(document_ids.shape[1], device=document_ids.device)
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    return same & causal_mask(pos, pos, window)
