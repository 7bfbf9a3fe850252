"""A whole model of this process written as a run's final/, for the tests of what reads one
(export, generate, the messages): final.write_final, the protocol `loomtrain import` uses."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from loomtrain.launcher.checkpoints.final import write_final


def save_final(model: torch.nn.Module, model_cfg, tokenizer, out_dir: str | os.PathLike) -> Path | str:
    """The final directory from a whole model in this process (a tied table stored once)."""
    # Copies, not the live tensors: at ZeRO 1-2 every parameter is a view into DeepSpeed's
    # flat buffer. A tied table is stored once.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.tok_emb.weight:
        state.pop("lm_head.weight")
    return write_final(state, model_cfg, tokenizer, out_dir)
