"""A WeightSource: a ModelConfig, the safetensors files that hold its weights, and for every
loomtrain parameter name a TensorRef saying where its tensor lies in those files.

The readers of a folder build one (weight_source.open_source for a run's final/,
hf_source.open_hf for a Hugging Face model directory); everything that reads weights a slice
at a time works on it. Reading goes through `safe_open(...).get_slice`, so only the rows or
columns asked for are read, and nothing is ever unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from loomtrain.launcher.weights import WEIGHTS, WEIGHTS_INDEX
from loomtrain.model import Transformer
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
