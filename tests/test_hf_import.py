"""`loomtrain import --format hf`: a Hugging Face Llama or GPT-2 becomes a run that generates what
transformers generates and exports back to the same tensors; what loomtrain cannot represent
is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from hf_fixtures import bpe, tiny_gpt2, tiny_llama  # noqa: F401  (bpe: a fixture)
from safetensors import safe_open

from loomtrain.launcher import cli

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "def add(a"


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
