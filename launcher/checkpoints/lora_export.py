"""`loomtrain export RUN --format peft --output DIR`: a LoRA run's adapters as a PEFT adapter folder.

    adapter_config.json          peft's LoraConfig: r, lora_alpha, lora_dropout, target_modules
                                 (Hugging Face module names: q_proj, ..., down_proj),
                                 base_model_name_or_path (the run's model.init_from)
    adapter_model.safetensors    base_model.model.<HF module>.lora_A.weight [r, in] and
                                 .lora_B.weight [out, r] per adapted layer

`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)` computes what
the run computed: peft's scale is lora_alpha / r, as loomtrain's. The HF module names are the
export's own maps (hf_families.family_refs: Llama, Qwen2, Qwen3, Mistral), so a family export
can take the adapters; GPT-2's fused c_attn has none to give (refused). The adapters come
from the run's newest complete checkpoint (export.open_source), in fp32 unless --dtype says.
`--format hf` on the same run writes the merged model instead (lora_weights.merge_adapters).
"""

from __future__ import annotations

import json
from pathlib import Path

from loomtrain.durable import write_durable
from loomtrain.launcher.checkpoints.export import DTYPES, ExportError, hf_architecture, replacing, write_export
from loomtrain.launcher.checkpoints.hf_families import family_refs
from loomtrain.launcher.checkpoints.shards import SafetensorsWriter
from loomtrain.model.lora import is_adapter

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_names(cfg, adapter_names) -> dict[str, str]:
    """loomtrain adapter name (blocks.0.attn.wq.lora_A) -> peft's key
    (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)."""
    refs = family_refs(cfg)
    out = {}
    for name in adapter_names:
        layer, factor = name.rsplit(".", 1)
        module = refs[f"{layer}.weight"].key.removesuffix(".weight")
        out[name] = f"{PEFT_PREFIX}{module}.{factor}.weight"
    return out


def adapter_config(cfg, names: dict[str, str]) -> dict:
    targets = sorted(
        {key.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for key in names.values() if ".lora_A." in key}
    )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.init_from or None,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def _write(source, out: Path, dtype: str, shown: str) -> None:
    if not hasattr(source, "adapters"):
        raise ExportError(f"{source.what}: holds no LoRA adapters (model.lora.rank=0); use --format hf")
    cfg = source.cfg
    arch = hf_architecture(cfg)
    if arch == "GPT2LMHeadModel":
        raise ExportError("--format peft: GPT-2's fused c_attn has no q/k/v modules for adapters; use --format hf")
    shapes, get = source.adapters
    names = peft_names(cfg, [n for n in shapes if is_adapter(n)])
    torch_dtype = DTYPES[dtype]
    with replacing(out) as tmp:
        w = SafetensorsWriter(tmp / ADAPTER_WEIGHTS, [(k, torch_dtype, shapes[n]) for n, k in names.items()])
        for n, k in names.items():
            w.write(k, get(n).float().to(torch_dtype).contiguous())
        w.close()
        write_durable(tmp / ADAPTER_CONFIG, json.dumps(adapter_config(cfg, names), indent=2) + "\n")
    print(
        f"export: {source.what} -> {shown} (PEFT LoRA adapters for {arch}, rank {cfg.lora.rank}, {len(names)} tensors)"
    )


def export_peft(src, output, dtype: str = "fp32", **_) -> Path | str:
    """The adapter folder at `output` (a directory, or a URI: staged locally and uploaded, the config last)."""
    return write_export(
        src,
        output,
        dtype,
        lambda source, out: _write(source, out, dtype, str(output)),
        last=ADAPTER_CONFIG,
        ours=lambda name: name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG),
        what="an earlier adapter export",
    )
