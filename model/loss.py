"""The output layer and its loss: logits, or cross-entropy without ever holding the logits.

Training needs only the loss and its gradients, yet the plain `lm_head(h)` then
`cross_entropy(logits.float())` keeps [tokens, vocab] logits in the compute dtype, a
float32 copy and the softmax for backward: for a 50k vocabulary and 16k tokens a
micro batch, ~8 GB. `linear_cross_entropy` instead walks the tokens in chunks and,
per chunk, computes the logits, the loss and the gradients of the hidden states and
the weight at once (as Liger-Kernel's fused linear cross-entropy does): the same
FLOPs (one forward and two backward matmuls), one chunk of logits alive at a time,
and on CPU no logits-sized block is mapped and unmapped every step.

Gradients are kept unnormalised (sum over tokens of softmax - one-hot) until
backward multiplies them by grad_output / n_valid: in fp16 the per-token gradients
divided by 16k tokens would underflow before the loss scale reaches them.
"""

from __future__ import annotations

import torch
from torch import nn

IGNORE_INDEX = -100

# Bytes of float32 logits per chunk. CPU: 8-16 MiB measured fastest (2-core EPYC,
# benchmarks/output_layer.py) and under glibc's 32 MiB mmap threshold, so the chunk's
# memory is reused rather than mapped and unmapped. GPU: large enough that each chunk's
# matmuls keep the tensor cores busy (1,334 tokens at a 50k vocabulary: ~0.3 TFLOP per
# matmul at d 2048).
_CHUNK_BYTES = {"cpu": 16 << 20}
_CHUNK_BYTES_DEFAULT = 256 << 20


def chunk_rows(vocab_size: int, device_type: str) -> int:
    """Tokens per chunk for a vocabulary of vocab_size on this device type ("cpu", "cuda")."""
    budget = _CHUNK_BYTES.get(device_type, _CHUNK_BYTES_DEFAULT)
    return max(64, budget // (4 * vocab_size))


def _chunks(n: int, rows: int):
    return ((s, min(s + rows, n)) for s in range(0, n, rows))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, want_grad_hidden, want_grad_weight):
        # hidden [N, D], weight [V, D], targets [N]. Runs with autocast off: the compute
        # dtype was fixed by the caller (autocast's, else the inputs').
        valid = targets != IGNORE_INDEX
        safe_t = targets.masked_fill(~valid, 0)
        loss_dtype = torch.promote_types(hidden.dtype, torch.float32)  # bf16/fp16 -> float32
        total = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_grad_hidden else None
        grad_w = torch.zeros(weight.shape, dtype=loss_dtype, device=weight.device) if want_grad_weight else None
        for s, e in _chunks(hidden.shape[0], rows):
            h, t, ok = hidden[s:e], safe_t[s:e], valid[s:e]
            logits = (h @ weight.t()).to(loss_dtype)
            target_logit = logits.gather(1, t[:, None]).squeeze(1)
            row_max = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(row_max).exp_()  # one exp pass serves the loss and the gradient
            sum_exp = probs.sum(dim=-1)
            total += ((row_max.squeeze(1) + sum_exp.log() - target_logit) * ok).sum()
            if grad_h is None and grad_w is None:
                continue
            probs.mul_((ok / sum_exp)[:, None])  # softmax; ignored tokens contribute nothing
            probs[torch.arange(e - s, device=probs.device), t] -= ok.to(probs.dtype)
            grad = probs.to(hidden.dtype)
            if grad_h is not None:
                torch.matmul(grad, weight, out=grad_h[s:e])
            if grad_w is not None:
                if grad.dtype == grad_w.dtype:
                    grad_w.addmm_(grad.t(), h)
                else:  # bf16/fp16 matmul, accumulated over chunks in float32
                    grad_w += grad.t() @ h
        n_valid = valid.sum().clamp(min=1).to(loss_dtype)
        ctx.save_for_backward(n_valid, grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        n_valid, grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.to(n_valid.dtype) / n_valid

        def scaled(grad, dtype):
            return None if grad is None else (grad.to(scale.dtype) * scale).to(dtype)

        return scaled(grad_h, ctx.dtypes[0]), scaled(grad_w, ctx.dtypes[1]), None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of logits = hidden @ weight.T against targets, computed chunk by
    chunk: equals `cross_entropy((hidden @ weight.T).float(), targets, ignore_index=-100)`
    in value and gradients. A float32 scalar (float64 for float64 inputs).
    hidden [..., D], weight [V, D], targets [...]; rows: tokens per chunk (default by device)."""
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    if flat_t.shape[0] != flat_h.shape[0]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden states {tuple(hidden.shape)}")
    rows = rows or chunk_rows(weight.shape[0], hidden.device.type)
    device = flat_h.device.type  # the compute dtype: autocast's, else the inputs'
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else flat_h.dtype
    grads = torch.is_grad_enabled()
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(
            flat_h.to(dtype),
            weight.to(dtype),
            flat_t,
            rows,
            grads and hidden.requires_grad,
            grads and weight.requires_grad,
        )


class LMHead(nn.Linear):
    """The un-embedding: nn.Linear(d_model, vocab_size, bias=False) whose forward(x) gives
    logits and forward(x, targets) the mean cross-entropy by `linear_cross_entropy`.
    The loss lives inside this module's forward so that engines which gather a layer's
    parameters around its forward (ZeRO-3) see the weight used."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets)
