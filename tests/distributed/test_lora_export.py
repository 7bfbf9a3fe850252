"""Export of a LoRA run trained on a Hugging Face Llama and a Qwen2 (tp 2, through `loomtrain train`):

* `export --format hf` (from the newest checkpoint: the base at model.init_from + its adapters,
  merged) loads in transformers, and its logits equal transformers + PEFT on the same base
  with the `--format peft` export within 1e-4; both equal loomtrain's own LoRA model (base +
  the checkpoint's adapters) and the run's final/ (written merged at tp 2);
* peft's key names are its own (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight);
* an export whose base changed since training is refused in one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_fixtures import tiny_family, tiny_llama
from launch import run_loomtrain
from loomtrain.launcher import cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
TOL = 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_merged_and_peft_exports_equal_each_other_and_loomtrain(tmp_path, bpe, family, s3_bucket, monkeypatch, capsys):
    import peft
    import transformers
    from loomtrain.launcher.checkpoints.state import open_reader
    from loomtrain.launcher.checkpoints.store import CheckpointStore
    from loomtrain.launcher.checkpoints.weight_source import load_final, load_into, open_source
    from loomtrain.launcher.config_loader import load_config
    from loomtrain.model import Transformer
    from loomtrain.model.lora import apply_lora

    hf, imported, run = tmp_path / "hf", tmp_path / "imported", tmp_path / "run"
    vocab = bpe.get_vocab_size() | 1  # odd vocabulary: tp 2 pads it
    if family == "llama":
        tiny_llama(hf, bpe, vocab_size=vocab)
    else:  # q/k/v biases, tied embeddings, a sliding window
        tiny_family(hf, bpe, "Qwen2ForCausalLM", vocab_size=vocab)
    assert cli.main(["import", "--format", "hf", str(hf), "--output", str(imported)]) == 0
    overrides = [
        f"run.dir={run}",
        f"model.init_from={hf}",
        f"data.tokenizer={hf}",
        "model.lora.rank=4",
        "model.lora.alpha=16",
        "model.lora.targets=[q,k,v,o,gate,up,down]",
        "parallel.tp=2",
        "train.max_steps=4",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "train.lr=2e-2",
        "train.warmup_steps=1",
        "eval.every_steps=0",
        "eval.num_samples=0",
        "checkpoint.every_steps=0",
        "data.max_files=20",
        f"data.cache_dir={tmp_path / 'cache'}",
        "log.tensorboard=false",
        "log.progress=plain",
    ]
    run_loomtrain("train", imported / "config.yaml", *overrides, nproc=2, timeout=900)
    merged, adapters = tmp_path / "merged", tmp_path / "adapters"
    assert cli.main(["export", str(run), "--format", "hf", "--output", str(merged)]) == 0
    assert cli.main(["export", str(run), "--format", "peft", "--output", str(adapters)]) == 0

    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["base_model_name_or_path"] == str(hf)
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    from safetensors import safe_open

    with safe_open(str(adapters / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * 7 * 2

    # to object storage: the same two files; an upload the store refuses is one line, not a traceback
    from loomtrain import storage

    assert cli.main(["export", str(run), "--format", "peft", "--output", f"{s3_bucket}/adapters"]) == 0
    stored = storage.location(f"{s3_bucket}/adapters")
    assert {name: stored.read(name) for name in stored.sizes()} == {p.name: p.read_bytes() for p in adapters.iterdir()}

    def refused(local, uri):
        raise storage.StorageError(f"{uri}: cannot upload {local} to it (ClientError: AccessDenied)")

    monkeypatch.setattr(storage, "upload_file", refused)
    capsys.readouterr()
    assert cli.main(["export", str(run), "--format", "peft", "--output", f"{s3_bucket}/refused"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"loomtrain export: {s3_bucket}/refused/"), err
    monkeypatch.undo()

    tokens = torch.randint(0, bpe.get_vocab_size(), (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
        base_logits = base(tokens).logits
        tuned = peft.PeftModel.from_pretrained(base, str(adapters)).eval()
        peft_logits = tuned(tokens).logits
        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
        merged_logits = hf_merged(tokens).logits

        cfg = load_config(run / "config.yaml", world_size=2)
        ours = Transformer(cfg.model)
        load_into(ours, open_source(hf))
        apply_lora(ours, cfg.model.lora)
        ckpt = open_reader(CheckpointStore(run).find_resumable(checksums=False))
        for name, p in ours.named_parameters():
            if p.requires_grad:
                p.copy_(ckpt.full(name))
        our_logits = ours.eval()(tokens)
        final_model, _ = load_final(run)
        final_logits = final_model.eval()(tokens)

    moved = (peft_logits - base_logits).abs().max().item()
    diffs = {
        "hf merged vs peft": (merged_logits - peft_logits).abs().max().item(),
        "peft vs loomtrain": (peft_logits - our_logits).abs().max().item(),
        "hf merged vs loomtrain": (merged_logits - our_logits).abs().max().item(),
        "final/ vs loomtrain": (final_logits - our_logits).abs().max().item(),
    }
    print(f"\nadapters move the logits by {moved:.3e}; max |logit diff|: {diffs}")
    assert moved > 1e-2  # the adapters trained: a lost adapter would show
    assert all(d <= TOL for d in diffs.values()), diffs

    # the base changed since training: both exports refuse, in one line
    shutil.rmtree(merged)
    with safe_open(str(next(hf.glob("model*.safetensors"))), "pt") as f:
        key = next(iter(f.keys()))
        tensor = f.get_tensor(key)
    from safetensors.torch import save_file

    for path in hf.glob("model*.safetensors"):
        with safe_open(str(path), "pt") as f:
            if key in f.keys():
                state = {k: f.get_tensor(k) for k in f.keys()}
                state[key] = tensor + 1
                save_file(state, str(path), metadata={"format": "pt"})
    proc = run_loomtrain("export", run, "--format", "hf", "--output", merged, rc=2)
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "LoRA adapters were trained on a base with sha256" in line, proc.stderr
    assert not merged.exists()
    # the base is gone: one line naming it
    hf.rename(tmp_path / "hf-gone")
    proc = run_loomtrain("export", run, "--format", "peft", "--output", tmp_path / "again", rc=2)
    assert proc.stderr.strip() == (
        f"loomtrain export: model.init_from={hf}: the LoRA base is not there ({hf}: no such folder)"
    ), proc.stderr
