"""Building what the loop runs on: topology, model, data. One function each.

Seams:
* `build_model`: tensor parallelism is `parallelize` here (issue 5); building a
  large model on the meta device for a dry run (issue 6) also belongs here.
* `build_data`: the embedded corpus or a shard directory -> tokenizer + this DP
  rank's training stream; `val_stream` builds a fresh, reproducible eval stream.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.config_loader import ConfigError
from loomtrain.launcher.distributed import DistEnv, barrier


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch (CPU and CUDA) RNGs; the model init has its own seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_topology(cfg: RunConfig, env: DistEnv):
    from loomtrain.parallel import Topology

    try:
        return Topology(env.world_size, env.rank, cfg.parallel.tp, model_cfg=cfg.model)
    except ValueError as exc:  # check_tp's one-line message names parallel.tp
        raise ConfigError(str(exc)) from exc


def build_model(cfg: RunConfig, topology, device: torch.device) -> torch.nn.Module:
    """The full model from train.seed (identical on every rank), then sharded in place; with
    model.init_from, its weights then replace the random ones (an optimizer starts fresh)."""
    from loomtrain.model import Transformer
    from loomtrain.parallel import parallelize

    model = Transformer(cfg.model, seed=cfg.train.seed)
    model = parallelize(model, topology, sequence_parallel=cfg.parallel.sequence_parallel)
    if cfg.model.init_from:  # the random init is replaced: each rank reads only its TP slice
        from loomtrain.launcher.checkpoints.weight_source import init_from

        init_from(model, cfg.model, log=print if topology.rank == 0 else (lambda *a: None))
    apply_block_options(model, cfg)
    # DeepSpeed casts parameters to bf16/fp16 but not buffers; the RoPE / sinusoidal
    # tables must follow or they promote activations back to fp32.
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    return model.to(device=device, dtype=dtype)


def apply_block_options(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """parallel.activation_checkpointing, then parallel.compile, on every block (in place).

    Both act per block, as torchtitan applies them, and leave parameter names alone:
    `block.compile()` (nn.Module.compile) rather than `torch.compile(model)`, whose
    `_orig_mod.` prefix breaks checkpoint resumes (nanoGPT #325). Per block, one graph
    serves every layer, and the output layer's chunked loss loop stays eager."""
    if cfg.parallel.activation_checkpointing:
        from loomtrain.launcher.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    if cfg.parallel.compile:
        for block in model.blocks:
            block.compile()
    return model


def data_cache_dir(cfg: RunConfig) -> Path:
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir)
    return Path(cfg.run.dir).absolute().parent / ".data_cache"


def build_data(cfg: RunConfig, topology, env: DistEnv, log=print):
    """-> (shard_dir, tokenizer, train_stream). Rank 0 prepares the data first.
    shard_dir is one directory, or for data.sources the list [(dir, weight), ...]."""
    from loomtrain.data_pipeline import TokenStream, prepare_sources

    cache = data_cache_dir(cfg)
    quiet = (lambda *a, **k: None)
    if env.rank == 0:
        shard_dir, tok = prepare_sources(cfg.data, cache, log=log)
    barrier()
    if env.rank != 0:
        shard_dir, tok = prepare_sources(cfg.data, cache, log=quiet)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: expected at least the tokenizer's vocabulary size {tok.vocab_size} "
            f"(data.tokenizer={cfg.data.tokenizer}), got {cfg.model.vocab_size}"
        )
    t = cfg.train
    stream = TokenStream(
        shard_dir, "train", seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
        dp_rank=topology.dp_rank, dp_size=topology.dp_size, seed=t.seed,
        prefetch=cfg.data.prefetch, expected_tokenizer_hash=tok.hash,
    )
    return shard_dir, tok, stream


def val_stream(cfg: RunConfig, shard_dir, topology, tok):
    """A fresh validation stream: the same batches at every evaluation."""
    from loomtrain.data_pipeline import TokenStream

    t = cfg.train
    return TokenStream(
        shard_dir, "val", seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
        dp_rank=topology.dp_rank, dp_size=topology.dp_size, seed=t.seed,
        prefetch=0, expected_tokenizer_hash=tok.hash,
    )


def run_dir(cfg: RunConfig) -> Path:
    return Path(os.path.expanduser(cfg.run.dir))
