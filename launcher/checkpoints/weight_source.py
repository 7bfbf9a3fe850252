"""Where a model's initial weights come from, read a slice at a time (`model.init_from`, `import`).

A WeightSource is a ModelConfig, the safetensors files that hold the weights, and for every
loomtrain parameter name a TensorRef saying where its tensor lies in those files. Three kinds
of directory are sources (`open_source`):

  * a run's final/ (model_config.json + model.safetensors, or shards named by
    model.safetensors.index.json), or the run directory holding it; `loomtrain import`
    writes this too;
  * a Hugging Face model directory (config.json + safetensors), mapped by hf_source, or a
    model id (`meta-llama/Llama-3.2-1B`, `ORG/NAME@REV`) naming one in the local Hugging Face
    cache (hf_cache.resolve_model: an existing folder wins; nothing is downloaded);
  * either at a URI (s3://bucket/prefix: a run's storage, its final/, or a Hugging Face folder):
    its objects are fetched into this host's cache (`fetch_weights`; a final/ checked against its
    manifest) and read from there as a local folder; messages name the objects.

What a source is and how it is read: safetensors_source.py. A tensor-parallel rank reads only
its own rows or columns of each tensor (`load_into`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from loomtrain.data_pipeline import load_tokenizer
from loomtrain.hf_cache import ModelIdError, resolve_model
from loomtrain.launcher.checkpoints.final import (
    FINAL_MANIFEST,
    MODEL_CONFIG,
    TOKENIZER_DIR,
    WEIGHTS,
    WEIGHTS_INDEX,
    FinalWeightsError,
    broken,
    fetch_final,
    find_final_uri,
    manifest_files,
    naming_objects,
    objects_named,
    remember_copy,
    staging_folder,
    verify_final,
    weights_cache,
)
from loomtrain.launcher.checkpoints.hf_source import open_hf
from loomtrain.launcher.checkpoints.safetensors_source import (
    PICKLED_SUFFIXES,
    SafetensorsFiles,
    TensorRef,
    WeightSource,
    WeightSourceError,
    check_complete,
    model_tensor_names,
)
from loomtrain.launcher.checkpoints.store import CheckpointStore
from loomtrain.launcher.config import ConfigError, RunConfig, check
from loomtrain.launcher.config_loader import run_has_checkpoints
from loomtrain.launcher.rundir import run_dir
from loomtrain.model import ModelConfig, Transformer
from loomtrain.parallel.plan import spec_of
from loomtrain.storage import (
    StorageError,
    below,
    download_verified,
    join,
    list_objects,
    local_folder,
    read_object,
    same_location,
)
from safetensors import SafetensorError

# What a Hugging Face folder at a URI holds that is read: config, index, weights, tokenizer files.
HF_SUFFIXES = (".json", ".safetensors", ".model", ".txt")


def weights_at(where: str | os.PathLike) -> bool:
    """Does `where` (a folder or a URI) hold weights open_source reads (a committed final/, or a
    config.json)?"""
    return find_final_uri(str(where)) is not None or read_object(join(where, "config.json")) is not None


def _not_weights(uri: str) -> WeightSourceError:
    return WeightSourceError(
        f"{uri}: neither a run's final/ ({FINAL_MANIFEST}), a run storage with one, nor a Hugging Face "
        f"model folder (config.json); a final/ whose upload was cut short has no {FINAL_MANIFEST}"
    )


def _hf_objects(uri: str) -> dict[str, int]:
    """The files of a Hugging Face folder at `uri` that are read, with their sizes."""
    listed = {rel: info for rel, info in list_objects(uri).items() if "/" not in rel}
    wanted = {rel: info["size"] for rel, info in listed.items() if rel.endswith(HF_SUFFIXES)}
    pickled = sorted(rel for rel in listed if rel.endswith(PICKLED_SUFFIXES))
    if pickled and not any(rel.endswith(".safetensors") for rel in wanted):
        raise WeightSourceError(
            f"{join(uri, pickled[0])}: pickled weights are not read (loading them can run arbitrary code); "
            f"convert them to safetensors first"
        )
    return wanted


def fetch_headers(uri: str, folder: Path) -> Path:
    """The weights at `uri` laid out in `folder` for a check of their shapes only (the pre-flight):
    the small files whole, each safetensors file as its header read with two ranged reads and the
    rest a hole of the object's size (no tensor is downloaded). Only for open_source's checks:
    its tensors read as zeros."""
    try:
        found = find_final_uri(uri)
        if found is not None:
            base = found[0]
            sizes = {rel: info["size"] for rel, info in manifest_files(*found).items()}
        elif read_object(join(uri, "config.json")) is not None:
            base, sizes = uri, _hf_objects(uri)
        else:
            raise _not_weights(uri)
        for rel, size in sorted(sizes.items()):
            dest = folder / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if rel.endswith(".safetensors"):
                head = read_object(join(base, rel), 0, min(8, size))
                n = int.from_bytes(head, "little") if head is not None and len(head) == 8 else 0
                header = read_object(join(base, rel), 8, 8 + n) if 0 < n <= size - 8 else b""
                data = (head or b"") + (header or b"")
            else:
                data = read_object(join(base, rel))
            if data is None:
                raise WeightSourceError(f"{join(base, rel)}: missing")
            with open(dest, "wb") as f:
                f.write(data)
                f.truncate(size)
        remember_copy(folder, base)
        return folder
    except (FinalWeightsError, StorageError) as exc:
        raise WeightSourceError(str(exc)) from None


def fetch_weights(uri: str) -> Path:
    """The weights at `uri` as a local folder of this host's cache: a run's final/ (or the storage
    holding one: every file checked against its manifest), else a Hugging Face folder (its
    config, index, safetensors and tokenizer files). WeightSourceError naming the object otherwise."""
    try:
        if (found := find_final_uri(uri)) is not None:  # its manifest, read once
            return fetch_final(uri, found)
        if read_object(join(uri, "config.json")) is None:
            raise _not_weights(uri)
        return download_verified(uri, weights_cache(uri), dict.fromkeys(_hf_objects(uri)))
    except (FinalWeightsError, StorageError) as exc:
        raise WeightSourceError(str(exc)) from None


def weights_folder(where: str | Path) -> Path:
    """The local folder of the weights at `where`: a folder as it is, a Hugging Face model id's
    snapshot in the local cache, a URI's objects fetched into this host's cache (checked)."""
    try:
        return local_folder(resolve_model(where), fetch_weights)
    except ModelIdError as exc:
        raise WeightSourceError(str(exc)) from None


def open_source(where: str | Path) -> WeightSource:
    """A run's final/ (or its run directory) or a Hugging Face model directory, local or at a URI
    (named by the URI in messages, though read from this host's copy)."""
    with naming_objects():
        source = _open_folder(weights_folder(where))
    source.description = objects_named(source.description)
    return source


def _open_folder(path: Path) -> WeightSource:
    if not path.is_dir():
        raise WeightSourceError(
            f"{path}: no such directory (expected a run's final/, a run directory or a Hugging Face model directory)"
        )
    # final weights themselves, or a run directory's final/
    final = next((d for d in (path, path / "final") if (d / MODEL_CONFIG).is_file()), None)
    if final is not None:
        try:
            cfg = ModelConfig(**json.loads((final / MODEL_CONFIG).read_text()))
        except (TypeError, ValueError) as exc:
            raise WeightSourceError(f"{final / MODEL_CONFIG}: not a loomtrain model config: {exc}") from None
        refs = {name: TensorRef(name) for name in model_tensor_names(cfg)}
        tok = final / TOKENIZER_DIR
        return WeightSource(
            cfg, SafetensorsFiles(final), refs, f"loomtrain weights {final}", tok if tok.is_dir() else None
        )
    if (path / "config.json").is_file():
        return open_hf(path)
    raise WeightSourceError(
        f"{path}: neither a run's final/ ({MODEL_CONFIG}), a run directory with one, "
        f"nor a Hugging Face model directory (config.json)"
    )


# model.init_from ---------------------------------------------------------------------------
# Fields that decide which tensors a model has and their shapes, or what the weights mean.
# Others (rope_theta, norm_eps, dropout, max_seq_len without learned positions) may differ:
# changing them is how one fine-tunes for a longer context or another regularisation.
_MUST_MATCH = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "norm",
    "norm_placement",
    "activation",
    "positions",
    "bias",
    "tie_embeddings",
    "head_dim",
    "qkv_bias",
    "qk_norm",
    # not shapes, but what the weights were trained with: a Mistral or a Llama 3.2 run without
    # them would silently compute another model
    "sliding_window",
    "rope_scaling",
)


# Fields whose value in effect a property gives (None: the usual value for the model's shape).
_EFFECTIVE = {"n_kv_heads": "kv_heads", "head_dim": "head_width", "ffn_hidden": "ffn_dim"}


def _effective(cfg, field: str):
    return getattr(cfg, _EFFECTIVE.get(field, field))


def check_matches(source: WeightSource, cfg) -> None:
    """Refuse a source whose model differs from `cfg` (model.*), naming the field and both values;
    every differing field in the one line, so that one edit of the config fixes them all."""
    fields = list(_MUST_MATCH) + (["max_seq_len"] if cfg.positions == "learned" else [])
    if cfg.head_dim is None and source.model_cfg.head_dim is None:
        fields.remove("head_dim")  # then it follows d_model / n_heads, which are compared already
    differ = [
        (field, ours, theirs)
        for field in fields
        if (theirs := _effective(source.model_cfg, field)) != (ours := _effective(cfg, field))
    ]
    if differ:
        (field, ours, theirs), rest = differ[0], differ[1:]
        also = "".join(f"; also model.{f}: the config has {o!r}, the weights {t!r}" for f, o, t in rest)
        raise WeightSourceError(
            f"model.{field}: the config has {ours!r}, but the weights in "
            f"model.init_from={cfg.init_from} have {theirs!r}{also}"
        )


def read_shard(source: WeightSource, name: str, spec) -> torch.Tensor:
    """This rank's shard of parameter `name` as the TP plan lays it out (`spec`: a
    loomtrain.parallel.plan.ShardSpec), reading only its rows or columns; vocabulary padding
    past the real rows is zeros."""
    got = source.shape(name)
    if got != tuple(spec.full_shape):
        raise WeightSourceError(
            f"{source.description}: {source.refs[name].key} has shape {list(got)}, "
            f"the model's {name} has {list(spec.full_shape)}"
        )
    if spec.replicated:
        return source.read(name)
    lo, hi = spec.bounds()
    local = source.read(name, spec.dim, lo, hi) if hi > lo else None
    if local is not None and hi - lo == spec.local_shape[spec.dim]:
        return local
    out = torch.zeros(spec.local_shape, dtype=torch.float32 if local is None else local.dtype)
    if local is not None:
        out.narrow(spec.dim, 0, hi - lo).copy_(local)
    return out


@torch.no_grad()
def load_into(model: torch.nn.Module, source: WeightSource) -> None:
    """Copy the source's weights into a (possibly tensor-parallel) model's allocated parameters
    in place; a sharded parameter reads only its own slice (`read_shard`)."""
    for name, p in model.named_parameters():
        if name not in source.refs:
            raise WeightSourceError(f"{source.description}: no tensor for loomtrain's {name}")
        p.copy_(read_shard(source, name, spec_of(p)))


def _config_error(exc: WeightSourceError) -> ConfigError:
    msg = objects_named(str(exc))  # a cached copy of a URI's object: named as the object
    return ConfigError(msg if msg.startswith("model.") else f"model.init_from: {msg}")


def open_matching(cfg, where: str | Path | None = None) -> WeightSource:
    """The source model.init_from names (read from `where` when given: a local copy), checked
    against model.*: a one-line ConfigError naming the field otherwise (`check_init_from` calls
    this before any worker starts; it reads the files' headers, not their tensors)."""
    try:
        source = open_source(cfg.init_from if where is None else where)
        check_matches(source, cfg)
        check_complete(source)
    except WeightSourceError as exc:
        raise _config_error(exc) from None
    return source


def check_init_from(cfg: RunConfig) -> None:
    """`train`'s pre-flight for model.init_from (nothing when it is empty): it exists, is not the
    run's own final/ (which the run's end replaces), and holds a model with the shapes model.*
    gives. It reads the disk, so it is not part of the config's validation (config_loader), which
    a config passes wherever its files are; `train`, `submit` and each rank's start call it."""
    if not cfg.model.init_from:
        return
    try:
        where = resolve_model(cfg.model.init_from)  # a model id: its folder in the local Hugging Face cache
    except ModelIdError as exc:
        if _has_checkpoints(cfg):
            return  # the weights only seed the first start: a restart resumes from the run's own checkpoints
        raise ConfigError(f"model.init_from: {exc}") from None
    for key, own in (("run.dir", run_dir(cfg)), ("run.storage", cfg.run.storage)):
        check(
            not own or not any(same_location(where, o) for o in (own, below(own, "final"))),
            "model.init_from",
            f"weights outside {key}={getattr(cfg.run, key[4:])} (the run's end replaces its final/; give the new "
            f"run its own {key})",
            cfg.model.init_from,
        )
    try:
        there = weights_at(where)
    except StorageError as exc:
        raise ConfigError(f"model.init_from: {exc}") from None
    if not there and _has_checkpoints(cfg):
        return  # the weights only seed the first start: a restart resumes from the run's own checkpoints
    # Headers only from a URI: the machine that checks (a laptop submitting a job) need not hold
    # the weights; each rank fetches and verifies them whole when it starts (init_from).
    with tempfile.TemporaryDirectory(prefix="init-from-", dir=staging_folder()) as tmp:
        try:
            local = local_folder(where, lambda uri: fetch_headers(uri, Path(tmp)))
        except WeightSourceError as exc:
            raise _config_error(exc) from None
        check(
            local.is_dir(),
            "model.init_from",
            "a run's final/ directory, a run directory or a Hugging Face model directory",
            cfg.model.init_from,
        )
        open_matching(cfg.model, where=local)


def _has_checkpoints(cfg: RunConfig) -> bool:
    """Has the run checkpoints of its own (in run.storage when set, else under run.dir)?"""
    if not cfg.run.storage:
        return run_has_checkpoints(cfg)
    try:
        return CheckpointStore(cfg.run.storage).find_resumable(checksums=False) is not None
    except (StorageError, OSError, ValueError):
        return False  # a store that cannot be read: the weights are needed, and their check says why


def _weights_gone(init_from: str) -> bool:
    try:
        return not weights_at(resolve_model(init_from))
    except ModelIdError:
        return True
    except StorageError:
        return False  # open_matching names what is wrong


def init_from(model: torch.nn.Module, cfg, log=print, run_dir=None, resume: str = "auto") -> None:
    """Load model.init_from into a freshly built (possibly tensor-parallel) model, in place.

    The weights only seed a run's first start: when they are gone but the run (`run_dir`: its
    folder, or the run.storage URI holding its checkpoints; `checkpoint.resume` not "never")
    has a complete checkpoint, which the resume then loads over the model anyway, nothing is read."""
    if run_dir is not None and resume != "never" and _weights_gone(cfg.init_from):
        found = CheckpointStore(run_dir, log=log).find_resumable(checksums=False)  # a folder or run.storage's URI
        if found is not None:
            log(f"model.init_from: {cfg.init_from} is gone; the run resumes from {found}")
            return
    source = open_matching(cfg)
    try:
        with naming_objects():
            load_into(model, source)  # every tensor is checked to be finite as it is read
    except WeightSourceError as exc:  # a NaN or inf: refused before step 1, naming the tensor
        raise _config_error(exc) from None
    log(f"model.init_from: starting from {source.description}")


# generate: a whole model in this process ---------------------------------------------------
def _final_of(run_or_final_dir: str | os.PathLike) -> Path:
    path = Path(run_or_final_dir)
    if not path.exists():
        raise FileNotFoundError(f"no such run directory: {run_or_final_dir}")
    if (path / WEIGHTS).exists() or (path / WEIGHTS_INDEX).exists() or (path / MODEL_CONFIG).exists():
        return path
    if not (path / "final").is_dir():
        raise FileNotFoundError(f"no final/ directory in {run_or_final_dir} (did the run finish?)")
    return path / "final"


def load_final(run_or_final_dir: str | os.PathLike, device: str | torch.device = "cpu"):
    """-> (Transformer, tokenizer) from RUN_DIR (or RUN_DIR/final), or from a URI: a run's
    storage or its final/ (`fetch_final`).

    A missing or corrupt file raises FinalWeightsError naming it (a run killed while
    an older loomtrain wrote final/, a copy cut short, a disk error), never a
    safetensors / JSON traceback."""
    with naming_objects():
        return _load_final(local_folder(run_or_final_dir, fetch_final, local=_final_of), device)


def _load_final(path: Path, device: str | torch.device):
    weights_name = WEIGHTS_INDEX if (path / WEIGHTS_INDEX).exists() else WEIGHTS
    for name in (weights_name, MODEL_CONFIG, TOKENIZER_DIR):
        if not (path / name).exists():
            raise broken(path, name, "missing")
    verify_final(path)
    try:
        model_cfg = ModelConfig(**json.loads((path / MODEL_CONFIG).read_text()))
    except (OSError, ValueError, TypeError) as exc:  # unreadable, not JSON, unknown keys, bad values
        raise broken(path, MODEL_CONFIG, _unreadable(exc)) from None
    model = Transformer(model_cfg)
    try:
        files = SafetensorsFiles(path)  # the reader model.init_from and export use
        state = {name: files.read(TensorRef(name)) for name in files.keys()}
        dtype = next(iter(state.values())).dtype  # bf16 runs save bf16 weights
        if dtype in (torch.bfloat16, torch.float16):
            model = model.to(dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = ["lm_head.weight"] if model_cfg.tie_embeddings else []
        if unexpected or sorted(missing) != tied:
            raise RuntimeError(
                f"tensors do not match model_config.json: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
    except WeightSourceError as exc:  # unreadable, or not finite: named as the reader names it
        raise FinalWeightsError(str(exc)) from None
    except (SafetensorError, OSError, StopIteration, RuntimeError) as exc:
        # RuntimeError: tensors missing or of another shape than model_config.json says.
        raise broken(path, weights_name, _unreadable(exc)) from None
    model.reset_buffers()
    try:
        tokenizer = load_tokenizer(str(path / TOKENIZER_DIR))
    except Exception as exc:  # the tokenizers library raises its own types
        raise broken(path, TOKENIZER_DIR, _unreadable(exc)) from None
    return model.to(device).eval(), tokenizer


def _unreadable(exc: BaseException) -> str:
    """Why a file of final/ cannot be used: the first line of the reader's error, or its type."""
    return f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
