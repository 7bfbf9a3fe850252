"""Streamed export (--dtype, --max-shard-size, HF shard names and index), written into a temp
folder and renamed into place, and final/'s manifest checked by generate and export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from final_weights import save_final
from loomtrain.launcher.checkpoints import export
from loomtrain.launcher.cli import export as export_cli
from loomtrain.launcher.cli import generate
from loomtrain.model import ModelConfig, Transformer
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

LLAMA = dict(norm="rmsnorm", activation="swiglu", positions="rope")


def make_final(tmp_path: Path, cfg: ModelConfig, name: str = "run") -> Path:
    from loomtrain.data_pipeline import load_tokenizer

    save_final(Transformer(cfg, seed=0), cfg, load_tokenizer("byte"), tmp_path / name / "final")
    return tmp_path / name


def tensors(out: Path) -> dict[str, torch.Tensor]:
    res = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            res.update({k: h.get_tensor(k) for k in h.keys()})
    return res


def logits(out: Path, tokens, dtype=torch.float32):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval()
    with torch.no_grad():
        return hf(tokens).logits.float()


def test_sizes_parse_like_hugging_face():
    assert export.parse_size("5GB") == 5 * 10**9 and export.parse_size("500MB") == 500 * 10**6
    assert export.parse_size("2GiB") == 2 * 2**30 and export.parse_size("1234") == 1234
    for bad in ("", "5 parsecs", "0MB", "-1GB"):
        with pytest.raises(export.ExportError, match="--max-shard-size"):
            export.parse_size(bad)


def test_sharded_export_then_a_single_file_export_over_it_leaves_no_stale_file(tmp_path):
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, **LLAMA)
    run = make_final(tmp_path, cfg)
    out = tmp_path / "hf"
    assert export_cli.main([str(run), "--output", str(out), "--max-shard-size", "40KB"]) == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors(out)) and set(index["weight_map"].values()) == set(shards)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    sharded = logits(out, tokens)

    (out / "model.safetensors.index.json").touch()  # an earlier export: replaced whole
    assert export_cli.main([str(run), "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temp or old folder left
    assert torch.equal(logits(out, tokens), sharded)


def test_output_that_is_not_an_earlier_export_is_refused_and_untouched(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, **LLAMA)
    run = make_final(tmp_path, cfg)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert export_cli.main([str(run), "--output", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(mine) in err[0] and "not an earlier export" in err[0]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


def test_a_corrupted_final_file_is_refused_by_generate_and_export(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, **LLAMA)
    run = make_final(tmp_path, cfg)
    victim = run / "final" / "model.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of one weight: same size, still a valid file
    victim.write_bytes(bytes(raw))
    assert generate.main([str(run), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(victim) in err[0] and "sha256" in err[0], err
    assert export_cli.main([str(run), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(victim) in err[0] and "sha256" in err[0], err
    assert not (tmp_path / "hf").exists()


RSS = """import resource, sys
from loomtrain.launcher.cli import export as export_cli
assert export_cli.main(sys.argv[1:]) == 0
print("RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _export_rss(*argv: str) -> int:
    p = subprocess.run([sys.executable, "-c", RSS, *argv], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return int(p.stdout.split("RSS_KB")[1].split()[0]) * 1024


@pytest.mark.slow
def test_100m_export_bf16_in_50mb_shards_streams(tmp_path):
    big = ModelConfig(
        vocab_size=8192, d_model=768, n_layers=14, n_heads=12, max_seq_len=64, tie_embeddings=False, **LLAMA
    )  # 112 M parameters, the largest tensor 25 MB in fp32
    tiny = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, **LLAMA)
    run, small = make_final(tmp_path, big), make_final(tmp_path, tiny, "tiny")
    out, out32 = tmp_path / "bf16", tmp_path / "fp32"
    rss_big = _export_rss(str(run), "--output", str(out), "--dtype", "bf16", "--max-shard-size", "50MB")
    rss_tiny = _export_rss(
        str(small), "--output", str(tmp_path / "tiny_hf"), "--dtype", "bf16", "--max-shard-size", "50MB"
    )
    print(f"export peak RSS: 112 M model {rss_big / 2**20:.0f} MiB, tiny {rss_tiny / 2**20:.0f} MiB")
    assert rss_big - rss_tiny <= 150 * 2**20, (rss_big, rss_tiny)

    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 4 and all(p.stat().st_size <= 50 * 10**6 + 10**5 for p in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = tensors(out)
    assert set(index["weight_map"]) == set(got) and len(got) == 3 + 9 * big.n_layers
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

    assert export_cli.main([str(run), "--output", str(out32), "--max-shard-size", "50MB"]) == 0
    full = tensors(out32)
    assert all(torch.equal(got[k], full[k].to(torch.bfloat16)) for k in full)  # bf16 rounding of the fp32 export
    tokens = torch.randint(0, big.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    a, b = logits(out, tokens), logits(out32, tokens)  # transformers loads both (computed in fp32)
    assert (a - b).abs().max().item() <= 2**-7 * b.abs().max().item() + 1e-3
