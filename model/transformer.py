"""The decoder-only Transformer: embeddings, a stack of blocks, final norm, un-embedding."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import torch
from torch import nn

from . import flops
from .block import Block
from .cache import KVCache
from .config import ModelConfig
from .generate import generate
from .loss import LMHead
from .masking import MaskSpec, WindowSlice
from .norms import RMSNorm, build_norm
from .positions import alibi_slopes, document_positions, rope_tables, sinusoidal_table


class Transformer(nn.Module):
    """Transformer(cfg)(tokens [B, T]) -> logits [B, T, vocab_size];
    Transformer(cfg)(tokens, targets=next_tokens) -> mean cross-entropy (float32 scalar) over the
    targets that are not -100, computed without materialising the logits (see loomtrain.model.loss);
    Transformer(cfg)(tokens, targets=..., document_ids=ids [B, T]) for packed documents: equal ids
    are one document, attention stays inside it and positions restart where the id changes, so
    each document gives what it gives alone. Without document_ids the model is as before.

    Module names are a contract with the tensor-parallel plan: tok_emb, pos_emb
    (learned positions, else None), drop, blocks, norm, lm_head. Sinusoidal and
    RoPE tables are non-persistent buffers (pos_table, rope_cos, rope_sin) for
    max_seq_len positions. The final `norm` exists for pre-norm placement only:
    with post-norm every block already ends in a norm (as in Vaswani et al. 2017,
    which has none), so `norm` is nn.Identity there. Embeddings are not scaled by
    sqrt(d_model) (GPT-2 convention).
    """

    def __init__(self, cfg: ModelConfig, seed: int | None = None) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        if cfg.norm_placement == "pre":
            self.norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        else:
            self.norm = nn.Identity()
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("pos_table", None, persistent=False)
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.init_weights(seed)

    # Initialisation ---------------------------------------------------------
    def init_schedule(self) -> list[tuple[str, str, float]]:
        """(parameter name, rule, std) in the order init_weights applies them. Rules: "normal"
        draws N(0, std) from the init generator; "zeros" and "ones" draw nothing. The order is
        the random stream's, so `init_tensors` (one parameter at a time) reproduces init_weights
        bitwise by following it. GPT-2 init: N(0, init_std) for linears and embeddings, zero
        biases, unit norms; the residual output projections (attn.wo, ffn.down) get
        init_std / sqrt(2 * n_layers). A tied lm_head is the embedding and is skipped."""
        std = self.cfg.init_std
        scaled = {id(b.attn.wo.weight) for b in self.blocks} | {id(b.ffn.down.weight) for b in self.blocks}
        out: list[tuple[str, str, float]] = []
        for name, module in self.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.cfg.tie_embeddings:
                    continue
                s = std / math.sqrt(2 * self.cfg.n_layers) if id(module.weight) in scaled else std
                out.append((prefix + "weight", "normal", s))
                if getattr(module, "bias", None) is not None:
                    out.append((prefix + "bias", "zeros", 0.0))
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):  # what their reset_parameters does
                out.append((prefix + "weight", "ones", 0.0))
                if getattr(module, "bias", None) is not None:
                    out.append((prefix + "bias", "zeros", 0.0))
        return out

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter by `init_schedule`. With `seed` the result depends on
        nothing else (a generator on the parameters' device), without it on torch's global RNG.
        Also recomputes the position buffers, so a model built on the meta device works after
        `to_empty(device=...)` + `init_weights()`."""
        device = self.tok_emb.weight.device
        gen = None
        if seed is not None and device.type != "meta":
            gen = torch.Generator(device=device).manual_seed(seed)
        for name, rule, std in self.init_schedule():
            apply_init(self.get_parameter(name), rule, std, gen)
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the derived buffers (position tables, ALiBi slopes) on `device` (default: the
        parameters'), in the parameters' dtype. ALiBi slopes are rewritten only where a layer
        still holds all cfg.n_heads of them: a tensor-parallel plan that slices them must
        (re)slice after this. A model built on the meta device calls it with device="cpu" so
        that its buffers are real before the plan slices them."""
        cfg, weight = self.cfg, self.tok_emb.weight
        device = weight.device if device is None else torch.device(device)
        if cfg.positions == "alibi":
            slopes = alibi_slopes(cfg.n_heads).to(device, weight.dtype)
            for block in self.blocks:
                if block.attn.alibi_slopes is not None and block.attn.alibi_slopes.shape == slopes.shape:
                    block.attn.alibi_slopes = slopes.clone()
        if cfg.positions == "sinusoidal":
            self.pos_table = sinusoidal_table(cfg.max_seq_len, cfg.d_model).to(device, weight.dtype)
        if cfg.positions == "rope":
            cos, sin = rope_tables(cfg.max_seq_len, cfg.head_width, cfg.rope_theta, scaling=cfg.rope_scaling)
            self.rope_cos = cos.to(device, weight.dtype)
            self.rope_sin = sin.to(device, weight.dtype)

    # Forward ------------------------------------------------------------------
    def check_length(self, length: int) -> None:
        """Learned, sinusoidal and RoPE tables stop at max_seq_len; ALiBi and `none` do not."""
        if self.cfg.positions in ("learned", "sinusoidal", "rope") and length > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {length} exceeds model.max_seq_len={self.cfg.max_seq_len} "
                f"(positions={self.cfg.positions})"
            )

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        window_slice: WindowSlice | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]. With a cache, tokens are the new ones and their
        positions continue from cache.length; the cache is extended in place. With targets
        [B, T] (-100 = ignore) -> the mean cross-entropy instead of the logits. With document_ids
        [B, T] (packed documents, see the class): positions and attention per document.
        With window_slice: tokens are the positions `window_slice.index` of a window of
        `window_slice.length` (document_ids, if any, the whole window's): positions are the
        window's, and attention sees the window's keys where an exchange brings them
        (Attention.kv_exchange, set by context parallelism), else the slice's own."""
        t = tokens.shape[1]
        start = 0 if cache is None else cache.length
        if cache is not None and (document_ids is not None or window_slice is not None):
            raise ValueError(
                "document_ids / window_slice: packed documents and slices are for training; generation runs one per row"
            )
        self.check_length(start + t if window_slice is None else window_slice.length)
        width = t if window_slice is None else window_slice.length
        if document_ids is not None and document_ids.shape != (tokens.shape[0], width):
            raise ValueError(f"document_ids {tuple(document_ids.shape)} do not match tokens {tuple(tokens.shape)}")
        positions = torch.arange(start, start + t, device=tokens.device)  # [t], or per document [B, t]
        if document_ids is not None:
            positions = document_positions(document_ids)
            if window_slice is not None:
                positions = positions[:, window_slice.index.to(positions.device)]
        elif window_slice is not None:
            positions = window_slice.index.to(tokens.device)
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        elif self.pos_table is not None:
            x = x + self.pos_table[positions]
        x = self.drop(x)
        rope = None
        if self.rope_cos is not None:
            rope = (self.rope_cos[positions], self.rope_sin[positions])
            if positions.dim() == 2:  # [B, T, head_dim] -> [B, 1, T, head_dim], one per row
                rope = (rope[0].unsqueeze(1), rope[1].unsqueeze(1))
        mask = None  # one whole window without documents: plain causal attention
        if cache is None and (document_ids is not None or window_slice is not None):
            mask = MaskSpec.for_tokens(t, tokens.device, document_ids, window_slice)  # one for all blocks
        for i, block in enumerate(self.blocks):
            x = block(x, rope, None if cache is None else cache[i], mask)
        return self.lm_head(self.norm(x), targets)  # logits, or with targets the loss

    # Inference ----------------------------------------------------------------
    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache for up to `capacity` positions (default max_seq_len)."""
        return KVCache(self.cfg.n_layers, capacity or self.cfg.max_seq_len)

    # Prompt + up to max_new_tokens new tokens: loomtrain.model.generate.generate as a method.
    generate = generate

    # Accounting ---------------------------------------------------------------
    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at sequence length seq_len for the whole (unsharded) model:
        6 * N + 12 * n_layers * n_heads * head_dim * seq_len with N = param_count(cfg, exclude_embeddings=True).
        See loomtrain.model.flops for the convention."""
        return flops.flops_per_token(self.cfg, seq_len)


def apply_init(t: torch.Tensor, rule: str, std: float, generator: torch.Generator | None) -> None:
    """One step of `Transformer.init_schedule`, in place."""
    if rule == "normal":
        nn.init.normal_(t, 0.0, std, generator=generator)
    elif rule == "zeros":
        nn.init.zeros_(t)
    elif rule == "ones":
        nn.init.ones_(t)
    else:
        raise ValueError(f"unknown init rule {rule!r}")


def meta_transformer(cfg: ModelConfig) -> Transformer:
    """The model's shapes: its parameters and buffers on the meta device, no memory, no values.
    A meta tensor has no values to initialise, so torch's random inits are skipped while it is
    built: on meta they run torch's Python reference, whose first call imports torch._dynamo
    (~1.3 s of every start-up; the position tables are computed on the CPU for the same reason)."""
    with torch.device("meta"), contextlib.ExitStack() as skipped:
        for name in ("normal_", "uniform_", "kaiming_uniform_"):
            skipped.enter_context(mock.patch.object(nn.init, name, lambda tensor, *_, **__: tensor))
        return Transformer(cfg)


def init_tensors(cfg: ModelConfig, seed: int | None = None):
    """Yield (parameter name, full float32 CPU tensor) one parameter at a time, bitwise equal to
    `Transformer(cfg, seed=seed)` on the CPU, in its init order (the order the random stream
    is drawn in). Holds one full parameter at a time: the previous one is released before the
    next is generated, so a consumer that keeps only a slice never holds the whole model."""
    shapes = meta_transformer(cfg)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, rule, std in shapes.init_schedule():
        t = torch.empty(shapes.get_parameter(name).shape, dtype=torch.float32)
        apply_init(t, rule, std, gen)
        yield name, t
        del t
