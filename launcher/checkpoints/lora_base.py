"""Which base model a LoRA run's adapters belong to, recorded in every checkpoint.

A LoRA checkpoint holds only what trains -- the adapters, their Adam moments, the data
position, RNG and counters (parts.py saves `requires_grad` parameters only) -- so a resume
rebuilds the frozen base from where it came from (model.init_from, or the seeded init) and
must find the same one. `base_reference(cfg)` names it and takes a checksum:

    model.init_from set   "init_from": the path / id / URI as given; "sha256": over the sha256 of
                          every *.safetensors file of the resolved folder (a run's final/ reuses
                          its manifest's sums; others are hashed once, on rank 0, at start-up)
    seeded init           "init_from": ""; "sha256": over the model config (LoRA fields aside)
                          and train.seed, which decide the init bit for bit

`LoraBase` (a checkpoint part, parts.PARTS) writes it to trainer.json["lora_base"] and, at a
resume, refuses a checkpoint whose base differs, in one line naming both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from loomtrain.launcher.checkpoints.final import FINAL_MANIFEST, MODEL_CONFIG
from loomtrain.launcher.distributed import broadcast_str, current_rank
from loomtrain.storage import sha256_file

KEY = "lora_base"


def _folder(init_from: str) -> Path:
    from loomtrain.launcher.checkpoints.weight_source import weights_folder

    path = weights_folder(init_from)  # the folder the weights load from (weight_source._open_folder's rule)
    return next((d for d in (path, path / "final") if (d / MODEL_CONFIG).is_file()), path)


def _weights_sha256(folder: Path) -> str:
    manifest = folder / FINAL_MANIFEST
    known = json.loads(manifest.read_text())["files"] if manifest.is_file() else {}
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        entry = known.get(f.name)
        h.update(f"{f.name}:{entry['sha256'] if entry else sha256_file(f)}\n".encode())
    return h.hexdigest()


def compute_reference(m, seed: int) -> dict:
    """{"init_from", "sha256"} of the base of a model config `m` trained from `seed` (reads the
    base's files when init_from is set)."""
    if m.init_from:
        folder = _folder(m.init_from)
        if not folder.is_dir():
            raise ValueError(f"model.init_from={m.init_from}: the LoRA base is not there ({folder}: no such folder)")
        return {"init_from": m.init_from, "sha256": _weights_sha256(folder)}
    shape = {k: v for k, v in dataclasses.asdict(m).items() if k not in ("lora", "init_from")}
    text = json.dumps({"model": shape, "seed": seed}, sort_keys=True, default=str)
    return {"init_from": "", "sha256": hashlib.sha256(text.encode()).hexdigest()}


def base_reference(cfg) -> dict:
    """compute_reference on rank 0, the same dict on every rank (a collective)."""
    mine = json.dumps(compute_reference(cfg.model, cfg.train.seed)) if current_rank() == 0 else None
    return json.loads(broadcast_str(mine))


def _named(ref: dict) -> str:
    where = f"model.init_from={ref['init_from']}" if ref.get("init_from") else "the seeded init"
    return f"{where} (sha256 {ref.get('sha256', '?')[:12]})"


class LoraBase:
    """trainer.json["lora_base"]: the base the adapters were trained on (the model's
    `lora_base` attribute, set where the adapters are applied); a resume onto another base is
    refused with a ValueError, which the checkpoint hook reports in one line."""

    def take(self, training, snap, copy: bool) -> None:
        ref = getattr(training.engine.module, KEY, None)
        if snap.trainer is not None and ref is not None:
            snap.trainer[KEY] = ref

    def put(self, training, ckpt) -> None:
        ref = getattr(training.engine.module, KEY, None)
        saved = ckpt.trainer.get(KEY)
        if ref is None and saved is None:
            return
        if ref is None:
            raise ValueError(
                f"the checkpoint holds LoRA adapters for {_named(saved)}; set model.lora.rank to resume it"
            )
        if saved is None:
            raise ValueError("the checkpoint holds no LoRA adapters (a full fine-tuning run); set model.lora.rank=0")
        if saved.get("sha256") != ref.get("sha256"):
            raise ValueError(f"its LoRA adapters were trained on {_named(saved)}, not on this run's base {_named(ref)}")
