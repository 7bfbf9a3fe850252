"""Shard directories made from ready token arrays, and TokenStreams read the way data-parallel
ranks do, for the data tests."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from loomtrain.data_pipeline import TokenStream
from loomtrain.data_pipeline.shards import FORMAT, INDEX, SPLITS, VERSION, SplitWriter, token_dtype
from loomtrain.durable import atomic_write_json


def global_order(source, m, d, rounds, decode, *, seq_len, seed=0, start_state=None, prefetch=2, **kw):
    """Run d data-parallel streams over `source` (a shard directory or weighted sources) for
    `rounds` rounds, one micro batch of `m` per rank per round; -> (the global sequence of
    `decode(inputs)` of every micro batch, rank by rank, and each rank's final state)."""
    streams = [
        TokenStream(
            source, seq_len=seq_len, micro_batch_size=m, dp_rank=r, dp_size=d, seed=seed, prefetch=prefetch, **kw
        )
        for r in range(d)
    ]
    if start_state is not None:
        for s in streams:
            s.load_state_dict(start_state)
    order = []
    for _ in range(rounds):
        for s in streams:
            order += decode(next(s)[0])
    states = [s.state_dict() for s in streams]
    for s in streams:
        s.close()
    return order, states


def write_arrays(
    out_dir: str | os.PathLike,
    splits: dict[str, np.ndarray],
    tokenizer_info: dict,
    shard_tokens: int = 1 << 27,
    dtype=None,
    doc_lengths: dict[str, list[int]] | None = None,
    masks: dict[str, np.ndarray] | None = None,
    records: str | None = None,
) -> dict:
    """Write ready token arrays as a shard directory (synthetic data for tests and
    benchmarks). tokenizer_info: {"hash", "name", "vocab_size", "eos_id"}. Each split is one
    document unless doc_lengths gives its documents' lengths; masks (uint8, 1 = target, per
    token) make a loss-masked split, and records names the data ("chat" by default then)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype) if dtype is not None else token_dtype(tokenizer_info["vocab_size"])
    doc_lengths, masks = doc_lengths or {}, masks or {}
    info = {}
    for split in SPLITS:
        w = SplitWriter(out, split, dtype, shard_tokens, masked=bool(masks))
        tokens = splits.get(split, np.zeros(0, dtype))
        lengths = doc_lengths.get(split, [tokens.size] if tokens.size else [])
        mask = masks.get(split, np.zeros(0, np.uint8)) if masks else None
        w.write_docs(tokens, np.asarray(lengths, dtype=np.int64), mask)
        info[split] = w.close()
    index = {
        "format": FORMAT,
        "version": VERSION,
        "records": records or ("chat" if masks else "text"),
        "dtype": dtype.name,
        "tokenizer": {"file": None, **tokenizer_info},
        "splits": info,
        "split": {},
        "stats": {},
        "sources": ["write_arrays"],
    }
    atomic_write_json(out / INDEX, index)
    return index
