"""Tensor-parallel layers, built from the shards the TP plan cuts.

The layout (which dim, vocabulary padding, replicated KV heads) is decided in one place,
`loomtrain.parallel.plan` (`shard_spec`, `shard_tensor`); `parallelize` cuts each full
parameter there and hands these layers their shards, already marked (`attach_spec`) with:

    tensor_model_parallel  True on the rank that owns it (DeepSpeed's gradient-norm
                           and clipping code counts such params on every TP rank,
                           and non-TP params only on tp_rank 0)
    tp_meta                `ShardSpec.as_meta()`: partition_dim, full_shape, padded_size,
                           num_shards, shard_index, replicas

A KV projection replicated over m = tp / n_kv_heads ranks has num_shards =
n_kv_heads; only the first rank of the m holds it as `tensor_model_parallel`
(so norms count it once), and its gradient is summed over those m ranks so the
replicas stay identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from loomtrain.parallel import collectives as C


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A's output rows split across TP ranks: y stays split on its last dim.

    input_mode: "none" (the caller already made the input TP-ready, e.g. one hook for
    wq/wk/wv together), "copy" (identity fwd / all-reduce bwd), or "gather_seq"
    (sequence parallelism: all-gather the sequence fwd / reduce-scatter bwd).
    gather_output: all-gather the output along its last dim and drop padding.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        topology,
        *,
        full_out_features: int,
        padded_out: int | None = None,
        input_mode: str = "none",
        tag: str = "",
    ):
        super().__init__()
        self.group = topology.tp_group
        self.in_features = weight.shape[1]
        self.full_out_features = full_out_features
        self.padded_out = padded_out or full_out_features
        self.input_mode = input_mode
        self.gather_output = False
        self.tag = tag
        self.weight = weight  # a tied head passes the embedding's (already sharded) parameter
        self.out_features = weight.shape[0]
        self.register_parameter("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_mode == "copy":
            x = C.copy_to_tp(x, self.group, self.tag)
        elif self.input_mode == "gather_seq":
            x = C.gather_seq(x, self.group, self.tag)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = C.gather_last_dim(y, self.group, self.tag)[..., : self.full_out_features]
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out_local={self.out_features}, out_full={self.full_out_features}, "
            f"padded={self.padded_out}, input={self.input_mode}, bias={self.bias is not None}"
        )


class RowParallelLinear(nn.Module):
    """y = x A^T with A's input columns split across ranks; partial sums are all-reduced
    (or reduce-scattered along the sequence under sequence parallelism). The bias is
    replicated and added after the reduction."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        topology,
        *,
        sequence_parallel: bool = False,
        tag: str = "",
    ):
        super().__init__()
        self.group = topology.tp_group
        self.sequence_parallel = sequence_parallel
        self.tag = tag
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)  # under SP it sees a sequence shard: the plan sums its grads over TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial output summed over TP (SP: reduce-scattered along the sequence), plus the bias."""
        if self.sequence_parallel:
            y = C.reduce_scatter_seq(partial, self.group, self.tag)
        else:
            y = C.reduce_from_tp(partial, self.group, self.tag)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_local={self.in_features}, out={self.out_features}, sp={self.sequence_parallel}, "
            f"bias={self.bias is not None}"
        )


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows (the vocabulary, padded to a multiple of tp) split across
    ranks. Each rank looks up the tokens in its range, zeroes the rest, and the partial
    results are summed: all-reduce, or reduce-scatter along the sequence (output_mode
    "reduce_scatter_seq")."""

    def __init__(
        self,
        weight: nn.Parameter,
        topology,
        *,
        num_embeddings: int,
        padded_vocab: int,
        output_mode: str = "all_reduce",
        tag: str = "embedding",
    ):
        super().__init__()
        self.group = topology.tp_group
        self.num_embeddings, self.embedding_dim = num_embeddings, weight.shape[1]
        self.padded_vocab = padded_vocab
        self.per_rank = weight.shape[0]
        self.vocab_start = topology.tp_rank * self.per_rank
        self.output_mode = output_mode
        self.tag = tag
        self.weight = weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.output_mode == "reduce_scatter_seq":
            return C.reduce_scatter_seq(out, self.group, self.tag)
        return C.reduce_from_tp(out, self.group, self.tag)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings}, padded={self.padded_vocab}, local={self.per_rank}, "
            f"dim={self.embedding_dim}, start={self.vocab_start}, out={self.output_mode}"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy: three all-reduces of [N] scalars
    (max, target logit, sum of exp) instead of gathering [N, vocab] logits."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, ignore_index):
        # logits [N, V_local] (float32), targets [N]
        n_local = logits.shape[-1]
        logits = logits.clone()
        pad_from = max(0, min(n_local, vocab_size - vocab_start))
        if pad_from < n_local:  # padded vocabulary entries never win
            logits[:, pad_from:] = float("-inf")
        logits_max = logits.max(dim=-1).values
        C.all_reduce(logits_max, group, "cross_entropy", "fwd", op=dist.ReduceOp.MAX)
        logits.sub_(logits_max.unsqueeze(-1))

        valid = targets != ignore_index
        local_t = targets - vocab_start
        in_range = valid & (local_t >= 0) & (local_t < n_local)
        local_t = local_t.masked_fill(~in_range, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        target_logit = logits[rows, local_t].masked_fill(~in_range, 0.0)
        C.all_reduce(target_logit, group, "cross_entropy", "fwd")

        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        C.all_reduce(sum_exp, group, "cross_entropy", "fwd")
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, local columns
        ctx.save_for_backward(exp, rows, local_t, in_range, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, rows, local_t, in_range, valid = ctx.saved_tensors
        grad = softmax
        grad[rows, local_t] -= in_range.to(grad.dtype)
        grad.mul_((grad_loss * valid.to(grad_loss.dtype)).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, topology, vocab_size: int, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of vocab-sharded logits [..., V_padded/tp] against global targets [...]."""
    n_local = logits.shape[-1]
    flat = logits.reshape(-1, n_local).float()
    t = targets.reshape(-1)
    start = topology.tp_rank * n_local
    losses = _VocabParallelCrossEntropy.apply(flat, t, topology.tp_group, start, vocab_size, ignore_index)
    n_valid = (t != ignore_index).sum().clamp(min=1)
    return losses.sum() / n_valid


class VocabParallelLMHead(ColumnParallelLinear):
    """The tensor-parallel `LMHead`: column-parallel over the (padded) vocabulary, so
    forward(x) gives this rank's logits [..., V_padded/tp] and forward(x, targets) the mean
    cross-entropy by `vocab_parallel_cross_entropy` (the full logits are never gathered)."""

    def __init__(self, weight: nn.Parameter, topology, **kwargs):
        super().__init__(weight, None, topology, **kwargs)
        self.topology = topology

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(x)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.topology, self.full_out_features)
