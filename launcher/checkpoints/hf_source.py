"""A Hugging Face model directory as a WeightSource (safetensors_source.py): its config.json
translated to a ModelConfig, and where each loomtrain tensor lies in its safetensors files.
Read by `model.init_from` (weight_source.py) and `loomtrain import` (hf_import.py); its name
maps (hf_families.family_refs, `gpt2_refs`) are also what `loomtrain export --format hf`
(export.py) writes by, so import and export are each other's inverse, tensor for tensor:

  * LlamaForCausalLM (Llama 2/3.x with llama3 RoPE scaling), Qwen2ForCausalLM (Qwen2/2.5: q/k/v
    biases), Qwen3ForCausalLM (q/k norms), MistralForCausalLM (sliding window) -> pre-norm,
    rmsnorm, swiglu, rope: hf_families.py, which says what each family's keys become.
  * GPT2LMHeadModel -> pre-norm, layernorm, learned positions, biases. GPT-2's Conv1D stores
    [in, out], so every linear is transposed; q/k/v are cut out of the fused c_attn. GPT-2's
    "gelu_new" is the tanh GELU: model.activation=gelu_tanh (F.gelu(approximate="tanh"),
    equal to transformers' formula to float rounding).

Anything loomtrain's model cannot compute exactly (another RoPE scaling, a mixture of windowed
and full layers, mixtures of experts, quantized weights, other architectures...) is refused
naming the config.json field, and so is a field of the wrong type (`"hidden_size": "64"`) or a
config.json that is not a JSON object. Weights are safetensors only, single or sharded
(model.safetensors.index.json); pickled .bin files are refused and never opened.
"""

from __future__ import annotations

import json
from pathlib import Path

from loomtrain.launcher.checkpoints.hf_config import (
    HFImportError,
    Missing,
    bool_field,
    float_field,
    int_field,
    off,
    refuse,
    str_field,
    str_list,
)
from loomtrain.launcher.checkpoints.hf_families import FAMILIES, family_refs, read_family_config
from loomtrain.launcher.checkpoints.safetensors_source import SafetensorsFiles, TensorRef, WeightSource
from loomtrain.model import ModelConfig

ARCHITECTURES = [*FAMILIES, "GPT2LMHeadModel"]
# GPT-2 activation_function -> model.activation computing the same function
GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}
# config.json fields whose presence (with a value other than off) changes the computation in a
# way loomtrain's model does not have (a family's own keys, RoPE scaling and sliding windows
# among them, are read by hf_families).
UNSUPPORTED = {
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
# A GPT-2 block in its own order: (loomtrain, GPT-2, stored transposed); Conv1D keeps [in, out].
GPT2_LAYER = (
    ("attn_norm", "ln_1", False),
    ("attn.qkv", "attn.c_attn", True),
    ("attn.wo", "attn.c_proj", True),
    ("ffn_norm", "ln_2", False),
    ("ffn.up", "mlp.c_fc", True),
    ("ffn.down", "mlp.c_proj", True),
)


# config.json -> ModelConfig -------------------------------------------------------------------
def _gpt2_config(c: dict, where: Path) -> dict:
    act = str_field(c, where, "activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        refuse(where, "activation_function", act, f"loomtrain has {', '.join(GPT2_ACTIVATIONS)}")
    if not bool_field(c, where, "scale_attn_weights", True):
        refuse(where, "scale_attn_weights", False, "loomtrain scales attention by 1/sqrt(head_dim)")
    if bool_field(c, where, "scale_attn_by_inverse_layer_idx", False):
        refuse(where, "scale_attn_by_inverse_layer_idx", True, "loomtrain scales every layer alike")
    drops = {k: float_field(c, where, k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        refuse(
            where,
            "attn_pdrop",
            drops["attn_pdrop"],
            f"loomtrain has one model.dropout for all three "
            f"(resid_pdrop={drops['resid_pdrop']}, embd_pdrop={drops['embd_pdrop']})",
        )
    d = int_field(c, where, "n_embd")
    return dict(
        vocab_size=int_field(c, where, "vocab_size"),
        d_model=d,
        n_layers=int_field(c, where, "n_layer"),
        n_heads=int_field(c, where, "n_head"),
        n_kv_heads=None,
        ffn_hidden=int_field(c, where, "n_inner", 4 * d),
        max_seq_len=int_field(c, where, "n_positions", 1024),
        norm="layernorm",
        norm_placement="pre",
        activation=GPT2_ACTIVATIONS[act],
        positions="learned",
        tie_embeddings=bool_field(c, where, "tie_word_embeddings", True),
        bias=True,
        dropout=drops["resid_pdrop"],
        norm_eps=float_field(c, where, "layer_norm_epsilon", 1e-5),
        init_std=float_field(c, where, "initializer_range", 0.02),
    )


def read_hf_config(src: Path) -> tuple[str, dict]:
    """-> (architecture, e.g. 'Qwen2ForCausalLM', ModelConfig keyword arguments) from SRC/config.json."""
    where = src / "config.json"
    try:
        c = json.loads(where.read_text())
    except OSError as exc:
        raise HFImportError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise HFImportError(f"{where}: not JSON: {exc}") from None
    if not isinstance(c, dict):
        raise HFImportError(f"{where}: a JSON {type(c).__name__}, expected an object of model settings")
    archs = str_list(c, where, "architectures")
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        refuse(where, "architectures", archs, f"loomtrain imports {', '.join(ARCHITECTURES)}")
    for field, what in UNSUPPORTED.items():
        if not off(c.get(field)):
            refuse(where, field, c[field], f"{what} is not in loomtrain's model")
    arch = archs[0]
    try:
        if arch in FAMILIES:
            return arch, read_family_config(arch, c, where)
        for field in ("sliding_window", "use_sliding_window", "rope_scaling"):
            if not off(c.get(field)):
                refuse(where, field, c[field], "not in GPT-2")
        return arch, _gpt2_config(c, where)
    except Missing as exc:
        raise HFImportError(f"{where}: no {exc.args[0]!r}, which a {arch} config needs") from None


# loomtrain name -> where the tensor lies: the Llama-shaped families' map is
# hf_families.family_refs; GPT-2's is here.
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
    if arch in FAMILIES:
        refs = family_refs(cfg)
    else:
        refs = gpt2_refs(cfg, "transformer." if "transformer.wte.weight" in keys else "")
    used = {r.key for r in refs.values()} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    extra = sorted(k for k in keys - used if not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise HFImportError(
            f"{src}: tensor {extra[0]!r} has no place in a loomtrain model from {arch} ({len(extra)} such tensors)"
        )
    tok = src if (src / "tokenizer.json").is_file() else None
    return WeightSource(cfg, files, refs, f"Hugging Face {FAMILIES.get(arch, 'gpt2')} model {src}", tok)
