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

Public for other writers/readers of final/: WEIGHTS, WEIGHTS_INDEX, MODEL_CONFIG,
TOKENIZER_DIR, FINAL_MANIFEST, write_final, save_final_sharded, verify_final,
final_weight_files, read_final_state, load_final.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from loomtrain.data_pipeline import load_tokenizer
from loomtrain.durable import replace_dir, write_durable, write_json_durable
from loomtrain.launcher.checkpoints.ds_state import full_shape, named_params, read_local
from loomtrain.launcher.checkpoints.shards import SafetensorsWriter, write_safetensors
from loomtrain.launcher.checkpoints.store import sha256_file
from loomtrain.launcher.distributed import barrier, current_rank, current_world_size
from loomtrain.model import ModelConfig, Transformer
from loomtrain.parallel.plan import gather_shards, spec_of
from safetensors import SafetensorError, safe_open

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MODEL_CONFIG = "model_config.json"
TOKENIZER_DIR = "tokenizer"
FINAL_MANIFEST = "manifest.json"
_PARTS = ".parts"


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
    shutil.rmtree(tmp / _PARTS, ignore_errors=True)
    write_json_durable(tmp / FINAL_MANIFEST, {"files": files})
    return replace_dir(tmp, out_dir)


def save_final_sharded(engine, topology, model_cfg, tokenizer, out_dir: str | os.PathLike) -> Path:
    """Every rank calls this at the end of a run; each writes the parameters it owns (i % world),
    joined from TP shards and ZeRO partitions one at a time and streamed into its file, in the
    training dtype (fp32 runs: the fp32 masters, bitwise). Rank 0 adds the index, config,
    tokenizer and manifest and renames the directory into place."""
    out_dir = Path(out_dir)
    rank, world = current_rank(), current_world_size()
    tmp = _begin(out_dir) if rank == 0 else out_dir.with_name(out_dir.name + ".tmp")
    barrier()
    params = named_params(engine)
    owners = min(world, len(params))
    name = WEIGHTS if owners == 1 else f"model-{rank + 1:05d}-of-{owners:05d}.safetensors"
    mine = [(n, p) for i, (n, p) in enumerate(params) if i % world == rank]
    writer = SafetensorsWriter(tmp / name, [(n, p.dtype, full_shape(p)) for n, p in mine]) if mine else None
    for i, (n, p) in enumerate(params):
        full = gather_shards(read_local(engine, p, None), spec_of(p), topology)  # collective
        if writer is not None and i % world == rank:
            writer.write(n, full.to(p.dtype).reshape(full_shape(p)))
        del full
    part = {"files": {name: writer.close()} if writer else {}, "weight_map": {n: name for n, _ in mine}}
    write_json_durable(tmp / _PARTS / f"rank_{rank:05d}.json", part)
    barrier()
    if rank == 0:
        files, weight_map = {}, {}
        for r in range(world):
            got = json.loads((tmp / _PARTS / f"rank_{r:05d}.json").read_text())
            files.update(got["files"])
            weight_map.update(got["weight_map"])
        _finish(tmp, out_dir, files, model_cfg, tokenizer, weight_map=None if owners == 1 else weight_map)
    barrier()
    return out_dir


class FinalWeightsError(ValueError):
    """RUN_DIR/final is missing a file or holds a corrupt one (one line naming it)."""


def _final_dir(run_or_final_dir: str | os.PathLike) -> Path:
    path = Path(run_or_final_dir)
    if not path.exists():
        raise FileNotFoundError(f"no such run directory: {run_or_final_dir}")
    if (path / WEIGHTS).exists() or (path / WEIGHTS_INDEX).exists() or (path / MODEL_CONFIG).exists():
        return path
    if not (path / "final").is_dir():
        raise FileNotFoundError(f"no final/ directory in {run_or_final_dir} (did the run finish?)")
    return path / "final"


def _broken(path: Path, name: str, why: str) -> FinalWeightsError:
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
        raise _broken(path, FINAL_MANIFEST, f"unreadable ({exc})") from None
    for rel, info in sorted(files.items()):
        p = path / rel
        if not p.is_file():
            raise _broken(path, rel, "missing")
        if p.stat().st_size != info["size"]:
            raise _broken(path, rel, f"{p.stat().st_size} bytes, the manifest says {info['size']}")
        if sha256_file(p) != info["sha256"]:
            raise _broken(path, rel, "fails its sha256 checksum")


def final_weight_files(final_dir: str | os.PathLike) -> dict[str, Path]:
    """loomtrain tensor name -> the file in final/ holding it (one file, or an index's shards)."""
    path = Path(final_dir)
    if (path / WEIGHTS_INDEX).is_file():
        try:
            weight_map = json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _broken(path, WEIGHTS_INDEX, f"unreadable ({exc})") from None
        return {k: path / f for k, f in weight_map.items()}
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        return {k: path / WEIGHTS for k in f.keys()}


def read_final_state(final_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All of final/'s tensors by loomtrain name (for a model in this process)."""
    by_file: dict[Path, list[str]] = {}
    for k, f in final_weight_files(final_dir).items():
        by_file.setdefault(f, []).append(k)
    out = {}
    for f, keys in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            for k in keys:
                out[k] = h.get_tensor(k)
    return out


def load_final(run_or_final_dir: str | os.PathLike, device: str | torch.device = "cpu"):
    """-> (Transformer, tokenizer) from RUN_DIR (or RUN_DIR/final).

    A missing or corrupt file raises FinalWeightsError naming it (a run killed while
    an older loomtrain wrote final/, a copy cut short, a disk error), never a
    safetensors / JSON traceback."""
    path = _final_dir(run_or_final_dir)
    weights_name = WEIGHTS_INDEX if (path / WEIGHTS_INDEX).exists() else WEIGHTS
    for name in (weights_name, MODEL_CONFIG, TOKENIZER_DIR):
        if not (path / name).exists():
            raise _broken(path, name, "missing")
    verify_final(path)
    try:
        model_cfg = ModelConfig(**json.loads((path / MODEL_CONFIG).read_text()))
    except (OSError, ValueError, TypeError) as exc:  # unreadable, not JSON, unknown keys, bad values
        raise _broken(
            path, MODEL_CONFIG, f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    model = Transformer(model_cfg)
    try:
        state = read_final_state(path)
        dtype = next(iter(state.values())).dtype  # bf16 runs save bf16 weights
        if dtype in (torch.bfloat16, torch.float16):
            model = model.to(dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = ["lm_head.weight"] if model_cfg.tie_embeddings else []
        if unexpected or sorted(missing) != tied:
            raise RuntimeError(
                f"tensors do not match model_config.json: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
    except (SafetensorError, OSError, StopIteration, RuntimeError) as exc:
        # RuntimeError: tensors missing or of another shape than model_config.json says.
        raise _broken(
            path, weights_name, f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    model.reset_buffers()
    try:
        tokenizer = load_tokenizer(str(path / TOKENIZER_DIR))
    except Exception as exc:  # the tokenizers library raises its own types
        raise _broken(
            path, TOKENIZER_DIR, f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    return model.to(device).eval(), tokenizer
