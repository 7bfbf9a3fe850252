"""The Llama-shaped Hugging Face families both ways: config.json -> ModelConfig (import,
model.init_from) and ModelConfig -> config.json (export), and the tensor names of both.

All four are pre-norm RMSNorm, SwiGLU (hidden_act silu), RoPE in the rotate-half layout
loomtrain uses (q/k copied without a permutation), GQA/MQA, tied or untied embeddings, an
optional head_dim wider or narrower than hidden_size / heads. What sets them apart:

  family                       biases                          other                   window
  LlamaForCausalLM   llama     attention_bias + mlp_bias       rope_scaling llama3     none
                               (every linear: model.bias)      (Llama 3.1-3.3), linear
  Qwen2ForCausalLM   qwen2     q, k, v always (model.qkv_bias)                         per layer_types
  Qwen3ForCausalLM   qwen3     none (attention_bias refused)   q_norm, k_norm          per layer_types
                                                               (model.qk_norm)
  MistralForCausalLM mistral   none                                                    sliding_window

RoPE: transformers 5 writes `rope_parameters` (rope_theta inside); hub folders of 2024-25 have
`rope_scaling` beside a top-level `rope_theta`. Both are read as transformers reads them
(`rope_scaling` first), and export writes both (rope_scaling only when there is a scaling).
Sliding windows: transformers decides per layer (`layer_types`, or for Qwen2/3 the layers from
`max_window_layers` on when `use_sliding_window`); loomtrain has one window for every layer, so a
mixture is refused naming `layer_types`. Anything else loomtrain would compute differently
(another hidden_act, rope type or rotary fraction, attention dropout, a bias layout it lacks) is
refused in one line naming the field and its value.
"""

from __future__ import annotations

from pathlib import Path

from loomtrain.launcher.checkpoints.hf_config import (
    bool_field,
    dict_field,
    float_field,
    int_field,
    off,
    refuse,
    str_field,
    str_list,
)
from loomtrain.launcher.checkpoints.safetensors_source import TensorRef

# architecture -> model_type
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
LINEARS = {
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "ffn.gate": "mlp.gate_proj",
    "ffn.up": "mlp.up_proj",
    "ffn.down": "mlp.down_proj",
}
QKV = ("attn.wq", "attn.wk", "attn.wv")
# A RoPE dict's keys for each kind loomtrain computes (transformers' rope_type -> model.rope_scaling.type)
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
LAYER_TYPES = ("full_attention", "sliding_attention")


# config.json -> ModelConfig ---------------------------------------------------------------------
def _rope(c: dict, where: Path) -> tuple[float, dict | None]:
    """(rope_theta, model.rope_scaling or None) as transformers reads them: `rope_scaling` when
    set (older configs), else `rope_parameters`; rope_theta inside it, else at the top level."""
    section = "rope_scaling" if not off(c.get("rope_scaling")) else "rope_parameters"
    rope = dict_field(c, where, section)
    theta = float_field(c, where, f"{section}.rope_theta", float_field(c, where, "rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        refuse(
            where, f"{section}.rope_type", kind, f"loomtrain's RoPE scaling is {', '.join(ROPE_TYPES)}, not this one"
        )
    if float_field(c, where, f"{section}.partial_rotary_factor", 1.0) != 1.0:
        refuse(where, f"{section}.partial_rotary_factor", rope["partial_rotary_factor"], "loomtrain rotates the head")
    extra = sorted(set(rope) - ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        refuse(where, f"{section}.{extra[0]}", rope[extra[0]], f"not a parameter of {kind} RoPE in loomtrain")
    if kind == "default":
        return theta, None
    scaling = {"type": ROPE_TYPES[kind], "factor": float_field(c, where, f"{section}.factor", 1.0)}
    if kind == "llama3":
        scaling.update(
            low_freq_factor=float_field(c, where, f"{section}.low_freq_factor", 1.0),
            high_freq_factor=float_field(c, where, f"{section}.high_freq_factor", 4.0),
            original_max_position=int_field(c, where, f"{section}.original_max_position_embeddings", 8192),
        )
    return theta, scaling


def _window(arch: str, c: dict, where: Path, n_layers: int) -> int | None:
    """The one sliding window of every layer (None: full attention), as transformers decides it
    per layer; a mixture of windowed and full layers is refused naming layer_types."""
    if arch == "LlamaForCausalLM":
        for field in ("sliding_window", "use_sliding_window"):
            if not off(c.get(field)):
                refuse(where, field, c[field], "sliding-window attention is not in transformers' Llama")
        kinds = str_list(c, where, "layer_types")
        if set(kinds) - {"full_attention"}:
            refuse(where, "layer_types", kinds, "transformers' Llama has full attention in every layer")
        return None
    if arch == "MistralForCausalLM":
        # transformers' Mistral puts sliding_window on every layer and ignores layer_types (it
        # warns: Ministral reads them); a layer_types saying otherwise is refused, not ignored
        window = int_field(c, where, "sliding_window", None)
        kinds = str_list(c, where, "layer_types")
        if kinds and set(kinds) != {"sliding_attention" if window is not None else "full_attention"}:
            refuse(
                where,
                "layer_types",
                kinds,
                f"MistralForCausalLM applies sliding_window={window} to every layer; "
                "loomtrain has one attention kind in every layer",
            )
        return window
    # Qwen2 / Qwen3: the window only when use_sliding_window, on layers max_window_layers and up
    use = bool_field(c, where, "use_sliding_window", False)
    window = int_field(c, where, "sliding_window", None) if use else None
    first = c.get("max_window_layers", 28)  # transformers' default
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        refuse(where, "max_window_layers", first, "expected a layer count (0 or more)")
    if window is None:
        return None  # transformers passes no window to any layer, whatever layer_types says
    kinds = str_list(c, where, "layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
    ]
    return _uniform(where, kinds, n_layers, window, f"max_window_layers={first}")


def _uniform(where: Path, kinds: list[str], n_layers: int, window: int, hint: str) -> int | None:
    if len(kinds) != n_layers or not set(kinds) <= set(LAYER_TYPES):
        refuse(where, "layer_types", kinds, f"expected {n_layers} of {', '.join(LAYER_TYPES)}")
    if len(set(kinds)) > 1:
        n = kinds.count("sliding_attention")
        refuse(
            where,
            "layer_types",
            f"{n} sliding_attention, {n_layers - n} full_attention",
            f"loomtrain has one attention kind in every layer (model.sliding_window), not a mixture ({hint})",
        )
    return window if kinds[0] == "sliding_attention" else None


def _biases(arch: str, c: dict, where: Path) -> tuple[bool, bool]:
    """(model.bias, model.qkv_bias) from the family's bias keys."""
    if arch == "Qwen2ForCausalLM":
        return False, True  # transformers' Qwen2 has q/k/v biases, whatever attention_bias says
    attn = bool_field(c, where, "attention_bias", False) if arch != "MistralForCausalLM" else False
    mlp = bool_field(c, where, "mlp_bias", False) if arch == "LlamaForCausalLM" else False
    if arch == "Qwen3ForCausalLM" and attn:
        refuse(
            where,
            "attention_bias",
            True,
            "Qwen3's attention_bias puts biases on q, k, v and o but not the MLP; loomtrain has q/k/v biases "
            "(model.qkv_bias) or biases on every linear (model.bias)",
        )
    if attn != mlp:
        refuse(
            where,
            "mlp_bias",
            mlp,
            f"loomtrain's model.bias covers attention and MLP alike (attention_bias={attn})",
        )
    return attn, False


def read_family_config(arch: str, c: dict, where: Path) -> dict:
    """ModelConfig keyword arguments from a LlamaForCausalLM / Qwen2 / Qwen3 / Mistral config.json."""
    if str_field(c, where, "hidden_act", "silu") != "silu":
        refuse(where, "hidden_act", c["hidden_act"], "these models' MLP is SwiGLU (silu) in loomtrain")
    if float_field(c, where, "partial_rotary_factor", 1.0) != 1.0:
        refuse(where, "partial_rotary_factor", c["partial_rotary_factor"], "loomtrain rotates the whole head")
    if not off(c.get("attention_dropout")):
        refuse(
            where,
            "attention_dropout",
            c["attention_dropout"],
            "loomtrain's model.dropout also drops the residual stream; set it after import instead",
        )
    d, heads = int_field(c, where, "hidden_size"), int_field(c, where, "num_attention_heads")
    n_layers = int_field(c, where, "num_hidden_layers")
    head_dim = int_field(c, where, "head_dim", None)
    theta, scaling = _rope(c, where)
    bias, qkv_bias = _biases(arch, c, where)
    out = dict(
        vocab_size=int_field(c, where, "vocab_size"),
        d_model=d,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=int_field(c, where, "num_key_value_heads", heads),
        # kept None where it is the usual d_model / heads, so the config reads as before
        head_dim=None if head_dim is None or head_dim * heads == d else head_dim,
        ffn_hidden=int_field(c, where, "intermediate_size"),
        max_seq_len=int_field(c, where, "max_position_embeddings", 2048),
        norm="rmsnorm",
        norm_placement="pre",
        activation="swiglu",
        positions="rope",
        rope_theta=theta,
        tie_embeddings=bool_field(c, where, "tie_word_embeddings", False),
        bias=bias,
        qkv_bias=qkv_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_window(arch, c, where, n_layers),
        dropout=0.0,
        norm_eps=float_field(c, where, "rms_norm_eps", 1e-6),
        init_std=float_field(c, where, "initializer_range", 0.02),
    )
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


# loomtrain name -> where the tensor lies ----------------------------------------------------------
# The one map between loomtrain's names and Hugging Face's, read both ways: `import` and
# `model.init_from` read each loomtrain tensor where its TensorRef points; `export` writes each
# HF tensor from the loomtrain tensors that point into it (export.hf_recipes). In HF's own order
# (embeddings, layers, final norm, head), which export's shard plan follows.
def family_refs(cfg) -> dict[str, TensorRef]:
    refs = {"tok_emb.weight": "model.embed_tokens.weight"}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        refs[ours + "attn_norm.weight"] = theirs + "input_layernorm.weight"
        refs[ours + "ffn_norm.weight"] = theirs + "post_attention_layernorm.weight"
        for o, t in LINEARS.items():
            refs[f"{ours}{o}.weight"] = f"{theirs}{t}.weight"
            if cfg.bias or (cfg.qkv_bias and o in QKV):
                refs[f"{ours}{o}.bias"] = f"{theirs}{t}.bias"
        if cfg.qk_norm:
            refs[ours + "attn.q_norm.weight"] = theirs + "self_attn.q_norm.weight"
            refs[ours + "attn.k_norm.weight"] = theirs + "self_attn.k_norm.weight"
    refs["norm.weight"] = "model.norm.weight"
    if not cfg.tie_embeddings:
        refs["lm_head.weight"] = "lm_head.weight"
    return {k: TensorRef(v) for k, v in refs.items()}


# ModelConfig -> config.json -------------------------------------------------------------------
def family_of(cfg) -> str:
    """The architecture a model exports as: Qwen3 with q/k norms, Qwen2 with q/k/v biases only,
    Mistral with a sliding window, else Llama; ValueError naming the model.* field that no
    family has alongside the others."""

    def no(field: str, arch: str, why: str) -> None:
        raise ValueError(f"model.{field}={getattr(cfg, field)!r}: {arch} has {why}; no Hugging Face family fits")

    if cfg.qk_norm:
        if cfg.bias or cfg.qkv_bias:
            no("bias" if cfg.bias else "qkv_bias", "Qwen3ForCausalLM (q/k norms)", "biases on q, k, v and o together")
        return "Qwen3ForCausalLM"
    if cfg.qkv_bias and not cfg.bias:
        return "Qwen2ForCausalLM"
    if cfg.sliding_window is not None:
        if cfg.bias:
            no("bias", "MistralForCausalLM (sliding window)", "no biases")
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def family_config(cfg, arch: str) -> dict:
    """config.json's model keys for `arch` (family_of(cfg)); the caller adds tokens and dtype."""
    s = cfg.rope_scaling
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if s.type == "linear":
        rope.update(rope_type="linear", factor=s.factor)
    elif s.type == "llama3":
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position,
        )
    config = {
        "architectures": [arch],
        "model_type": FAMILIES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_width,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
    }
    if s.type != "none":  # where transformers 4.x reads a scaling (5.x reads it first too)
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if arch == "LlamaForCausalLM":
        config.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    elif arch == "Qwen3ForCausalLM":
        config["attention_bias"] = False
    if arch == "MistralForCausalLM":
        config["sliding_window"] = cfg.sliding_window
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        windowed = cfg.sliding_window is not None
        config.update(
            use_sliding_window=windowed,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if windowed else cfg.n_layers,
            layer_types=[LAYER_TYPES[windowed]] * cfg.n_layers,
        )
    return config
