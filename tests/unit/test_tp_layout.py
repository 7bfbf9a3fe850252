"""The TP layout (`loomtrain.parallel.plan`): one definition, asked by every cutter and joiner.

Single process: `parallelize` is run for each TP rank of a stand-alone topology (the dry
run's, whose collectives are identities), so every rank's shards can be compared with
`shard_tensor` and joined back with `join_shards` without a process group.
"""

from __future__ import annotations

import copy

import pytest
import torch
from loomtrain.launcher.planning.dryrun import OneRankTopology
from loomtrain.model import ModelConfig, Transformer
from loomtrain.parallel import ShardSpec, gather_shards, join_shards, parallelize, shard_spec, shard_tensor, spec_of

CFG = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, dropout=0.0)


def test_specs_by_name():
    cfg = ModelConfig(**CFG, n_kv_heads=1, bias=True)
    vocab = shard_spec("tok_emb.weight", (61, 32), cfg, 4, 3)
    assert (vocab.dim, vocab.padded_size, vocab.num_shards, vocab.local_shape) == (0, 64, 4, (16, 32))
    assert vocab.bounds() == (48, 61)  # 3 padding rows on the last rank
    assert shard_spec("blocks.0.attn.wo.weight", (32, 32), cfg, 4, 1).local_shape == (32, 8)
    assert shard_spec("blocks.0.attn.wo.bias", (32,), cfg, 4, 1).replicated
    assert shard_spec("blocks.1.ffn_norm.weight", (32,), cfg, 4, 1).replicated
    kv = shard_spec("blocks.0.attn.wk.weight", (8, 32), cfg, 4, 2)  # one KV head on 4 ranks
    assert (kv.num_shards, kv.shard_index, kv.replicas, kv.owner, kv.local_shape) == (1, 0, 4, False, (8, 32))
    assert shard_spec("blocks.0.attn.wk.weight", (8, 32), cfg, 4, 0).owner
    assert ShardSpec.from_meta(vocab.as_meta()) == vocab


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(
    "overrides",
    [dict(n_kv_heads=1, tie_embeddings=True, bias=True), dict(n_kv_heads=2, activation="swiglu", positions="alibi")],
)
def test_parallelize_cuts_what_the_layout_says_and_join_restores(tp, overrides):
    cfg = ModelConfig(**CFG, **overrides)
    full = Transformer(cfg, seed=3)
    full_params = dict(full.named_parameters())
    ranks = [parallelize(copy.deepcopy(full), OneRankTopology(tp, r)) for r in range(tp)]
    for name, _ in ranks[0].named_parameters():
        specs = [shard_spec(name, full_params[name].shape, cfg, tp, r) for r in range(tp)]
        locals_ = [dict(m.named_parameters())[name] for m in ranks]
        for r in range(tp):
            assert spec_of(locals_[r]) == specs[r], name
            assert torch.equal(locals_[r], shard_tensor(full_params[name], specs[r])), name
        distinct = locals_[:: specs[0].replicas] if not specs[0].replicated else locals_[:1]
        assert torch.equal(join_shards(distinct, specs[0]), full_params[name]), name
    # Lone process, tp 1: gather_shards drops nothing and adds nothing.
    w = full_params["tok_emb.weight"]
    assert torch.equal(gather_shards(w, shard_spec("tok_emb.weight", w.shape, cfg, 1), None), w)


def test_shape_mismatch_is_one_line():
    cfg = ModelConfig(**CFG)
    with pytest.raises(ValueError, match=r"does not match the layout's full shape \(61, 32\)"):
        shard_tensor(torch.zeros(60, 32), shard_spec("tok_emb.weight", (61, 32), cfg, 2, 0))
