"""loomtrain.parallel: tensor x data parallel topology and the tensor-parallel plan.

    topo = Topology(world_size, rank, tp)          # after torch.distributed is initialised
    model = parallelize(model, topo, sequence_parallel=False)   # in place; no-op at tp 1
    loss_fn = make_loss_fn(topo, vocab_size)       # fn(logits, targets) -> scalar
    engine, *_ = deepspeed.initialize(model=model, ..., mpu=topo.mpu)
    stream = ...(dp_rank=topo.dp_rank, dp_size=topo.dp_size)   # TP ranks see the same data

Files: topology (groups, checks), collectives (autograd collectives, byte counts),
layers (column/row/vocab-parallel layers, vocab-parallel cross-entropy), plan
(parallelize, make_loss_fn, gathered_logits, gather_full_param), mpu (for DeepSpeed).
`check_tp(model_cfg, tp, world_size)` validates a config before any worker starts.
"""

from loomtrain.parallel.mpu import MPU
from loomtrain.parallel.plan import gather_full_param, gathered_logits, make_loss_fn, parallelize
from loomtrain.parallel.topology import Topology, check_tp, padded_vocab_size

__all__ = [
    "MPU",
    "Topology",
    "check_tp",
    "gather_full_param",
    "gathered_logits",
    "make_loss_fn",
    "padded_vocab_size",
    "parallelize",
]
