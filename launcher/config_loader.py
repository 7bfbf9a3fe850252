"""Load a run's YAML config onto the typed schema, and check it before any work.

    cfg = load_config("configs/tiny.yaml", ["train.lr=1e-3", "train.max_steps=50"])

* the YAML may say `extends: other.yaml` (a path relative to the file, or a
  list of them); bases are merged first, so the file's own keys win; chains
  of extends work and cycles are refused;
* `key=value` overrides (OmegaConf dotlist) are merged last;
* the result is `OmegaConf.to_object` of the structured `RunConfig`, i.e. plain
  dataclasses with defaults from `loomtrain.launcher.config` only;
* every problem raises `ConfigError` whose message is one line naming the
  dotted key and what was expected (with the closest valid key for a typo).

`validate` holds the value and cross-field rules; call it again once the real
world size is known (the loop does).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loomtrain.launcher.config import ConfigError, RunConfig, check
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("cosine", "linear", "constant")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "bar", "plain")
BUILTIN_TOKENIZERS = ("byte", "bpe")


# --- schema helpers ---------------------------------------------------------
def valid_keys(obj: Any = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema (`train.lr`, `model.d_model`, ...)."""
    keys: list[str] = []
    for f in dataclasses.fields(obj):
        name = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            keys += valid_keys(type(default), name + ".")
        else:
            keys.append(name)
    return keys


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


def _closest(key: str) -> str:
    keys = valid_keys()
    pool = keys + _sections()
    # Compare the full dotted key, and also the last part alone (`lr` -> `train.lr`).
    match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    if not match:
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
        near = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        match = [by_leaf[near[0]]] if near else []
    return f" (did you mean {match[0]!r}?)" if match else ""


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _omegaconf_error(exc: OmegaConfBaseException, where: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    msg = _first_line(exc)
    name = type(exc).__name__
    if "KeyError" in name or "not in" in msg:
        return ConfigError(f"{key}: unknown key{_closest(key)} [{where}]")
    if "ValidationError" in name or "could not be converted" in msg:
        # "Value 'abc' of type 'str' could not be converted to Float"
        return ConfigError(f"{key}: wrong type: {msg} [{where}]")
    return ConfigError(f"{key or '<config>'}: {msg} [{where}]")


# --- loading -----------------------------------------------------------------
def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[DictConfig, str]]:
    """The file and its `extends` chain as (layer, source) pairs, bases first."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"extends: cycle {chain}")
    if not path.is_file():
        raise ConfigError(
            f"extends: no such config file {str(path)!r}" if seen else f"config file not found: {str(path)!r}"
        )
    try:
        layer = OmegaConf.load(path)
    except Exception as exc:  # yaml syntax errors and the like
        raise ConfigError(f"{path}: cannot parse YAML: {_first_line(exc)}") from exc
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    layers: list[tuple[DictConfig, str]] = []
    if "extends" in layer:
        bases = layer.pop("extends")
        bases = [bases] if isinstance(bases, str) else list(bases or [])
        for base in bases:
            if not isinstance(base, str):
                raise ConfigError(f"extends: expected a file name or a list of them, got {base!r} [{path}]")
            layers += _load_yaml(path.parent / base, (*seen, path))
    layers.append((layer, str(path)))
    return layers


def _parse_overrides(overrides: Iterable[str]) -> DictConfig:
    items = list(overrides)
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{item!r}: expected an override of the form section.key=value")
        if key.startswith("extends"):
            raise ConfigError("extends: not allowed as an override; put it in the YAML file")
    for item in items:  # a value YAML cannot parse (`ray.address=[::1]:6379`) names its override
        try:
            OmegaConf.from_dotlist([item])
        except OmegaConfBaseException:
            pass
        except Exception as exc:  # yaml's own errors
            raise ConfigError(
                f"{item.partition('=')[0]}: cannot parse the value of {item!r} "
                f"({_first_line(exc)}); quote it: key='value'"
            ) from None
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, "command line") from exc


def _check_keys(layer: DictConfig, source: str) -> None:
    """Unknown keys, named in full with the closest valid dotted key."""
    known, sections = set(valid_keys()), set(_sections())

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node.keys():
            dotted = f"{prefix}{key}"
            if dotted in known:
                continue
            child = node._get_node(key)
            if dotted in sections:
                if not OmegaConf.is_dict(child):
                    raise ConfigError(
                        f"{dotted}: expected a section (a mapping of keys), got {child._value()!r} [{source}]"
                    )
                walk(node[key], dotted + ".")
                continue
            while OmegaConf.is_dict(child) and len(child) == 1:  # `trian.lr=1` -> name `trian.lr`
                (sub,) = child.keys()
                dotted, child = f"{dotted}.{sub}", child._get_node(sub)
            raise ConfigError(f"{dotted}: unknown key{_closest(dotted)} [{source}]")

    walk(layer, "")


def merge_layers(layers: list[tuple[DictConfig, str]]) -> RunConfig:
    """Merge the layers onto the structured schema and build the dataclasses."""
    merged = OmegaConf.structured(RunConfig)
    for layer, source in layers:
        _check_keys(layer, source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, source) from exc
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, "interpolation") from exc
    except ValueError as exc:  # ModelConfig.validate: "model.<field>: ..."
        raise ConfigError(_first_line(exc)) from exc
    assert isinstance(cfg, RunConfig)
    return cfg


def load_config(path: str | os.PathLike, overrides: Iterable[str] = (), world_size: int | None = None) -> RunConfig:
    """YAML (+ extends chain) + overrides -> a validated RunConfig.

    `world_size` is the number of ranks the run will have, when known (for the
    batch-size rules); by default WORLD_SIZE from the environment, else 1.
    """
    cfg = resolve(path, overrides)
    validate(cfg, env_world_size() if world_size is None else world_size)
    return cfg


def resolve(path: str | os.PathLike, overrides: Iterable[str] = ()) -> RunConfig:
    """YAML (+ extends chain) + overrides -> RunConfig, with types checked but not the rules."""
    layers = _load_yaml(Path(path))
    layers.append((_parse_overrides(overrides), "command line"))
    return merge_layers(layers)


def env_world_size() -> int:
    """WORLD_SIZE as a launcher (torchrun) set it, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def config_from_dict(data: dict, world_size: int = 1) -> RunConfig:
    """A RunConfig from a nested dict (tests, Ray workers receiving a config)."""
    cfg = merge_layers([(OmegaConf.create(data), "dict")])
    validate(cfg, world_size)
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config (loadable again with load_config)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, path)


# --- rules ---------------------------------------------------------------------
def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    check(value in choices, key, "one of " + ", ".join(choices), value)


def _positive(key: str, value: Any, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    check(ok, key, "a non-negative number" if allow_zero else "a positive number", value)


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Value and cross-field rules; raises ConfigError naming the dotted key."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    # choices
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    _choice("train.device", t.device, DEVICES)
    _choice("log.progress", cfg.log.progress, PROGRESS)
    check(
        cfg.checkpoint.resume in ("auto", "never")
        or "://" in cfg.checkpoint.resume
        or Path(cfg.checkpoint.resume).exists()
        # a PATH only seeds the first start: once the run has checkpoints, the seed may be gone
        or (Path(os.path.expanduser(cfg.run.dir)) / "checkpoints").is_dir(),
        "checkpoint.resume",
        "auto, never or the path of an existing checkpoint",
        cfg.checkpoint.resume,
    )
    check(
        t.device != "cuda" or _cuda_available(),
        "train.device",
        "auto or cpu on a machine without CUDA",
        t.device,
    )
    tok = cfg.data.tokenizer
    check(
        tok in BUILTIN_TOKENIZERS or Path(tok).is_file() or (Path(tok) / "tokenizer.json").is_file(),
        "data.tokenizer",
        "byte, bpe, the path of an existing tokenizer.json or a directory holding one "
        "(a Hugging Face model or tokenizer directory)",
        tok,
    )
    check(bool(cfg.run.dir), "run.dir", "a directory path", cfg.run.dir)
    # numbers: inf/nan pass `> 0` and min/max checks, then poison the run (nan fails them
    # with a less helpful message); every float knob must be a finite number.
    for key, value in _float_leaves(cfg):
        check(math.isfinite(value), key, "a finite number", value)
    for key in ("max_steps", "seq_len", "micro_batch_size", "global_batch_size", "lr"):
        _positive(f"train.{key}", getattr(t, key))
    for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "eps", "max_consecutive_skips"):
        _positive(f"train.{key}", getattr(t, key), allow_zero=True)
    check(t.min_lr <= t.lr, "train.min_lr", f"at most train.lr={t.lr}", t.min_lr)
    for key in ("beta1", "beta2"):
        check(0.0 <= getattr(t, key) < 1.0, f"train.{key}", "a number in [0, 1)", getattr(t, key))
    check(
        t.seq_len <= m.max_seq_len,
        "train.seq_len",
        f"at most model.max_seq_len={m.max_seq_len}",
        t.seq_len,
    )
    _positive("parallel.tp", p.tp)
    try:  # heads, KV heads and FFN width must split tp ways (torch-free; loomtrain.parallel)
        from loomtrain.parallel.topology import check_tp

        check_tp(m, p.tp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check(
        not p.sequence_parallel or t.seq_len % p.tp == 0,
        "train.seq_len",
        f"a multiple of parallel.tp={p.tp} with parallel.sequence_parallel",
        t.seq_len,
    )
    check(p.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", "0, 1, 2 or 3", p.zero_stage)
    p.check_offload()
    check(
        not p.compile or (t.device != "cpu" and _cuda_available()) or _cxx_available(),
        "parallel.compile",
        "false on a CPU without a C++ compiler (torch.compile's CPU backend builds with $CXX or g++)",
        p.compile,
    )
    _positive("parallel.timeout_s", p.timeout_s)
    _positive("eval.every_steps", cfg.eval.every_steps, allow_zero=True)
    _positive("eval.batches", cfg.eval.batches)
    _positive("eval.num_samples", cfg.eval.num_samples, allow_zero=True)
    _positive("eval.sample_tokens", cfg.eval.sample_tokens, allow_zero=True)
    _positive("eval.temperature", cfg.eval.temperature, allow_zero=True)
    _positive("eval.top_k", cfg.eval.top_k, allow_zero=True)
    _positive("log.every_steps", cfg.log.every_steps)
    _positive("checkpoint.every_steps", cfg.checkpoint.every_steps, allow_zero=True)
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    _positive("checkpoint.keep_every", cfg.checkpoint.keep_every, allow_zero=True)
    _positive("checkpoint.stop_at_step", cfg.checkpoint.stop_at_step, allow_zero=True)
    _positive("checkpoint.timeout_s", cfg.checkpoint.timeout_s)
    ps = list(cfg.log.profile_steps)
    check(
        not ps or (len(ps) == 2 and 1 <= ps[0] <= ps[1]),
        "log.profile_steps",
        "[] or [START, END] with 1 <= START <= END",
        ps,
    )
    check(
        all(r >= 0 for r in cfg.log.profile_ranks),
        "log.profile_ranks",
        "global ranks (>= 0)",
        list(cfg.log.profile_ranks),
    )
    _positive("log.memory_snapshot_step", cfg.log.memory_snapshot_step, allow_zero=True)
    check(0.0 <= cfg.data.val_fraction < 1.0, "data.val_fraction", "a number in [0, 1)", cfg.data.val_fraction)
    _positive("data.max_files", cfg.data.max_files, allow_zero=True)
    check(
        not (cfg.data.path and cfg.data.sources),
        "data.sources",
        "empty when data.path is set (data.path is the one-source form of data.sources)",
        "a list",
    )
    for i, src in enumerate(cfg.data.sources):
        check(bool(src.path), f"data.sources[{i}].path", "a shard directory made by `loomtrain preprocess`", src.path)
        check(
            math.isfinite(src.weight) and src.weight > 0, f"data.sources[{i}].weight", "a positive number", src.weight
        )
    _positive("data.prefetch", cfg.data.prefetch, allow_zero=True)
    _positive("ray.num_workers", cfg.ray.num_workers)
    _positive("ray.cpus_per_worker", cfg.ray.cpus_per_worker)
    _positive("ray.max_failures", cfg.ray.max_failures, allow_zero=True)
    try:  # Ray's own parser would fail later with a traceback, or hang resolving the host
        from loomtrain.launcher.cluster.addresses import check_ray_address

        check_ray_address(cfg.ray.address)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    # cross-field: world size, tp, dp and the batch sizes
    check(
        world_size % p.tp == 0,
        "parallel.tp",
        f"a divisor of the world size {world_size}",
        p.tp,
    )
    t.grad_accum_steps(world_size // p.tp)  # refuses a global batch that does not split
    if m.init_from:  # last: it reads the weights' config (and may name a path only a cluster has)
        _check_init_from(cfg)


def _float_leaves(obj: Any, prefix: str = "") -> Iterable[tuple[str, float]]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_leaves(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}", value


def _check_init_from(cfg: RunConfig) -> None:
    """model.init_from exists, is not the run's own final/ (which the run's end replaces), and
    holds a model with the shapes model.* gives."""
    src = Path(cfg.model.init_from).expanduser()
    if not src.exists() and (Path(os.path.expanduser(cfg.run.dir)) / "checkpoints").is_dir():
        return  # the weights only seed the first start: a restart resumes from the run's own checkpoints
    check(
        src.is_dir(),
        "model.init_from",
        "a run's final/ directory, a run directory or a Hugging Face model directory",
        cfg.model.init_from,
    )
    own = Path(cfg.run.dir).expanduser().absolute()
    check(
        src.absolute() not in (own, own / "final"),
        "model.init_from",
        f"weights outside run.dir={cfg.run.dir} (the run's end replaces its final/; give the new run its own run.dir)",
        cfg.model.init_from,
    )
    from loomtrain.launcher.checkpoints.weight_source import open_matching

    open_matching(cfg.model)


def _cxx_available() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False
