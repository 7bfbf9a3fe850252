"""`loomtrain import --format hf`: a Hugging Face Llama or GPT-2 becomes a run that generates what
transformers generates and exports back to the same tensors; what loomtrain cannot represent
is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from loomtrain.launcher import cli

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
] * 4
PROMPT = "def add(a"


@pytest.fixture(scope="module")
def bpe():
    """A small byte-level BPE trained here with `tokenizers` (<|endoftext|> as EOS)."""
    from loomtrain.data_pipeline.tokenizer import train_bpe

    return train_bpe(iter(TEXT), vocab_size=300)._tok


def save_tokenizer(tok, directory):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")
    fast.save_pretrained(str(directory))
    assert (directory / "tokenizer.json").is_file()


def spread(model, seed: int):
    """Weights well away from the init (norms, biases included) so greedy choices are clear-cut
    and a swapped or transposed tensor changes the text."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p + (0.3 if p.ndim == 1 else 0.15) * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_llama(directory, tok, **extra):
    eos = tok.token_to_id("<|endoftext|>")
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False,
        max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=eos, eos_token_id=eos, **extra,
    )
    torch.manual_seed(0)
    model = spread(transformers.LlamaForCausalLM(cfg), 1)
    model.save_pretrained(str(directory), max_shard_size="100KB")  # sharded: an index and several files
    save_tokenizer(tok, directory)
    return model


def tiny_gpt2(directory, tok):
    eos = tok.token_to_id("<|endoftext|>")
    cfg = transformers.GPT2Config(  # activation gelu_new, dropout 0.1, tied: GPT-2's own defaults
        vocab_size=tok.get_vocab_size(), n_embd=64, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=eos, eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = spread(transformers.GPT2LMHeadModel(cfg), 2)
    model.save_pretrained(str(directory))
    save_tokenizer(tok, directory)
    return model


def hf_greedy_text(model, tok, prompt: str, n: int) -> str:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    eos = tok.token_to_id("<|endoftext|>")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)
    new = out[0, len(ids):].tolist()
    new = new[: new.index(eos)] if eos in new else new
    return prompt + tok.decode(new, skip_special_tokens=False)


def tensors(path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def import_generate_export(tmp_path, capsys, model, tok, src):
    run, back = tmp_path / "run", tmp_path / "back"
    assert cli.main(["import", "--format", "hf", str(src), "--output", str(run)]) == 0
    assert (run / "final" / "model.safetensors").is_file() and (run / "config.yaml").is_file()
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", PROMPT, "--temperature", "0",
                     "--max-new-tokens", "24", "--device", "cpu"]) == 0
    ours = capsys.readouterr().out[:-1]  # print's newline
    theirs = hf_greedy_text(model, tok, PROMPT, 24)
    assert ours == theirs
    assert len(theirs) > len(PROMPT) + 8  # it really generated something

    assert cli.main(["export", str(run), "--format", "hf", "--output", str(back)]) == 0
    original, exported = tensors(src), tensors(back)
    assert sorted(original) == sorted(exported)
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    return run


def test_llama_import_generates_like_transformers_and_exports_bitwise(tmp_path, capsys, bpe):
    src = tmp_path / "hf"
    model = tiny_llama(src, bpe)
    assert (src / "model.safetensors.index.json").is_file()
    run = import_generate_export(tmp_path, capsys, model, bpe, src)
    cfg = json.loads((run / "final" / "model_config.json").read_text())
    assert (cfg["n_kv_heads"], cfg["rope_theta"], cfg["tie_embeddings"], cfg["norm"]) == (2, 500000.0, False, "rmsnorm")


def test_gpt2_import_generates_like_transformers_and_exports_bitwise(tmp_path, capsys, bpe):
    src = tmp_path / "hf"
    model = tiny_gpt2(src, bpe)
    run = import_generate_export(tmp_path, capsys, model, bpe, src)
    cfg = json.loads((run / "final" / "model_config.json").read_text())
    assert (cfg["activation"], cfg["positions"], cfg["bias"], cfg["tie_embeddings"]) == ("gelu_tanh", "learned", True, True)


def refusal(capsys, src, tmp_path) -> str:
    capsys.readouterr()  # the set-up's progress bars
    assert cli.main(["import", "--format", "hf", str(src), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "final").exists()
    return err


def test_rope_scaling_is_refused_naming_the_field(tmp_path, capsys, bpe):
    src = tmp_path / "hf"
    tiny_llama(src, bpe)
    config = json.loads((src / "config.json").read_text())
    # as Llama 3.1 checkpoints write it
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    (src / "config.json").write_text(json.dumps(config))
    assert "rope_scaling=" in refusal(capsys, src, tmp_path)


def test_pickled_weights_are_refused_without_being_read(tmp_path, capsys, bpe):
    src = tmp_path / "hf"
    tiny_llama(src, bpe)
    for f in src.glob("model*.safetensors*"):
        f.unlink()
    (src / "pytorch_model.bin").write_bytes(b"not a pickle: opening it would fail loudly")
    err = refusal(capsys, src, tmp_path)
    assert "pytorch_model.bin" in err and "safetensors" in err
