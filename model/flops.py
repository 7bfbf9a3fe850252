"""Closed-form parameter count and training FLOPs per token, from a ModelConfig alone.

These work without building the model (meta device, `plan`) and give the
*global* model's numbers even when the live model is tensor-parallel sharded.

FLOPs convention (PaLM, Chowdhery et al. 2022, appendix B):
    flops_per_token(T) = 6 * N + 12 * L * H * Q * T
N = parameters that take part in a matmul per token: every parameter except
the input embedding table and the learned position table (embedding lookups
cost no FLOPs; torchtitan excludes embeddings the same way). The output
projection (lm_head, V * d_model) *is* counted, tied or not: when tied, the
shared table is used as the lm_head matmul, so it stays in N. Norm weights and
biases are kept in N too (negligible, as torchtitan does). L = n_layers,
H = n_heads (query heads, also under GQA/MQA), Q = head_dim (cfg.head_width), T = sequence length;
the attention term is the full (unhalved) causal score and value matmuls, forward
+ backward, also with a sliding window (the masked SDPA kernels used here compute every
score; a windowed kernel would do ~min(T, window) / T of it). 6 = 2 (multiply-add) x 3 (forward + backward).
"""

from __future__ import annotations

from .config import ModelConfig


def param_count(cfg: ModelConfig, exclude_embeddings: bool = False) -> int:
    d, v, f = cfg.d_model, cfg.vocab_size, cfg.ffn_dim
    q_dim, kv_dim = cfg.n_heads * cfg.head_width, cfg.kv_heads * cfg.head_width
    b, b_qkv = int(cfg.bias), int(cfg.bias or cfg.qkv_bias)
    norm = d + (d * b if cfg.norm == "layernorm" else 0)
    qk_norm = 2 * cfg.head_width if cfg.qk_norm else 0  # one RMSNorm weight each for q and k
    attn = d * q_dim + 2 * d * kv_dim + q_dim * d + b_qkv * (q_dim + 2 * kv_dim) + b * d + qk_norm
    n_in = 2 if cfg.activation == "swiglu" else 1  # matrices d -> f (up, and gate for SwiGLU)
    ffn = (n_in + 1) * d * f + b * (n_in * f + d)
    layer = attn + ffn + 2 * norm
    final_norm = norm if cfg.norm_placement == "pre" else 0
    tok_emb = v * d
    pos_emb = cfg.max_seq_len * d if cfg.positions == "learned" else 0
    lm_head = 0 if cfg.tie_embeddings else v * d
    total = tok_emb + pos_emb + cfg.n_layers * layer + final_norm + lm_head
    if exclude_embeddings:
        # Drop the lookup tables, keep the lm_head matmul (which is tok_emb itself when tied).
        total -= pos_emb + (0 if cfg.tie_embeddings else tok_emb)
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    n = param_count(cfg, exclude_embeddings=True)
    return 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_width * seq_len
