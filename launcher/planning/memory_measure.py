"""Measure what one rank of a DeepSpeed engine holds: parameters, gradients,
optimizer states, and DeepSpeed's communication buffers, in bytes.

Counting works on any device (CPU included, where torch keeps no allocator
statistics): it walks the tensors the model and DeepSpeed's optimizer hold, and
counts each underlying storage once (flat buffers with many views count once, with
their alignment padding, which is real memory).

* params: the model's parameter storages; at ZeRO-3 each parameter's partition
  (`ds_tensor`) instead of the (released) full tensor.
* optimizer states: the torch optimizer's state (Adam m, v, step) plus the fp32
  master partitions DeepSpeed keeps (`single_partition_of_fp32_groups` at stages 1-2,
  `fp32_partitioned_groups_flat` at stage 3, `fp32_groups_flat_partition` of the
  BF16 optimizer, `fp32_groups(_flat)` of the FP16 optimizers that bf16/fp16 use at
  stage 0), minus any storage already counted as a parameter.
* grads: the peak over one backward of the live gradient storages: `param.grad`
  tensors and DeepSpeed's gradient partitions (`averaged_gradients`,
  `grads_in_partition`, `grad_partitions_flat_buffer`, fp32 partitions' `.grad`),
  sampled after each parameter's gradient is accumulated and at the end of backward.
  ZeRO-1 reduces only at the end of backward, so its peak holds the full gradients
  (the ZeRO paper's stage-1 figure) although only a partition survives it.
* buffers: DeepSpeed's reduce buckets (`ipg_buckets`, the larger of now and the peak
  sampled during backward, since stages 1-2 free them after the step): constant-size communication
  buffers, which the ZeRO paper counts as residual states, not model states.
  Gradients that live inside a bucket are counted here, not under grads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from loomtrain.launcher.checkpoints.ds_state import inner_optimizer

# DeepSpeed's fp32 master copies: ZeRO 1-2, ZeRO-3, BF16_Optimizer, FP16 (un)fused optimizers.
_MASTER = (
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
    "fp32_groups_flat_partition",
    "fp32_groups",
    "fp32_groups_flat",
)


def _flatten(obj: Any) -> Iterable[torch.Tensor]:
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.nbytes():
            out[s.data_ptr()] = s.nbytes()
    return out


def _params(engine: Any) -> list[torch.Tensor]:
    return [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]


def _bucket_tensors(opt: Any) -> list[torch.Tensor]:
    buckets = getattr(opt, "ipg_buckets", None) or {}
    return [t for b in buckets.values() for t in _flatten(getattr(b, "buffer", None))]


def _grad_tensors(engine: Any) -> list[torch.Tensor]:
    opt = engine.optimizer
    out = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for name in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
        out += list(_flatten(getattr(opt, name, None)))
    for name in _MASTER:
        out += [t.grad for t in _flatten(getattr(opt, name, None)) if t.grad is not None]
    out += list(_flatten(getattr(opt, "fp32_groups_gradients_flat", None)))  # BF16 optimizer
    return out


def _optimizer_tensors(engine: Any) -> list[torch.Tensor]:
    opt = engine.optimizer
    inner = inner_optimizer(engine.optimizer)
    out = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
    for name in _MASTER:
        out += list(_flatten(getattr(opt, name, None)))
    return out


class GradPeak:
    """Samples live gradient bytes during backward (see module docstring)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.peak = 0
        self.bucket_peak = 0  # stages 1-2 free their reduce bucket after the step
        self._handles = [
            p.register_post_accumulate_grad_hook(lambda _p: self.sample())
            for p in engine.module.parameters()
            if p.requires_grad
        ]

    def sample(self) -> None:
        opt = self.engine.optimizer
        buckets = _storages(_bucket_tensors(opt))
        live = {k: v for k, v in _storages(_grad_tensors(self.engine)).items() if k not in buckets}
        self.peak = max(self.peak, sum(live.values()))
        self.bucket_peak = max(self.bucket_peak, sum(buckets.values()))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def measure(engine: Any, grad_peak: GradPeak) -> dict[str, int]:
    """Bytes this rank holds now (params, optimizer, buffers) and the sampled grad peak.

    Call after at least one optimizer step (Adam's states exist from the first step).
    """
    params = _storages(_params(engine))
    opt_st = {k: v for k, v in _storages(_optimizer_tensors(engine)).items() if k not in params}
    buckets = _storages(_bucket_tensors(engine.optimizer))
    out = dict(
        params=sum(params.values()),
        optimizer=sum(opt_st.values()),
        buffers=max(sum(buckets.values()), grad_peak.bucket_peak),
        grads=grad_peak.peak,
    )
    out["model_states"] = out["params"] + out["optimizer"] + out["grads"]
    return out
