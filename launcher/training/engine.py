"""The one place that builds the DeepSpeed engine from a RunConfig.

    engine, optimizer, scheduler = build_engine(cfg, model, dp_size=..., mpu=...)

* `ds_config`: the DeepSpeed config dict (batch sizes and gradient accumulation
  from `TrainConfig.grad_accum_steps`; clipping; bf16 / fp16; the ZeRO stage over
  the data-parallel group, with optimizer offload where `ParallelConfig.check_offload`
  allows it);
* `param_groups`: a client `torch.optim.AdamW` with no weight decay on norms,
  biases and embeddings (DeepSpeed's own Adam would JIT-compile for a minute);
* `lr_lambda`: linear warmup, then cosine / linear decay to min_lr, or constant,
  as a `torch.optim.lr_scheduler.LambdaLR` that DeepSpeed steps once per
  optimizer step.

ZeRO offload, activation checkpointing and fp16 loss scaling are engine settings:
engine construction has this one home. Before the engine is built, DeepSpeed's Muon modules
are imported with their `torch.compile` deferred (`import_muon_compiled_on_first_call`): the
engine imports them for type checks only, and compiling at import cost ~2 CPU-s per rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from loomtrain.launcher.config import RunConfig
from torch import nn

# deepspeed is imported where an engine is built: ds_config (which the memory plan reads too)
# stays free of its start-up time.

# "Print every N steps" off: the loop does its own logging.
_NEVER = 10**12


def ds_config(cfg: RunConfig, dp_size: int) -> dict[str, Any]:
    """dp_size: DeepSpeed's data-parallel size (data x context parallel: the ranks holding the same
    parameters); the samples split over dp_size / parallel.cp of them (Topology.data_size)."""
    t, p = cfg.train, cfg.parallel
    grad_accum = t.grad_accum_steps(max(1, dp_size // p.cp))
    p.check_offload()  # the stages the config allows, not DeepSpeed's wider set
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_batch_size": t.micro_batch_size * grad_accum * dp_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        # A client torch.optim.AdamW under ZeRO / offload.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {
            "enabled": t.precision == "fp16",
            "loss_scale": 0,  # dynamic
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
    }


def _no_decay_ids(model: nn.Module) -> set[int]:
    """Norm weights, biases (every 1-D parameter) and embedding tables."""
    # By the full shape: a parameter already partitioned by ZeRO-3 at start-up is an empty 1-D tensor.
    ids = {id(p) for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) < 2}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        # By type, and by the contract names, since the TP plan swaps nn.Embedding for a
        # vocabulary-parallel module.
        if isinstance(module, nn.Embedding) or leaf in ("tok_emb", "pos_emb"):
            ids |= {id(p) for p in module.parameters()}
    return ids


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    skip = _no_decay_ids(model)
    decay, no_decay = [], []
    for p in model.parameters():  # a tied table appears once
        if p.requires_grad:
            (no_decay if id(p) in skip else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    # Only trainable parameters reach the optimizer (model.lora: the adapters, all in "decay");
    # DeepSpeed drops an empty group, which the scheduler built beside it would still count.
    return [g for g in groups if g["params"]]


def lr_lambda(cfg: RunConfig) -> Callable[[int], float]:
    """Multiplier of train.lr at optimizer step `step` (0-based)."""
    t = cfg.train
    floor = t.min_lr / t.lr

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        if t.lr_schedule == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - (1.0 - floor) * progress  # linear

    return factor


def build_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    t = cfg.train
    # fused: one kernel per step instead of a dozen passes over the parameters (on a 2-core
    # CPU the default per-tensor loop took ~12% of a small model's step; see benchmarks/).
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in model.parameters())
    return torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused or None
    )


def zero3_partitioner(cfg: RunConfig, topology, dtype: torch.dtype) -> Callable[[str, nn.Parameter], None]:
    """A callback that partitions one parameter over the DP group as soon as it exists
    (ZeRO-3), so that start-up never holds more than this rank's partitions plus one
    parameter. It is what `deepspeed.initialize` would do to the whole model (zero.Init with
    the same config and groups); the engine then finds every parameter partitioned."""
    import deepspeed

    anchor: list[nn.Parameter] = []

    def partition(name: str, param: nn.Parameter) -> None:
        if anchor:  # later parameters join the first one's zero.Init
            anchor[0].convert_to_zero_parameters(param_list=[param])
            return
        holder = nn.Module()
        holder.register_parameter("param", param)
        deepspeed.zero.Init(
            module=holder,
            data_parallel_group=topology.dp_group,
            mpu=topology.mpu,
            dtype=dtype,
            config_dict_or_path=ds_config(cfg, topology.dp_size),
        )
        anchor.append(param)

    return partition


MUON_MODULES = ("deepspeed.runtime.zero.muon.original_muon", "deepspeed.runtime.zero.muon.muon_optimizer")


def import_muon_compiled_on_first_call() -> None:
    """Import DeepSpeed's Muon modules with their `@torch.compile` deferred to the first call.

    DeepSpeed imports them in every ZeRO or bf16 engine, for `isinstance(optimizer,
    MuonWithAuxAdam)` checks; their module-level `@compiler.compile()` calls `torch.compile`,
    which imports all of torch._inductor: ~3 CPU-s per rank at every start, for an optimizer
    loomtrain never builds. Deferred, Muon still compiles, at its first call. (Once imported, the
    imports below are no-ops.)"""
    from deepspeed.runtime import compiler

    def compile_on_first_call(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            compiled = compiled or torch.compile(fn)
            return compiled(*args, **kwargs)

        return call

    eager_compile = compiler.compile
    compiler.compile = lambda: compile_on_first_call
    try:
        for name in MUON_MODULES:
            __import__(name)
    finally:
        compiler.compile = eager_compile


def build_engine(cfg: RunConfig, model: nn.Module, dp_size: int, mpu: Any = None):
    """-> (engine, optimizer, lr_scheduler). The process group must exist already."""
    import deepspeed

    import_muon_compiled_on_first_call()
    optimizer = build_optimizer(cfg, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        mpu=mpu,
        config=ds_config(cfg, dp_size),
        dist_init_required=False,
    )
    if cfg.parallel.zero_stage == 0 and dp_size == 1:
        # A data-parallel group of one: DeepSpeed would still flatten every gradient, "all-reduce"
        # it alone and copy it back after each backward (~2% of a small CPU step). ZeRO >= 1
        # does its own gradient bookkeeping in that call, so it stays on there.
        engine.enable_backward_allreduce = False
    return engine, optimizer, scheduler


def records_grad_norm(engine) -> bool:
    """DeepSpeed's fp32 ZeRO-0 path clips without keeping the norm; the others keep it."""
    return bool(engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())


def grad_norm(model: nn.Module, mpu: Any = None) -> torch.Tensor:
    """Global L2 norm of the current gradients (before clipping), over TP ranks, as a 0-d
    float64 tensor on the gradients' device: computing it reads nothing back to the host.

    Same convention as deepspeed.runtime.utils.clip_grad_norm_: a parameter
    replicated across the TP group is counted once (on TP rank 0); sharded ones
    (`tensor_model_parallel=True`) on every rank. DP ranks hold equal gradients
    after DeepSpeed's all-reduce. Call at the accumulation boundary, before
    engine.step().
    """
    tp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
    grads = [
        p.grad.detach()
        for p in model.parameters()
        if p.grad is not None and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False))
    ]
    device = next(model.parameters()).device
    if grads:
        # One fused pass (per-tensor norms in fp32), their squares summed in float64.
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total = torch.stack(norms).double().square().sum()
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
    if mpu is not None and mpu.get_model_parallel_world_size() > 1:
        total = total.to(device)
        torch.distributed.all_reduce(total, group=mpu.get_model_parallel_group())
    return total.sqrt()
