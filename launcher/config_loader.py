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

`validate` calls each section's own rules (beside its fields, in
`loomtrain.launcher.config`) and checks the rules that span sections; call it again
once the real world size is known (the loop does). It reads no weights: whether
model.init_from holds a model of model.*'s shapes is `train`'s pre-flight
(`loomtrain.launcher.checkpoints.weight_source.check_init_from`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loomtrain.durable import atomic_write
from loomtrain.launcher.config import RESUME_MODES, ConfigError, DataSource, RunConfig, check, cuda_available
from loomtrain.launcher.rundir import run_dir
from loomtrain.parallel.topology import check_tp
from loomtrain.storage import message_line
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


# --- schema helpers ---------------------------------------------------------
def _leaves(obj: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """(dotted key, value) of every leaf field of a config, its nested sections walked."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def valid_keys() -> list[str]:
    """Every dotted leaf key of the schema (`train.lr`, `model.d_model`, ...)."""
    return [key for key, _ in _leaves(RunConfig())]


def _closest(key: str) -> str:
    keys = valid_keys()
    pool = keys + [f.name for f in dataclasses.fields(RunConfig)]  # and the sections
    # Compare the full dotted key, and also the last part alone (`lr` -> `train.lr`).
    match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    if not match:
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
        near = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        match = [by_leaf[near[0]]] if near else []
    return f" (did you mean {match[0]!r}?)" if match else ""


def _no_value(key: str, where: str) -> ConfigError:
    """`run.dir=` (often an unset shell variable) or `dir:` with nothing after it: OmegaConf reads
    a null, which no field accepts; say so, and what to write instead."""
    default = dict(_leaves(RunConfig())).get(key)  # the schema's (None for an unknown key)
    none = f""", or "{key}=''" for none""" if default == "" else ""
    if where == "command line":
        return ConfigError(
            f"{key}: no value after '=' on the command line ('{key}=': an unset shell variable?); "
            f"give one ({key}=VALUE){none}, or leave the override out to keep the config's value"
        )
    return ConfigError(f"{key}: empty in {where}; give it a value{none}, or remove the line for the default")


def _omegaconf_error(exc: OmegaConfBaseException, where: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    msg = message_line(exc)
    name = type(exc).__name__
    if key and (msg.startswith("Incompatible value 'None'") or msg.endswith("is not Optional")):
        return _no_value(key, where)
    if "KeyError" in name or "not in" in msg:
        return ConfigError(f"{key}: unknown key{_closest(key)} [{where}]")
    if "ValidationError" in name or "could not be converted" in msg:
        # "Value 'abc' of type 'str' could not be converted to Float"
        return ConfigError(f"{key}: wrong type: {msg} [{where}]")
    return ConfigError(f"{key or '<config>'}: {msg} [{where}]")


# --- loading -----------------------------------------------------------------
def load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[DictConfig, str]]:
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
        raise ConfigError(f"{path}: cannot parse YAML: {message_line(exc)}") from exc
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    layers: list[tuple[DictConfig, str]] = []
    if "extends" in layer:
        bases = layer.pop("extends")
        bases = [bases] if isinstance(bases, str) else list(bases or [])
        for base in bases:
            if not isinstance(base, str):
                raise ConfigError(f"extends: expected a file name or a list of them, got {base!r} [{path}]")
            layers += load_yaml(path.parent / base, (*seen, path))
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
                f"({message_line(exc)}); quote it: key='value'"
            ) from None
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, "command line") from exc


def _check_keys(layer: DictConfig, source: str) -> None:
    """Unknown keys, named in full with the closest valid dotted key."""
    known = set(valid_keys())
    # every key's parent is a section, top-level (train) or nested (model.lora), and every section has keys
    sections = {key.rsplit(".", 1)[0] for key in known}

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


# Keys holding a list of typed items. Merged as a whole, OmegaConf names a bad item's field alone
# ("weight: wrong type"), so each item is checked on its own first, under its full name.
ITEM_LISTS = {"data.sources": DataSource}


def _check_list_items(layer: DictConfig, source: str) -> None:
    """Each item of an ITEM_LISTS key: a mapping of the item's own fields, each of its type;
    an error names the item (`data.sources[1].weight`) and what it takes."""
    for key, schema in ITEM_LISTS.items():
        node = OmegaConf.select(layer, key, default=None, throw_on_missing=False)
        if node is None:
            continue
        fields = [f.name for f in dataclasses.fields(schema)]
        shape = "{" + ", ".join(f"{name}: ..." for name in fields) + "}"
        if not OmegaConf.is_list(node):
            raise ConfigError(f"{key}: expected a list of {shape} items, got {_plain(node)!r} [{source}]")
        for i in range(len(node)):
            item, name = node._get_node(i), f"{key}[{i}]"
            if not OmegaConf.is_dict(item):
                raise ConfigError(f"{name}: expected a mapping {shape}, got {_plain(item)!r} [{source}]")
            for field in item.keys():
                if field not in fields:
                    near = difflib.get_close_matches(str(field), fields, n=1, cutoff=0.6)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    if ":" in str(field):
                        hint = " (YAML needs a space after the colon: {path: DIR})"
                    raise ConfigError(f"{name}.{field}: unknown key{hint}; an item has {shape} [{source}]")
            try:
                OmegaConf.merge(OmegaConf.structured(schema), item)
            except OmegaConfBaseException as exc:
                field = str(getattr(exc, "key", None) or getattr(exc, "full_key", "") or "")
                value = _plain(item._get_node(field)) if field in fields else None
                expected = schema.EXPECTED.get(field, "a value of the right type")
                raise ConfigError(f"{name}.{field}: expected {expected}, got {value!r} [{source}]") from None


def _plain(node: Any) -> Any:
    """A node's value as plain Python (lists and mappings as such), for a message."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node)
    return node._value() if hasattr(node, "_value") else node


def merge_layers(layers: list[tuple[DictConfig, str]]) -> RunConfig:
    """Merge the layers onto the structured schema and build the dataclasses."""
    merged = OmegaConf.structured(RunConfig)
    for layer, source in layers:
        _check_keys(layer, source)
        _check_list_items(layer, source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, source) from exc
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, "interpolation") from exc
    except ValueError as exc:  # ModelConfig.validate: "model.<field>: ..."
        raise ConfigError(message_line(exc)) from exc
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
    layers = load_yaml(Path(path))
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
    atomic_write(path, to_yaml(cfg))


# --- rules ---------------------------------------------------------------------
def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Every section's own rules (`section.validate(prefix)`, beside its fields), then the rules
    that span sections; raises ConfigError naming the dotted key."""
    # inf/nan pass `> 0` and min/max checks, then poison the run (nan fails them with a less
    # helpful message): every float knob of every section must be a finite number, first.
    for key, value in _leaves(cfg):
        if isinstance(value, float):
            check(math.isfinite(value), key, "a finite number", value)
    for f in dataclasses.fields(cfg):
        try:
            getattr(cfg, f.name).validate(f.name)
        except ConfigError:
            raise
        except ValueError as exc:  # ModelConfig's: the model knows nothing of ConfigError
            raise ConfigError(message_line(exc)) from None
    _check_across_sections(cfg, world_size)


def _check_across_sections(cfg: RunConfig, world_size: int) -> None:
    t, p, m = cfg.train, cfg.parallel, cfg.model
    _check_path_fits("run.dir", cfg.run.dir)
    # LoRA's adapters are made after the base is materialised, which ZeRO-3 partitions as it goes
    check(not m.lora.enabled or p.zero_stage < 3, "parallel.zero_stage", "0, 1 or 2 with model.lora", p.zero_stage)
    if cfg.data.cache_dir:
        _check_path_fits("data.cache_dir", cfg.data.cache_dir)
    resume = cfg.checkpoint.resume
    check(  # a PATH only seeds the first start: once the run has checkpoints, the seed may be gone
        resume in RESUME_MODES or "://" in resume or Path(resume).exists() or run_has_checkpoints(cfg),
        "checkpoint.resume",
        "auto, never or the path of an existing checkpoint",
        resume,
    )
    check(t.seq_len <= m.max_seq_len, "train.seq_len", f"at most model.max_seq_len={m.max_seq_len}", t.seq_len)
    known = _tokenizer_vocab(cfg.data)
    if known is not None:  # ids must fit the embedding (build_data checks again once a bpe is trained)
        vocab, whose = known
        check(
            m.vocab_size >= vocab,
            "model.vocab_size",
            f"at least the tokenizer's vocabulary {vocab} ({whose})",
            m.vocab_size,
        )
    try:  # heads, KV heads and FFN width must split tp ways
        check_tp(m, p.tp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check(
        p.cp == 1 or t.seq_len % (2 * p.cp) == 0,
        "train.seq_len",
        f"a multiple of 2 x parallel.cp = {2 * p.cp} (each CP rank holds 2 of 2 x cp chunks)",
        t.seq_len,
    )
    check(
        not p.sequence_parallel or (t.seq_len // p.cp) % p.tp == 0,
        "train.seq_len",
        f"a multiple of {cfg.model_group()} with parallel.sequence_parallel",
        t.seq_len,
    )
    check(
        not p.compile or (t.device != "cpu" and cuda_available()) or shutil.which(os.environ.get("CXX", "g++")),
        "parallel.compile",
        "false on a CPU without a C++ compiler (torch.compile's CPU backend builds with $CXX or g++)",
        p.compile,
    )
    # world size, tp, dp and the batch sizes
    check(world_size % p.tp == 0, "parallel.tp", f"a divisor of the world size {world_size}", p.tp)
    check(
        world_size % (p.tp * p.cp) == 0,
        "parallel.cp",
        f"a divisor of the world size {world_size} / parallel.tp={p.tp}",
        p.cp,
    )
    t.grad_accum_steps(cfg.data_ranks(world_size))  # samples split over the data ranks only
    if cfg.ray.elastic:  # the smallest elastic group must be a size the run can use too
        check(
            cfg.usable_world_size(cfg.ray.least_workers),
            "ray.min_workers",
            f"a multiple of {cfg.model_group()} whose DP size x train.micro_batch_size={t.micro_batch_size} "
            f"divides train.global_batch_size={t.global_batch_size}",
            cfg.ray.least_workers,
        )


def _tokenizer_vocab(data) -> tuple[int, str] | None:
    """(vocabulary size, whose) of the run's tokenizer where it is known before any data work: the
    byte tokenizer, a tokenizer.json, or for `bpe` the first shard directory's index (what
    data_pipeline/corpus.py's prepare_sources loads); None for a bpe still to be trained."""
    from loomtrain.data_pipeline import ByteTokenizer, DataError, load_tokenizer
    from loomtrain.data_pipeline.shards import INDEX

    if data.tokenizer == "byte":
        return ByteTokenizer.vocab_size, "data.tokenizer=byte"
    if data.tokenizer != "bpe":
        try:
            return load_tokenizer(data.tokenizer).vocab_size, f"data.tokenizer={data.tokenizer}"
        except DataError:
            return None  # prepare_sources names what is wrong with the tokenizer
    first = data.path or (data.sources[0].path if data.sources else "")
    index = Path(first) / INDEX if first and "://" not in first else None
    if index is None or not index.is_file():
        return None
    try:
        return int(json.loads(index.read_text())["tokenizer"]["vocab_size"]), f"the tokenizer of {first}"
    except (OSError, ValueError, KeyError, TypeError):
        return None  # prepare_sources names what is wrong with the shards


# What loomtrain adds below a run directory, at most (a checkpoint's temp folder and the files
# in it, a heartbeat's temp file): a run.dir must leave this much of PATH_MAX.
ROOM_UNDER_RUN_DIR = 200


def _fs_limit(path: Path, name: str, fallback: int) -> int:
    """os.pathconf `name` (PC_NAME_MAX, PC_PATH_MAX) of the filesystem `path` will be on."""
    for folder in (path, *path.parents):
        if os.path.exists(folder):  # False, not ENAMETOOLONG, for a name over the limit
            try:
                return os.pathconf(folder, name)
            except (OSError, ValueError):
                break
    return fallback


def _check_path_fits(key: str, value: str) -> None:
    """A name over the filesystem's limit (255 bytes on most) fails every write under it with
    ENAMETOOLONG: refuse it now, naming the key and the limit."""
    path = Path(os.path.expanduser(value)).absolute()
    name_max = _fs_limit(path, "PC_NAME_MAX", 255)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            raise ConfigError(
                f"{key}: a folder name in it is {size} bytes long ({part[:24]}...); the filesystem "
                f"allows at most {name_max} bytes per name: pick a shorter {key}"
            )
    path_max = _fs_limit(path, "PC_PATH_MAX", 4096)
    size = len(os.fsencode(str(path)))
    if size + ROOM_UNDER_RUN_DIR > path_max:
        raise ConfigError(
            f"{key}: the path is {size} bytes long; the filesystem allows {path_max} bytes per path, and "
            f"loomtrain needs {ROOM_UNDER_RUN_DIR} of them for the files under it: pick a shorter {key}"
        )


def run_has_checkpoints(cfg: RunConfig) -> bool:
    """Whether the run may have checkpoints of its own. With run.storage (a URI) the answer is
    the store's, which a config check does not contact: the start-up's resume resolution asks it."""
    return bool(cfg.run.storage) or (run_dir(cfg) / "checkpoints").is_dir()
