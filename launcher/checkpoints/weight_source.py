"""Where a model's initial weights come from, read a slice at a time (`model.init_from`, `import`).

A WeightSource is a ModelConfig, the safetensors files that hold the weights, and for every
loomtrain parameter name a TensorRef saying where its tensor lies in those files. Three kinds
of directory are sources (`open_source`):

  * a run's final/ (model_config.json + model.safetensors, or shards named by
    model.safetensors.index.json), or the run directory holding it; `loomtrain import`
    writes this too;
  * a Hugging Face model directory (config.json + safetensors), mapped by hf_import.

Reading goes through `safe_open(...).get_slice`, so a tensor-parallel rank reads only its own
rows or columns of each tensor (`load_into`), and nothing is ever unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from loomtrain.launcher.checkpoints.store import CheckpointStore
from loomtrain.launcher.config import ConfigError
from loomtrain.launcher.weights import MODEL_CONFIG, TOKENIZER_DIR, WEIGHTS, WEIGHTS_INDEX
from loomtrain.model import ModelConfig, Transformer
from loomtrain.parallel.plan import spec_of
from safetensors import safe_open

# Pickled weight files: refused, never opened.
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class WeightSourceError(ValueError):
    """A source that cannot give these weights; the message is one line naming the file or field."""


@dataclass(frozen=True)
class TensorRef:
    """A loomtrain tensor inside a source file: `key` there, stored transposed (GPT-2's Conv1D
    keeps [in, out]) or not, and, for fused tensors, only rows [offset, offset + rows) of
    loomtrain's dim 0 (q, k and v inside GPT-2's c_attn)."""

    key: str
    transpose: bool = False
    offset: int = 0
    rows: int | None = None


def weight_files(directory: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it: one model.safetensors, or the shards an
    index names. Pickled weights are refused without being opened."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightSourceError(f"{index}: not a safetensors index (no readable weight_map: {exc})") from None
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise WeightSourceError(f"{index}: names shard {missing[0]}, which is not in {directory}")
        return {k: directory / f for k, f in weight_map.items()}
    if (directory / WEIGHTS).is_file():
        with safe_open(str(directory / WEIGHTS), framework="pt") as f:
            return {k: directory / WEIGHTS for k in f.keys()}
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise WeightSourceError(
            f"{directory / pickled[0]}: pickled weights are not read (loading them can run arbitrary code); "
            f"convert them to safetensors first, e.g. AutoModelForCausalLM.from_pretrained(DIR)"
            f".save_pretrained(OUT) with transformers, which writes model.safetensors"
        )
    raise WeightSourceError(f"{directory}: no {WEIGHTS} and no {WEIGHTS_INDEX}")


class SafetensorsFiles:
    """Reads TensorRefs from a directory's safetensors files, whole or a range of one dim."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = weight_files(directory)
        self._open: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self.files)

    def _slice(self, key: str):
        path = self.files.get(key)
        if path is None:
            raise WeightSourceError(f"{self.directory}: no tensor {key!r} in the weight files")
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_slice(key)

    def shape(self, ref: TensorRef) -> tuple[int, ...]:
        """The loomtrain tensor's shape."""
        shape = list(self._slice(ref.key).get_shape())
        if ref.transpose:
            shape = shape[::-1]
        if ref.rows is not None:
            shape[0] = ref.rows
        return tuple(shape)

    def read(self, ref: TensorRef, dim: int = 0, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The loomtrain tensor, only entries [lo, hi) along `dim` (all by default)."""
        full = self.shape(ref)
        hi = full[dim] if hi is None else hi
        ours = [slice(0, n) for n in full]
        ours[dim] = slice(lo, hi)
        ours[0] = slice(ours[0].start + ref.offset, ours[0].stop + ref.offset)
        theirs = ours[::-1] if ref.transpose else ours
        t = self._slice(ref.key)[tuple(theirs)]
        return t.t().contiguous() if ref.transpose else t


@dataclass
class WeightSource:
    model_cfg: object  # loomtrain.model.ModelConfig
    files: SafetensorsFiles
    refs: dict[str, TensorRef]  # loomtrain parameter name -> where it lies
    description: str
    tokenizer_dir: Path | None = None

    def read(self, name: str, dim: int = 0, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return self.files.read(self.refs[name], dim, lo, hi)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(self.refs[name])


def model_tensor_names(model_cfg) -> dict[str, tuple[int, ...]]:
    """The persistent tensors of a loomtrain model with this config and their shapes (a tied
    output layer is the embedding table, stored once), without allocating them."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model_cfg.tie_embeddings:
        names.pop("lm_head.weight")
    return names


def _final_dir(path: Path) -> Path | None:
    for d in (path, path / "final"):
        if (d / MODEL_CONFIG).is_file():
            return d
    return None


def open_source(path: str | Path) -> WeightSource:
    """A run's final/ (or its run directory) or a Hugging Face model directory."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise WeightSourceError(
            f"{path}: no such directory (expected a run's final/, a run directory or a Hugging Face model directory)"
        )
    final = _final_dir(path)
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
        # Imported here: hf_import builds on this module (a cycle at the top).
        from loomtrain.launcher.checkpoints.hf_import import open_hf

        return open_hf(path)
    raise WeightSourceError(
        f"{path}: neither a run's final/ ({MODEL_CONFIG}), a run directory with one, "
        f"nor a Hugging Face model directory (config.json)"
    )


def check_complete(source: WeightSource) -> None:
    """Every tensor the model needs is there with the model's shape; nothing is left over."""
    expected = model_tensor_names(source.model_cfg)
    for name, shape in expected.items():
        ref = source.refs.get(name)
        if ref is None:
            raise WeightSourceError(f"{source.description}: no tensor for loomtrain's {name}")
        got = source.shape(name)
        if got != shape:
            raise WeightSourceError(
                f"{source.description}: {ref.key} has shape {list(got)}, "
                f"the model config gives {name} the shape {list(shape)}"
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
)


def _effective(cfg, field: str):
    if field == "n_kv_heads":
        return cfg.kv_heads
    if field == "ffn_hidden":
        return cfg.ffn_dim
    return getattr(cfg, field)


def check_matches(source: WeightSource, cfg) -> None:
    """Refuse a source whose model differs from `cfg` (model.*), naming the field and both values;
    every differing field in the one line, so that one edit of the config fixes them all."""
    fields = list(_MUST_MATCH) + (["max_seq_len"] if cfg.positions == "learned" else [])
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


def open_matching(cfg) -> WeightSource:
    """The source model.init_from names, checked against model.*: a one-line ConfigError naming
    the field otherwise (the launcher's validation calls this before any worker starts)."""
    try:
        source = open_source(cfg.init_from)
        check_matches(source, cfg)
        check_complete(source)
    except WeightSourceError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("model.") else f"model.init_from: {msg}") from None
    return source


def init_from(model: torch.nn.Module, cfg, log=print, run_dir=None, resume: str = "auto") -> None:
    """Load model.init_from into a freshly built (possibly tensor-parallel) model, in place.

    The weights only seed a run's first start: when they are gone but the run (`run_dir`,
    `checkpoint.resume` not "never") has a complete checkpoint, which the resume then loads
    over the model anyway, nothing is read."""
    if run_dir is not None and resume != "never" and not Path(cfg.init_from).expanduser().exists():
        found = CheckpointStore(run_dir, log=log).find_resumable(checksums=False)
        if found is not None:
            log(f"model.init_from: {cfg.init_from} is gone; the run resumes from {found}")
            return
    source = open_matching(cfg)
    load_into(model, source)
    log(f"model.init_from: starting from {source.description}")
