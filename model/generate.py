"""Autoregressive generation with a KV cache: greedy (temperature 0) or sampled with top-k / top-p."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .transformer import Transformer


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> next token ids [B]. temperature 0 is argmax; otherwise softmax(logits / temperature)
    restricted to the top_k most likely tokens and to the smallest set whose probability reaches top_p."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first one always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    tokens: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """tokens [B, T] (or [T]) -> [B, T + n] (or [T + n]): the prompt followed by n <= max_new_tokens new tokens.

    Rows that produced `eos_id` are padded with `eos_id` afterwards; generation stops
    early once every row has. The model runs in eval mode (dropout off) and is put
    back in its previous mode afterwards.
    """
    squeeze = tokens.dim() == 1
    if squeeze:
        tokens = tokens[None]
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    total = tokens.shape[1] + max_new_tokens
    model.check_length(total)
    was_training = model.training
    model.eval()
    try:
        out = [tokens]
        if max_new_tokens > 0:
            cache = model.new_cache(capacity=total)
            logits = model(tokens, cache)[:, -1]
            done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            for step in range(max_new_tokens):
                nxt = sample_next(logits, temperature, top_k, top_p, generator)
                if eos_id is not None:
                    nxt = nxt.masked_fill(done, eos_id)
                    done |= nxt == eos_id
                out.append(nxt[:, None])
                if step == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
                    break
                logits = model(nxt[:, None], cache)[:, -1]
    finally:
        model.train(was_training)
    result = torch.cat(out, dim=1)
    return result[0] if squeeze else result
