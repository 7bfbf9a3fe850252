"""Position information: sinusoidal table, RoPE, ALiBi.

Learned absolute positions are a plain nn.Embedding (`Transformer.pos_emb`) and
`none` adds nothing; the rest are functions of positions, kept here.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

# The position tables are computed on the CPU even where the default device is meta (a model
# built for its shapes): torch runs an op on meta through its Python reference, whose first
# call imports torch._dynamo (~1.3 s of a start-up).
CPU = torch.device("cpu")


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> [B, T] positions that restart at 0 wherever the id changes."""
    t = document_ids.shape[1]
    index = torch.arange(t, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def sinusoidal_table(max_len: int, dim: int) -> torch.Tensor:
    """[max_len, dim]: PE(p, 2i) = sin(p / 10000^(2i/dim)), PE(p, 2i+1) = cos(...) (Vaswani et al. 2017).
    Computed on the CPU."""
    pos = torch.arange(max_len, dtype=torch.float64, device=CPU)[:, None]
    inv = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64, device=CPU) / dim)
    table = torch.zeros(max_len, dim, dtype=torch.float64, device=CPU)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : dim // 2]
    return table.float()


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """[head_dim / 2] float64 inverse frequencies theta^(-2i/head_dim), stretched by `scaling` (a
    loomtrain.model.config.RopeScaling, None = none) with the formulas of transformers'
    modeling_rope_utils (_compute_linear_scaling_rope_parameters, _compute_llama3_parameters),
    in float64 where transformers computes in float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=CPU) / head_dim)
    kind = "none" if scaling is None else scaling.type
    if kind == "none":
        return inv_freq
    factor = float(scaling.factor)
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"model.rope_scaling.type: {kind!r} is not one of none, linear, llama3")
    low, high, old_len = float(scaling.low_freq_factor), float(scaling.high_freq_factor), scaling.original_max_position
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by factor, short ones kept, the band between
    # interpolated: smooth goes 0 -> 1 as the wavelength shrinks from old_len/low to old_len/high.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    max_len: int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32, scaling=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_len, head_dim], for the rotate-half layout (as in HF Llama / GPT-NeoX).

    Dimension pair (i, i + head_dim/2) is rotated by angle p * theta^(-2i/head_dim) (Su et al. 2021),
    the frequencies stretched by `scaling` (see rope_inv_freq). Computed on the CPU.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64, device=CPU), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pair (i, i + half) rotated by the angle whose cos/sin the tables [T, head_dim] hold (-sin:
    the opposite angle, bit for bit, as negation is exact)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half].contiguous(), sin[..., :half].contiguous()  # [T, half]: small
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class _Rope(torch.autograd.Function):
    """The backward of a rotation is the rotation by the opposite angle: one pass each way,
    instead of autograd's walk back through neg / cat / two products / sum (which also
    zero-fills and adds the two half-gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, head_dim] by the tables cos/sin [T, head_dim] (already sliced to x's positions;
    or [B, 1, T, head_dim], gathered at each sequence's own positions).

    Rotate-half layout: x_i' = x_i cos - x_{i+h} sin, x_{i+h}' = x_{i+h} cos + x_i sin
    (cos/sin hold each angle twice, at i and i + h, as rope_tables builds them).
    """
    # The tables may be kept in fp32 while activations run in bf16/fp16 (DeepSpeed casts
    # parameters, not every buffer): rotate in the activations' dtype so q, k and v agree.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.requires_grad or sin.requires_grad:  # tables are buffers; keep autograd's path if not
        return _rotate(x, cos, sin)
    return _Rope.apply(x, cos, sin)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """[n_heads] geometric slopes 2^(-8/n), 2^(-16/n), ... (Press et al. 2022).

    When n_heads is not a power of two: the slopes of the closest smaller power
    of two, then every other slope of the next power of two (the paper's recipe).
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device=CPU)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Additive attention bias [H, Tq, Tk]: -slope * (i - j) for key j <= query i, -inf above the diagonal.

    Without `causal` the bias is -slope * |i - j| and nothing is masked.
    """
    dist = (q_pos[:, None] - k_pos[None, :]).to(slopes.dtype)
    bias = -slopes[:, None, None] * (dist if causal else dist.abs())
    if causal:
        bias = bias.masked_fill(dist < 0, float("-inf"))
    return bias
