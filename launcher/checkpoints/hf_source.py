"""A Hugging Face model directory as a WeightSource (safetensors_source.py): its config.json
translated to a ModelConfig, and where each loomtrain tensor lies in its safetensors files.
Read by `model.init_from` (weight_source.py) and `loomtrain import` (hf_import.py); its name
maps (`llama_refs`, `gpt2_refs`) are also what `loomtrain export --format hf` (export.py) writes
by, so import and export are each other's inverse, tensor for tensor:

  * LlamaForCausalLM (MHA, GQA, MQA; rope_theta; tied or untied embeddings; rms_norm_eps;
    attention_bias / mlp_bias) -> pre-norm, rmsnorm, swiglu, rope. HF Llama's RoPE is the
    rotate-half layout loomtrain uses, so q/k are copied without a permutation.
  * GPT2LMHeadModel -> pre-norm, layernorm, learned positions, biases. GPT-2's Conv1D stores
    [in, out], so every linear is transposed; q/k/v are cut out of the fused c_attn. GPT-2's
    "gelu_new" is the tanh GELU: model.activation=gelu_tanh (F.gelu(approximate="tanh"),
    equal to transformers' formula to float rounding).

Anything loomtrain's model cannot compute exactly (RoPE scaling, sliding windows, mixtures
of experts, quantized weights, other architectures...) is refused naming the config.json
field, and so is a field of the wrong type (`"hidden_size": "64"`) or a config.json that is not
a JSON object. Weights are safetensors only, single or sharded (model.safetensors.index.json);
pickled .bin files are refused and never opened.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from loomtrain.launcher.checkpoints.safetensors_source import (
    SafetensorsFiles,
    TensorRef,
    WeightSource,
    WeightSourceError,
)
from loomtrain.model import ModelConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}
# GPT-2 activation_function -> model.activation computing the same function
GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}
# config.json fields whose presence (with a value other than off) changes the computation in a
# way loomtrain's model does not have.
UNSUPPORTED = {
    "rope_scaling": "RoPE scaling",
    "sliding_window": "sliding-window attention",
    "use_sliding_window": "sliding-window attention",
    "num_local_experts": "a mixture of experts",
    "num_experts": "a mixture of experts",
    "n_routed_experts": "a mixture of experts",
    "moe_intermediate_size": "a mixture of experts",
    "quantization_config": "quantized weights",
    "add_cross_attention": "cross-attention",
    "attention_chunk_size": "chunked attention",
}
# Buffers some checkpoints carry that loomtrain recomputes: the RoPE frequencies and
# GPT-2's causal mask.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
LLAMA_LINEARS = {
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "ffn.gate": "mlp.gate_proj",
    "ffn.up": "mlp.up_proj",
    "ffn.down": "mlp.down_proj",
}
# A GPT-2 block in its own order: (loomtrain, GPT-2, stored transposed); Conv1D keeps [in, out].
GPT2_LAYER = (
    ("attn_norm", "ln_1", False),
    ("attn.qkv", "attn.c_attn", True),
    ("attn.wo", "attn.c_proj", True),
    ("ffn_norm", "ln_2", False),
    ("ffn.up", "mlp.c_fc", True),
    ("ffn.down", "mlp.c_proj", True),
)


class HFImportError(WeightSourceError):
    pass


def _refuse(where: Path, field: str, value, why: str):
    raise HFImportError(f"{where}: {field}={value!r}: {why}")


def _off(value) -> bool:
    return value in (None, False, 0, "", [], {})


_REQUIRED = object()


class _Missing(KeyError):
    """A field the architecture needs is not in config.json."""


def _get(c: dict, field: str, default):
    """config.json's `field` (in `rope_parameters`: "rope_parameters.FIELD"); null counts as
    absent, as transformers writes `"head_dim": null`."""
    section, _, key = field.rpartition(".")
    value = ((c.get(section) or {}) if section else c).get(key)  # a section's type is checked first
    if value is None:
        if default is _REQUIRED:
            raise _Missing(field)
        return default
    return value


def _int(c: dict, where: Path, field: str, default=_REQUIRED) -> int | None:
    """A positive integer (a size or a count); a string, float or bool is refused by name."""
    value = _get(c, field, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        _refuse(where, field, value, "expected a positive integer")
    return value


def _float(c: dict, where: Path, field: str, default: float) -> float:
    value = _get(c, field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _refuse(where, field, value, "expected a finite number")
    return float(value)


def _bool(c: dict, where: Path, field: str, default: bool) -> bool:
    value = _get(c, field, default)
    if value not in (True, False):  # 0 and 1 pass too, as some hand-written configs have them
        _refuse(where, field, value, "expected true or false")
    return bool(value)


def _str(c: dict, where: Path, field: str, default: str) -> str:
    value = _get(c, field, default)
    if not isinstance(value, str):
        _refuse(where, field, value, "expected a string")
    return value


def _str_list(c: dict, where: Path, field: str) -> list[str]:
    value = _get(c, field, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        _refuse(where, field, value, "expected a list of strings")
    return value


# config.json -> ModelConfig -------------------------------------------------------------------
def _llama_config(c: dict, where: Path) -> dict:
    if _str(c, where, "hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", c["hidden_act"], "loomtrain's Llama MLP is SwiGLU (silu)")
    d, heads = _int(c, where, "hidden_size"), _int(c, where, "num_attention_heads")
    head_dim = _int(c, where, "head_dim", None)
    if head_dim is not None and head_dim * heads != d:
        _refuse(
            where, "head_dim", head_dim, f"loomtrain's head dim is hidden_size / num_attention_heads = {d // heads}"
        )
    rope = _get(c, "rope_parameters", {})
    if not isinstance(rope, dict):
        _refuse(where, "rope_parameters", rope, "expected a JSON object")
    if _str(c, where, "rope_parameters.rope_type", "default") != "default":
        _refuse(where, "rope_parameters.rope_type", rope["rope_type"], "RoPE scaling is not in loomtrain's model")
    if _float(c, where, "partial_rotary_factor", 1.0) != 1.0:
        _refuse(where, "partial_rotary_factor", c["partial_rotary_factor"], "loomtrain rotates the whole head")
    attn_bias, mlp_bias = _bool(c, where, "attention_bias", False), _bool(c, where, "mlp_bias", False)
    if attn_bias != mlp_bias:
        _refuse(
            where,
            "mlp_bias",
            mlp_bias,
            f"loomtrain's model.bias covers attention and MLP alike (attention_bias={attn_bias})",
        )
    if not _off(c.get("attention_dropout")):
        _refuse(
            where,
            "attention_dropout",
            c["attention_dropout"],
            "loomtrain's model.dropout also drops the residual stream; set it after import instead",
        )
    return dict(
        vocab_size=_int(c, where, "vocab_size"),
        d_model=d,
        n_layers=_int(c, where, "num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=_int(c, where, "num_key_value_heads", heads),
        ffn_hidden=_int(c, where, "intermediate_size"),
        max_seq_len=_int(c, where, "max_position_embeddings", 2048),
        norm="rmsnorm",
        norm_placement="pre",
        activation="swiglu",
        positions="rope",
        rope_theta=_float(c, where, "rope_parameters.rope_theta", _float(c, where, "rope_theta", 10000.0)),
        tie_embeddings=_bool(c, where, "tie_word_embeddings", False),
        bias=attn_bias,
        dropout=0.0,
        norm_eps=_float(c, where, "rms_norm_eps", 1e-6),
        init_std=_float(c, where, "initializer_range", 0.02),
    )


def _gpt2_config(c: dict, where: Path) -> dict:
    act = _str(c, where, "activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        _refuse(where, "activation_function", act, f"loomtrain has {', '.join(GPT2_ACTIVATIONS)}")
    if not _bool(c, where, "scale_attn_weights", True):
        _refuse(where, "scale_attn_weights", False, "loomtrain scales attention by 1/sqrt(head_dim)")
    if _bool(c, where, "scale_attn_by_inverse_layer_idx", False):
        _refuse(where, "scale_attn_by_inverse_layer_idx", True, "loomtrain scales every layer alike")
    drops = {k: _float(c, where, k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        _refuse(
            where,
            "attn_pdrop",
            drops["attn_pdrop"],
            f"loomtrain has one model.dropout for all three "
            f"(resid_pdrop={drops['resid_pdrop']}, embd_pdrop={drops['embd_pdrop']})",
        )
    d = _int(c, where, "n_embd")
    return dict(
        vocab_size=_int(c, where, "vocab_size"),
        d_model=d,
        n_layers=_int(c, where, "n_layer"),
        n_heads=_int(c, where, "n_head"),
        n_kv_heads=None,
        ffn_hidden=_int(c, where, "n_inner", 4 * d),
        max_seq_len=_int(c, where, "n_positions", 1024),
        norm="layernorm",
        norm_placement="pre",
        activation=GPT2_ACTIVATIONS[act],
        positions="learned",
        tie_embeddings=_bool(c, where, "tie_word_embeddings", True),
        bias=True,
        dropout=drops["resid_pdrop"],
        norm_eps=_float(c, where, "layer_norm_epsilon", 1e-5),
        init_std=_float(c, where, "initializer_range", 0.02),
    )


def read_hf_config(src: Path) -> tuple[str, dict]:
    """-> (architecture 'llama' | 'gpt2', ModelConfig keyword arguments) from SRC/config.json."""
    where = src / "config.json"
    try:
        c = json.loads(where.read_text())
    except OSError as exc:
        raise HFImportError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise HFImportError(f"{where}: not JSON: {exc}") from None
    if not isinstance(c, dict):
        raise HFImportError(f"{where}: a JSON {type(c).__name__}, expected an object of model settings")
    archs = _str_list(c, where, "architectures")
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if len(archs) != 1 or not known:
        _refuse(where, "architectures", archs, f"loomtrain imports {' and '.join(ARCHITECTURES)}")
    for field, what in UNSUPPORTED.items():
        if not _off(c.get(field)):
            _refuse(where, field, c[field], f"{what} is not in loomtrain's model")
    layer_types = set(_str_list(c, where, "layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        _refuse(where, "layer_types", sorted(layer_types), "loomtrain has full attention in every layer")
    arch = known[0]
    try:
        return arch, (_llama_config if arch == "llama" else _gpt2_config)(c, where)
    except _Missing as exc:
        raise HFImportError(f"{where}: no {exc.args[0]!r}, which a {archs[0]} config needs") from None


# loomtrain name -> where the tensor lies ------------------------------------------------------
# The one map between loomtrain's names and Hugging Face's, read both ways: `import` and
# `model.init_from` read each loomtrain tensor where its TensorRef points; `export` writes each
# HF tensor from the loomtrain tensors that point into it (export.hf_recipes). The refs are in
# HF's own order (embeddings, layers, final norm, head), which export's shard plan follows.
def llama_refs(cfg) -> dict[str, TensorRef]:
    refs = {"tok_emb.weight": "model.embed_tokens.weight"}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        refs[ours + "attn_norm.weight"] = theirs + "input_layernorm.weight"
        refs[ours + "ffn_norm.weight"] = theirs + "post_attention_layernorm.weight"
        for o, t in LLAMA_LINEARS.items():
            refs[f"{ours}{o}.weight"] = f"{theirs}{t}.weight"
            if cfg.bias:
                refs[f"{ours}{o}.bias"] = f"{theirs}{t}.bias"
    refs["norm.weight"] = "model.norm.weight"
    if not cfg.tie_embeddings:
        refs["lm_head.weight"] = "lm_head.weight"
    return {k: TensorRef(v) for k, v in refs.items()}


def gpt2_refs(cfg, prefix: str) -> dict[str, TensorRef]:
    """prefix: "transformer." as GPT2LMHeadModel saves, "" in checkpoints saved from GPT2Model.
    Biases are always mapped (GPT-2 has them; export writes zeros for a model without)."""
    d, t = cfg.d_model, prefix
    refs = {"tok_emb.weight": TensorRef(t + "wte.weight"), "pos_emb.weight": TensorRef(t + "wpe.weight")}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"{t}h.{i}."
        for o, n, transposed in GPT2_LAYER:
            if o == "attn.qkv":  # c_attn holds q, k, v side by side
                for j, p in enumerate(("wq", "wk", "wv")):
                    refs[f"{ours}attn.{p}.weight"] = TensorRef(theirs + "attn.c_attn.weight", True, j * d, d)
                    refs[f"{ours}attn.{p}.bias"] = TensorRef(theirs + "attn.c_attn.bias", False, j * d, d)
            else:
                refs[f"{ours}{o}.weight"] = TensorRef(f"{theirs}{n}.weight", transposed)
                refs[f"{ours}{o}.bias"] = TensorRef(f"{theirs}{n}.bias")
    refs["norm.weight"] = TensorRef(t + "ln_f.weight")
    refs["norm.bias"] = TensorRef(t + "ln_f.bias")
    if not cfg.tie_embeddings:
        refs["lm_head.weight"] = TensorRef("lm_head.weight")
    return refs


def open_hf(src: str | Path) -> WeightSource:
    """A Hugging Face model directory as a WeightSource; refuses what loomtrain cannot represent."""
    src = Path(src)
    arch, kwargs = read_hf_config(src)
    try:
        cfg = ModelConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise HFImportError(f"{src / 'config.json'}: gives a model loomtrain cannot build: {exc}") from None
    files = SafetensorsFiles(src)
    keys = set(files.keys())
    if arch == "llama":
        refs = llama_refs(cfg)
    else:
        refs = gpt2_refs(cfg, "transformer." if "transformer.wte.weight" in keys else "")
    used = {r.key for r in refs.values()} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    extra = sorted(k for k in keys - used if not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise HFImportError(
            f"{src}: tensor {extra[0]!r} has no place in a loomtrain {arch} model ({len(extra)} such tensors)"
        )
    tok = src if (src / "tokenizer.json").is_file() else None
    return WeightSource(cfg, files, refs, f"Hugging Face {arch} model {src}", tok)
