"""loomtrain.model: a plain, single-device decoder-only transformer in PyTorch.

    from loomtrain.model import ModelConfig, Transformer
    model = Transformer(ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4), seed=0)
    logits = model(tokens)                       # [B, T] -> [B, T, vocab]
    loss = model(tokens, targets=next_tokens)    # mean cross-entropy, logits never held
    out = model.generate(prompt, max_new_tokens=20)  # greedy; prompt + new tokens

Files: config (ModelConfig, RopeScaling), norms, positions (sinusoidal, RoPE, ALiBi), attention,
feedforward, block, loss (LMHead: logits or a chunked fused cross-entropy),
transformer (init_tensors: its seeded init one parameter at a time;
meta_transformer: its shapes), cache (KVCache), generate, flops (closed-form
parameter count and PaLM training FLOPs).
"""

from __future__ import annotations

# Lazy exports: a config (model.config: plain dataclasses) loads without torch, so `loomtrain
# preprocess`, a Ray driver and a config check start in a fraction of a second.
_EXPORTS = {
    "Attention": "attention",
    "Block": "block",
    "KVCache": "cache",
    "ModelConfig": "config",
    "RopeScaling": "config",
    "FeedForward": "feedforward",
    "flops_per_token": "flops",
    "param_count": "flops",
    "sample_next": "generate",
    "LMHead": "loss",
    "linear_cross_entropy": "loss",
    "RMSNorm": "norms",
    "build_norm": "norms",
    "Transformer": "transformer",
    "init_tensors": "transformer",
    "meta_transformer": "transformer",
}

__all__ = [*_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
