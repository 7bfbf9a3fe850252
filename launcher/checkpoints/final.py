"""Final weights of a run: RUN_DIR/final/, read by `loomtrain generate`, `export`, `model.init_from`.

    model.safetensors                  the weights by loomtrain name (a tied output layer once), or,
    model-0000k-of-0000N.safetensors   written by several ranks, N files and
    model.safetensors.index.json       {"metadata": {"total_size"}, "weight_map": {name: file}}
    model_config.json                  the ModelConfig
    tokenizer/                         the tokenizer
    manifest.json                      {"files": {relpath: {"size", "sha256"}}}, written last

At the end of a run every rank writes its share (`save_final_sharded`: parameter i belongs
to rank i % world; its TP shards and ZeRO partitions are joined one parameter at a time and
streamed into the owner's file, so no rank holds more than one full parameter beyond its
own state). `write_final` writes the same layout from full tensors in memory (`loomtrain
import`, tests). Both run one protocol through storage.location's backend: on a disk into
final.tmp/, renamed into place; on object storage (`run.storage=s3://bucket/prefix`: final/ is
{run.storage}/final/, same layout) there is no rename: manifest.json is the commit point, so
final/ exists iff its manifest does. A writer first deletes an earlier manifest (the earlier
final/ is gone from then on) and the rest of the prefix, streams the files up (each rank its
own, as a multipart upload: nothing is staged on a disk), and writes the manifest last
(`loomtrain import` uploads a finished local final/ the same way: storage.upload_folder). Readers check the manifest's
sha256 (`verify_final`) before trusting a byte, and never unpickle anything.
A reader of a URI (`fetch_final`) downloads the manifest's files into a local cache folder per
URI and host (`weights_cache`), each checked against its size and sha256 as it streams in and
kept for the next reader while neither its manifest entry nor its object changed, and hands
that folder to the same readers as a local final/; a missing or damaged object is one line
naming it. Messages about the cached copy name the object instead (`naming_objects`).

Public for other writers/readers of final/: WEIGHTS, WEIGHTS_INDEX, MODEL_CONFIG,
TOKENIZER_DIR, FINAL_MANIFEST, final_location, write_final, save_final_sharded, verify_final,
broken, find_final_uri,
fetch_final, manifest_files, weights_cache, staging_folder, remember_copy, naming_objects, objects_named.
Read by launcher/checkpoints/weight_source.py (`open_source`, `load_final`), the one reader of
final/ and Hugging Face folders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import posixpath
from pathlib import Path

import torch
from loomtrain.durable import json_bytes
from loomtrain.launcher.checkpoints.ds_state import full_shape
from loomtrain.launcher.checkpoints.lora_final import final_params
from loomtrain.launcher.checkpoints.shards import SafetensorsWriter, write_safetensors
from loomtrain.launcher.distributed import all_gather_objects, current_rank, current_world_size
from loomtrain.parallel.plan import gather_shards, spec_of
from loomtrain.storage import (
    StorageError,
    download_verified,
    file_entry,
    first_line,
    join,
    location,
    read_object,
    sha256_file,
    store_failure,
)

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MODEL_CONFIG = "model_config.json"
TOKENIZER_DIR = "tokenizer"
FINAL_MANIFEST = "manifest.json"


def final_location(storage: str, run_dir: str | os.PathLike) -> Path | str:
    """Where a run's final weights go: {run.storage}/final when run.storage is set, else RUN_DIR/final."""
    return join(storage, "final") if storage else Path(run_dir) / "final"


def write_final(state: dict[str, torch.Tensor], model_cfg, tokenizer, out_dir: str | os.PathLike) -> Path | str:
    """The final directory from full tensors by loomtrain name (a tied output layer left out),
    by the protocol of save_final_sharded with one writer. `loomtrain import` writes through this."""
    store, stage, name = _stage(out_dir)
    _clear(store, stage)
    where, sink = store.child(stage).sink(WEIGHTS)
    entry = write_safetensors(where, {k: v.contiguous() for k, v in state.items()}, sink=sink)
    _publish(store, stage, name, [{"files": {WEIGHTS: entry}, "weight_map": {}, "owners": 1}], model_cfg, tokenizer)
    return store.name(name)


def _stage(out_dir: str | os.PathLike):
    """(the backend holding final/, the name it is written under, its name): on a disk final.tmp,
    renamed into place at the end; in an object store final/ itself (no rename: the manifest
    written last is the commit point)."""
    base, name = posixpath.split(str(out_dir).rstrip("/"))
    store = location(base or ".")
    return store, (f"{name}.tmp" if store.renames else name), name


def save_final_sharded(engine, topology, model_cfg, tokenizer, out_dir: str | os.PathLike) -> Path | str:
    """Every rank calls this at the end of a run; each writes the parameters it owns (i % world),
    joined from TP shards and ZeRO partitions one at a time and streamed into its file, in the
    training dtype (fp32 runs: the fp32 masters, bitwise). One protocol on a disk and in an object
    store (storage.location): rank 0 clears the stage (an earlier attempt, its manifest first);
    each rank streams its file into the stage (a file there, or a multipart upload: no folder is
    shared between hosts); rank 0 adds the index, config and tokenizer and the manifest last, and
    on a disk renames the stage into place (an older final/ goes then). A failure on any rank
    fails every rank with that rank's one line (no rank waits on a collective for it)."""
    store, stage, name = _stage(out_dir)
    at = store.child(stage)
    _on_rank0(lambda: _clear(store, stage))  # also the barrier: nothing is written before it
    part = _write_share(engine, topology, at)
    parts = all_gather_objects(part)
    failed = [p["error"] for p in parts if p.get("error")]
    if failed:
        raise FinalWeightsError(failed[0])
    _on_rank0(lambda: _publish(store, stage, name, parts, model_cfg, tokenizer))
    return store.name(name)


def _on_rank0(work) -> None:
    """`work()` on rank 0; its failure, in one line, raised on every rank (a collective)."""
    error = None
    if current_rank() == 0:
        try:
            work()
        except Exception as exc:  # told to every rank: none may wait on a collective for rank 0
            error = _failure(exc)
    error = all_gather_objects(error)[0]
    if error is not None:
        raise FinalWeightsError(error)


def _failure(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, (StorageError, FinalWeightsError)) else store_failure(exc) or first_line(exc)


def _clear(store, stage: str) -> None:
    store.delete(f"{stage}/{FINAL_MANIFEST}")  # first: a reader finds no final/ from here on
    store.delete_tree(stage)
    store.make_folder(stage)


def _publish(store, stage: str, name: str, parts: list[dict], model_cfg, tokenizer) -> None:
    """Rank 0: the small files, the manifest last (the commit point), then a disk's rename."""
    at = store.child(stage)
    files = {rel: entry for part in parts for rel, entry in part["files"].items()}  # every rank's weight file
    stored = at.sizes()
    for rel, info in sorted(files.items()):  # every rank's file is where rank 0 publishes
        if stored.get(rel) != info["size"]:
            raise StorageError(
                f"{at.name(rel)}: {stored.get(rel, 'no')} bytes stored, {info['size']} written (ranks on "
                "several hosts write final/ into one folder only on a filesystem they share: set run.storage)"
            )
    if parts[0]["owners"] != 1:  # several weight files: the index names each tensor's
        weight_map = {n: rel for part in parts for n, rel in part["weight_map"].items()}
        sizes = {f: files[f]["size"] for f in set(weight_map.values())}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        files[WEIGHTS_INDEX] = _write(at, WEIGHTS_INDEX, json_bytes(index))
    files[MODEL_CONFIG] = _write(
        at, MODEL_CONFIG, (json.dumps(dataclasses.asdict(model_cfg), indent=2) + "\n").encode()
    )
    files.update(at.write_folder(TOKENIZER_DIR, lambda folder: tokenizer.save(Path(folder))))
    at.sync()
    at.write(FINAL_MANIFEST, json_bytes({"files": files}))
    if store.renames:
        store.rename(stage, name)


def _write(at, rel: str, data: bytes) -> dict:
    at.write(rel, data)
    return file_entry(data)


def _write_share(engine, topology, at) -> dict:
    """This rank's parameters (i % world) streamed into its file at `at` (a collective: every rank
    joins each parameter's gather, a rank whose write failed too) -> {"files": {name: manifest
    entry}, "weight_map", "owners", "error": the failure in one line, or None}."""
    rank, world = current_rank(), current_world_size()
    params, read = final_params(engine)  # LoRA: the whole model, adapted weights merged
    owners = min(world, len(params))
    name = WEIGHTS if owners == 1 else f"model-{rank + 1:05d}-of-{owners:05d}.safetensors"
    mine = [(n, p) for i, (n, p) in enumerate(params) if i % world == rank]
    writer, sink, error = None, None, None

    def cannot(exc: BaseException) -> str:
        return f"{at.name(name)}: cannot write it ({_failure(exc)})"

    try:
        if mine:
            where, sink = at.sink(name)
            writer = SafetensorsWriter(where, [(n, p.dtype, full_shape(p)) for n, p in mine], sink=sink)
    except Exception as exc:
        error = cannot(exc)
    for i, (n, p) in enumerate(params):
        full = gather_shards(read(n, p), spec_of(p), topology)  # collective
        if writer is not None and error is None and i % world == rank:
            try:
                writer.write(n, full.to(p.dtype).reshape(full_shape(p)))
            except Exception as exc:  # a full disk, a refused upload: every rank is told after the loop
                error = cannot(exc)
        del full
    entry = None
    if writer is not None and error is None:
        try:
            entry = writer.close()
        except Exception as exc:
            error = cannot(exc)
    if error is not None and sink is not None:
        with contextlib.suppress(Exception):
            sink.abort()
    return {
        "files": {name: entry} if entry else {},
        "weight_map": {n: name for n, _ in mine},
        "owners": owners,
        "error": error,
    }


class FinalWeightsError(ValueError):
    """RUN_DIR/final is missing a file or holds a corrupt one (one line naming it)."""


def broken(path: Path, name: str, why: str) -> FinalWeightsError:
    return FinalWeightsError(
        f"{path / name}: {why}: the final weights are incomplete or corrupt; run the same "
        "`loomtrain train` command again to rewrite final/ from the newest checkpoint"
    )


def verify_final(final_dir: str | os.PathLike) -> None:
    """Check every file manifest.json lists (present, size, sha256); FinalWeightsError names the
    first bad one. A final/ from before manifests existed has none and is taken as it is."""
    path = Path(final_dir)
    mpath = path / FINAL_MANIFEST
    if not mpath.exists():
        return
    try:
        files = json.loads(mpath.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise broken(path, FINAL_MANIFEST, f"unreadable ({exc})") from None
    for rel, info in sorted(files.items()):
        p = path / rel
        if not p.is_file():
            raise broken(path, rel, "missing")
        if p.stat().st_size != info["size"]:
            raise broken(path, rel, f"{p.stat().st_size} bytes, the manifest says {info['size']}")
        if sha256_file(p) != info["sha256"]:
            raise broken(path, rel, "fails its sha256 checksum")


# Final weights at a URI, read through a local cache ---------------------------------------------
_CACHED: dict[str, str] = {}  # cache folder -> the URI it holds (for naming_objects)


def _cache_base() -> Path:
    """This host's loomtrain cache: $XDG_CACHE_HOME/loomtrain (~/.cache/loomtrain when unset)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")) / "loomtrain"


def weights_cache(uri: str) -> Path:
    """This host's copy of the objects under `uri`: CACHE/objects/HASH, one folder per URI,
    shared by the processes of the host."""
    uri = uri.rstrip("/")
    folder = _cache_base() / "objects" / hashlib.sha256(uri.encode()).hexdigest()[:24]
    _CACHED[str(folder)] = uri
    return folder


def staging_folder() -> Path:
    """Where `export` and `import` write what they then upload to a URI (CACHE/staging)."""
    folder = _cache_base() / "staging"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def remember_copy(folder: str | os.PathLike, uri: str) -> None:
    """Name `folder` (a local copy of objects) as `uri` in messages (objects_named)."""
    _CACHED[str(folder)] = uri.rstrip("/")


def objects_named(text: str) -> str:
    """`text` with every cache folder of this process replaced by the URI it holds."""
    for folder, uri in _CACHED.items():
        text = text.replace(folder, uri)
    return text


@contextlib.contextmanager
def naming_objects():
    """An error raised inside whose message names a cached copy names the object instead (the
    same exception type), so that a reader's one line points at what the user gave."""
    try:
        yield
    except (ValueError, OSError) as exc:
        text = str(exc)
        named = objects_named(text)
        if named == text:
            raise
        try:
            renamed = type(exc)(named)
        except Exception:  # an exception type that takes other arguments
            renamed = ValueError(named)
        raise renamed from None


def find_final_uri(uri: str) -> tuple[str, bytes] | None:
    """(the final/ URI, its manifest's bytes) for `uri` naming a final/ or a run's storage
    holding one; None when neither has a manifest (no final weights: none committed)."""
    uri = uri.rstrip("/")
    for candidate in (uri, join(uri, "final")):
        raw = read_object(join(candidate, FINAL_MANIFEST))
        if raw is not None:
            return candidate, raw
    return None


def fetch_final(uri: str, found: tuple[str, bytes] | None = None) -> Path:
    """The final/ weights at `uri` (a final/ or a run's storage) as a local folder of this host's
    cache, every file checked against the manifest; FinalWeightsError naming a missing or
    damaged object. `found`: find_final_uri(uri), when the caller has read it already."""
    found = found or find_final_uri(uri)
    if found is None:
        raise FinalWeightsError(
            f"{uri}: no {FINAL_MANIFEST} there or under {uri.rstrip('/')}/final/ (final weights on object "
            f"storage exist once their manifest is written: did the run finish, or was its upload cut short?)"
        )
    final_uri, raw = found
    files = manifest_files(final_uri, raw)
    try:
        return download_verified(final_uri, weights_cache(final_uri), files, written={FINAL_MANIFEST: raw})
    except StorageError as exc:
        raise FinalWeightsError(f"{exc}; the final weights at {final_uri} are incomplete or damaged") from None


def manifest_files(final_uri: str, raw: bytes) -> dict[str, dict]:
    """manifest.json's {relpath: {"size", "sha256"}}, or FinalWeightsError naming it."""
    try:
        files = json.loads(raw)["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise ValueError("expected {relpath: {size, sha256}} under 'files'")
    except (ValueError, KeyError, TypeError) as exc:
        raise FinalWeightsError(
            f"{join(final_uri, FINAL_MANIFEST)}: unreadable ({str(exc).splitlines()[0] if str(exc) else exc!r})"
        ) from None
    return files
