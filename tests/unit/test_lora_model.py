"""model.lora: the config's rules (one line naming model.lora.<field>), the LoRA layer's math,
and the adapters on a tensor-parallel model's layout (shard_spec)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from launch import TINY
from loomtrain.launcher.config_loader import ConfigError, load_config
from loomtrain.model import ModelConfig, Transformer
from loomtrain.model.lora import LoraConfig, LoraLinear, apply_lora, init_lora_a, merge
from loomtrain.parallel.plan import shard_spec


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora.rank=-1", "model.lora.rank: must be a non-negative integer (0 = off), got -1"),
        ("model.lora.alpha=0", "model.lora.alpha: must be a positive number, got 0.0"),
        ("model.lora.dropout=1.0", "model.lora.dropout: must be in [0, 1), got 1.0"),
        ("model.lora.targets=[q,x]", "model.lora.targets: 'x' is not one of q, k, v, o, gate, up, down"),
        ("model.lora.targets=[]", "model.lora.targets: must be a non-empty list"),
        ("model.lora.targets=[q,wq]", "model.lora.targets: names a layer twice"),
        ("model.lora.rnak=4", "model.lora.rnak: unknown key (did you mean 'model.lora.rank'?)"),
    ],
)
def test_bad_lora_settings_are_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as exc:
        load_config(TINY, [override])
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_zero3_is_refused_with_lora():
    with pytest.raises(ConfigError, match=r"^parallel\.zero_stage: expected 0, 1 or 2 with model\.lora, got 3$"):
        load_config(TINY, ["model.lora.rank=4", "parallel.zero_stage=3"])


def test_off_by_default_and_a_saved_config_rebuilds_it():
    cfg = load_config(TINY, ["model.lora.rank=8", "model.lora.targets=[q,v]"])
    assert not ModelConfig().lora.enabled
    saved = dataclasses.asdict(cfg.model)  # what final/model_config.json and config.yaml hold
    again = ModelConfig(**saved)
    assert again.lora == LoraConfig(rank=8, alpha=16.0, dropout=0.0, targets=["q", "v"])
    with pytest.raises(ValueError, match=r"^model\.lora\.rnak: not a LoRA setting"):
        ModelConfig(**{**saved, "lora": {"rnak": 8}})


def test_lora_linear_starts_as_the_base_and_merges_exactly():
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 12)
    layer = LoraLinear(base, init_lora_a("x", 4, 16, seed=0), scale=2.0)
    x = torch.randn(3, 16)
    assert torch.equal(layer(x), base(x))  # B = 0
    with torch.no_grad():
        layer.lora_B.normal_()
    w = merge(layer.weight, layer.lora_A, layer.lora_B, layer.scale)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, layer.bias), rtol=1e-5, atol=1e-5)
    assert layer.weight is base.weight  # the same frozen tensor, under the same name


def test_apply_lora_keeps_names_and_freezes_the_base():
    cfg = load_config(TINY, ["model.lora.rank=4", "model.lora.targets=[q,o,gate,down]"]).model
    model = Transformer(cfg, seed=0)
    names_before = {n for n, _ in model.named_parameters()}
    apply_lora(model, cfg.lora, seed=0)
    params = dict(model.named_parameters())
    assert names_before <= set(params)  # blocks.0.attn.wq.weight stays blocks.0.attn.wq.weight
    trainable = sorted(n for n, p in params.items() if p.requires_grad)
    expected = sorted(
        f"blocks.{i}.{where}.{factor}"
        for i in range(cfg.n_layers)
        for where in ("attn.wq", "attn.wo", "ffn.gate", "ffn.down")
        for factor in ("lora_A", "lora_B")
    )
    assert trainable == expected
    assert params["blocks.0.attn.wq.lora_A"].shape == (4, cfg.d_model)
    assert params["blocks.0.ffn.down.lora_B"].shape == (cfg.d_model, 4)


def test_tp_layout_of_the_factors():
    cfg = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, activation="swiglu", ffn_hidden=96)
    # column-parallel: B split like the output, A replicated
    assert shard_spec("blocks.0.attn.wq.lora_B", (64, 4), cfg, 2, 1).dim == 0
    assert shard_spec("blocks.0.attn.wq.lora_A", (4, 64), cfg, 2, 1).dim is None
    # row-parallel: A split like the input, B replicated
    assert shard_spec("blocks.0.ffn.down.lora_A", (4, 96), cfg, 2, 1).dim == 1
    assert shard_spec("blocks.0.ffn.down.lora_B", (64, 4), cfg, 2, 1).dim is None
    # a KV head replicated on 2 of 4 ranks: B replicated with it
    kv = shard_spec("blocks.0.attn.wk.lora_B", (32, 4), cfg, 4, 1)
    assert (kv.num_shards, kv.replicas, kv.owner) == (2, 2, False)
