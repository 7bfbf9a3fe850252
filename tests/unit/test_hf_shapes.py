"""`plan`, `dryrun`'s rank shard and the tp check know the shapes of the models people start from:
configs/llama3.2-1b.yaml and configs/qwen2.5-0.5b.yaml count the parameters transformers counts
for Llama-3.2-1B and Qwen2.5-0.5B (GQA, tied embeddings, q/k/v biases, vocabularies of 128,256
and 151,936); 14 query / 2 KV heads split at tp 2 and are refused at tp 4 with the sizes that work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from launch import one_line, run_loomtrain
from loomtrain.launcher.config_loader import ConfigError, load_config
from loomtrain.launcher.planning.dryrun import build_rank_shard

ROOT = Path(__file__).resolve().parents[2]
LLAMA, QWEN = ROOT / "configs" / "llama3.2-1b.yaml", ROOT / "configs" / "qwen2.5-0.5b.yaml"
# The real models' configs (hub config.json values), for transformers to count their parameters.
REAL = {
    LLAMA: (
        "LlamaForCausalLM",
        transformers.LlamaConfig,
        dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16),
        dict(num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    ),
    QWEN: (
        "Qwen2ForCausalLM",
        transformers.Qwen2Config,
        dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24),
        dict(num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    ),
}


def transformers_count(config: Path) -> tuple[int, int]:
    """(all parameters, all but the embedding table) of the real model, built on meta."""
    arch, cls, sizes, heads = REAL[config]
    with torch.device("meta"):
        model = getattr(transformers, arch)(cls(**sizes, **heads))
    n = sum(p.numel() for p in model.parameters())
    return n, n - model.model.embed_tokens.weight.numel()


@pytest.mark.parametrize("config, billions", [(LLAMA, (1.24, 0.97)), (QWEN, (0.49, 0.36))])
def test_plan_counts_what_transformers_counts(config, billions):
    proc = run_loomtrain("plan", config, "--world-size", "8", "--json")
    plan = json.loads(proc.stdout)
    total, non_embedding = transformers_count(config)
    assert plan["params"]["total"] == plan["analytic_params"] == total
    assert plan["params"]["total"] - plan["params"]["embedding"] == non_embedding
    assert (round(total / 1e9, 2), round(non_embedding / 1e9, 2)) == billions
    assert plan["tp"] == 2 and plan["fits"]


def test_the_real_configs_carry_the_real_switches():
    llama, qwen = load_config(LLAMA, world_size=8).model, load_config(QWEN, world_size=8).model
    assert (llama.rope_scaling.type, llama.rope_scaling.factor, llama.rope_scaling.original_max_position) == (
        "llama3",
        32.0,
        8192,
    )
    assert (llama.rope_theta, llama.kv_heads, llama.tie_embeddings, llama.norm_eps) == (500000.0, 8, True, 1e-5)
    assert (qwen.qkv_bias, qwen.bias, qwen.kv_heads, qwen.rope_theta, qwen.norm_eps) == (True, False, 2, 1e6, 1e-6)


def test_fourteen_heads_split_at_tp2_and_are_refused_at_tp4_with_the_sizes_that_work():
    load_config(QWEN, ["parallel.tp=2"], world_size=8)
    with pytest.raises(ConfigError) as err:
        load_config(QWEN, ["parallel.tp=4"], world_size=8)
    assert str(err.value) == (
        "parallel.tp=4: model.n_heads=14 is not divisible by tp; the tp sizes that split this model: 1, 2"
    )
    with pytest.raises(ConfigError, match=r"the tp sizes that split this model: 1, 2, 4, 8, 16, 32$"):
        load_config(LLAMA, ["parallel.tp=3"], world_size=6)
    proc = run_loomtrain("plan", QWEN, "--world-size", "8", "parallel.tp=4", rc=2)
    assert one_line(proc.stderr).endswith("the tp sizes that split this model: 1, 2")


@pytest.mark.parametrize(
    "config, tp, rows",
    # Llama's 2048 x 128,256 table is made whole (one tensor at a time) before it is split: ~13 s
    [(QWEN, 2, 151936 // 2), pytest.param(LLAMA, 8, 128256 // 8, marks=pytest.mark.slow)],
)
def test_dryruns_rank_shard_of_the_real_vocabulary_and_heads(config, tp, rows):
    """One rank as dryrun builds it (one layer of the real width): the vocabulary split tp ways,
    q/k/v biases and KV heads sharded or replicated as the heads allow."""
    cfg = load_config(config, ["model.n_layers=1", f"parallel.tp={tp}", "train.precision=fp32"], world_size=8)
    shard = build_rank_shard(cfg, torch.device("cpu"))
    m = cfg.model
    attn = shard.blocks[0].attn
    assert shard.tok_emb.weight.shape == (rows, m.d_model)
    assert attn.wq.weight.shape == (m.n_heads // tp * m.head_width, m.d_model)
    kv_local = max(m.kv_heads // tp, 1)  # Qwen's 2 KV heads: one a rank at tp 2; Llama's 8 at tp 8: one
    assert attn.wk.weight.shape == (kv_local * m.head_width, m.d_model)
    if m.qkv_bias:
        assert attn.wq.bias.shape == (m.n_heads // tp * m.head_width,) and attn.wo.bias is None
