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
import`, tests). Both write into a temp directory renamed into place. Readers check the
manifest's sha256 (`verify_final`) before trusting a byte, and never unpickle anything.

On object storage (`run.storage=s3://bucket/prefix`: final/ is {run.storage}/final/, same
layout) there is no rename: manifest.json is the commit point, so final/ exists iff its
manifest does. A writer first deletes an earlier manifest (the earlier final/ is gone from
then on) and the rest of the prefix, uploads the files (each rank its own, from a local
staging folder under run.dir), and writes the manifest last (`retract_final`, `publish_final`).
A reader of a URI (`fetch_final`) downloads the manifest's files into a local cache folder per
URI and host (`weights_cache`), each checked against its size and sha256 as it streams in and
kept for the next reader while neither its manifest entry nor its object changed, and hands
that folder to the same readers as a local final/; a missing or damaged object is one line
naming it. Messages about the cached copy name the object instead (`naming_objects`).

Public for other writers/readers of final/: WEIGHTS, WEIGHTS_INDEX, MODEL_CONFIG,
TOKENIZER_DIR, FINAL_MANIFEST, final_location, write_final, save_final_sharded, publish_final,
retract_final, verify_final, broken, find_final_uri,
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
import shutil
from pathlib import Path

import torch
from loomtrain.durable import json_bytes, replace_dir, write_durable, write_json_durable
from loomtrain.launcher.checkpoints.ds_state import full_shape
from loomtrain.launcher.checkpoints.lora_final import final_params
from loomtrain.launcher.checkpoints.shards import SafetensorsWriter, write_safetensors
from loomtrain.launcher.distributed import all_gather_objects, barrier, current_rank, current_world_size
from loomtrain.parallel.plan import gather_shards, spec_of
from loomtrain.storage import (
    StorageError,
    delete_objects,
    download_verified,
    is_uri,
    join,
    read_object,
    sha256_file,
    upload_files,
    write_object,
)

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MODEL_CONFIG = "model_config.json"
TOKENIZER_DIR = "tokenizer"
FINAL_MANIFEST = "manifest.json"
_PARTS = ".parts"
# Each rank's local staging folder for an upload of final/ to object storage, under run.dir.
UPLOAD_STAGING = ".tmp-final-upload"


def final_location(storage: str, run_dir: str | os.PathLike) -> Path | str:
    """Where a run's final weights go: {run.storage}/final when run.storage is set, else RUN_DIR/final."""
    return join(storage, "final") if storage else Path(run_dir) / "final"


def save_final(model: torch.nn.Module, model_cfg, tokenizer, out_dir: str | os.PathLike) -> Path:
    """The final directory from a whole model in this process (a tied table stored once)."""
    # Copies, not the live tensors: at ZeRO 1-2 every parameter is a view into DeepSpeed's
    # flat buffer. A tied table is stored once.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.tok_emb.weight:
        state.pop("lm_head.weight")
    return write_final(state, model_cfg, tokenizer, out_dir)


def write_final(state: dict[str, torch.Tensor], model_cfg, tokenizer, out_dir: str | os.PathLike) -> Path:
    """The final directory from full tensors by loomtrain name (a tied output layer left out),
    atomically (temp dir, then rename). `loomtrain import` writes through this too."""
    tmp = _begin(Path(out_dir))
    files = {WEIGHTS: write_safetensors(tmp / WEIGHTS, {k: v.contiguous() for k, v in state.items()})}
    return _finish(tmp, Path(out_dir), files, model_cfg, tokenizer, weight_map=None)


def _begin(out_dir: Path) -> Path:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, out_dir: Path, files: dict, model_cfg, tokenizer, weight_map: dict | None) -> Path:
    """Rank 0: the small files, the manifest last, then the rename (an older final/ goes)."""
    _small_files(tmp, files, model_cfg, tokenizer, weight_map)
    shutil.rmtree(tmp / _PARTS, ignore_errors=True)
    write_json_durable(tmp / FINAL_MANIFEST, {"files": files})
    return replace_dir(tmp, out_dir)


def _small_files(tmp: Path, files: dict, model_cfg, tokenizer, weight_map: dict | None) -> None:
    """The index (several weight files), model_config.json and tokenizer/ into `tmp`; their
    manifest entries added to `files` (which holds the weight files' already)."""
    if weight_map is not None:
        sizes = {f: files[f]["size"] for f in set(weight_map.values())}
        write_json_durable(
            tmp / WEIGHTS_INDEX, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        )
    write_durable(tmp / MODEL_CONFIG, json.dumps(dataclasses.asdict(model_cfg), indent=2) + "\n")
    tokenizer.save(tmp / TOKENIZER_DIR)
    for p in sorted(tmp.rglob("*")):
        rel = str(p.relative_to(tmp))
        if p.is_file() and rel not in files and _PARTS not in p.relative_to(tmp).parts:
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}  # small files


def save_final_sharded(
    engine, topology, model_cfg, tokenizer, out_dir: str | os.PathLike, staging: str | os.PathLike | None = None
) -> Path | str:
    """Every rank calls this at the end of a run; each writes the parameters it owns (i % world),
    joined from TP shards and ZeRO partitions one at a time and streamed into its file, in the
    training dtype (fp32 runs: the fp32 masters, bitwise). Rank 0 adds the index, config,
    tokenizer and manifest and renames the directory into place.

    `out_dir` a URI ({run.storage}/final): each rank writes its file into its own folder under
    `staging` (a local folder: run.dir) and uploads it; no folder is shared (`_save_final_to_uri`)."""
    if is_uri(out_dir):
        if staging is None:
            raise ValueError(f"final weights to {out_dir}: a local staging folder is needed")
        return _save_final_to_uri(engine, topology, model_cfg, tokenizer, str(out_dir), Path(staging))
    out_dir = Path(out_dir)
    rank, world = current_rank(), current_world_size()
    tmp = _begin(out_dir) if rank == 0 else out_dir.with_name(out_dir.name + ".tmp")
    barrier()
    part = _write_share(engine, topology, tmp)
    write_json_durable(tmp / _PARTS / f"rank_{rank:05d}.json", part)
    barrier()
    if rank == 0:
        parts = [json.loads((tmp / _PARTS / f"rank_{r:05d}.json").read_text()) for r in range(world)]
        files, weight_map = _merged(parts)
        _finish(tmp, out_dir, files, model_cfg, tokenizer, weight_map)
    barrier()
    return out_dir


def _write_share(engine, topology, folder: Path) -> dict:
    """This rank's parameters (i % world) into its file in `folder` (a collective: every rank
    joins each parameter's gather); -> {"files": {name: manifest entry}, "weight_map", "owners"}."""
    rank, world = current_rank(), current_world_size()
    params, read = final_params(engine)  # LoRA: the whole model, adapted weights merged
    owners = min(world, len(params))
    name = WEIGHTS if owners == 1 else f"model-{rank + 1:05d}-of-{owners:05d}.safetensors"
    mine = [(n, p) for i, (n, p) in enumerate(params) if i % world == rank]
    writer = SafetensorsWriter(folder / name, [(n, p.dtype, full_shape(p)) for n, p in mine]) if mine else None
    for i, (n, p) in enumerate(params):
        full = gather_shards(read(n, p), spec_of(p), topology)  # collective
        if writer is not None and i % world == rank:
            writer.write(n, full.to(p.dtype).reshape(full_shape(p)))
        del full
    return {
        "files": {name: writer.close()} if writer else {},
        "weight_map": {n: name for n, _ in mine},
        "owners": owners,
    }


def _merged(parts: list[dict]) -> tuple[dict, dict | None]:
    """(manifest entries of every rank's weight file, the index's weight_map or None for one file)."""
    files, weight_map = {}, {}
    for got in parts:
        files.update(got["files"])
        weight_map.update(got["weight_map"])
    return files, (None if parts[0]["owners"] == 1 else weight_map)


def _save_final_to_uri(engine, topology, model_cfg, tokenizer, uri: str, staging: Path) -> str:
    """final/ on object storage: rank 0 retracts an earlier one (its manifest first); each rank
    writes its file into staging/UPLOAD_STAGING/rank_N and uploads it; rank 0 adds the small
    files and writes the manifest last, once every rank's file is up. An upload that fails on
    any rank fails every rank with that rank's one line (no rank waits on a collective for it)."""
    rank = current_rank()
    mine = staging / UPLOAD_STAGING / f"rank_{rank:05d}"
    shutil.rmtree(mine, ignore_errors=True)
    mine.mkdir(parents=True)
    error = None
    if rank == 0:
        try:
            retract_final(uri)
        except StorageError as exc:
            error = str(exc)
    retracted = all_gather_objects(error)[0]  # also the barrier: nothing is uploaded before the retraction
    if retracted is not None:
        _remove_staging(mine)
        raise FinalWeightsError(retracted)
    part = _write_share(engine, topology, mine)
    try:
        upload_files(mine, sorted(part["files"]), uri)
    except StorageError as exc:
        part["error"] = str(exc)
    parts = all_gather_objects(part)
    failed = [p["error"] for p in parts if p.get("error")]
    if failed:
        _remove_staging(mine)
        raise FinalWeightsError(failed[0])
    error = None
    if rank == 0:
        files, weight_map = _merged(parts)
        own = set(files)
        try:
            _small_files(mine, files, model_cfg, tokenizer, weight_map)
            upload_files(mine, sorted(set(files) - own), uri)
            write_object(join(uri, FINAL_MANIFEST), json_bytes({"files": files}))  # the commit point, last
        except StorageError as exc:
            error = str(exc)
    errors = all_gather_objects(error)
    _remove_staging(mine)
    if errors[0] is not None:
        raise FinalWeightsError(errors[0])
    return uri


def _remove_staging(mine: Path) -> None:
    """This rank's staging folder, and their parent once the last rank of the host left it."""
    shutil.rmtree(mine, ignore_errors=True)
    with contextlib.suppress(OSError):
        mine.parent.rmdir()


def retract_final(uri: str) -> None:
    """Make a final/ at `uri` invisible (its manifest goes first: a reader then finds none),
    then remove what else is under the prefix, so no stale shard outlives it."""
    delete_objects(uri, [FINAL_MANIFEST])
    delete_objects(uri)


def publish_final(local_final: str | os.PathLike, uri: str) -> str:
    """A finished local final/ (with its manifest) onto object storage at `uri`: an earlier
    one retracted, the files uploaded several at a time, the manifest last."""
    local_final = Path(local_final)
    files = json.loads((local_final / FINAL_MANIFEST).read_text())["files"]
    retract_final(uri)
    upload_files(local_final, sorted(files), uri)
    write_object(join(uri, FINAL_MANIFEST), (local_final / FINAL_MANIFEST).read_bytes())
    return uri


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


def no_final_at(uri: str) -> FinalWeightsError:
    return FinalWeightsError(
        f"{uri}: no {FINAL_MANIFEST} there or under {uri.rstrip('/')}/final/ (final weights on object "
        f"storage exist once their manifest is written: did the run finish, or was its upload cut short?)"
    )


def fetch_final(uri: str) -> Path:
    """The final/ weights at `uri` (a final/ or a run's storage) as a local folder of this host's
    cache, every file checked against the manifest; FinalWeightsError naming a missing or
    damaged object."""
    found = find_final_uri(uri)
    if found is None:
        raise no_final_at(uri)
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
