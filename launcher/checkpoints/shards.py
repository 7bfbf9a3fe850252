"""Layout-free sharded tensor files: each rank writes the pieces it holds, any rank reads any slice.

Every tensor is seen as a matrix, rows = shape[0], cols = prod(shape[1:]) (a 1-D tensor is a
column). Tensor parallelism splits dim 0 (rows) or dim 1 (a block of columns); within that
box DeepSpeed's data-parallel partition is a range of the box's row-major order. So what one
rank holds of one parameter is a `Region`:

    box  = (r0, r1, c0, c1)   the rank's TP shard in matrix coordinates (padding included:
                              a padded vocabulary runs past the real rows)
    flat = (a, b)             the range of the box's row-major order it holds

and it is stored as one 1-D tensor of b - a values (padding positions included, never read).

Checksums per tile. The matrix is cut into a fixed grid of GRID_ROWS x GRID_COLS tiles (a
function of the full shape only, so the same for every layout). For every piece the writer
hashes, per tile, the piece's values inside that tile (row-major), while it writes. A reader
that needs some region of a parameter reads, of every piece that overlaps it, the tiles it
touches, checks their sha256 and keeps what it needs. So a rank verifies exactly what it
reads, no rank hashes another's whole file, and a reshard to another TP size reads at most a
tile's worth more than its share at each edge (the column grid also serves row-parallel
weights, whose TP shards are column blocks).

Files are safetensors, written here by a streaming writer (header first, then tensor by
tensor, hashing the bytes as they go): the `safetensors` package can only serialise a whole
dict in memory, and hashing after the fact would read every byte back.

Public (also used by `final/` and the Hugging Face export): `Region`, `matrix_shape`,
`shard_box`, `SafetensorsWriter`, `write_safetensors`, `tile_hashes`, `ShardedReader`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

GRID_ROWS, GRID_COLS = 32, 8

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.float64: "F64",
    torch.int16: "I16",
    torch.bool: "BOOL",
}


class CorruptCheckpoint(ValueError):
    """A stored piece does not match its checksum, or the index does not fit the files."""


# Geometry ---------------------------------------------------------------------------
def matrix_shape(shape: Iterable[int]) -> tuple[int, int]:
    shape = list(shape)
    if not shape:
        return 1, 1
    return int(shape[0]), int(math.prod(shape[1:]))


def shard_box(full_shape, tp_dim: int | None, start: int = 0, length: int = 0) -> tuple[int, int, int, int]:
    """The matrix box of a TP shard covering [start, start + length) of dim `tp_dim` (padded)."""
    rows, cols = matrix_shape(full_shape)
    if tp_dim is None:
        return (0, rows, 0, cols)
    if tp_dim == 0:
        return (start, start + length, 0, cols)
    if tp_dim == 1:
        inner = int(math.prod(list(full_shape)[2:]))
        return (0, rows, start * inner, (start + length) * inner)
    raise ValueError(f"tensor-parallel split along dim {tp_dim} is not supported by the checkpoint format")


@dataclass(frozen=True)
class Region:
    box: tuple[int, int, int, int]
    flat: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0]

    @classmethod
    def whole(cls, box) -> Region:
        r0, r1, c0, c1 = box
        return cls(tuple(box), (0, (r1 - r0) * (c1 - c0)))

    def to_json(self) -> dict:
        return {"box": list(self.box), "flat": list(self.flat)}

    @classmethod
    def from_json(cls, d: dict) -> Region:
        return cls(tuple(int(v) for v in d["box"]), tuple(int(v) for v in d["flat"]))


def region_runs(reg: Region, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The region's real (non-padding) values as runs contiguous in the matrix's row-major order:
    (matrix offset of each run, its length, its offset inside the region's flat range)."""
    r0, r1, c0, c1 = reg.box
    a, b = reg.flat
    w = c1 - c0
    empty = (np.zeros(0, np.int64),) * 3
    if b <= a or w <= 0:
        return empty
    if c0 == 0 and w == cols:  # full rows: one contiguous run
        x0, x1 = r0 * cols + a, min(r0 * cols + b, rows * cols)
        if x1 <= x0:
            return empty
        return np.array([x0], np.int64), np.array([x1 - x0], np.int64), np.array([0], np.int64)
    real_w = max(0, min(c1, cols) - c0)
    i = np.arange(a // w, (b - 1) // w + 1, dtype=np.int64)
    lo = np.maximum(a, i * w)
    hi = np.minimum(b, i * w + real_w)
    keep = (hi > lo) & (r0 + i < rows)
    i, lo, hi = i[keep], lo[keep], hi[keep]
    return (r0 + i) * cols + c0 + (lo - i * w), hi - lo, lo - a


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return max(1, -(-rows // GRID_ROWS)), max(1, -(-cols // GRID_COLS))


def _expand(runs, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Matrix offsets and region offsets of every value of `runs` inside matrix offsets [lo, hi)."""
    x0, n, off = runs
    s = np.maximum(x0, lo)
    e = np.minimum(x0 + n, hi)
    keep = e > s
    s, e, base = s[keep], e[keep], (off + (np.maximum(x0, lo) - x0))[keep]
    lens = e - s
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    step = np.arange(total, dtype=np.int64) - starts
    return np.repeat(s, lens) + step, np.repeat(base, lens) + step


def _row_blocks(runs, cols: int, rb: int) -> range:
    x0, n, _ = runs
    if len(x0) == 0:
        return range(0)
    return range(int(x0.min()) // cols // rb, (int((x0 + n).max()) - 1) // cols // rb + 1)


def _tiles(runs, rows: int, cols: int):
    """Per tile the piece touches: (tile row, tile col, matrix offsets, region offsets), row-major."""
    rb, cs = _grid(rows, cols)
    for ti in _row_blocks(runs, cols, rb):
        x, off = _expand(runs, ti * rb * cols, (ti + 1) * rb * cols)
        if len(x) == 0:
            continue
        g = (x % cols) // cs
        for tg in np.unique(g):
            sel = g == tg
            yield ti, int(tg), x[sel], off[sel]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes_of(t)).hexdigest()


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _take(data: torch.Tensor, off: np.ndarray) -> torch.Tensor:
    if len(off) and int(off[-1]) - int(off[0]) + 1 == len(off):
        return data[int(off[0]) : int(off[-1]) + 1]
    return data[torch.from_numpy(off)]


def tile_hashes(region: Region, full_shape, tensors: dict[str, torch.Tensor]) -> list[list]:
    """[[tile row, tile col, sha256 of tensors[k]'s values in the tile for each k (sorted)], ...]
    for one stored piece (1-D tensors of region.numel values each)."""
    rows, cols = matrix_shape(full_shape)
    keys = sorted(tensors)
    out = []
    for ti, tg, _, off in _tiles(region_runs(region, rows, cols), rows, cols):
        out.append([ti, tg, *[_sha(_take(tensors[k], off)) for k in keys]])
    return out


# Writing ----------------------------------------------------------------------------
class SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (names, dtypes, shapes) first,
    then each tensor's bytes as the caller produces them, hashed on the way; so a file of many
    tensors never needs them all in memory. `close()` fsyncs and returns {"size", "sha256"}."""

    def __init__(
        self,
        path: str | os.PathLike,
        specs: list[tuple[str, torch.dtype, list[int]]],
        metadata: dict[str, str] | None = None,
    ):
        header: dict = {}
        pos = 0
        for name, dtype, shape in specs:
            n = int(math.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": [int(v) for v in shape], "data_offsets": [pos, pos + n]}
            pos += n
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._specs = list(specs)
        self._next = 0
        self._size = 8 + len(raw) + pos
        self._hash = hashlib.sha256()
        self._f = open(self.path, "wb")
        for chunk in (struct.pack("<Q", len(raw)), raw):
            self._write(memoryview(chunk))

    def _write(self, data: memoryview) -> None:
        self._f.write(data)
        self._hash.update(data)

    def write(self, name: str, t: torch.Tensor) -> None:
        want, dtype, shape = self._specs[self._next]
        if name != want or t.dtype != dtype or list(t.shape) != [int(v) for v in shape]:
            raise ValueError(
                f"{self.path}: expected {want} {dtype} {list(shape)} next, got {name} {t.dtype} {list(t.shape)}"
            )
        self._write(_bytes_of(t.cpu() if t.device.type != "cpu" else t))
        self._next += 1

    def close(self) -> dict:
        if self._next != len(self._specs):
            raise ValueError(f"{self.path}: {len(self._specs) - self._next} tensors were not written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"size": self._size, "sha256": self._hash.hexdigest()}


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> dict:
    """Write a safetensors file, hashing as it goes; fsynced. Returns {"size", "sha256"}."""
    w = SafetensorsWriter(path, [(k, t.dtype, list(t.shape)) for k, t in tensors.items()], metadata)
    for k, t in tensors.items():
        w.write(k, t)
    return w.close()


# Reading ----------------------------------------------------------------------------
class ShardedReader:
    """Reads slices of tensors from a sharded directory through its index, verifying every tile
    it touches; `bytes_read` counts the tensor bytes taken from the files.

    index: {"params": {name: {"shape", "pieces": [{"file", "box", "flat", "tiles"}]}}} where
    "tiles" rows are [tile row, tile col, sha256 per key in `keys` order]; `files` maps a key
    (None for the weight) to (sub-directory, tensor-name pattern with {name})."""

    def __init__(self, root: str | os.PathLike, index: dict, files: dict, keys: list):
        self.root = Path(root)
        self.params = index["params"]
        self.files = files
        self.keys = keys
        self.bytes_read = 0
        self._open: dict = {}

    def names(self) -> list[str]:
        return list(self.params)

    def shape(self, name: str) -> list[int]:
        return list(self.params[name]["shape"])

    def close(self) -> None:
        self._open.clear()

    def _handle(self, rel: str):
        if rel not in self._open:
            path = self.root / rel
            if not path.is_file():
                raise CorruptCheckpoint(f"{path}: missing (named by the checkpoint index)")
            self._open[rel] = safe_open(str(path), framework="pt")
        return self._open[rel]

    def full(self, name: str, key: str | None = None) -> torch.Tensor:
        shape = self.shape(name)
        rows, cols = matrix_shape(shape)
        return self.read(name, key, Region.whole((0, rows, 0, cols))).reshape(shape)

    def read(self, name: str, key: str | None, target: Region) -> torch.Tensor:
        """The values of `target` (a 1-D tensor; padding positions are zero)."""
        entry = self.params[name]
        rows, cols = matrix_shape(entry["shape"])
        sub, pattern = self.files[key]
        col = 2 + self.keys.index(key)
        out = torch.zeros(target.numel, dtype=torch.float32)
        t_x0, t_n, t_off = region_runs(target, rows, cols)
        if len(t_x0) == 0:
            return out
        rb, cs = _grid(rows, cols)
        for piece in entry["pieces"]:
            reg = Region.from_json(piece)
            tiles = {(int(t[0]), int(t[1])): t[col] for t in piece["tiles"]}
            rel = f"{sub}/{piece['file']}"
            tname = pattern.format(name=name)
            runs = region_runs(reg, rows, cols)
            for ti in _row_blocks(runs, cols, rb):
                x, off = _expand(runs, ti * rb * cols, (ti + 1) * rb * cols)
                if len(x) == 0:
                    continue
                # where each of the piece's values goes in the target (-1: not wanted)
                k = np.searchsorted(t_x0, x, side="right") - 1
                inside = (k >= 0) & (x < t_x0[np.maximum(k, 0)] + t_n[np.maximum(k, 0)])
                if not inside.any():
                    continue
                dest = np.where(inside, t_off[np.maximum(k, 0)] + x - t_x0[np.maximum(k, 0)], -1)
                g = (x % cols) // cs
                wanted = np.unique(g[inside])
                sel = np.isin(g, wanted)
                data = self._read_offsets(rel, tname, off[sel])
                gs, ds = g[sel], dest[sel]
                for tg in wanted:
                    m = gs == tg
                    want = tiles.get((ti, int(tg)))
                    got = _sha(data[torch.from_numpy(m)])
                    if want != got:
                        raise CorruptCheckpoint(
                            f"{self.root / rel}: {tname} (tile {ti},{int(tg)}) fails its sha256 checksum"
                        )
                ok = ds >= 0
                out[torch.from_numpy(ds[ok])] = data[torch.from_numpy(ok)].float()
        return out

    def _read_offsets(self, rel: str, tname: str, off: np.ndarray) -> torch.Tensor:
        """The stored values at these (sorted) offsets, read as few contiguous slices."""
        f = self._handle(rel)
        sl = f.get_slice(tname)
        breaks = np.flatnonzero(np.diff(off) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [len(off)]])
        parts = []
        for s, e in zip(starts, ends):
            lo, hi = int(off[s]), int(off[e - 1]) + 1
            t = sl[lo:hi]
            self.bytes_read += t.numel() * t.element_size()
            parts.append(t)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
