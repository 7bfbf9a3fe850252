"""loomtrain.model: a plain, single-device decoder-only transformer in PyTorch.

    from loomtrain.model import ModelConfig, Transformer
    model = Transformer(ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4), seed=0)
    logits = model(tokens)                       # [B, T] -> [B, T, vocab]
    loss = model(tokens, targets=next_tokens)    # mean cross-entropy, logits never held
    out = model.generate(prompt, max_new_tokens=20)  # greedy; prompt + new tokens

Files: config (ModelConfig), norms, positions (sinusoidal, RoPE, ALiBi), attention,
feedforward, block, loss (LMHead: logits or a chunked fused cross-entropy),
transformer (init_tensors: its seeded init one parameter at a time;
meta_transformer: its shapes), cache (KVCache), generate, flops (closed-form
parameter count and PaLM training FLOPs).
"""

from .attention import Attention
from .block import Block
from .cache import KVCache
from .config import ModelConfig
from .feedforward import FeedForward
from .flops import flops_per_token, param_count
from .generate import sample_next
from .loss import LMHead, linear_cross_entropy
from .norms import RMSNorm, build_norm
from .transformer import Transformer, init_tensors, meta_transformer

__all__ = [
    "meta_transformer",
    "Attention",
    "Block",
    "FeedForward",
    "KVCache",
    "LMHead",
    "ModelConfig",
    "RMSNorm",
    "Transformer",
    "build_norm",
    "flops_per_token",
    "init_tensors",
    "linear_cross_entropy",
    "param_count",
    "sample_next",
]
