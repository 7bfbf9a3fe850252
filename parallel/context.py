"""Context parallelism (parallel.cp), applied from outside the model as the TP plan is.

Each sequence of T tokens is cut into 2 x cp chunks of T / (2 cp); CP rank i computes chunks i
and 2cp-1-i (`chunk_index`), so that under causal attention every rank has the same work (an
early chunk sees few keys, its partner many). Every rank of a CP group reads the same window
from the data stream (which splits samples over the data ranks only, see Topology): a forward
pre-hook on the model cuts this rank's tokens, targets and the window's description
(`WindowSlice`: positions in the window, for RoPE, learned or sinusoidal positions and masks;
document ids stay the whole window's, so per-document positions and masks are the global ones).
Token ids of a whole window are O(T) integers: cutting them after the stream keeps the stream,
its position, resume and DP-size changes exactly as they are.

Attention exchanges keys and values with an all-gather over the CP group (`Attention.kv_exchange`,
set here): each rank's local queries attend every key of the window, masked by global positions,
document ids and the sliding window (loomtrain.model.masking). Chosen over a ring for its
simplicity: one all-gather of K and V per layer (backward: one reduce-scatter of dK and dV,
collectives.gather_kv); it holds the window's K and V ([B, Hkv, T, hd] per layer, while the
layer runs), not its activations: everything else (the embedding, norms, FFN, the output layer
and its loss) is local, T / cp tokens.

Gradients: CP ranks hold the same parameters, and each one's gradients are partial sums over its
tokens; DeepSpeed's data-parallel group is data x cp (Topology, MPU), and the loop weights each
rank's mean loss by its share of the global batch's targets, so the average over that group is
the gradient of the mean over every target token, as without CP.

Forwards with a KV cache, or without targets (logits for generation), run whole on every rank.
"""

from __future__ import annotations

import torch
from loomtrain.model.masking import WindowSlice
from loomtrain.parallel import collectives as C
from torch import nn


def chunk_index(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """[2 * seq_len / (2 cp)] positions of CP rank cp_rank's chunks i and 2cp-1-i, ascending."""
    c = seq_len // (2 * cp)
    if c * 2 * cp != seq_len:
        raise ValueError(f"parallel.cp={cp}: sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)
    return torch.cat([first, second])


class KVExchange:
    """Attention.kv_exchange for one CP group: the window's keys and values, in window order."""

    def __init__(self, group, cp: int, tag: str) -> None:
        self.group, self.cp, self.tag = group, cp, tag
        self._order: dict = {}

    def order(self, local: int, device) -> torch.Tensor:
        """Where each window position sits in the all-gathered (rank-order) keys."""
        key = (local, str(device))
        if key not in self._order:
            seq_len = local * self.cp
            gathered = torch.cat([chunk_index(seq_len, self.cp, r) for r in range(self.cp)])
            self._order[key] = torch.argsort(gathered).to(device)
        return self._order[key]

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = k.shape[1]
        both = C.gather_kv(torch.cat([k, v], dim=1), self.group, self.tag)  # one all-gather a layer
        both = both.index_select(2, self.order(k.shape[2], k.device))
        return both[:, :heads], both[:, heads:]


def _slice_hook(cp: int, cp_rank: int):
    def hook(module, args, kwargs):
        kwargs = {**kwargs, **dict(zip(("tokens", "cache", "targets", "document_ids"), args))}  # positionals by name
        tokens, targets = kwargs.get("tokens"), kwargs.get("targets")
        if targets is None or kwargs.get("cache") is not None or kwargs.get("window_slice") is not None:
            return None
        idx = chunk_index(tokens.shape[1], cp, cp_rank, tokens.device)
        kwargs.update(targets=targets[:, idx], window_slice=WindowSlice(idx, tokens.shape[1]))
        return (tokens[:, idx],), {k: v for k, v in kwargs.items() if k != "tokens"}

    return hook


def apply_context_parallel(model: nn.Module, topology) -> nn.Module:
    """Split every loss forward of `model` (a Transformer, TP plan applied or not) over the CP
    group of `topology`, in place; a no-op at cp 1. Returns the model."""
    cp = getattr(topology, "cp_size", 1)
    if cp == 1:
        return model
    model.register_forward_pre_hook(_slice_hook(cp, topology.cp_rank), with_kwargs=True)
    for i, block in enumerate(model.blocks):
        block.attn.kv_exchange = KVExchange(topology.cp_group, cp, f"blocks.{i}.cp_kv")
    return model


def stand_in_context_parallel(model: nn.Module, cp: int) -> nn.Module:
    """CP rank 0 of `cp`, alone (`loomtrain dryrun`): its tokens cut as in a cluster run, and an
    exchange that tiles its own keys and values cp times, so the window's K/V have the shapes,
    memory and attention work of the all-gathered ones (not their values). No-op at cp 1."""
    if cp == 1:
        return model
    model.register_forward_pre_hook(_slice_hook(cp, 0), with_kwargs=True)

    def tiled(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k.repeat(1, 1, cp, 1), v.repeat(1, 1, cp, 1)

    for block in model.blocks:
        block.attn.kv_exchange = tiled
    return model
