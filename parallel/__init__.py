"""loomtrain.parallel: tensor x context x data parallel topology, the tensor-parallel plan, context parallelism.

    topo = Topology(world_size, rank, tp, cp=cp)   # after torch.distributed is initialised
    model = parallelize(model, topo, sequence_parallel=False)   # in place; no-op at tp 1
    model = apply_context_parallel(model, topo)    # parallel.cp (loomtrain.parallel.context); no-op at cp 1
    loss = model(x, targets=y)                     # vocab-parallel loss, logits never gathered
    engine, *_ = deepspeed.initialize(model=model, ..., mpu=topo.mpu)
    stream = ...(dp_rank=topo.data_rank, dp_size=topo.data_size)   # TP and CP ranks see the same data

Files: topology (groups, checks), collectives (autograd collectives, byte counts),
layers (column/row/vocab-parallel layers, vocab-parallel cross-entropy), plan
(the one definition of the TP layout: ShardSpec, shard_spec, spec_of, shard_tensor,
join_shards, gather_shards; parallelize, gathered_logits),
materialize (start-up: a meta model, then only this rank's shards, one full parameter
at a time), mpu (for DeepSpeed; its data-parallel group is dp x cp), context (context parallelism:
each sequence's chunks per CP rank, the K/V all-gather).
`check_tp(model_cfg, tp, world_size)` validates a config before any worker starts.
"""

import importlib

# Names are imported on first use (PEP 562), so `loomtrain.parallel.topology.check_tp`
# can validate a config without importing torch.
_EXPORTS = {
    "MPU": "mpu",
    "Topology": "topology",
    "check_tp": "topology",
    "check_cp": "topology",
    "apply_context_parallel": "context",
    "padded_vocab_size": "topology",
    "ShardSpec": "plan",
    "gather_shards": "plan",
    "join_shards": "plan",
    "shard_spec": "plan",
    "shard_tensor": "plan",
    "spec_of": "plan",
    "gathered_logits": "plan",
    "parallelize": "plan",
}

__all__ = [*_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"loomtrain.parallel.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'loomtrain.parallel' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
