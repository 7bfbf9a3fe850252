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
    attn.q_norm/k_norm replicated (weights of head_dim); their gradients, each rank's from
                       its own heads, are summed over TP by a gradient hook
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
import dataclasses
import math
from dataclasses import dataclass

import torch
from loomtrain.parallel import collectives as C
from loomtrain.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from loomtrain.parallel.topology import check_tp, padded_vocab_size
from torch import nn

# The layout: how each parameter is split ---------------------------------------------
# The one definition of the tensor-parallel layout. Everything that cuts or joins a
# parameter asks here: the parallel layers (through `parallelize`), checkpoint save /
# load / reshard, start-up materialisation, the memory planner and the dry run.
#
#     spec = shard_spec(name, full_shape, model_cfg, tp, tp_rank)   # from a plain-model name
#     spec = spec_of(param)              # from a parameter of a parallelized model (its tp_meta)
#     local = shard_tensor(full, spec)   # this rank's shard of the full, unpadded tensor
#     full = join_shards(shards, spec)   # the full, unpadded tensor from its num_shards shards
#     full = gather_shards(local, spec, topology)   # the same, collective over the TP group
#
# Guarantees:
# * shard_spec is pure arithmetic on (name, full_shape, model config, tp, tp_rank); any
#   name the plan does not split gets a replicated spec (dim None). The dim does not
#   depend on tp (at tp 1 a split parameter has one shard, the full tensor). Names are those of
#   the plain `loomtrain.model.Transformer` (`named_parameters()`), which parallelize keeps.
# * shard_tensor(full, spec) returns a new contiguous tensor (never a view of `full`, so
#   the caller may drop `full`), with the dtype and device of `full` (meta works); rows
#   past the real size along the split dim (vocabulary padding) are zeros. A replicated
#   spec returns a copy of `full`. It is exactly what parallelize puts on that rank.
# * join_shards(shards, spec) takes the num_shards distinct shards in shard-index order
#   (not one per TP rank when KV heads are replicated) and returns a new contiguous
#   tensor of spec.full_shape; join_shards([shard_tensor(full, spec_k) ...]) == full
#   bitwise. A replicated spec takes a one-element list and returns that tensor.
# * gather_shards(local, spec, topology): every TP rank passes its own shard and gets
#   the full tensor; a replicated spec or tp == 1 returns `local` itself (no collective).
# * spec_of(param) reads the `tp_meta` dict parallelize attaches to every split
#   parameter (`ShardSpec.as_meta` / `ShardSpec.from_meta` convert); a parameter without
#   tp_meta is replicated over TP, and its full shape is its (ZeRO-3: `ds_shape`) shape.


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the TP group, seen from one TP rank.

    full_shape   the parameter of the plain model (unpadded)
    dim          the dim it is split along; None: every TP rank holds all of it
    padded_size  dim's size after zero-padding to a multiple of num_shards (vocabulary)
    num_shards   distinct shards: tp, or n_kv_heads when fewer KV heads than tp are
                 replicated (then `replicas` = tp / num_shards consecutive ranks hold each)
    shard_index  the shard this rank holds
    owner        the first of the ranks holding this shard (counts it in gradient norms)
    """

    full_shape: tuple
    dim: int | None = None
    padded_size: int = 0
    num_shards: int = 1
    shard_index: int = 0
    owner: bool = True
    replicas: int = 1

    @property
    def replicated(self) -> bool:
        return self.dim is None

    @property
    def local_shape(self) -> tuple:
        if self.dim is None:
            return tuple(self.full_shape)
        shape = list(self.full_shape)
        shape[self.dim] = self.padded_size // self.num_shards
        return tuple(shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def bounds(self) -> tuple[int, int]:
        """[start, stop) of this shard's real entries along dim in the full tensor (stop - start
        may be less than the local size: the rest is padding)."""
        if self.dim is None:
            return 0, (self.full_shape[0] if self.full_shape else 0)
        size = self.padded_size // self.num_shards
        start = self.shard_index * size
        return min(start, self.full_shape[self.dim]), min(start + size, self.full_shape[self.dim])

    def as_meta(self) -> dict | None:
        """The `tp_meta` dict parallelize attaches to a split parameter (None if replicated)."""
        if self.dim is None:
            return None
        return dict(
            partition_dim=self.dim,
            full_shape=tuple(self.full_shape),
            padded_size=self.padded_size,
            num_shards=self.num_shards,
            shard_index=self.shard_index,
            replicas=self.replicas,
        )

    @classmethod
    def from_meta(cls, meta: dict) -> ShardSpec:
        return cls(
            tuple(meta["full_shape"]),
            meta["partition_dim"],
            meta["padded_size"],
            meta["num_shards"],
            meta["shard_index"],
            replicas=meta.get("replicas", 1),
        )


# Parameters split by the name of the layer that holds them (the model's contract names).
_COLUMN = {"wq", "wk", "wv", "up", "gate"}  # output features split; bias split too
_ROW = {"wo", "down"}  # input features split; bias replicated (added after the reduction)
_VOCAB = {"tok_emb", "lm_head"}  # vocabulary rows split, padded to a multiple of tp


def shard_spec(name: str, full_shape, model_cfg, tp: int, tp_rank: int = 0) -> ShardSpec:
    """How TP rank `tp_rank` of `tp` holds the plain-model parameter `name` of `full_shape`."""
    full_shape = tuple(full_shape)
    *_, layer, leaf = ["", *name.split(".")]  # layer "" for a top-level name
    if not full_shape:
        return ShardSpec(full_shape)
    if layer in _VOCAB:
        return ShardSpec(full_shape, 0, padded_vocab_size(full_shape[0], tp), tp, tp_rank)
    # LoRA factors (loomtrain.parallel.lora): a row-parallel layer's A [r, in] is split like its
    # input, its B [out, r] replicated; a column-parallel layer's B like its output, A replicated.
    if layer in _ROW and leaf in ("weight", "lora_A"):
        return ShardSpec(full_shape, 1, full_shape[1], tp, tp_rank)
    if layer in _COLUMN and leaf != "lora_A":
        n_kv = model_cfg.kv_heads
        if layer in ("wk", "wv") and n_kv % tp:
            # Fewer KV heads than tp: rank r's query heads [r*H/tp, (r+1)*H/tp) all read KV
            # head r * n_kv // tp, which m = tp / n_kv consecutive ranks hold as a replica.
            m = tp // n_kv
            return ShardSpec(full_shape, 0, full_shape[0], n_kv, tp_rank // m, tp_rank % m == 0, m)
        return ShardSpec(full_shape, 0, full_shape[0], tp, tp_rank)
    return ShardSpec(full_shape)


def spec_of(param: torch.Tensor) -> ShardSpec:
    """The spec of a parameter of a parallelized model (replicated when it has no tp_meta)."""
    meta = getattr(param, "tp_meta", None)
    if meta is not None:
        return dataclasses.replace(ShardSpec.from_meta(meta), owner=bool(getattr(param, "tensor_model_parallel", True)))
    return ShardSpec(tuple(getattr(param, "ds_shape", param.shape)))


def attach_spec(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Mark a split parameter as DeepSpeed and the checkpoint code expect (no-op if replicated):
    tensor_model_parallel (on the owner of each shard only, so norms count a replica once) and
    tp_meta (`ShardSpec.as_meta`)."""
    if spec.dim is not None:
        param.tensor_model_parallel = bool(spec.owner)
        param.tp_meta = spec.as_meta()
    return param


def shard_tensor(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's shard of the full, unpadded tensor (a new contiguous tensor; padding zeros)."""
    if tuple(full.shape) != tuple(spec.full_shape):
        raise ValueError(
            f"tensor of shape {tuple(full.shape)} does not match the layout's full shape {tuple(spec.full_shape)}"
        )
    if spec.dim is None:
        return full.detach().clone(memory_format=torch.contiguous_format)
    start, stop = spec.bounds()
    real = full.detach().narrow(spec.dim, start, stop - start)
    pad = spec.local_shape[spec.dim] - (stop - start)
    if pad == 0:
        return real.clone(memory_format=torch.contiguous_format)
    pad_shape = list(real.shape)
    pad_shape[spec.dim] = pad
    return torch.cat([real, real.new_zeros(pad_shape)], dim=spec.dim)


def join_shards(shards, spec: ShardSpec) -> torch.Tensor:
    """The full, unpadded tensor from its shards 0..num_shards-1 (a new contiguous tensor)."""
    shards = list(shards)
    if spec.dim is None:
        if len(shards) != 1:
            raise ValueError(f"a replicated tensor has one shard, got {len(shards)}")
        return shards[0]
    if len(shards) != spec.num_shards:
        raise ValueError(f"expected {spec.num_shards} shards, got {len(shards)}")
    full = torch.cat([s.detach() for s in shards], dim=spec.dim)
    size = spec.full_shape[spec.dim]
    return full if full.shape[spec.dim] == size else full.narrow(spec.dim, 0, size).contiguous()


def gather_shards(local: torch.Tensor, spec: ShardSpec, topology) -> torch.Tensor:
    """The full, unpadded tensor on every TP rank from each rank's shard (collective over the
    TP group unless replicated or tp == 1). Works for gradients and optimizer moments too."""
    if spec.dim is None:
        return local
    if topology is None or topology.tp_size == 1:
        if spec.num_shards != 1:
            raise ValueError(f"a tensor split {spec.num_shards} ways needs its TP group to be joined")
        return join_shards([local], spec)
    parts = [torch.empty_like(local) for _ in range(topology.tp_size)]
    torch.distributed.all_gather(parts, local.detach().contiguous(), group=topology.tp_group)
    return join_shards(parts[:: spec.replicas], spec)


def grad_all_reduce_hook(group, tag):
    """A gradient hook summing the gradient over `group` (the ranks holding parts of its inputs)."""

    def hook(grad):
        return C.all_reduce(grad.clone(), group, tag, "bwd")

    return hook


def _input_hook(fn, group, tag):
    """Forward pre-hook applying `fn` to the module's first positional input."""

    def hook(module, args, kwargs):
        return (fn(args[0], group, tag), *args[1:]), kwargs

    return hook


def _sp_grad_sync(module: nn.Module, group, tag: str) -> None:
    """A hook summing over TP the gradient of each parameter of `module` that TP does not split."""
    for p in module.parameters(recurse=True):
        if p.requires_grad and not getattr(p, "tensor_model_parallel", False):
            p.register_hook(grad_all_reduce_hook(group, tag))


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


def _cut(layer: nn.Module, attr: str, name: str, cfg, topology) -> nn.Parameter | None:
    """This rank's shard of `layer.<attr>` (plain-model name `name`), as a marked Parameter."""
    full = getattr(layer, attr)
    if full is None:
        return None
    spec = shard_spec(name, full.shape, cfg, topology.tp_size, topology.tp_rank)
    return attach_spec(nn.Parameter(shard_tensor(full, spec), requires_grad=full.requires_grad), spec)


def _split(linear: nn.Linear, name: str, cfg, topology, **kwargs) -> ColumnParallelLinear | RowParallelLinear:
    """`linear` (plain-model name `name`) as the parallel layer its name makes it (_ROW or _COLUMN),
    holding this rank's shards of its weight and bias."""
    weight, bias = (_cut(linear, attr, f"{name}.{attr}", cfg, topology) for attr in ("weight", "bias"))
    if name.rsplit(".", 1)[-1] in _ROW:
        return RowParallelLinear(weight, bias, topology, **kwargs)
    return ColumnParallelLinear(weight, bias, topology, full_out_features=linear.out_features, **kwargs)


def _shard_attention(attn, topology, cfg, sp: bool, tag: str) -> None:
    tp, r, group = topology.tp_size, topology.tp_rank, topology.tp_group
    attn.register_forward_pre_hook(
        _input_hook(C.gather_seq if sp else C.copy_to_tp, group, f"{tag}.attn_in"), with_kwargs=True
    )
    for name in ("wq", "wk", "wv"):
        setattr(attn, name, _split(getattr(attn, name), f"{tag}.attn.{name}", cfg, topology))
    kv = spec_of(attn.wk.weight)
    if kv.replicas > 1:  # one KV head on m ranks: sum its gradient over them to keep replicas equal
        sub = topology.tp_subgroup(kv.replicas)
        for p in (attn.wk.weight, attn.wk.bias, attn.wv.weight, attn.wv.bias):
            if p is not None:
                p.register_hook(grad_all_reduce_hook(sub, f"{tag}.kv_replica_grad"))
    attn.wo = _split(attn.wo, f"{tag}.attn.wo", cfg, topology, sequence_parallel=sp, tag=f"{tag}.attn_out")
    attn.n_heads = cfg.n_heads // tp
    attn.n_kv_heads = kv.local_shape[0] // cfg.head_width
    for norm in (attn.q_norm, attn.k_norm):  # replicated, each rank's gradient from its own heads: sum them
        if norm is not None:
            norm.weight.register_hook(grad_all_reduce_hook(group, f"{tag}.qk_norm_grad"))
    if attn.alibi_slopes is not None:  # the slopes of this rank's query heads
        attn.alibi_slopes = attn.alibi_slopes.chunk(tp)[r].clone()


def _shard_ffn(ffn, topology, cfg, sp: bool, tag: str) -> None:
    ffn.register_forward_pre_hook(
        _input_hook(C.gather_seq if sp else C.copy_to_tp, topology.tp_group, f"{tag}.ffn_in"), with_kwargs=True
    )
    ffn.up = _split(ffn.up, f"{tag}.ffn.up", cfg, topology)
    if hasattr(ffn, "gate"):
        ffn.gate = _split(ffn.gate, f"{tag}.ffn.gate", cfg, topology)
    ffn.down = _split(ffn.down, f"{tag}.ffn.down", cfg, topology, sequence_parallel=sp, tag=f"{tag}.ffn_out")


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
    padded = padded_vocab_size(cfg.vocab_size, tp)
    tied = model.lm_head.weight is model.tok_emb.weight

    # SP: the embedding's partial sums are reduce-scattered straight into [B, T/tp, D];
    # learned positions are cut to this rank's positions by a hook on pos_emb (its
    # gradient, from local positions only, summed over TP). The sinusoidal table is
    # indexed inside the model's forward, where no hook reaches: there the embedding
    # all-reduces and `drop` takes this rank's slice.
    table = cfg.positions == "sinusoidal" or getattr(model, "pos_table", None) is not None
    emb_mode = "reduce_scatter_seq" if sp and not table else "all_reduce"
    emb = model.tok_emb
    if emb.padding_idx is not None or emb.max_norm is not None or emb.sparse:
        raise ValueError(
            "parallel.tp: VocabParallelEmbedding supports plain nn.Embedding only (no padding_idx, max_norm or sparse)"
        )
    model.tok_emb = VocabParallelEmbedding(
        _cut(emb, "weight", "tok_emb.weight", cfg, topology),
        topology,
        num_embeddings=emb.num_embeddings,
        padded_vocab=padded,
        output_mode=emb_mode,
    )
    if sp and table:
        model.drop.register_forward_pre_hook(_input_hook(C.split_seq, group, "embedding.split"), with_kwargs=True)
    if sp and model.pos_emb is not None:
        model.pos_emb.register_forward_hook(lambda mod, args, out: C.split(out, out.dim() - 2, group))
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
        _shard_ffn(block.ffn, topology, cfg, sp, f"blocks.{i}")
        if sp:  # the norms' parameters and the row-parallel biases (their split weights are marked)
            for module in (block.attn_norm, block.ffn_norm, block.attn.wo, block.ffn.down):
                _sp_grad_sync(module, group, f"blocks.{i}.sp_grad")
    if sp:
        _sp_grad_sync(model.norm, group, "norm.sp_grad")

    head = model.tok_emb.weight if tied else _cut(model.lm_head, "weight", "lm_head.weight", cfg, topology)
    model.lm_head = VocabParallelLMHead(
        head,
        topology,
        full_out_features=cfg.vocab_size,
        padded_out=padded,
        input_mode="gather_seq" if sp else "copy",
        tag="lm_head_in",
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
