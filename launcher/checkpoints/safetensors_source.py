"""A WeightSource: a ModelConfig, the safetensors files that hold its weights, and for every
loomtrain parameter name a TensorRef saying where its tensor lies in those files.

The readers of a folder build one (weight_source.open_source for a run's final/,
hf_source.open_hf for a Hugging Face model directory); everything that reads weights a slice
at a time works on it. Reading goes through `safe_open(...).get_slice`, so only the rows or
columns asked for are read, and nothing is ever unpickled.

Every check is made here, once, for `loomtrain import` and `model.init_from` alike, each failure
a WeightSourceError of one line naming the file and the tensor or field: each file's header
against the file (`read_header`: a file cut short, sizes that disagree with shapes), an index's
entries against its shards (`weight_files`), dtypes and shapes against the model
(`check_complete`), and every value read finite (`SafetensorsFiles.read`, as it is read).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from loomtrain.launcher.checkpoints.final import WEIGHTS, WEIGHTS_INDEX
from loomtrain.model import meta_transformer
from safetensors import SafetensorError, safe_open

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


# safetensors dtype -> bytes per value (every dtype the format has)
ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
# What a loomtrain model's weights can be (quantized or integer tensors cannot be trained).
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it (checked against the file's size)."""

    dtype: str
    shape: tuple[int, ...]


def _bad_file(path: Path, why: str) -> WeightSourceError:
    return WeightSourceError(f"{path}: {why}")


def _header_entry(path: Path, key: str, entry) -> tuple[TensorInfo, int, int]:
    """(the tensor's dtype and shape, its data's [start, end) bytes), each field's type checked."""
    if not isinstance(entry, dict):
        raise _bad_file(path, f"tensor {key!r}: its header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEMSIZE:
        raise _bad_file(path, f"tensor {key!r}: dtype {dtype!r} is not a safetensors dtype")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise _bad_file(path, f"tensor {key!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        raise _bad_file(path, f"tensor {key!r}: data_offsets {offsets!r} is not [start, end]")
    start, end = offsets
    need = math.prod(shape) * ITEMSIZE[dtype]
    if not 0 <= start <= end or end - start != need:
        raise _bad_file(
            path,
            f"tensor {key!r}: data_offsets {offsets} hold {end - start} bytes, "
            f"but {dtype} {shape} takes {need} (a corrupt header)",
        )
    return TensorInfo(dtype, tuple(shape)), start, end


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, from its header alone (no data is read): every
    entry's dtype, shape and byte range checked against each other and against the file's size,
    so a file cut short (an interrupted download or copy) is refused naming the first tensor
    it cuts, and a bad header naming the entry, before safetensors sees either."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
            if n is None or n > size - 8:
                raise _bad_file(
                    path,
                    f"truncated: {size} bytes, too short for the safetensors header it starts "
                    f"(an interrupted download or copy? fetch the file again)",
                )
            raw = f.read(n)
    except OSError as exc:
        raise _bad_file(path, f"cannot read it: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8
        header = None
    if not isinstance(header, dict):
        raise _bad_file(path, "not a safetensors file (its header is not a JSON object)")
    data_size, out, spans = size - 8 - n, {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        out[key], start, end = _header_entry(path, key, entry)
        spans.append((start, end, key))
    last, before = 0, None  # the tensors' bytes follow one another, as safetensors requires
    for start, end, key in sorted(spans):
        if start != last:
            how = f"overlap {before!r}" if start < last else f"leave a gap after {before or 'the header'!r}"
            raise _bad_file(path, f"tensor {key!r}: data_offsets [{start}, {end}] {how} (a corrupt header)")
        if end > data_size:
            raise _bad_file(
                path,
                f"truncated: tensor {key!r} ends at byte {8 + n + end}, the file has {size} bytes "
                f"(an interrupted download or copy? fetch the file again)",
            )
        last, before = end, key
    if last != data_size:
        raise _bad_file(path, f"{data_size - last} bytes after the last tensor its header describes (a corrupt file)")
    return out


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except OSError as exc:
        raise _bad_file(index, f"cannot read it: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad_file(index, f"not a safetensors index (no readable weight_map: {exc})") from None
    if not isinstance(weight_map, dict):
        raise _bad_file(index, f"weight_map is a {type(weight_map).__name__}, expected {{tensor name: file name}}")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise _bad_file(index, f"weight_map[{key!r}] = {name!r}: expected the name of a file beside the index")
    return weight_map


def weight_files(directory: Path) -> dict[str, tuple[Path, TensorInfo]]:
    """tensor name -> (the safetensors file holding it, its dtype and shape): one
    model.safetensors, or the shards an index names, each index entry checked against the
    shard's header. Pickled weights are refused without being opened."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        weight_map = _read_index(index)
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise _bad_file(index, f"names shard {missing[0]}, which is not in {directory}")
        headers = {f: read_header(directory / f) for f in sorted(set(weight_map.values()))}
        for key, name in weight_map.items():
            if key not in headers[name]:
                holders = [f for f, h in headers.items() if key in h]
                where = f"it is in {holders[0]}" if holders else "no shard holds it"
                raise _bad_file(index, f"weight_map puts tensor {key!r} in {name}, which does not hold it ({where})")
        return {key: (directory / name, headers[name][key]) for key, name in weight_map.items()}
    if (directory / WEIGHTS).is_file():
        return {key: (directory / WEIGHTS, info) for key, info in read_header(directory / WEIGHTS).items()}
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise WeightSourceError(
            f"{directory / pickled[0]}: pickled weights are not read (loading them can run arbitrary code); "
            f"convert them to safetensors first, e.g. AutoModelForCausalLM.from_pretrained(DIR)"
            f".save_pretrained(OUT) with transformers, which writes model.safetensors"
        )
    raise WeightSourceError(f"{directory}: no {WEIGHTS} and no {WEIGHTS_INDEX}")


FINITE_CHUNK = 1 << 24  # values checked at a time: the exact check's scratch stays at 16 MiB


def _all_finite(t: torch.Tensor) -> bool:
    """A sum is finite only when every value is (an inf or NaN never cancels out), and a sum is
    one fast vectorised pass (20x isfinite's on CPU); only a sum that is not finite (a NaN, or
    large values overflowing fp16) is checked value by value."""
    if math.isfinite(t.sum().item()):
        return True
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + FINITE_CHUNK]).all()) for i in range(0, flat.numel(), FINITE_CHUNK))


def _count_nonfinite(t: torch.Tensor) -> str:
    nan = int(torch.isnan(t).sum())
    inf = t.numel() - nan - int(torch.isfinite(t).sum())
    parts = [f"{nan:,} NaN" if nan else "", f"{inf:,} inf" if inf else ""]
    return " and ".join(p for p in parts if p) + f" of {t.numel():,} values read"


class SafetensorsFiles:
    """Reads TensorRefs from a directory's safetensors files, whole or a range of one dim;
    every tensor read is checked to be finite (a NaN in the weights would train as `loss nan`)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = weight_files(directory)
        self._open: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self.files)

    def _where(self, key: str) -> tuple[Path, TensorInfo]:
        found = self.files.get(key)
        if found is None:
            raise WeightSourceError(f"{self.directory}: no tensor {key!r} in the weight files")
        return found

    def _slice(self, key: str):
        path, _ = self._where(key)
        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:  # what read_header does not check
                raise _bad_file(path, f"not a readable safetensors file ({str(exc).splitlines()[0]})") from None
        return self._open[path].get_slice(key)

    def dtype(self, ref: TensorRef) -> str:
        """The tensor's safetensors dtype ("F32", "BF16", ...)."""
        return self._where(ref.key)[1].dtype

    def file_of(self, ref: TensorRef) -> Path:
        return self._where(ref.key)[0]

    def shape(self, ref: TensorRef) -> tuple[int, ...]:
        """The loomtrain tensor's shape."""
        path, info = self._where(ref.key)
        shape = list(info.shape)
        if ref.transpose:
            shape = shape[::-1]
        if ref.rows is not None:
            if not shape or ref.offset + ref.rows > shape[0]:
                raise _bad_file(
                    path, f"tensor {ref.key!r} has shape {list(info.shape)}, too small to hold rows "
                    f"[{ref.offset}, {ref.offset + ref.rows}) of the fused tensor"
                )  # fmt: skip
            shape[0] = ref.rows
        return tuple(shape)

    def read(self, ref: TensorRef, dim: int = 0, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The loomtrain tensor, only entries [lo, hi) along `dim` (all by default); refused
        naming the file and tensor when it holds a NaN or inf."""
        full = self.shape(ref)
        hi = full[dim] if hi is None else hi
        ours = [slice(0, n) for n in full]
        ours[dim] = slice(lo, hi)
        ours[0] = slice(ours[0].start + ref.offset, ours[0].stop + ref.offset)
        theirs = ours[::-1] if ref.transpose else ours
        t = self._slice(ref.key)[tuple(theirs)]
        if t.is_floating_point() and not _all_finite(t):
            raise _bad_file(
                self.file_of(ref),
                f"tensor {ref.key!r} holds {_count_nonfinite(t)}; the weights must be finite numbers "
                f"(a diverged run or a corrupt copy? take the weights from before it went wrong)",
            )
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
    model = meta_transformer(model_cfg)
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model_cfg.tie_embeddings:
        names.pop("lm_head.weight")
    return names


def check_complete(source: WeightSource) -> None:
    """Every tensor the model needs is there, of a floating-point dtype, with the model's shape."""
    expected = model_tensor_names(source.model_cfg)
    for name, shape in expected.items():
        ref = source.refs.get(name)
        if ref is None:
            raise WeightSourceError(f"{source.description}: no tensor for loomtrain's {name}")
        dtype = source.files.dtype(ref)
        if dtype not in FLOAT_DTYPES:
            raise _bad_file(
                source.files.file_of(ref),
                f"tensor {ref.key!r} is {dtype}; loomtrain reads {', '.join(FLOAT_DTYPES)} weights, "
                f"not 8-bit or integer (quantized) ones: import the unquantized model",
            )
        got = source.shape(name)
        if got != shape:
            raise WeightSourceError(
                f"{source.description}: {ref.key} has shape {list(got)}, "
                f"the model config gives {name} the shape {list(shape)}"
            )
