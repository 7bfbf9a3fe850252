"""Building what the loop runs on: topology, model, data. One function each.

Seams:
* `build_model`: the model on the meta device, the TP plan applied, then only this
  rank's shards materialised (loomtrain.parallel.materialize, which takes any (name, full
  tensor) supplier), from the seeded init or from model.init_from.
* `build_data`: the embedded corpus or a shard directory -> tokenizer + this DP
  rank's training stream; `val_stream` builds a fresh, reproducible eval stream.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from loomtrain.data_pipeline import DataError, TokenStream, prepare_sources
from loomtrain.data_pipeline.records import question_tokens
from loomtrain.data_pipeline.tokenizer import Tokenizer
from loomtrain.launcher.checkpoints.lora_base import base_reference
from loomtrain.launcher.checkpoints.weight_source import init_from
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.config_loader import ConfigError
from loomtrain.launcher.distributed import DistEnv, all_gather_objects, barrier
from loomtrain.launcher.rundir import checkpoint_location, data_cache_dir
from loomtrain.launcher.training import engine
from loomtrain.launcher.training.activation_checkpointing import apply_activation_checkpointing
from loomtrain.model import init_tensors
from loomtrain.model.masking import leave_out_of_compile
from loomtrain.parallel import Topology
from loomtrain.parallel.context import apply_context_parallel
from loomtrain.parallel.lora import apply_lora_parallel
from loomtrain.parallel.materialize import allocate_shards, materialize, sharded_meta_model
from loomtrain.parallel.topology import check_cp, check_tp, check_tp_placement


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch (CPU and CUDA) RNGs; the model init has its own seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_topology(cfg: RunConfig, env: DistEnv) -> Topology:
    """The TP x DP groups; refused (one line naming parallel.tp) before any group exists when
    the model cannot be split tp ways or a TP group would span hosts (parallel.allow_cross_host_tp)."""
    try:
        check_tp(cfg.model, cfg.parallel.tp, env.world_size)
        check_tp_placement(cfg.parallel.tp, env.hosts, cfg.parallel.allow_cross_host_tp)
        check_cp(cfg.parallel.cp, env.world_size, cfg.parallel.tp, cfg.train.seq_len)
        return Topology(env.world_size, env.rank, cfg.parallel.tp, model_cfg=cfg.model, cp=cfg.parallel.cp)
    except ValueError as exc:  # check_tp's, check_cp's and check_tp_placement's one-line messages name their key
        raise ConfigError(str(exc)) from exc


def build_model(cfg: RunConfig, topology: Topology, device: torch.device) -> torch.nn.Module:
    """This rank's shard of the model, without ever building the full model.

    Built on the meta device and parallelized there, then each parameter is materialised
    one at a time: its full tensor comes from the seeded init (`init_tensors(cfg.model,
    train.seed)`, identical on every rank), this rank's slice is kept on `device` in the
    training dtype and the full tensor dropped. At ZeRO-3 each parameter is also
    partitioned over DP as soon as it exists. Peak: the shards (ZeRO-3: partitions) plus
    about one full parameter.

    With model.init_from the shards are allocated empty and filled by `init_from`, each rank
    reading only its TP slices (an optimizer starts fresh); at ZeRO-3 they are partitioned
    after that, so such a rank briefly holds its whole TP shard."""
    model = sharded_meta_model(cfg.model, topology, cfg.parallel.sequence_parallel)
    model = apply_context_parallel(model, topology)  # parallel.cp: hooks only, no parameter changes
    # DeepSpeed casts parameters to bf16/fp16 but not buffers; materialize casts both, or the
    # RoPE / sinusoidal tables would promote activations back to fp32.
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    after = None
    if cfg.parallel.zero_stage == 3:
        after = engine.zero3_partitioner(cfg, topology, dtype or torch.float32)
    if cfg.model.init_from:
        allocate_shards(model, device=device, dtype=dtype)
        _init_from_on_every_rank(model, cfg, topology)
        if after is not None:
            for name, param in model.named_parameters():
                after(name, param)
    else:
        materialize(model, init_tensors(cfg.model, cfg.train.seed), device=device, dtype=dtype, after_param=after)
    return apply_block_options(_with_lora(model, cfg, topology), cfg)


def _init_from_on_every_rank(model: torch.nn.Module, cfg: RunConfig, topology: Topology) -> None:
    """model.init_from into this rank's shards; a refusal on any rank is every rank's. Each rank
    reads and checks only its own TP slices, so a NaN in one half of a tensor stops one rank: the
    others would go on into DeepSpeed's first collective and end in a gloo traceback. The ranks
    agree through the store (all_gather_objects) and each raises the first rank's one line."""
    error = None
    try:
        init_from(
            model,
            cfg.model,
            log=print if topology.rank == 0 else _quiet,
            run_dir=checkpoint_location(cfg),  # where a restart finds the run's checkpoints
            resume=cfg.checkpoint.resume,
        )
    except ConfigError as exc:
        error = str(exc)
    first = next((e for e in all_gather_objects(error) if e), None)
    if first is not None:
        raise ConfigError(first)


def _with_lora(model: torch.nn.Module, cfg: RunConfig, topology: Topology) -> torch.nn.Module:
    """model.lora: adapters on this rank's (sharded) layers, every other parameter frozen."""
    if not cfg.model.lora.enabled:
        return model
    try:
        model = apply_lora_parallel(model, cfg.model.lora, topology, seed=cfg.train.seed)
    except ValueError as exc:  # names model.lora.targets
        raise ConfigError(str(exc)) from exc
    model.lora_base = base_reference(cfg)  # which base the checkpoints' adapters belong to
    return model


def apply_block_options(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """parallel.activation_checkpointing, then parallel.compile, on every block (in place).

    Both act per block, as torchtitan applies them, and leave parameter names alone:
    `block.compile()` (nn.Module.compile) rather than `torch.compile(model)`, whose
    `_orig_mod.` prefix breaks checkpoint resumes (nanoGPT #325). Per block, one graph
    serves every layer, and the output layer's chunked loss loop stays eager."""
    if cfg.parallel.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.parallel.compile:
        leave_out_of_compile()
        for block in model.blocks:
            block.compile()
    return model


def _quiet(*args, **kwargs) -> None:
    """A log that drops everything: for ranks other than 0, which repeat rank 0's work quietly."""


def build_data(
    cfg: RunConfig, topology: Topology, env: DistEnv
) -> tuple[Path | list[tuple[Path, float]], Tokenizer, TokenStream]:
    """-> (shard_dir, tokenizer, train_stream). Rank 0 prepares the data first.
    shard_dir is one directory, or for data.sources the list [(dir, weight), ...]."""
    cache = data_cache_dir(cfg)
    if env.rank == 0:
        shard_dir, tok = prepare_sources(cfg.data, cache, log=print)
    barrier()
    if env.rank != 0:
        shard_dir, tok = prepare_sources(cfg.data, cache, log=_quiet)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: expected at least the tokenizer's vocabulary size {tok.vocab_size} "
            f"(data.tokenizer={cfg.data.tokenizer}), got {cfg.model.vocab_size}"
        )
    return shard_dir, tok, _stream(cfg, shard_dir, "train", topology, tok, prefetch=cfg.data.prefetch)


def val_stream(cfg: RunConfig, shard_dir, topology: Topology, tok: Tokenizer) -> TokenStream:
    """A fresh validation stream: the same batches at every evaluation."""
    return _stream(cfg, shard_dir, "val", topology, tok, prefetch=0)


PROMPT_TOKENS = 16  # the evaluation samples' prompt: this many tokens of a held-out document


def held_out_prompt(tokens: list[int], eos_id: int, n: int = PROMPT_TOKENS) -> list[int]:
    """A document's first tokens from `tokens` (the first validation sample): after its first
    end-of-text when a document starts there, else from its start; at most `n`, never across an
    end-of-text ([eos_id] when nothing is left)."""
    if eos_id in tokens:
        after = tokens[tokens.index(eos_id) + 1 :]
        if len(after) >= min(n, 4) and after[0] != eos_id:
            tokens = after
    head = tokens[:n]
    head = head[: head.index(eos_id)] if eos_id in head else head
    return head or [eos_id]


def sample_prompt(cfg: RunConfig, shard_dir, topology: Topology, tok: Tokenizer) -> list[int]:
    """The token ids the evaluation samples continue: eval.prompt when set, else the start of a
    held-out document, so the prompt fits the data (a 'def ' suits only Python); with a chat
    model's tokenizer, that start as a user's turn in its chat template, so the sample is the
    model's reply."""
    if cfg.eval.prompt:
        return tok.encode(cfg.eval.prompt) or [tok.eos_id]
    try:
        stream = val_stream(cfg, shard_dir, topology, tok)
        try:
            x = next(stream)[0]
        finally:
            stream.close()
    except (DataError, StopIteration, ValueError, OSError):  # no usable validation split: from end-of-text
        return [tok.eos_id]
    prompt = held_out_prompt(x[0].tolist(), tok.eos_id, min(PROMPT_TOKENS, cfg.model.max_seq_len // 2))
    if not getattr(tok, "chat", None):
        return prompt
    try:  # the document's start as a user's turn, tokenized as preprocess and `generate --chat` do
        return question_tokens(tok, tok.decode(prompt))
    except ValueError:  # the template refuses the message: the document's start as it is
        return prompt


def held_out_questions(cfg: RunConfig, shard_dir, topology: Topology, tok: Tokenizer, n: int) -> list[list[int]]:
    """The questions of the validation split's first `n` instruction or chat records: each record's
    tokens before its first target (the prompt, through the assistant's cue), for the evaluation
    samples to answer. [] for plain text (no loss mask), with no usable validation split, or where
    no record's question is shorter than model.max_seq_len; a record trained on whole
    (--train-on-prompt: no question to tell apart) is passed over."""
    try:
        stream = val_stream(cfg, shard_dir, topology, tok)
    except (DataError, ValueError, OSError):
        return []
    questions: list[list[int]] = []
    try:
        for shards in stream.sources:
            if shards.mask is None:
                continue
            starts = shards.doc_starts
            for a, b in zip(starts.tolist(), [*starts[1:].tolist(), shards.num_tokens]):
                first_target = int(np.argmax(shards.read_mask(a, b - a)))  # every record has one
                if 0 < first_target < cfg.model.max_seq_len:
                    questions.append(shards.read(a, first_target).tolist())
                if len(questions) == n:
                    return questions
    finally:
        stream.close()
    return questions


def _stream(cfg: RunConfig, shard_dir, split: str, topology: Topology, tok: Tokenizer, prefetch: int) -> TokenStream:
    """This data rank's stream of `split`, in train.micro_batch_size x train.seq_len batches (the
    ranks of a CP group read the same windows; each computes its chunks of them)."""
    t = cfg.train
    return TokenStream(
        shard_dir,
        split,
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        dp_rank=topology.data_rank,
        dp_size=topology.data_size,
        seed=t.seed,
        prefetch=prefetch,
        expected_tokenizer_hash=tok.hash,
        document_masking=cfg.data.document_masking,
        cache_bytes=cfg.data.cache_bytes,
    )
