"""Full activation checkpointing per transformer block, applied from outside the model.

Like torchtitan's `apply_ac`, the model file knows nothing of it: each block of
`model.blocks` gets its forward wrapped in `torch.utils.checkpoint.checkpoint`
(non-reentrant, RNG state preserved so dropout recomputes identically). The forward is
replaced on the instance rather than by wrapping the module (torch's
`checkpoint_wrapper`), so parameter names -- and with them checkpoints, the TP plan
and export -- do not change. Only the block inputs stay alive between forward and
backward; the backward reruns each block's forward (TP collectives included) first.
Inference (no grad, or a KV cache) runs the plain forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward):
    def run(x, *args, **kwargs):
        cache = args[1] if len(args) > 1 else kwargs.get("cache")
        if not torch.is_grad_enabled() or cache is not None:
            return forward(x, *args, **kwargs)
        return checkpoint(forward, x, *args, use_reentrant=False, **kwargs)

    run.activation_checkpointed = True
    return run


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Checkpoint every block of `model.blocks` (in place; idempotent); returns the model."""
    for block in model.blocks:
        if not getattr(block.forward, "activation_checkpointed", False):
            block.forward = _checkpointed(block.forward)
    return model
