"""`loomtrain export --format hf`: transformers loads the result and computes loomtrain's logits."""

from __future__ import annotations

import pytest
import torch
from final_weights import save_final
from loomtrain.launcher.checkpoints import export
from loomtrain.launcher.cli import export as export_cli
from loomtrain.model import ModelConfig, Transformer

transformers = pytest.importorskip("transformers")


def perturbed(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model whose norms and biases are not at their init values (so a mix-up shows)."""
    model = Transformer(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def make_run(tmp_path, cfg: ModelConfig):
    from loomtrain.data_pipeline import load_tokenizer

    model = perturbed(cfg)
    save_final(model, cfg, load_tokenizer("byte"), tmp_path / "run" / "final")
    return model, tmp_path / "run"


def hf_logits(out_dir, tokens):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits, hf


VARIANTS = {
    # Llama-style: GQA, tied embeddings
    "llama": dict(norm="rmsnorm", activation="swiglu", positions="rope", n_kv_heads=2, tie_embeddings=True),
    # Llama-style with biases and an untied head
    "llama_bias_untied": dict(
        norm="rmsnorm",
        activation="swiglu",
        positions="rope",
        n_kv_heads=4,
        tie_embeddings=False,
        bias=True,
        rope_theta=500.0,
    ),
    # GPT-2-style: biases, untied head
    "gpt2": dict(norm="layernorm", activation="gelu", positions="learned", bias=True, tie_embeddings=False),
    # GPT-2-style without biases (zeros written), tied
    "gpt2_nobias_tied": dict(norm="layernorm", activation="gelu", positions="learned", bias=False, tie_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_export_with_equal_logits(tmp_path, variant):
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, max_seq_len=32, **VARIANTS[variant])
    model, run = make_run(tmp_path, cfg)
    out = tmp_path / "hf"
    assert export_cli.main([str(run), "--format", "hf", "--output", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    theirs, hf = hf_logits(out, tokens)
    expected = "LlamaForCausalLM" if cfg.positions == "rope" else "GPT2LMHeadModel"
    assert type(hf).__name__ == expected
    assert (theirs - ours).abs().max().item() < 1e-4


def test_exported_byte_tokenizer_gives_the_same_ids(tmp_path):
    from loomtrain.data_pipeline import load_tokenizer

    cfg = ModelConfig(vocab_size=260, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, **VARIANTS["llama"])
    _, run = make_run(tmp_path, cfg)
    out = tmp_path / "hf"
    export.export_hf(run, out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer("byte")
    text = "def héllo(x):\n    return x  # ünïcode ✓\n"
    assert hf_tok.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf_tok.decode(ours.encode(text)) == text
    assert hf_tok.convert_tokens_to_ids("<|endoftext|>") == ours.eos_id


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(positions="alibi"), "model.positions"),
        (dict(positions="sinusoidal"), "model.positions"),
        (dict(norm="layernorm", activation="swiglu", positions="rope"), "model.norm"),
        (dict(norm="rmsnorm", activation="gelu", positions="rope"), "model.activation"),
        (dict(norm="rmsnorm", activation="gelu", positions="learned"), "model.norm"),
        (dict(norm="layernorm", activation="gelu", positions="learned", n_kv_heads=2), "model.n_kv_heads"),
        (dict(norm="rmsnorm", activation="swiglu", positions="rope", norm_placement="post"), "model.norm_placement"),
    ],
)
def test_unsupported_variants_are_refused_naming_the_field(tmp_path, capsys, change, field):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16, **change)
    _, run = make_run(tmp_path, cfg)
    assert export_cli.main([str(run), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert field in err and "\n" not in err.strip()
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_missing_run_is_a_clear_error(tmp_path, capsys):
    assert export_cli.main([str(tmp_path / "nope"), "--output", str(tmp_path / "hf")]) == 2
    assert "nope" in capsys.readouterr().err


def test_generation_config_sets_no_max_length_for_max_new_tokens_to_meet(tmp_path):
    """The exported generation_config.json set max_length (the context length), so transformers
    warned 'Both `max_new_tokens` (=5) and `max_length`(=16) seem to have been set' on every
    generate(max_new_tokens=...): it sets the special tokens only."""
    import json
    import logging

    cfg = ModelConfig(vocab_size=260, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, **VARIANTS["llama"])
    _, run = make_run(tmp_path, cfg)
    out = tmp_path / "hf"
    export.export_hf(run, out)
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 256, "eos_token_id": 256}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert hf.config.max_position_embeddings == 16  # the context length is still there

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = Lines()
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(lines)
    try:
        tokens = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    finally:
        logger.removeHandler(lines)
    assert tokens.shape == (1, 8)
    assert not [line for line in lines.lines if "max_length" in line], lines.lines
