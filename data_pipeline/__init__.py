"""loomtrain.data_pipeline: tokenizers, preprocessing into token shards, and the
rank-sharded, packed, resumable token stream.

API (what the training loop codes against)
------------------------------------------
    from loomtrain.data_pipeline import prepare_data, TokenStream, load_tokenizer, DataError

    shard_dir, tok = prepare_data(cfg.data, cache_dir)        # rank 0 first, or all ranks: it is lock-safe
    stream = TokenStream(shard_dir, "train", seq_len=T, micro_batch_size=m,
                         dp_rank=topo.dp_rank, dp_size=topo.dp_size, seed=cfg.train.seed,
                         prefetch=cfg.data.prefetch, expected_tokenizer_hash=tok.hash)
    inputs, targets = next(stream)     # LongTensor [m, T] each; targets = inputs shifted by one
    state = stream.state_dict()        # {"global_position": P, "epoch", "seed", ...}: put it in the checkpoint
    stream.load_state_dict(state)      # also under another dp_size, if P % (m * dp_size) == 0
    stream.samples_per_epoch, stream.tokens_per_epoch, stream.epoch, stream.position
    stream.close()

Mixtures: `prepare_sources(data_cfg, cache_dir)` returns data.sources as
[(shard_dir, weight), ...] (one tokenizer for all, checked), or prepare_data's one
directory; TokenStream takes either (see stream.py's Blend for the order).
`loomtrain data-stats` (stats.py) reports what a run's stream will read.

`prepare_data(data_cfg, cache_dir=None) -> (Path, tokenizer)`: data_cfg.path empty -> the
embedded corpus (the stdlib's .py sources, the first data_cfg.max_files of them, sorted)
is tokenized once into data_cfg.cache_dir (or the cache_dir argument, e.g.
RUN_DIR/../.data_cache) and reused; else data_cfg.path must be a shard directory, checked
(index, tokenizer hash, shard sizes). Raises DataError (one line) on bad data. The loop
should also check tok.vocab_size <= model.vocab_size (tokenizer ids must fit the embedding).

Tokenizers: `load_tokenizer("byte" | "path/to/tokenizer.json" | shard_dir)`; each has
encode(str) -> list[int], decode(ids) -> str, vocab_size, eos_id, save(dir), hash.
Byte tokenizer: ids 0..255 = UTF-8 bytes, eos_id = 256, vocab_size = 257.

Ordering contract
-----------------
A split is a sequence of packed samples (seq_len + 1 tokens each, packed across document
EOS boundaries; sample i starts at token i * seq_len). Global positions 0, 1, 2, ... run
over the whole training run: position P is sample perm_e(P mod S) of epoch e = P // S,
S = samples_per_epoch, perm_e a permutation seeded by (seed, e). With micro batch m and DP
size d, round k = positions [k*m*d, (k+1)*m*d); DP rank r gets k*m*d + r*m + [0, m).
Hence optimizer step s with global batch G = m*d*grad_accum reads positions
[s*G, (s+1)*G) whatever d is. Epoch tail: positions run straight on into the next epoch
(the last round of an epoch may mix two epochs), so nothing is dropped and every sample
is read exactly once per epoch across all DP ranks, for any S, m, d.
Tensor-parallel ranks of one DP group pass the same dp_rank and get identical batches.
The stream is infinite; prefetching (a background thread, `prefetch` batches ahead)
never changes what is yielded. For evaluation, build a fresh val stream (split="val",
or shuffle=False) each time to get the same batches.
"""

from __future__ import annotations

from loomtrain.data_pipeline.shards import DataError

# Lazy exports: preprocessing workers import this package and must not pay for torch.
_EXPORTS = {
    "TokenStream": "loomtrain.data_pipeline.stream",
    "prepare_data": "loomtrain.data_pipeline.corpus",
    "prepare_sources": "loomtrain.data_pipeline.corpus",
    "load_tokenizer": "loomtrain.data_pipeline.tokenizer",
    "train_bpe": "loomtrain.data_pipeline.tokenizer",
    "ByteTokenizer": "loomtrain.data_pipeline.tokenizer",
    "preprocess_files": "loomtrain.data_pipeline.preprocess",
}

__all__ = ["DataError", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'loomtrain.data_pipeline' has no attribute {name!r}")
