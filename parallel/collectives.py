"""Tensor-parallel collectives as autograd functions, each with its exact backward.

Megatron's conjugate pairs (f and g in the Megatron-LM paper), along the TP group:

    copy_to_tp          forward identity          backward all-reduce
    reduce_from_tp      forward all-reduce        backward identity
    gather_last_dim     forward all-gather (-1)   backward split (-1)

and, for context parallelism, along the sequence of keys and values (dim 2 of [B, H, T, hd]):

    gather_kv           forward all-gather (T)    backward reduce-scatter (T)

and, for sequence parallelism, along the sequence dimension (dim 1 of [B, T, D]):

    gather_seq          forward all-gather (T)    backward reduce-scatter (T)
    reduce_scatter_seq  forward reduce-scatter    backward all-gather
    split_seq           forward split (no comm)   backward all-gather

Every collective records the bytes it moves in `COMM_STATS`, keyed by
(tag, op, phase) with phase "fwd" or "bwd", so a benchmark can compare them with
Megatron's count. The volume recorded is that of the full (unsharded) tensor the
collective works on: an all-reduce of N elements, an all-gather producing N
elements and a reduce-scatter consuming N elements all count N. That is the
convention of Megatron's "4 all-reduces of b*s*h per layer" and of its statement
that sequence parallelism moves the same volume (all-gather + reduce-scatter).
Next to it, `wire` is what each rank sends with a ring algorithm on p ranks:
2(p-1)/p N for an all-reduce, (p-1)/p N for an all-gather or a reduce-scatter
(so an all-reduce costs exactly one reduce-scatter plus one all-gather).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

# (tag, op, phase) -> [calls, bytes, wire bytes per rank]
COMM_STATS: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _record(tag: str, op: str, phase: str, t: torch.Tensor, p: int) -> None:
    entry = COMM_STATS[(tag, op, phase)]
    n = t.numel() * t.element_size()
    entry[0] += 1
    entry[1] += n
    entry[2] += (2 if op == "all_reduce" else 1) * (p - 1) / p * n


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


# Raw collectives (no autograd) -------------------------------------------------
def all_reduce(x: torch.Tensor, group, tag: str = "", phase: str = "fwd", op=dist.ReduceOp.SUM) -> torch.Tensor:
    p = _size(group)
    if p == 1:
        return x
    x = x.contiguous()
    _record(tag, "all_reduce", phase, x, p)
    dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group, tag: str, phase: str) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    # Gather along dim 0 of a contiguous view with `dim` moved to the front.
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((n * xt.shape[0], *xt.shape[1:]))
    _all_gather_single(out, xt, group=group)
    _record(tag, "all_gather", phase, out, n)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, tag: str, phase: str) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"parallel.sequence_parallel: sequence length {x.shape[dim]} is not divisible by tp={n}")
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((xt.shape[0] // n, *xt.shape[1:]))
    _record(tag, "reduce_scatter", phase, xt, n)
    _reduce_scatter_single(out, xt, group=group)
    return out.movedim(0, dim)


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of x along `dim` (no communication, no autograd rule)."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        what = "sequence length" if dim == 1 else f"size of dim {dim}"
        raise ValueError(f"parallel.tp={n}: {what} {x.shape[dim]} is not divisible by tp")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


# Autograd functions -------------------------------------------------------------
# Each is a conjugate pair: `forward` runs on the input, `backward` on the gradient, both
# `(tensor, group, tag, phase) -> tensor`; one torch.autograd.Function per pair, made here.
def _conjugate(name: str, doc: str, forward, backward):
    def fwd(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return forward(x, group, tag, "fwd")

    def bwd(ctx, grad):
        return backward(grad, ctx.group, ctx.tag, "bwd"), None, None

    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})

    def apply(x: torch.Tensor, group, tag: str = "") -> torch.Tensor:
        return x if _size(group) == 1 else fn.apply(x, group, tag)

    apply.__name__, apply.__doc__ = name, doc
    return apply


def _gather_seq(x, group, tag, phase):
    return _all_gather(x, 1, group, tag, phase)


def _reduce_scatter_seq(x, group, tag, phase):
    return _reduce_scatter(x, 1, group, tag, phase)


copy_to_tp = _conjugate(
    "copy_to_tp",
    "Identity forward; all-reduce of the gradient (input of a column-parallel region).",
    lambda x, group, tag, phase: x.view_as(x),
    lambda g, group, tag, phase: all_reduce(g.clone(), group, tag, phase),
)
reduce_from_tp = _conjugate(
    "reduce_from_tp",
    "All-reduce forward; identity backward (output of a row-parallel region).",
    lambda x, group, tag, phase: all_reduce(x.clone(), group, tag, phase),
    lambda g, group, tag, phase: g,
)
gather_last_dim = _conjugate(
    "gather_last_dim",
    "All-gather along the last dim (e.g. full logits for generation); backward splits.",
    lambda x, group, tag, phase: _all_gather(x, x.dim() - 1, group, tag, phase),
    lambda g, group, tag, phase: split(g, g.dim() - 1, group),
)
gather_seq = _conjugate(
    "gather_seq",
    "[B, T/tp, ...] -> [B, T, ...]; backward reduce-scatters (SP -> column-parallel).",
    _gather_seq,
    _reduce_scatter_seq,
)
reduce_scatter_seq = _conjugate(
    "reduce_scatter_seq",
    "Partial sums [B, T, ...] -> reduced [B, T/tp, ...]; backward all-gathers (row-parallel -> SP).",
    _reduce_scatter_seq,
    _gather_seq,
)
split_seq = _conjugate(
    "split_seq",
    "Replicated [B, T, ...] -> this rank's [B, T/tp, ...]; backward all-gathers.",
    lambda x, group, tag, phase: split(x, 1, group),
    _gather_seq,
)

# Context parallelism: keys and values [B, H, T/cp, hd] of every CP rank along the sequence (dim 2).
gather_kv = _conjugate(
    "gather_kv",
    "[B, H, T/cp, hd] -> [B, H, T, hd] in rank order; backward reduce-scatters dK/dV (each rank's own keys).",
    lambda x, group, tag, phase: _all_gather(x, 2, group, tag, phase),
    lambda g, group, tag, phase: _reduce_scatter(g, 2, group, tag, phase),
)
