"""Final weights of a run: RUN_DIR/final/{model.safetensors, model_config.json, tokenizer}.

Written at the end of training by the loop, read by `loomtrain generate`. Loading
never unpickles anything (safetensors + JSON).

Seam (issue 7): `full_model_for_export` returns a module holding the full,
unsharded weights. Today that is the engine's own module when tp == 1 and ZeRO
stage < 3; consolidating TP shards and ZeRO-3 partitions goes there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_file

WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"
TOKENIZER_DIR = "tokenizer"


class NotConsolidated(NotImplementedError):
    """Full weights are not available from this rank layout (yet)."""


def full_model_for_export(ctx) -> torch.nn.Module:
    """The unsharded model (every rank calls this; only the logging rank writes).

    At tp > 1 or ZeRO-3 the fp32 masters are gathered (TP shards joined, vocabulary
    unpadded, ZeRO partitions collected) into a fresh full model on the logging rank;
    the other ranks get their own shard back (they do not write)."""
    if ctx.topology.tp_size == 1 and ctx.cfg.parallel.zero_stage != 3:
        return ctx.model
    from loomtrain.launcher.checkpoints.state import consolidated_weights
    from loomtrain.model import Transformer

    full = consolidated_weights(ctx.engine, ctx.topology, dst=0)
    if full is None:
        return ctx.model
    model = Transformer(ctx.cfg.model)
    missing, unexpected = model.load_state_dict(full, strict=False)
    tied = ["lm_head.weight"] if ctx.cfg.model.tie_embeddings else []
    if unexpected or sorted(missing) != tied:
        raise NotConsolidated(f"consolidated weights do not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def save_final(model: torch.nn.Module, model_cfg, tokenizer, out_dir: str | os.PathLike) -> Path:
    """Write the final directory atomically (temp dir, then rename)."""
    # Copies, not the live tensors: at ZeRO 1-2 every parameter is a view into DeepSpeed's
    # flat buffer, which safetensors refuses to write. A tied table is stored once.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.tok_emb.weight:
        state.pop("lm_head.weight")
    return write_final(state, model_cfg, tokenizer, out_dir)


def write_final(state: dict[str, torch.Tensor], model_cfg, tokenizer, out_dir: str | os.PathLike) -> Path:
    """The final directory from full tensors by loomtrain name (a tied output layer left out),
    atomically (temp dir, then rename). `loomtrain import` writes through this too."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS))
    (tmp / MODEL_CONFIG).write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2) + "\n")
    tokenizer.save(tmp / TOKENIZER_DIR)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


class FinalWeightsError(ValueError):
    """RUN_DIR/final is missing a file or holds a corrupt one (one line naming it)."""


def _final_dir(run_or_final_dir: str | os.PathLike) -> Path:
    path = Path(run_or_final_dir)
    if not path.exists():
        raise FileNotFoundError(f"no such run directory: {run_or_final_dir}")
    if (path / WEIGHTS).exists() or (path / MODEL_CONFIG).exists():
        return path
    if not (path / "final").is_dir():
        raise FileNotFoundError(f"no final/ directory in {run_or_final_dir} (did the run finish?)")
    return path / "final"


def load_final(run_or_final_dir: str | os.PathLike, device: str | torch.device = "cpu"):
    """-> (Transformer, tokenizer) from RUN_DIR (or RUN_DIR/final).

    A missing or corrupt file raises FinalWeightsError naming it (a run killed while
    an older loomtrain wrote final/, a copy cut short, a disk error), never a
    safetensors / JSON traceback."""
    from safetensors import SafetensorError, safe_open

    from loomtrain.data_pipeline import load_tokenizer
    from loomtrain.model import ModelConfig, Transformer

    path = _final_dir(run_or_final_dir)
    def broken(name: str, why: str) -> FinalWeightsError:
        return FinalWeightsError(
            f"{path / name}: {why}: the final weights are incomplete or corrupt; run the same "
            "`loomtrain train` command again to rewrite final/ from the newest checkpoint")

    for name in (WEIGHTS, MODEL_CONFIG, TOKENIZER_DIR):
        if not (path / name).exists():
            raise broken(name, "missing")
    try:
        model_cfg = ModelConfig(**json.loads((path / MODEL_CONFIG).read_text()))
    except (OSError, ValueError, TypeError) as exc:  # unreadable, not JSON, unknown keys, bad values
        raise broken(MODEL_CONFIG, f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    model = Transformer(model_cfg)
    try:
        # Match the saved dtype (bf16 runs save bf16 weights).
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            dtype = f.get_slice(next(iter(f.keys()))).get_dtype()
        if dtype in ("BF16", "F16"):
            model = model.to(torch.bfloat16 if dtype == "BF16" else torch.float16)
        load_model(model, str(path / WEIGHTS), device=str(device))
    except (SafetensorError, OSError, StopIteration, RuntimeError) as exc:
        # RuntimeError: tensors missing or of another shape than model_config.json says.
        raise broken(WEIGHTS, f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    model.reset_buffers()
    try:
        tokenizer = load_tokenizer(str(path / TOKENIZER_DIR))
    except Exception as exc:  # the tokenizers library raises its own types
        raise broken(TOKENIZER_DIR, f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return model.to(device).eval(), tokenizer
