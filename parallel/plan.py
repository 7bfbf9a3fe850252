"""The tensor-parallel plan: shard a plain `loomtrain.model.Transformer` in place.

The model file knows nothing of ranks; like torchtitan's `parallelize`, this plan
swaps modules by name (the contract in loomtrain.model) and adds forward pre-hooks
where one collective serves several layers:

    tok_emb            VocabParallelEmbedding (vocabulary padded to a multiple of tp)
    attn (pre-hook)    input: copy_to_tp  | SP: all-gather along the sequence
    attn.wq/wk/wv      column-parallel, whole heads per rank; with fewer KV heads than
                       tp each KV head is replicated on tp / n_kv_heads ranks
    attn.wo            row-parallel: all-reduce | SP: reduce-scatter along the sequence
    attn.n_heads, n_kv_heads, alibi_slopes    set to the local heads
    ffn (pre-hook)     input: copy_to_tp  | SP: all-gather
    ffn.up/gate        column-parallel;  ffn.down  row-parallel
    lm_head            column-parallel, output kept sharded: logits [B, T, vocab_padded / tp];
                       with targets, vocab-parallel cross-entropy over those shards
                       (tied: the same Parameter as tok_emb's shard)

So per layer: forward 2 all-reduces (SP: 2 all-gathers + 2 reduce-scatters), backward
the same, as in Megatron-LM with a fused QKV. One hook per attention/FFN instead of one
collective per wq/wk/wv/up/gate keeps it so although the model has separate Linears.

Sequence parallelism: between the row-parallel output and the next column-parallel
input (residual adds, norms, dropout) activations are [B, T/tp, D]. The embedding's
partial sums are reduce-scattered straight into that layout (learned positions:
pos_emb's output is cut to this rank's positions); with sinusoidal positions, a table
added inside the model's forward, the embedding all-reduces and `drop` takes this
rank's sequence slice.
Parameters used inside the SP region (norm weights/biases, row-parallel biases)
see only a sequence shard, so a gradient hook sums their gradients over TP.

Dropout (model.dropout > 0): attention (dropout on local heads) and, under SP, the
dropouts of the sequence-split region run under a TP-rank-specific RNG fork
(`_fork_rng`), as Megatron's model-parallel RNG tracker does; dropouts on replicated
activations use the global RNG, identical on every TP rank.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from loomtrain.parallel import collectives as C
from loomtrain.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from loomtrain.parallel.topology import check_tp


def _grad_all_reduce_hook(group, tag):
    def hook(grad):
        return C.all_reduce(grad.clone(), group, tag, "bwd")

    return hook


def _input_hook(fn, group, tag):
    """Forward pre-hook applying `fn` to the module's first positional input."""

    def hook(module, args, kwargs):
        return (fn(args[0], group, tag), *args[1:]), kwargs

    return hook


def _split_hook(group, tag):
    def hook(module, args):
        return (C.split_seq(args[0], group, tag), *args[1:])

    return hook


def _sp_grad_sync(module: nn.Module, group, tag: str) -> None:
    for p in module.parameters(recurse=True):
        if p.requires_grad and not getattr(p, "tensor_model_parallel", False):
            p.sequence_parallel = True
            p.register_hook(_grad_all_reduce_hook(group, tag))


def _fork_rng(module: nn.Module, tp_rank: int) -> None:
    """Run `module`'s forward under a TP-rank-specific RNG (Megatron's model-parallel RNG),
    so dropout masks differ between the shards of one tensor (attention heads; sequence
    chunks under SP) while replicated regions keep identical masks on every TP rank.

    Stateless: the fork's seed is one draw from the global CPU generator (the same on
    all TP ranks) plus an offset per tp_rank, and the global state is restored after the
    forward. Activation checkpointing, which restores the global RNG state before it
    recomputes, therefore replays the same masks; resuming needs only the global state.
    """
    saved: list = []

    def pre(mod, args):
        if not mod.training:
            saved.append(None)
            return
        seed = int(torch.randint(0, 2**62, ()))
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        saved.append((torch.get_rng_state(), cuda))
        torch.manual_seed(seed + 2718 * (tp_rank + 1))

    def post(mod, args, out):
        state = saved.pop() if saved else None
        if state is not None:
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state_all(state[1])

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)


def _shard_attention(attn, topology, cfg, sp: bool, tag: str) -> None:
    tp, r, group = topology.tp_size, topology.tp_rank, topology.tp_group
    n_heads, n_kv = cfg.n_heads, cfg.kv_heads
    attn.register_forward_pre_hook(
        _input_hook(C.gather_seq if sp else C.copy_to_tp, group, f"{tag}.attn_in"), with_kwargs=True
    )
    attn.wq = ColumnParallelLinear(attn.wq, topology, shard_index=r, num_shards=tp)
    if n_kv % tp == 0:
        attn.wk = ColumnParallelLinear(attn.wk, topology, shard_index=r, num_shards=tp)
        attn.wv = ColumnParallelLinear(attn.wv, topology, shard_index=r, num_shards=tp)
        local_kv = n_kv // tp
    else:
        # Fewer KV heads than tp: rank r's query heads [r*H/tp, (r+1)*H/tp) all read
        # KV head r * n_kv // tp, which m = tp / n_kv consecutive ranks hold as a replica.
        m = tp // n_kv
        head, owner = r // m, r % m == 0
        sub = topology.tp_subgroup(m)
        for name in ("wk", "wv"):
            layer = ColumnParallelLinear(getattr(attn, name), topology, shard_index=head, num_shards=n_kv,
                                         owner=owner)
            for p in (layer.weight, layer.bias):
                if p is not None:
                    p.tp_replicas = m
                    p.register_hook(_grad_all_reduce_hook(sub, f"{tag}.kv_replica_grad"))
            setattr(attn, name, layer)
        local_kv = 1
    attn.wo = RowParallelLinear(attn.wo, topology, sequence_parallel=sp, tag=f"{tag}.attn_out")
    attn.n_heads = n_heads // tp
    attn.n_kv_heads = local_kv
    if attn.alibi_slopes is not None:
        attn.alibi_slopes = attn.alibi_slopes.chunk(tp)[r].clone()


def _shard_ffn(ffn, topology, sp: bool, tag: str) -> None:
    tp, r, group = topology.tp_size, topology.tp_rank, topology.tp_group
    ffn.register_forward_pre_hook(
        _input_hook(C.gather_seq if sp else C.copy_to_tp, group, f"{tag}.ffn_in"), with_kwargs=True
    )
    ffn.up = ColumnParallelLinear(ffn.up, topology, shard_index=r, num_shards=tp)
    if hasattr(ffn, "gate"):
        ffn.gate = ColumnParallelLinear(ffn.gate, topology, shard_index=r, num_shards=tp)
    ffn.down = RowParallelLinear(ffn.down, topology, sequence_parallel=sp, tag=f"{tag}.ffn_out")


def parallelize(model: nn.Module, topology, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model` (a Transformer with its full weights) in place for `topology`; returns it.

    A no-op at tp == 1. Every rank must call it (it may create process groups), with
    the same seed-initialised full weights, so the shards equal the slices of the
    single-process model.
    """
    tp = topology.tp_size
    if tp == 1:
        return model
    cfg = model.cfg
    check_tp(cfg, tp, topology.world_size)
    group, r = topology.tp_group, topology.tp_rank
    sp = bool(sequence_parallel)
    padded = topology.padded_vocab(cfg.vocab_size)
    tied = model.lm_head.weight is model.tok_emb.weight

    # SP: the embedding's partial sums are reduce-scattered straight into [B, T/tp, D];
    # learned positions are cut to this rank's positions by a hook on pos_emb (its
    # gradient, from local positions only, summed over TP). The sinusoidal table is
    # indexed inside the model's forward, where no hook reaches: there the embedding
    # all-reduces and `drop` takes this rank's slice.
    table = cfg.positions == "sinusoidal" or getattr(model, "pos_table", None) is not None
    emb_mode = "reduce_scatter_seq" if sp and not table else "all_reduce"
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, topology, padded_vocab=padded, output_mode=emb_mode)
    if sp and table:
        model.drop.register_forward_pre_hook(_split_hook(group, "embedding.split"))
    if sp and model.pos_emb is not None:
        model.pos_emb.register_forward_hook(lambda mod, args, out: C._split(out, out.dim() - 2, group))
        _sp_grad_sync(model.pos_emb, group, "pos_emb.sp_grad")

    if cfg.dropout > 0:  # different masks per shard; replicated regions stay in step
        if sp:
            _fork_rng(model.drop, r)
        for block in model.blocks:
            _fork_rng(block.attn, r)
            if sp:
                _fork_rng(block.resid_drop, r)

    for i, block in enumerate(model.blocks):
        _shard_attention(block.attn, topology, cfg, sp, f"blocks.{i}")
        _shard_ffn(block.ffn, topology, sp, f"blocks.{i}")
        if sp:
            for name in ("attn_norm", "ffn_norm"):
                _sp_grad_sync(getattr(block, name), group, f"blocks.{i}.sp_grad")
            for layer in (block.attn.wo, block.ffn.down):
                if layer.bias is not None:
                    layer.bias.register_hook(_grad_all_reduce_hook(group, f"blocks.{i}.sp_grad"))
    if sp:
        _sp_grad_sync(model.norm, group, "norm.sp_grad")

    model.lm_head = VocabParallelLMHead(
        model.lm_head, topology, shard_index=r, num_shards=tp, padded_out=padded,
        input_mode="gather_seq" if sp else "copy", tag="lm_head_in",
        weight=model.tok_emb.weight if tied else None,
    )
    model.tp_plan = dict(tp=tp, sequence_parallel=sp, vocab_size=cfg.vocab_size, padded_vocab=padded)
    return model


@contextlib.contextmanager
def gathered_logits(model: nn.Module):
    """Inside this context a parallelized model returns full logits [B, T, vocab_size]
    (all-gathered, padding dropped), e.g. for `model.generate` under TP without SP."""
    head = model.lm_head
    if not isinstance(head, ColumnParallelLinear):
        yield model
        return
    if getattr(model, "tp_plan", {}).get("sequence_parallel"):
        raise ValueError("parallel.sequence_parallel: generation needs a model parallelized without it")
    head.gather_output = True
    try:
        yield model
    finally:
        head.gather_output = False


def gather_full_param(param: torch.Tensor, topology) -> torch.Tensor:
    """The full (unpadded) tensor of a sharded parameter or gradient, on every TP rank;
    a replicated tensor is returned as it is. For tests, export and checkpoint resharding."""
    meta = getattr(param, "tp_meta", None)
    return param if meta is None else gather_full(param, meta, topology)


def gather_full(t: torch.Tensor, meta: dict, topology) -> torch.Tensor:
    group, tp = topology.tp_group, topology.tp_size
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    n, dim = meta["num_shards"], meta["partition_dim"]
    if n < tp:  # replicas: keep the first copy of each shard
        parts = parts[:: tp // n]
    full = torch.cat(parts, dim=dim)
    return full.narrow(dim, 0, meta["full_shape"][dim])


@torch.no_grad()
def full_state_dict(model: nn.Module, topology) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a parallelized model, with the plain model's keys and
    shapes (vocabulary padding dropped), on every TP rank: what `Transformer.load_state_dict`
    takes. Resharding = full_state_dict at one tp, load into a plain model, parallelize at
    another. Collective over the TP group (every TP rank must call it)."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        meta = getattr(t, "tp_meta", None)
        out[name] = (t if meta is None else gather_full(t.detach(), meta, topology)).detach().clone()
    return out
