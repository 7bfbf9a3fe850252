"""Start-up without the full model: build it on the meta device, apply the TP plan, then
materialise only this rank's shards, one full parameter at a time.

    model = sharded_meta_model(model_cfg, topology, sequence_parallel)   # no parameter memory
    materialize(model, init_tensors(model_cfg, seed), device=device, dtype=dtype)

`materialize` takes any iterable of (plain-model parameter name, full tensor) pairs and
keeps, of each, the slice the plan (`loomtrain.parallel.plan.shard_spec`) gives this rank,
cast to `dtype` and moved to `device`; the full tensor is dropped before the next one is
asked for. With `loomtrain.model.init_tensors` (the seeded init, generated on the CPU in
the model's own order) the shards are bitwise those of "full init, then slice", and a
rank's peak is its shards plus about one full parameter.

The seam for loading weights instead (a Hugging Face checkpoint, `model.init_from`):
pass a generator that reads one tensor at a time (e.g. safetensors `safe_open(...).
get_tensor(name)`, names mapped to loomtrain's) to `materialize`. Every parameter must be
supplied once (a tied `lm_head.weight` is `tok_emb.weight` and needs no entry); a missing
one is reported by name. `model.init_from` fills
shards in place instead (`allocate_shards`, then its slice reads).

`after_param(name, param)` runs after each parameter is in place: ZeRO-3 partitions it
there (`loomtrain.launcher.training.engine.zero3_partitioner`), so at ZeRO-3 no rank ever holds
more than its partitions plus one parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from loomtrain.parallel.plan import parallelize, shard_tensor, spec_of
from torch import nn


def sharded_meta_model(model_cfg, topology, sequence_parallel: bool = False) -> nn.Module:
    """The model as `parallelize` leaves it for this rank, with its parameters on the meta
    device (no memory) and its buffers (position tables, this rank's ALiBi slopes) real."""
    from loomtrain.model import meta_transformer

    model = meta_transformer(model_cfg)
    model.reset_buffers(device="cpu")  # real buffers, so the plan slices real ALiBi slopes
    return parallelize(model, topology, sequence_parallel=sequence_parallel)


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) holding it (a tied table has two)."""
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((module, key))
    return out


def _replace(old: nn.Parameter, data: torch.Tensor, owners: dict) -> nn.Parameter:
    """A Parameter holding `data` in place of `old` everywhere, with its attributes and hooks."""
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)  # tensor_model_parallel, tp_meta, ...
    for hook in (old._backward_hooks or {}).values():
        new.register_hook(hook)
    holders = owners.pop(id(old), [])
    for module, key in holders:
        module._parameters[key] = new
    owners[id(new)] = holders
    return new


@torch.no_grad()
def allocate_shards(model: nn.Module, *, device, dtype=None) -> nn.Module:
    """Give every meta parameter an uninitialised shard of its local shape on `device`, for a
    loader that fills the shards in place (model.init_from reads each rank's slices itself)."""
    owners = _owners(model)
    for old in list(model.parameters()):
        if old.is_meta:
            _replace(old, torch.empty(spec_of(old).local_shape, device=device, dtype=dtype or old.dtype), owners)
    return finish_materialize(model, device, dtype)


def finish_materialize(model: nn.Module, device, dtype=None) -> nn.Module:
    """After every parameter is in place: refuse a model with parameters left on meta, and put
    the buffers (position tables, ALiBi slopes) on `device` in `dtype`."""
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise ValueError(f"weights: no values for {', '.join(left[:3])}{more}")
    model.reset_buffers()
    for module in model.modules():
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = b.to(device=device, dtype=dtype if dtype and b.is_floating_point() else b.dtype)
    return model


def materialize(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    device,
    dtype=None,
    after_param: Callable[[str, nn.Parameter], None] | None = None,
) -> nn.Module:
    """Materialise every parameter of a `sharded_meta_model` from (name, full tensor) pairs (see
    the module docstring): this rank's shard of each, cut from its whole, unpadded tensor, on
    `device` in `dtype` (default: the tensor's), in place of the meta parameter everywhere (tied
    names too), with its TP attributes and gradient hooks; returns the model."""
    owners = _owners(model)
    for name, full in tensors:
        try:
            old = model.get_parameter(name)
        except AttributeError:
            raise ValueError(f"weights: {name!r} is not a parameter of the model") from None
        spec = spec_of(old)
        if tuple(full.shape) != tuple(spec.full_shape):
            raise ValueError(
                f"weights: {name!r} has shape {tuple(full.shape)}, the model expects {tuple(spec.full_shape)}"
            )
        data = shard_tensor(full, spec)
        del full  # before the supplier makes the next one
        data = data.to(device=device, dtype=dtype if dtype is not None and data.is_floating_point() else data.dtype)
        param = _replace(old, data, owners)
        if after_param is not None:
            after_param(name, param)
    return finish_materialize(model, device, dtype)
