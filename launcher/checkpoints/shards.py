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
touches, checks their checksums and keeps what it needs. The checksum is XXH3-128
(TILE_CHECKSUM): it finds a damaged or torn byte as surely as sha256 does for this purpose (no
one forges a checkpoint tile), and at ~12 GB/s on one core against sha256's ~1.4 it leaves a
save to the disk's pace; checkpoints written with sha256 tiles (TILE_CHECKSUMS) still read.
So a rank verifies exactly what it reads, no rank hashes another's whole file, and a reshard
to another TP size reads at most a tile's worth more than its share at each edge (the column
grid also serves row-parallel weights, whose TP shards are column blocks).

Files are safetensors, written here by a streaming writer (header first, then tensor by
tensor, hashing the bytes as they go): the `safetensors` package can only serialise a whole
dict in memory, and hashing after the fact would read every byte back.

Public (also used by `final/` and the Hugging Face export): `Region`, `matrix_shape`,
`shard_box`, `SafetensorsWriter`, `write_safetensors`, `tile_hashes`, `ShardedReader`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash
from loomtrain.storage import below, location

GRID_ROWS, GRID_COLS = 32, 8
# name -> a new hash object, for the tile checksums of an index (its format says which: state.READS)
TILE_CHECKSUMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
TILE_CHECKSUM = "xxh3_128"  # what a save writes

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


Rect = tuple[int, int, int, int]  # box-local rows [i0, i1) x columns [j0, j1)


def region_bands(reg: Region, rows: int, cols: int) -> list[Rect]:
    """The region's real (non-padding) values as at most three rectangles, box-local: the first
    row (from the flat start), the full rows, the last row (to the flat end). Row-major order
    inside each, and from one to the next, is the order the piece stores its values in."""
    r0, r1, c0, c1 = reg.box
    a, b = reg.flat
    w = c1 - c0
    if b <= a or w <= 0:
        return []
    first, last = a // w, (b - 1) // w
    if first == last:
        spans = [(first, first + 1, a - first * w, b - first * w)]
    else:
        spans = [(first, first + 1, a - first * w, w), (first + 1, last, 0, w), (last, last + 1, 0, b - last * w)]
    real_h, real_w = min(r1, rows) - r0, min(c1, cols) - c0
    out = []
    for i0, i1, j0, j1 in spans:
        i1, j1 = min(i1, real_h), min(j1, real_w)
        if i1 > i0 and j1 > j0:
            out.append((i0, i1, j0, j1))
    return out


def real_count(reg: Region, rows: int, cols: int) -> int:
    """How many real (non-padding) values the region holds."""
    return sum((i1 - i0) * (j1 - j0) for i0, i1, j0, j1 in region_bands(reg, rows, cols))


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return max(1, -(-rows // GRID_ROWS)), max(1, -(-cols // GRID_COLS))


def _tile_rects(reg: Region, rows: int, cols: int) -> dict[tuple[int, int], list[Rect]]:
    """Per grid tile the region touches: its values in that tile as box-local rectangles, in
    stored (row-major) order."""
    rb, cs = _grid(rows, cols)
    r0, _, c0, _ = reg.box
    tiles: dict[tuple[int, int], list[Rect]] = {}
    for i0, i1, j0, j1 in region_bands(reg, rows, cols):
        top, bottom, left, right = r0 + i0, r0 + i1, c0 + j0, c0 + j1
        for ti in range(top // rb, (bottom - 1) // rb + 1):
            ra, rz = max(top, ti * rb) - r0, min(bottom, (ti + 1) * rb) - r0
            for tg in range(left // cs, (right - 1) // cs + 1):
                ca, cz = max(left, tg * cs) - c0, min(right, (tg + 1) * cs) - c0
                tiles.setdefault((ti, tg), []).append((ra, rz, ca, cz))
    return tiles


def _rect_view(data: np.ndarray, reg: Region, rect: Rect) -> np.ndarray:
    """The stored values of a box-local rectangle of the region: a 2-D view of its 1-D array.
    Only the band of full rows spans several rows (region_bands), so a view of whole rows,
    cut to the rectangle's columns, never reaches past the array."""
    i0, i1, j0, j1 = rect
    w = reg.box[3] - reg.box[2]
    start = i0 * w - reg.flat[0]
    if i1 - i0 == 1:
        return data[start + j0 : start + j1].reshape(1, j1 - j0)
    return data[start : start + (i1 - i0) * w].reshape(i1 - i0, w)[:, j0:j1]


def _hash_tiles(data: np.ndarray, reg: Region, tiles: list[list[Rect]], checksum: str) -> list[str]:
    """The checksum of each tile's values (on this thread: XXH3 holds the GIL, and at its speed
    a helper thread would only wait for it)."""
    digests = []
    for rects in tiles:
        h = TILE_CHECKSUMS[checksum]()
        for rect in rects:
            h.update(np.ascontiguousarray(_rect_view(data, reg, rect)))
        digests.append(h.hexdigest())
    return digests


_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a 1-D numpy array of same-sized integers (bytes to hash or write, any dtype)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(getattr(torch, np.dtype(_INT_OF_SIZE[t.element_size()]).name)).numpy()


def tile_hashes(
    region: Region, full_shape, tensors: dict[str, torch.Tensor], checksum: str = TILE_CHECKSUM
) -> list[list]:
    """[[tile row, tile col, checksum of tensors[k]'s values in the tile for each k (sorted)], ...]
    for one stored piece (1-D tensors of region.numel values each)."""
    rows, cols = matrix_shape(full_shape)
    tiles = _tile_rects(region, rows, cols)
    order = sorted(tiles)
    digests = [_hash_tiles(_raw(tensors[k]), region, [tiles[t] for t in order], checksum) for k in sorted(tensors)]
    return [[ti, tg, *per_key] for (ti, tg), *per_key in zip(order, *digests)]


# Writing ----------------------------------------------------------------------------
WRITEBACK_EVERY = 16 << 20  # bytes a writer leaves in the page cache before it starts the disk on them


def _writeback_starter():
    """Linux's sync_file_range(SYNC_FILE_RANGE_WRITE): start writing a range of a file to the disk
    and return at once (as RocksDB's bytes_per_sync does), so the disk works while the writer
    goes on and the final fsync finds little left; None where libc has no such call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    sync_file_range_write = 2  # SYNC_FILE_RANGE_WRITE
    return lambda fd, offset, length: call(fd, offset, length, sync_file_range_write)


_start_writeback = _writeback_starter()


class SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (names, dtypes, shapes) first,
    then each tensor's bytes as the caller produces them, hashed on the way; so a file of many
    tensors never needs them all in memory. `close()` fsyncs and returns {"size", "sha256"}
    ({"size"} alone with whole_file_hash=False: for files whose every value a tile hash covers)."""

    def __init__(
        self,
        path: str | os.PathLike,
        specs: list[tuple[str, torch.dtype, list[int]]],
        metadata: dict[str, str] | None = None,
        whole_file_hash: bool = True,
        sink=None,
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
        self.path = path if sink is not None else Path(path)
        self._specs = list(specs)
        self._next = 0
        self._size = 8 + len(raw) + pos
        self._hash = hashlib.sha256() if whole_file_hash else None
        self._written = self._unsynced = 0
        # `sink`: an object-store upload (storage.Upload: write, close, abort) instead of a file
        self._sink = sink
        if sink is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "wb") if sink is None else sink
        for chunk in (struct.pack("<Q", len(raw)), raw):
            self._write(memoryview(chunk))

    def _write(self, data: memoryview) -> None:
        self._f.write(data)
        if self._hash is not None:
            self._hash.update(data)
        self._unsynced += len(data)
        if self._unsynced >= WRITEBACK_EVERY and self._sink is None and _start_writeback is not None:
            # Write-behind: the disk starts on what is written while the caller produces the
            # rest (hashing, the next tensor); left to close(), the whole file would go to the
            # disk only after everything else is done.
            self._f.flush()
            _start_writeback(self._f.fileno(), self._written, self._unsynced)
            self._written += self._unsynced
            self._unsynced = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        want, dtype, shape = self._specs[self._next]
        if name != want or t.dtype != dtype or list(t.shape) != [int(v) for v in shape]:
            raise ValueError(
                f"{self.path}: expected {want} {dtype} {list(shape)} next, got {name} {t.dtype} {list(t.shape)}"
            )
        self._write(memoryview(_raw(t)).cast("B"))
        self._next += 1

    def close(self) -> dict:
        if self._next != len(self._specs):
            raise ValueError(f"{self.path}: {len(self._specs) - self._next} tensors were not written")
        if self._sink is not None:
            self._sink.close()
        else:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        if self._hash is None:
            return {"size": self._size}
        return {"size": self._size, "sha256": self._hash.hexdigest()}


def write_safetensors(
    path: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    whole_file_hash: bool = True,
    sink=None,
) -> dict:
    """Write a safetensors file, hashing as it goes; fsynced. Returns {"size", "sha256"}
    (see SafetensorsWriter for whole_file_hash). With `sink` (an object-store upload) the
    bytes go there instead, `path` naming it; a failure aborts the upload."""
    specs = [(k, t.dtype, list(t.shape)) for k, t in tensors.items()]
    try:
        w = SafetensorsWriter(path, specs, metadata, whole_file_hash, sink=sink)
        for k, t in tensors.items():
            w.write(k, t)
        return w.close()
    except BaseException:
        if sink is not None:
            sink.abort()
        raise


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file held in memory (already checksummed)."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        return json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except (struct.error, ValueError, UnicodeDecodeError, AttributeError):
        raise CorruptCheckpoint("not a readable safetensors file (damaged header)") from None


# Reading ----------------------------------------------------------------------------
# safetensors dtype -> the numpy type its values are read as: torch's own, but BF16 (which numpy
# lacks) raw, converted by torch
_NUMPY = {
    name: np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
    for dtype, name in _DTYPES.items()
}


# Ranged reads closer than this are fetched as one GET (a request costs about as much as this many bytes).
MERGE_GAP_BYTES = 1 << 20
HEADER_GUESS = 64 << 10  # the first read of a file: its header, usually whole


class _SafetensorsFile:
    """A safetensors file of a checkpoint, its header checked against its size first (a
    truncated file is named, never a SIGBUS). Local: memory-mapped, each tensor a zero-copy view,
    so a reader touches only the pages it reads. In an object store: read with ranged GETs, the
    header once, then of each tensor only the element ranges asked for (`spans`), fetched
    concurrently, handed back as an array of its full length whose other values are never read
    (zeros, not even allocated: the pages of a large np.zeros are mapped only when written)."""

    def __init__(self, objs, rel: str):
        self.path = objs.name(rel)
        self.bytes_fetched = 0
        self._map = None
        if objs.local:
            if not Path(self.path).is_file():
                raise CorruptCheckpoint(f"{self.path}: missing (named by the checkpoint index)")
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

            def read(a: int, b: int) -> bytes:
                return bytes(self._map[a:b])
        else:
            self._fs, self._key = objs.fs, f"{objs.path}/{rel}"
            try:
                size = int(self._fs.info(self._key)["size"])
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{self.path}: missing (named by the checkpoint index)") from None

            def read(a: int, b: int) -> bytes:
                return self._fs.cat_file(self._key, start=a, end=b)

        head = read(0, min(size, HEADER_GUESS)) if size else b""
        header = None
        try:
            (n,) = struct.unpack("<Q", head[:8])
            if 8 + n <= size:
                header = json.loads(head[8 : 8 + n] if 8 + n <= len(head) else read(8, 8 + n))
        except (struct.error, ValueError, UnicodeDecodeError):
            header = None
        if not isinstance(header, dict):
            raise CorruptCheckpoint(f"{self.path}: not a readable safetensors file (damaged header)")
        header.pop("__metadata__", None)
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        if 8 + n + end > size:
            raise CorruptCheckpoint(f"{self.path}: {size} bytes, its header says {8 + n + end} (truncated?)")
        self._header, self._base = header, 8 + n

    def tensor(self, name: str, spans: list[tuple[int, int]] | None = None) -> tuple[np.ndarray, str]:
        """(the tensor's values as a flat array of its raw type, its safetensors dtype); in an
        object store only `spans` (element ranges; None: all) are fetched."""
        try:
            info = self._header[name]
            dtype = info["dtype"]
            lo, hi = (int(v) for v in info["data_offsets"])
            item = np.dtype(_NUMPY[dtype]).itemsize
            count = (hi - lo) // item
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpoint(f"{self.path}: no tensor {name!r} (named by the checkpoint index)") from None
        if self._map is not None:
            return np.frombuffer(self._map, dtype=_NUMPY[dtype], count=count, offset=self._base + lo), dtype
        out = np.zeros(count, dtype=_NUMPY[dtype])
        ranges = _merge_spans(spans if spans is not None else [(0, count)], MERGE_GAP_BYTES // item)
        if not ranges:
            return out, dtype
        starts = [self._base + lo + a * item for a, _ in ranges]
        ends = [self._base + lo + b * item for _, b in ranges]
        got = self._fs.cat_ranges([self._key] * len(ranges), starts, ends, on_error="return")
        for (a, b), data in zip(ranges, got):
            if isinstance(data, FileNotFoundError):
                raise CorruptCheckpoint(f"{self.path}: missing (named by the checkpoint index)")
            if isinstance(data, BaseException):
                raise data
            if len(data) != (b - a) * item:
                raise CorruptCheckpoint(f"{self.path}: {name} is shorter than its header says (truncated?)")
            out[a:b] = np.frombuffer(data, dtype=out.dtype)
            self.bytes_fetched += len(data)
        return out, dtype


def _merge_spans(spans: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted element ranges, those closer than `gap` joined."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _tile_spans(reg: Region, rects_per_tile: list[list[Rect]]) -> list[tuple[int, int]]:
    """The element ranges of a stored piece that hold the given tiles (each rectangle: from
    its first value to its last, in the piece's row-major order)."""
    w, a = reg.box[3] - reg.box[2], reg.flat[0]
    return [(i0 * w + j0 - a, (i1 - 1) * w + j1 - a) for rects in rects_per_tile for i0, i1, j0, j1 in rects]


def _as_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return torch.from_numpy(np.ascontiguousarray(values)).view(torch.bfloat16).float().numpy()
    return values


def _intersect(a: tuple, b: tuple) -> tuple | None:
    """Two matrix rectangles (r0, r1, c0, c1): their overlap, or None."""
    r0, r1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r1 > r0 and c1 > c0 else None


def _to_matrix(reg: Region, rect: Rect) -> tuple[int, int, int, int]:
    return (reg.box[0] + rect[0], reg.box[0] + rect[1], reg.box[2] + rect[2], reg.box[2] + rect[3])


def _to_local(reg: Region, m: tuple) -> Rect:
    return (m[0] - reg.box[0], m[1] - reg.box[0], m[2] - reg.box[2], m[3] - reg.box[2])


class ShardedReader:
    """Reads slices of tensors from a sharded directory through its index, verifying every tile
    it touches; `bytes_read` counts the tensor bytes taken from the files (the whole of every
    tile touched: what is hashed).

    index: {"params": {name: {"shape", "pieces": [{"file", "box", "flat", "tiles"}]}}} where
    "tiles" rows are [tile row, tile col, checksum per key in `keys` order], of the hash
    `checksum` names (TILE_CHECKSUMS); `files` maps a key (None for the weight) to
    (sub-directory, tensor-name pattern with {name}).

    Files are memory-mapped: a piece's wanted values are copied straight from the page cache
    into the result, rectangle by rectangle, and each touched tile is hashed where it lies."""

    def __init__(self, root: str | os.PathLike, index: dict, files: dict, keys: list, checksum: str = TILE_CHECKSUM):
        # A URI (run.storage): the objects are read with ranged GETs of the tiles wanted only.
        self._objs = location(root, "checkpoint")
        self.root = below(root)
        self.params = index["params"]
        self.files = files
        self.keys = keys
        self.checksum = checksum
        self.bytes_read = 0
        self._open: dict[str, _SafetensorsFile] = {}

    def names(self) -> list[str]:
        return list(self.params)

    def shape(self, name: str) -> list[int]:
        return list(self.params[name]["shape"])

    def files_read(self) -> list[str]:
        """The files opened so far (paths under the root)."""
        return sorted(self._open)

    def close(self) -> None:
        self._open.clear()  # the maps close once no array refers to them

    @property
    def bytes_fetched(self) -> int:
        """Bytes taken from an object store (ranged GETs; 0 for local files)."""
        return sum(getattr(f, "bytes_fetched", 0) for f in self._open.values())

    def _file(self, rel: str) -> _SafetensorsFile:
        if rel not in self._open:
            self._open[rel] = _SafetensorsFile(self._objs, rel)
        return self._open[rel]

    def full(self, name: str, key: str | None = None) -> torch.Tensor:
        shape = self.shape(name)
        rows, cols = matrix_shape(shape)
        return self.read(name, key, Region.whole((0, rows, 0, cols))).reshape(shape)

    def read(self, name: str, key: str | None, target: Region, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values of `target` (a 1-D float32 tensor; padding positions are zero), written
        into `out` (a contiguous CPU float32 tensor of target.numel values) when given."""
        entry = self.params[name]
        rows, cols = matrix_shape(entry["shape"])
        sub, pattern = self.files[key]
        col = 2 + self.keys.index(key)
        bands = region_bands(target, rows, cols)
        if out is None:
            out = torch.zeros(target.numel, dtype=torch.float32)
        elif real_count(target, rows, cols) < target.numel:
            out.zero_()  # padding positions
        dest = out.detach().view(-1).numpy()
        wanted = [_to_matrix(target, r) for r in bands]
        rb, cs = _grid(rows, cols)
        for piece in entry["pieces"]:
            reg = Region.from_json(piece)
            held = [_to_matrix(reg, band) for band in region_bands(reg, rows, cols)]
            overlaps = [m for h in held for w in wanted if (m := _intersect(h, w))]
            if not overlaps:
                continue
            rel, tname = f"{sub}/{piece['file']}", pattern.format(name=name)
            tiles = _tile_rects(reg, rows, cols)
            hashes = {(int(t[0]), int(t[1])): t[col] for t in piece["tiles"]}
            touched = {
                (ti, tg)
                for r0, r1, c0, c1 in overlaps
                for ti in range(r0 // rb, (r1 - 1) // rb + 1)
                for tg in range(c0 // cs, (c1 - 1) // cs + 1)
            }
            touched = sorted(touched)
            # from an object store only the touched tiles travel
            data, dtype = self._file(rel).tensor(tname, _tile_spans(reg, [tiles[t] for t in touched]))
            if len(data) != reg.numel:
                raise CorruptCheckpoint(
                    f"{below(self.root, rel)}: {tname} has {len(data)} values, the index says {reg.numel}"
                )
            for tile, digest in zip(touched, _hash_tiles(data, reg, [tiles[t] for t in touched], self.checksum)):
                if hashes.get(tile) != digest:
                    raise CorruptCheckpoint(
                        f"{below(self.root, rel)}: {tname} (tile {tile[0]},{tile[1]}) fails its "
                        f"{self.checksum} checksum"
                    )
                self.bytes_read += data.itemsize * sum((i1 - i0) * (j1 - j0) for i0, i1, j0, j1 in tiles[tile])
            for m in overlaps:
                src = _as_float32(_rect_view(data, reg, _to_local(reg, m)), dtype)
                _rect_view(dest, target, _to_local(target, m))[...] = src
        return out
