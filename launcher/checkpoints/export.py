"""`loomtrain export RUN_DIR --format hf --output DIR`: a Hugging Face transformers checkpoint.

Source of the weights (full fp32, never sharded, vocabulary unpadded):
  * RUN_DIR/checkpoints: the newest complete checkpoint (its consolidated fp32 masters,
    whatever TP x DP x ZeRO layout wrote it), or a checkpoint directory given directly;
  * else RUN_DIR/final (the weights the loop writes at the end of a run).

Targets, chosen by the model's variant (every other combination is refused with the
field that does not fit):
  * Llama-style  (pre-norm, rmsnorm, swiglu, rope)        -> LlamaForCausalLM
    loomtrain's RoPE already uses the rotate-half layout of HF Llama (dimension i is
    paired with i + head_dim/2), so q/k weights are copied without a permutation.
  * GPT-2-style  (pre-norm, layernorm, gelu|gelu_tanh|relu, learned) -> GPT2LMHeadModel
    GPT-2's Conv1D stores weights as [in, out]: every linear is transposed, and
    q/k/v are fused into c_attn; biases the model does not have are written as zeros.

Written: model.safetensors, config.json, generation_config.json, and the tokenizer as
HF files (tokenizer.json + tokenizer_config.json; the byte tokenizer is expressed as an
equivalent byte-level `tokenizers` model, so AutoTokenizer gives the same ids).
Reading never unpickles: safetensors, JSON and YAML only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMATS = ("hf",)
# loomtrain activation -> GPT-2's activation_function computing the same function
HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


class ExportError(ValueError):
    pass


# Reading a run --------------------------------------------------------------------------
def _model_config_from_yaml(path: Path):
    import yaml

    from loomtrain.model import ModelConfig

    data = yaml.safe_load(path.read_text())
    return ModelConfig(**data["model"])


def load_source(src: str | Path) -> tuple[dict[str, torch.Tensor], object, Path | None, str]:
    """-> (full fp32 weights by loomtrain name, ModelConfig, tokenizer dir or None, description)."""
    from loomtrain.launcher.checkpoints.state import ConsolidatedReader
    from loomtrain.launcher.checkpoints.store import MANIFEST, CheckpointStore, verify
    from loomtrain.launcher.weights import MODEL_CONFIG, TOKENIZER_DIR, WEIGHTS

    src = Path(src)
    if not src.exists():
        raise ExportError(f"{src}: no such run or checkpoint directory")
    ckpt = None
    if (src / MANIFEST).is_file():
        v = verify(src)
        if not v.ok:
            raise ExportError(f"{src}: not a usable checkpoint: {v.reason}")
        ckpt = src
    elif (src / "checkpoints").is_dir():
        ckpt = CheckpointStore(src, log=lambda m: print(m, file=sys.stderr)).find_resumable()
    if ckpt is not None:
        weights = {k: v.float() for k, v in ConsolidatedReader(ckpt).weights().items()}
        tok = ckpt / "tokenizer"
        return weights, _model_config_from_yaml(ckpt / "config.yaml"), (tok if tok.is_dir() else None), f"checkpoint {ckpt}"
    final = src if (src / WEIGHTS).is_file() else src / "final"
    if (final / WEIGHTS).is_file():
        from loomtrain.model import ModelConfig

        with safe_open(str(final / WEIGHTS), framework="pt") as f:
            weights = {k: f.get_tensor(k).float() for k in f.keys()}
        cfg = ModelConfig(**json.loads((final / MODEL_CONFIG).read_text()))
        tok = final / TOKENIZER_DIR
        return weights, cfg, (tok if tok.is_dir() else None), f"final weights {final}"
    raise ExportError(f"{src}: no complete checkpoint in {src}/checkpoints and no {src}/final/{WEIGHTS}")


# Variant checks ---------------------------------------------------------------------------
def hf_architecture(cfg) -> str:
    """'llama' or 'gpt2', or an ExportError naming the model field that has no HF counterpart."""

    def need(field: str, allowed: tuple, arch: str) -> None:
        value = getattr(cfg, field)
        if value not in allowed:
            raise ExportError(
                f"model.{field}={value!r}: a {arch}-style export needs model.{field} in {list(allowed)}; "
                f"Hugging Face has no architecture for this variant"
            )

    if cfg.positions == "rope":
        arch = "Llama"
        need("norm_placement", ("pre",), arch)
        need("norm", ("rmsnorm",), arch)
        need("activation", ("swiglu",), arch)
        return "llama"
    if cfg.positions == "learned":
        arch = "GPT-2"
        need("norm_placement", ("pre",), arch)
        need("norm", ("layernorm",), arch)
        need("activation", ("gelu", "gelu_tanh", "relu"), arch)
        if cfg.kv_heads != cfg.n_heads:
            raise ExportError(f"model.n_kv_heads={cfg.n_kv_heads}: GPT-2 has no grouped-query attention "
                              f"(needs n_kv_heads == n_heads = {cfg.n_heads})")
        return "gpt2"
    raise ExportError(f"model.positions={cfg.positions!r}: Hugging Face export supports 'rope' (Llama-style: "
                      f"rmsnorm + swiglu) and 'learned' (GPT-2-style: layernorm + gelu)")


def _eos_id(tok_dir: Path | None, vocab_size: int) -> int | None:
    if tok_dir is None:
        return None
    from loomtrain.data_pipeline import load_tokenizer

    try:
        return int(load_tokenizer(str(tok_dir)).eos_id)
    except Exception:
        return None


# Llama --------------------------------------------------------------------------------------
def to_llama(w: dict[str, torch.Tensor], cfg, eos_id: int | None) -> tuple[dict, dict]:
    out = {"model.embed_tokens.weight": w["tok_emb.weight"], "model.norm.weight": w["norm.weight"]}
    names = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "ffn.gate": "mlp.gate_proj", "ffn.up": "mlp.up_proj",
             "ffn.down": "mlp.down_proj"}
    for i in range(cfg.n_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = w[src + "attn_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = w[src + "ffn_norm.weight"]
        for ours, theirs in names.items():
            out[dst + theirs + ".weight"] = w[src + ours + ".weight"]
            if cfg.bias:
                out[dst + theirs + ".bias"] = w[src + ours + ".bias"]
    out["lm_head.weight"] = w["tok_emb.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "torch_dtype": "float32", "dtype": "float32",
        "use_cache": True,
    }
    return out, config


# GPT-2 ---------------------------------------------------------------------------------------
def to_gpt2(w: dict[str, torch.Tensor], cfg, eos_id: int | None) -> tuple[dict, dict]:
    d = cfg.d_model

    def bias(name: str, n: int) -> torch.Tensor:
        return w[name] if name in w else torch.zeros(n)

    out = {"transformer.wte.weight": w["tok_emb.weight"], "transformer.wpe.weight": w["pos_emb.weight"],
           "transformer.ln_f.weight": w["norm.weight"], "transformer.ln_f.bias": bias("norm.bias", d)}
    for i in range(cfg.n_layers):
        s, t = f"blocks.{i}.", f"transformer.h.{i}."
        out[t + "ln_1.weight"] = w[s + "attn_norm.weight"]
        out[t + "ln_1.bias"] = bias(s + "attn_norm.bias", d)
        out[t + "ln_2.weight"] = w[s + "ffn_norm.weight"]
        out[t + "ln_2.bias"] = bias(s + "ffn_norm.bias", d)
        # Conv1D: y = x @ W + b with W [in, out]
        qkv = torch.cat([w[s + f"attn.{p}.weight"] for p in ("wq", "wk", "wv")], dim=0)
        out[t + "attn.c_attn.weight"] = qkv.t().contiguous()
        out[t + "attn.c_attn.bias"] = torch.cat([bias(s + f"attn.{p}.bias", d) for p in ("wq", "wk", "wv")])
        out[t + "attn.c_proj.weight"] = w[s + "attn.wo.weight"].t().contiguous()
        out[t + "attn.c_proj.bias"] = bias(s + "attn.wo.bias", d)
        out[t + "mlp.c_fc.weight"] = w[s + "ffn.up.weight"].t().contiguous()
        out[t + "mlp.c_fc.bias"] = bias(s + "ffn.up.bias", cfg.ffn_dim)
        out[t + "mlp.c_proj.weight"] = w[s + "ffn.down.weight"].t().contiguous()
        out[t + "mlp.c_proj.bias"] = bias(s + "ffn.down.bias", d)
    out["lm_head.weight"] = w["tok_emb.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_embd": d, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        # "gelu" is the exact erf GELU, as in loomtrain; gelu_pytorch_tanh is F.gelu(approximate="tanh")
        "activation_function": HF_ACTIVATION[cfg.activation],
        "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "torch_dtype": "float32", "dtype": "float32",
        "use_cache": True,
    }
    return out, config


# Tokenizer -------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what tokenizers' ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer_json(eos_token: str = "<|endoftext|>") -> str:
    """loomtrain's byte tokenizer (ids 0..255 = bytes, 256 = EOS) as a `tokenizers` model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos_token])
    assert tok.token_to_id(eos_token) == 256
    return tok.to_str(pretty=True)


def export_tokenizer(tok_dir: Path | None, out: Path, max_len: int) -> None:
    if tok_dir is None:
        print("export: the run has no tokenizer files; exporting weights only", file=sys.stderr)
        return
    from loomtrain.data_pipeline import load_tokenizer

    tok = load_tokenizer(str(tok_dir))
    if getattr(tok, "name", "") == "byte" or type(tok).__name__ == "ByteTokenizer":
        eos = "<|endoftext|>"
        (out / "tokenizer.json").write_text(byte_tokenizer_json(eos))
    else:
        eos = getattr(tok, "eos_token", None)
        shutil.copyfile(tok_dir / "tokenizer.json", out / "tokenizer.json")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "clean_up_tokenization_spaces": False}
    if eos:
        cfg.update(eos_token=eos, bos_token=eos)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# The command --------------------------------------------------------------------------------------
def export_hf(src: str | Path, output: str | Path) -> Path:
    weights, cfg, tok_dir, what = load_source(src)
    arch = hf_architecture(cfg)
    eos_id = _eos_id(tok_dir, cfg.vocab_size)
    tensors, config = (to_llama if arch == "llama" else to_gpt2)(weights, cfg, eos_id)
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight")  # tied in config.json; transformers re-ties on load
    for k, v in tensors.items():
        if v.dtype != torch.float32:
            tensors[k] = v.float()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": eos_id, "eos_token_id": eos_id, "max_length": cfg.max_seq_len}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    export_tokenizer(tok_dir, out, cfg.max_seq_len)
    print(f"export: {what} -> {out} ({config['architectures'][0]}, {sum(v.numel() for v in tensors.values()):,} parameters)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loomtrain export", description="Export a run's weights to Hugging Face format.")
    ap.add_argument("run_dir", help="a run directory (newest complete checkpoint, else final/) or a checkpoint directory")
    ap.add_argument("--format", default="hf", choices=FORMATS)
    ap.add_argument("--output", required=True, help="output directory")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        export_hf(args.run_dir, args.output)
    except ExportError as exc:
        print(f"loomtrain export: {exc}", file=sys.stderr)
        return 2
    return 0
