"""`loomtrain import --format hf`: a Hugging Face Llama or GPT-2 becomes a run that generates what
transformers generates and exports back to the same tensors; what loomtrain cannot represent
is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_fixtures import tiny_gpt2, tiny_llama
from loomtrain.launcher import cli
from safetensors import safe_open

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "def add(a"


def hf_greedy_text(model, tok, prompt: str, n: int) -> str:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    eos = tok.token_to_id("<|endoftext|>")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(ids) :].tolist()
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
    assert (
        cli.main(
            [
                "generate",
                str(run),
                "--prompt",
                PROMPT,
                "--temperature",
                "0",
                "--max-new-tokens",
                "24",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
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
    assert (cfg["activation"], cfg["positions"], cfg["bias"], cfg["tie_embeddings"]) == (
        "gelu_tanh",
        "learned",
        True,
        True,
    )
    # exported as activation_function gelu_pytorch_tanh: transformers computes the same logits
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(tokens).logits - model(tokens).logits).abs().max().item() < 1e-4


def refusal(capsys, src, tmp_path) -> str:
    capsys.readouterr()  # the set-up's progress bars
    assert cli.main(["import", "--format", "hf", str(src), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "final").exists()
    return err


def test_an_unknown_rope_scaling_is_refused_naming_the_field(tmp_path, capsys, bpe):
    """llama3 and linear scaling are imported (tests/distributed/test_hf_families.py); yarn is refused."""
    src = tmp_path / "hf"
    tiny_llama(src, bpe)
    config = json.loads((src / "config.json").read_text())
    # as a YaRN-extended checkpoint writes it
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    (src / "config.json").write_text(json.dumps(config))
    assert "rope_scaling.rope_type='yarn'" in refusal(capsys, src, tmp_path)


def test_pickled_weights_are_refused_without_being_read(tmp_path, capsys, bpe):
    src = tmp_path / "hf"
    tiny_llama(src, bpe)
    for f in src.glob("model*.safetensors*"):
        f.unlink()
    (src / "pytorch_model.bin").write_bytes(b"not a pickle: opening it would fail loudly")
    err = refusal(capsys, src, tmp_path)
    assert "pytorch_model.bin" in err and "safetensors" in err


def loomtrain_logits(run, tokens):
    from loomtrain.launcher.checkpoints.weight_source import load_final

    model, _ = load_final(run)
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize(
    "variant",
    [
        dict(num_key_value_heads=1, tie_word_embeddings=True),  # MQA, tied
        dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True),  # MHA with biases
    ],
)
def test_llama_variants_give_transformers_logits(tmp_path, bpe, variant):
    model = tiny_llama(tmp_path / "hf", bpe, **variant)
    assert cli.main(["import", "--format", "hf", str(tmp_path / "hf"), "--output", str(tmp_path / "run")]) == 0
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(tokens).logits
    assert (loomtrain_logits(tmp_path / "run", tokens) - theirs).abs().max().item() < 1e-4


def test_gpt2_saved_without_prefix_and_with_mask_buffers(tmp_path, bpe):
    """Checkpoints saved from GPT2Model (the original gpt2 upload) name tensors without
    `transformer.` and carry the causal-mask buffers attn.bias / attn.masked_bias."""
    from safetensors.torch import save_file

    model = tiny_gpt2(tmp_path / "hf", bpe)
    src = tensors(tmp_path / "hf")
    bare = {k.removeprefix("transformer."): v for k, v in src.items()}
    for i in range(2):
        bare[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
        bare[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(bare, str(tmp_path / "hf" / "model.safetensors"))
    assert cli.main(["import", "--format", "hf", str(tmp_path / "hf"), "--output", str(tmp_path / "run")]) == 0
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(tokens).logits
    assert (loomtrain_logits(tmp_path / "run", tokens) - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "field, value",
    [
        ("sliding_window", 4096),  # not in transformers' Llama (Mistral and Qwen have it)
        ("num_local_experts", 8),
        ("quantization_config", {"quant_method": "awq"}),
        ("hidden_act", "gelu"),
        ("attention_dropout", 0.1),
        ("mlp_bias", True),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0}),
        ("architectures", ["MixtralForCausalLM"]),
    ],
)
def test_unrepresentable_fields_are_refused_by_name(tmp_path, capsys, bpe, field, value):
    src = tmp_path / "hf"
    tiny_llama(src, bpe)
    config = json.loads((src / "config.json").read_text())
    config[field] = value
    (src / "config.json").write_text(json.dumps(config))
    assert refusal(capsys, src, tmp_path).startswith(f"loomtrain import: {src / 'config.json'}: {field}")


# A chat format of the usual shape: a turn per message, then the assistant's cue.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_chat_models_format_travels_and_its_eval_samples_answer_a_user_turn(tmp_path, capsys, bpe, where, data_cache):
    """Import keeps the chat template (from tokenizer_config.json, or chat_template.jinja as newer
    transformers save it); a run from the import starts its evaluation samples from a held-out
    document's start as a user's turn, so each sample is the model's reply; export gives the
    template back to transformers."""
    from launch import QUIET, SMALL, run_loomtrain

    src = tmp_path / "hf"
    tiny_llama(src, bpe)
    config = json.loads((src / "tokenizer_config.json").read_text())
    if where == "chat_template.jinja":
        (src / where).write_text(CHAT_TEMPLATE)
    else:
        config["chat_template"] = CHAT_TEMPLATE
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    run = tmp_path / "imported"
    assert cli.main(["import", "--format", "hf", str(src), "--output", str(run)]) == 0
    kept = json.loads((run / "final" / "tokenizer" / "tokenizer_config.json").read_text())
    assert kept["chat_template"] == CHAT_TEMPLATE and kept["eos_token"] == "<|endoftext|>"

    ft = tmp_path / "ft"
    args = [*SMALL, *QUIET, "train.max_steps=2", "eval.every_steps=2", "eval.num_samples=1", "eval.sample_tokens=4"]
    # the module's data cache: the second case reuses the first's corpus shards (same tokenizer)
    corpus = ["data.max_files=150", f"data.cache_dir={data_cache}"]
    proc = run_loomtrain("train", run / "config.yaml", *args, f"run.dir={ft}", *corpus, cwd=tmp_path)
    samples = [line for line in proc.stdout.splitlines() if line.startswith("sample: ")]
    assert len(samples) == 1, proc.stdout[-2000:]
    # <|endoftext|> as BOS, the user's turn holding the held-out document's start, the cue
    assert samples[0].startswith("sample: '<|endoftext|><|user|>\\n"), samples[0]
    assert "<|endoftext|>\\n<|assistant|>\\n" in samples[0], samples[0]

    out = tmp_path / "back"
    assert cli.main(["export", str(ft), "--format", "hf", "--output", str(out)]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|endoftext|><|user|>\nhi<|endoftext|>\n<|assistant|>\n"
