"""A bad ModelConfig raises ValueError naming the field (and, for choices, listing the valid ones)."""

import pytest
from loomtrain.model import ModelConfig

GOOD = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)

BAD = [
    ("vocab_size", dict(vocab_size=0)),
    ("vocab_size", dict(vocab_size=True)),
    ("d_model", dict(d_model=-32)),
    ("d_model", dict(d_model=32.0)),
    ("n_layers", dict(n_layers=0)),
    ("n_heads", dict(n_heads=0)),
    ("n_heads", dict(n_heads=5)),  # 32 % 5
    ("n_kv_heads", dict(n_kv_heads=3)),  # 4 % 3
    ("n_kv_heads", dict(n_kv_heads=0)),
    ("ffn_hidden", dict(ffn_hidden=-1)),
    ("max_seq_len", dict(max_seq_len=0)),
    ("norm", dict(norm="batchnorm")),
    ("norm_placement", dict(norm_placement="sandwich")),
    ("activation", dict(activation="tanh")),
    ("positions", dict(positions="xpos")),
    ("positions", dict(positions="rope", d_model=36, n_heads=12)),  # head dim 3 is odd
    ("rope_theta", dict(rope_theta=0.0)),
    ("dropout", dict(dropout=1.0)),
    ("dropout", dict(dropout=-0.1)),
    ("norm_eps", dict(norm_eps=0.0)),
    ("init_std", dict(init_std=-0.02)),
]


@pytest.mark.parametrize("field,change", BAD, ids=[f"{f}={list(c.values())[0]!r}" for f, c in BAD])
def test_bad_config_names_the_field(field, change):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        ModelConfig(**{**GOOD, **change})


@pytest.mark.parametrize(
    "field,bad,valid",
    [
        ("norm", "batchnorm", ("layernorm", "rmsnorm")),
        ("norm_placement", "mid", ("pre", "post")),
        ("activation", "tanh", ("relu", "gelu", "swiglu")),
        ("positions", "xpos", ("learned", "sinusoidal", "rope", "alibi", "none")),
    ],
)
def test_choice_errors_list_the_valid_values(field, bad, valid):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**GOOD, field: bad})
    for name in valid:
        assert name in str(err.value)


def test_good_configs_and_derived_sizes():
    cfg = ModelConfig(**GOOD)
    assert (cfg.kv_heads, cfg.head_width, cfg.ffn_dim) == (4, 8, 128)
    assert ModelConfig(**GOOD, n_kv_heads=1).kv_heads == 1
    assert ModelConfig(**GOOD, activation="swiglu").ffn_dim == 88  # 2/3 * 128 = 85.3 -> multiple of 8
    assert ModelConfig(**GOOD, ffn_hidden=40).ffn_dim == 40
