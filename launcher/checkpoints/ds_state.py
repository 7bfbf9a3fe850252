"""DeepSpeed state access: where DeepSpeed keeps a parameter's fp32 master and Adam moments,
and how to read and write them at any ZeRO stage and precision.

Used by parts.py (save / load at any layout) and final.py (final weights). Joining TP shards
into the full tensor and cutting them again is the TP layout's job (loomtrain.parallel.plan:
`spec_of`, `gather_shards`, `shard_tensor`).

    held_range / held_values          the part of p's TP shard DeepSpeed keeps on this rank
                                      (its ZeRO partition, or all of it at ZeRO 0), as a flat
                                      range and its fp32 values; no collective
    written_range                     the share of that this rank writes into a checkpoint
    set_held_values                   put such a range back (ZeRO-3: the model's partition too)
    local_box                         where p's TP shard lies in the full tensor (shards.py)
    read_local(engine, p)             this TP rank's fp32 master of p, whole over DP (collective)
    write_local(engine, p, v)         the reverse, for the master at ZeRO 0-2 (every DP rank passes the same value)
    ensure_optimizer_state(engine)    create Adam's lazily made state (zeros, step 0)
    optimizer_settings / engine_counters / loss_scaler_state (and their set_*): the small
                                      optimizer and engine states a checkpoint keeps in trainer.json
                                      (Adam's step count among them)

DeepSpeed's holders, all reached through `deepspeed.utils.safe_{get,set}_full_*` where it
has them: ZeRO 1/2 (flat fp32 partitions, `_hp_mapping`), bf16 at ZeRO 0 (BF16_Optimizer,
also `_hp_mapping`, or the unfused wrapper's per-parameter fp32 copies), ZeRO 3 (`ds_id`),
and fp32 at ZeRO 0 (the parameter itself, the client optimizer's state). Adam's state
is created lazily at the first step, so `ensure_optimizer_state` creates it (zeros, step
0: exactly what AdamW would create) before anything is read or written.

`deepspeed` is imported inside the functions that call it: reading a checkpoint for export
uses this module's layout helpers, and should not pay DeepSpeed's import (seconds).
"""

from __future__ import annotations

import torch
from loomtrain.launcher.checkpoints.shards import shard_box
from loomtrain.parallel.plan import spec_of

MOMENTS = ("exp_avg", "exp_avg_sq")


# Where DeepSpeed keeps fp32 masters and optimizer state --------------------------------
def inner_optimizer(opt):
    """The torch optimizer whose `.state` holds the Adam moments."""
    return opt.optimizer if hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer) else opt


def _flat_groups(opt) -> tuple[list, list] | None:
    """(lp param lists, flat fp32 partitions) for DeepSpeed's wrapped optimizers, else None."""
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO 1/2
        return opt.bit16_groups, opt.single_partition_of_fp32_groups
    if hasattr(opt, "fp32_groups_flat_partition"):  # bf16 at ZeRO 0
        return opt.bf16_groups, opt.fp32_groups_flat_partition
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO 3
        return None, opt.fp32_partitioned_groups_flat
    return None


def ensure_optimizer_state(engine) -> None:
    """Make Adam's (lazily created) state exist so it can be read or written before step 1."""
    opt = engine.optimizer
    inner = inner_optimizer(opt)
    groups = _flat_groups(opt)
    if groups is None:
        targets = [p for g in inner.param_groups for p in g["params"]]
    else:
        targets = list(groups[1])
    for t in targets:
        st = inner.state[t]
        if "exp_avg" not in st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(t, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(t, memory_format=torch.preserve_format)
    if groups is not None and groups[0] is not None:
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

        for lp, flat in zip(*groups):
            lazy_init_hp_params_optimizer_state(lp, flat, inner.state)
        opt._hp_optimizer_states_linked = True


def optimizer_settings(engine) -> dict:
    """Adam's step count and each param group's plain hyper-parameters (lr, betas, ...)."""
    inner = inner_optimizer(engine.optimizer)
    step = next((st["step"] for st in inner.state.values() if "step" in st), 0.0)  # a tensor, or a number
    groups = [{k: v for k, v in g.items() if k != "params" and _is_plain(v)} for g in inner.param_groups]
    return {"adam_step": float(step), "param_groups": groups}


def set_optimizer_settings(engine, step: float, groups: list[dict]) -> None:
    inner = inner_optimizer(engine.optimizer)
    for st in inner.state.values():
        if "step" in st:
            st["step"] = torch.tensor(float(step), dtype=torch.float32)
    for g, saved in zip(inner.param_groups, groups):
        for k, v in saved.items():
            if k in g and k != "params":
                g[k] = tuple(v) if isinstance(g[k], tuple) else v


_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def engine_counters(engine) -> dict:
    return {k: int(getattr(engine, k, 0) or 0) for k in _ENGINE_COUNTERS}


def set_engine_counters(engine, saved: dict) -> None:
    for k, v in saved.items():
        if hasattr(engine, k) and k != "micro_steps":
            setattr(engine, k, v)
    if hasattr(engine, "micro_steps"):
        # Micro steps count in this layout's gradient accumulation (it changes with DP size);
        # a saved count from another layout would put the accumulation boundary mid-step.
        engine.micro_steps = int(getattr(engine, "global_steps", 0)) * int(engine.gradient_accumulation_steps())


_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scaler_state(engine) -> dict | None:
    """fp16's dynamic loss scale; None without one."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    out = {}
    for k in _SCALER_FIELDS:
        v = getattr(scaler, k, None)
        if torch.is_tensor(v):
            v = v.item()
        if isinstance(v, (int, float)) or v is None:
            out[k] = v
    return out


def set_loss_scaler_state(engine, saved: dict | None) -> None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None or not saved:
        return
    for k, v in saved.items():
        if hasattr(scaler, k) and not torch.is_tensor(getattr(scaler, k)):
            setattr(scaler, k, v)


def _is_plain(v) -> bool:
    return isinstance(v, (int, float, str, bool, type(None))) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str, bool)) for x in v)
    )


def _is_ds(p) -> bool:
    """Held by a DeepSpeed optimizer wrapper (ZeRO 1-3, bf16): read/write via safe_*_full_*."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _master_of(engine, p):
    """The fp32 master of a plain (non-ZeRO) parameter: itself, or the per-parameter fp32
    copy DeepSpeed's unfused low-precision wrapper keeps (bf16/fp16 at ZeRO 0)."""
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups):
            for lp, hp in zip(lp_group, hp_group):
                if lp is p:
                    return hp
    return p


def read_local(engine, p) -> torch.Tensor:
    """This TP rank's fp32 master of p, whole over DP (collective).

    On the parameter's device (NCCL gathers need CUDA tensors); callers move it to the CPU."""
    from deepspeed.utils import safe_get_full_fp32_param

    if _is_ds(p):
        return safe_get_full_fp32_param(p).detach().float().reshape(spec_of(p).local_shape)  # whole over DP
    return _master_of(engine, p).detach().float().clone()


def write_local(engine, p, value: torch.Tensor) -> None:
    """Set this TP rank's fp32 master of p and the model's copy, at ZeRO 0-2 (every DP rank calls
    it with the same value; a ZeRO-3 partition is set_held_values')."""
    from deepspeed.utils import safe_set_full_fp32_param

    value = value.contiguous()
    p.data.copy_(value.to(p.device, p.dtype))  # the model's copy (low-precision, or the master itself)
    if _is_ds(p):
        safe_set_full_fp32_param(p, value.to(p.device, torch.float32))
        return
    hp = _master_of(engine, p)
    if hp is not p:
        hp.data.copy_(value.to(hp.device, hp.dtype))


def named_params(engine) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable parameters by name, each once (a tied table under its first name)."""
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


# What this rank holds, as a region of the full tensor (the sharded checkpoint format) --------
def local_box(p) -> tuple[int, int, int, int]:
    """The matrix box (see checkpoints/shards.py) of this rank's TP shard of p, padding included,
    as the TP plan lays it out."""
    spec = spec_of(p)
    length = spec.padded_size // spec.num_shards  # unread for a parameter TP does not split
    return shard_box(spec.full_shape, spec.dim, spec.shard_index * length, length)


def full_shape(p) -> list[int]:
    return list(spec_of(p).full_shape)


def _replica_split(p, topology) -> tuple[int, int]:
    """(number of TP ranks holding the same shard of p, this rank's index among them)."""
    tp = topology.tp_size if topology is not None else 1
    if tp == 1:
        return 1, 0
    spec = spec_of(p)
    if spec.dim is None:
        return tp, topology.tp_rank
    m = max(1, spec.replicas)  # consecutive TP ranks hold each replicated KV shard
    return m, topology.tp_rank % m


def _zero3_partition(engine, p) -> tuple[int, int, int]:
    """(start, real numel, partition numel) of this rank's ZeRO-3 partition in p's flat shard."""
    n = p.ds_tensor.numel()
    start = engine.optimizer._get_param_partition_rank(p) * n
    return start, max(0, min(n, p.ds_numel - start)), n


def held_range(engine, p) -> tuple[int, int]:
    """The range [a, b) of p's flattened TP shard that DeepSpeed keeps on this rank
    (the fp32 master and Adam moments): the ZeRO 1-3 partition, or all of it at ZeRO 0."""
    if hasattr(p, "ds_id"):
        start, real, _ = _zero3_partition(engine, p)
        return start, start + real
    if hasattr(p, "_hp_mapping"):
        hp = p._hp_mapping
        if hp is None:
            return 0, 0
        return hp.lp_fragment_address.start, hp.lp_fragment_address.start + hp.lp_fragment_address.numel
    return 0, p.numel()


def written_range(engine, p, topology) -> tuple[int, int]:
    """The share of p this rank writes: what it holds, split evenly among the ranks that hold
    the same values (DP ranks at ZeRO 0, TP ranks for parameters TP does not split)."""
    a, b = held_range(engine, p)
    holders, index = _replica_split(p, topology)
    if not _is_ds(p) and topology is not None and topology.dp_size > 1:
        holders, index = holders * topology.dp_size, topology.dp_rank * holders + index
    n = b - a
    return a + n * index // holders, a + n * (index + 1) // holders


def held_values(engine, p, key: str | None) -> torch.Tensor:
    """The 1-D fp32 values of `held_range` (master for key None, else an Adam moment);
    a view where DeepSpeed keeps them flat, on their device."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    if hasattr(p, "ds_id"):
        _, real, _ = _zero3_partition(engine, p)
        t = safe_get_local_fp32_param(p) if key is None else safe_get_local_optimizer_state(p, key)
        return t.reshape(-1)[:real]
    if hasattr(p, "_hp_mapping"):
        if p._hp_mapping is None:
            return torch.zeros(0)
        return p._hp_mapping.get_hp_fragment(key).reshape(-1)
    hp = _master_of(engine, p)
    if key is None:
        return hp.detach().reshape(-1)
    return inner_optimizer(engine.optimizer).state[hp][key].reshape(-1)


def load_target(engine, p, key: str | None) -> torch.Tensor | None:
    """A CPU fp32 tensor that holds `held_range`'s values in place, for a reader to fill
    directly (no copy through a temporary): an Adam moment at ZeRO 0-2, or the parameter itself
    when it is its own fp32 master (ZeRO 0, fp32). None where set_held_values must do the work
    (ZeRO-3 partitions, low-precision weights, GPU tensors)."""
    if hasattr(p, "ds_id") or (key is None and (_is_ds(p) or _master_of(engine, p) is not p)):
        return None
    t = held_values(engine, p, key)
    return t if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() else None


def set_held_values(engine, p, key: str | None, value: torch.Tensor) -> None:
    """Put back `held_range`'s values (a 1-D fp32 tensor): an Adam moment, or at ZeRO 3 the master
    too. For the master at ZeRO 0-2 use `write_local` with the whole shard instead (the model's own
    copy needs all of it)."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    if hasattr(p, "ds_id"):
        _, real, n = _zero3_partition(engine, p)
        dev = p.ds_tensor.device
        full = torch.zeros(n, dtype=torch.float32, device=dev)
        full[:real] = value.to(dev)
        if key is None:
            safe_set_local_fp32_param(p, full)
            p.ds_tensor.data.copy_(full.to(p.ds_tensor.dtype))  # the partitioned model weight
        else:
            safe_set_local_optimizer_state(p, full, key)
        return
    if hasattr(p, "_hp_mapping"):
        if p._hp_mapping is not None:
            frag = p._hp_mapping.get_hp_fragment(key)
            frag.data.copy_(value.to(frag.device, frag.dtype).reshape(frag.shape))
        return
    st = inner_optimizer(engine.optimizer).state[_master_of(engine, p)][key]
    st.copy_(value.to(st.device).reshape(st.shape))
