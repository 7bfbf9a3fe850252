"""The `mpu` (model-parallel unit) object handed to `deepspeed.initialize(mpu=...)`.

DeepSpeed 0.19.8 calls, with an mpu: get_model_parallel_{rank,world_size,group}
(gradient-norm all-reduce, ZeRO partitioning), get_data_parallel_{rank,world_size,
group,group_ranks} (ZeRO's data-parallel group, batch-size arithmetic, checkpoint
info), get_tensor_model_parallel_{rank,world_size,group,src_rank} (bwc helpers,
checkpoint names) and get_pipeline_model_parallel_{rank,world_size} (no pipeline
parallelism here: 1). "Model parallel" is tensor parallel here.

The data-parallel group is the topology's dp group: with context parallelism, data x context
parallel (every rank holding the same parameters), as Megatron hands its "data-parallel with
context-parallel" group to the optimizer: ZeRO partitions and averages gradients over it. The
ranks of a CP group hold different tokens of the same sequences, so their gradients are partial
sums that this average completes (the loss is weighted to the global mean, see the loop).

Deliberately absent: `initialize_sequence_parallel` and `get_sequence_parallel_*`.
Those name DeepSpeed-Ulysses sequence parallelism; their presence makes ZeRO ignore
the model-parallel group and divide the world size by the SP size. Our
`parallel.sequence_parallel` is Megatron-style and lives inside the TP group.
"""

from __future__ import annotations


class MPU:
    def __init__(self, topology):
        self.topology = topology

    # Tensor (== model) parallel --------------------------------------------
    def get_tensor_model_parallel_rank(self) -> int:
        return self.topology.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.tp_size

    def get_tensor_model_parallel_group(self):
        return self.topology.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.topology.tp_ranks[0]

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    # Data parallel ----------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        return self.topology.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.topology.dp_size

    def get_data_parallel_group(self):
        return self.topology.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.topology.dp_ranks)

    # Pipeline parallel: none ------------------------------------------------
    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def __repr__(self) -> str:
        t = self.topology
        return f"MPU(tp={t.tp_rank}/{t.tp_size}, dp={t.dp_rank}/{t.dp_size}, cp={t.cp_rank}/{t.cp_size})"
