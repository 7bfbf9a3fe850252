"""The families people fine-tune, in and out of Hugging Face form: LlamaForCausalLM (Llama 3.x's llama3
RoPE scaling), Qwen2ForCausalLM (q/k/v biases, tied), Qwen3ForCausalLM (q/k norms, head_dim 32
over hidden 64 / 4 heads) and MistralForCausalLM, each a tiny random model built with
transformers' own config class, with a sliding window of 8 on 64-token sequences where the
family has one (tests/hf_fixtures.py FAMILY_CONFIGS).

  * `loomtrain import` of it: its logits are transformers' within 1e-4 (fp32) and greedy
    generation of 32 tokens (KV cache, past the window) is transformers' token for token;
    imported by model id from a cache folder laid out here, it is the import by folder;
  * `loomtrain export` of the import gives back the source's tensors bitwise and its config keys,
    and transformers loads it with no missing or unexpected keys;
  * after one training step at tp 2 x dp 2 (4 processes, `loomtrain train` from model.init_from),
    the export loads in transformers with no missing or unexpected keys and its logits are
    loomtrain's within 1e-4 (the four families train one after another in one torchrun,
    tests/cli_driver.py, each test checking its own);
  * what loomtrain cannot compute is refused in one line naming the key.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_fixtures import FAMILY_CONFIGS, tiny_family
from launch import ROOT, one_line, python_cmd, run_child
from loomtrain.launcher import cli
from loomtrain.launcher.checkpoints.weight_source import load_final
from safetensors import safe_open
from test_hf_model_ids import COMMIT, lay_out_cache

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = list(FAMILY_CONFIGS)
# one training step at tp 2 x dp 2 (4 ranks), on top of each import's config.yaml
ONE_STEP = [
    "data.max_files=20",
    "parallel.tp=2",
    "train.max_steps=1",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=1e-2",
    "train.warmup_steps=0",
    "eval.every_steps=0",
    "eval.num_samples=0",
    "checkpoint.every_steps=0",
    "log.tensorboard=false",
    "log.progress=plain",
]
# config.json keys export must give back as the source had them (besides sizes and heads)
KEPT = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "rope_parameters",
    "rms_norm_eps",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
)
# what the import makes of each family's switches
EXPECTED = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False, sliding_window=None, head_dim=None, tie_embeddings=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False, sliding_window=8, head_dim=None, tie_embeddings=True),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True, sliding_window=8, head_dim=32, tie_embeddings=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False, sliding_window=8, head_dim=None, tie_embeddings=False),
}


def tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def tokens(vocab: int, batch: int = 2, length: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def load_hf(folder):
    """transformers' model from `folder`, asserting every tensor found its place."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return model.eval()


def hf_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # exactly n tokens, as loomtrain below
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        # the mask given: else transformers takes the prompt's 0s (pad_token_id) for padding
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False)
    return out[0, prompt.shape[1] :].tolist()


@pytest.fixture(scope="module")
def build(tmp_path_factory, bpe):
    """build(arch) -> (arch, HF folder, its transformers model, the folder's `loomtrain import`),
    made once per module (a failure is not kept: each test that asks again sees it)."""
    built = {}

    def build_family(arch: str):
        if arch not in built:
            base = tmp_path_factory.mktemp(arch)
            model = tiny_family(base / "hf", bpe, arch, vocab_size=bpe.get_vocab_size() | 1)
            assert cli.main(["import", str(base / "hf"), "--output", str(base / "run")]) == 0
            built[arch] = arch, base / "hf", model, base / "run"
        return built[arch]

    return build_family


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, build):
    """(architecture, HF folder, its transformers model, the folder's `loomtrain import`)."""
    return build(request.param)


def test_import_scores_and_generates_like_transformers(family):
    arch, hf, model, run = family
    cfg = json.loads((run / "final" / "model_config.json").read_text())
    assert {k: cfg[k] for k in EXPECTED[arch]} == EXPECTED[arch]
    if arch == "LlamaForCausalLM":
        assert cfg["rope_scaling"] == dict(
            type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=16
        )
    ours, _ = load_final(run)
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        diff = (ours(x) - model(x).logits).abs().max().item()
    print(f"\n{arch}: max |logit diff| vs transformers = {diff:.2e}")
    assert diff < 1e-4
    prompt = x[:1, :8]
    theirs = hf_greedy(model, prompt, 32)
    mine = ours.generate(prompt, 32, temperature=0.0)[0, 8:].tolist()
    assert mine == theirs
    assert len(set(theirs)) > 3  # it generated something, not one token over and over


def test_import_by_id_equals_import_by_folder(family, tmp_path, monkeypatch):
    arch, hf, _, run = family
    lay_out_cache(tmp_path / "hub", f"test-org/tiny-{arch.lower()}", hf)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for model_id in (f"test-org/tiny-{arch.lower()}", f"test-org/tiny-{arch.lower()}@{COMMIT}"):
        assert cli.main(["import", model_id, "--output", str(tmp_path / "by-id")]) == 0
        assert (tmp_path / "by-id" / "final" / "model_config.json").read_text() == (
            run / "final" / "model_config.json"
        ).read_text()
        a, b = tensors(run / "final"), tensors(tmp_path / "by-id" / "final")
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_export_of_the_import_is_the_source(family, tmp_path):
    arch, hf, model, run = family
    assert cli.main(["export", str(run), "--format", "hf", "--output", str(tmp_path / "back")]) == 0
    src, back = tensors(hf), tensors(tmp_path / "back")
    assert sorted(src) == sorted(back)
    assert all(torch.equal(src[k], back[k]) for k in src)
    theirs = json.loads((hf / "config.json").read_text())
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    kept = {k: exported.get(k) for k in KEPT if k in theirs}
    assert kept == {k: theirs[k] for k in kept}
    again = load_hf(tmp_path / "back")
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


def test_a_hub_config_with_rope_scaling_and_rope_theta_reads_as_rope_parameters(tmp_path, bpe):
    """Hub folders of 2024-25 (Llama 3.2) carry rope_scaling beside a top-level rope_theta."""
    model = tiny_family(tmp_path / "hf", bpe, "LlamaForCausalLM")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert cli.main(["import", str(tmp_path / "hf"), "--output", str(tmp_path / "run")]) == 0
    cfg = json.loads((tmp_path / "run" / "final" / "model_config.json").read_text())
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["type"] == "llama3"
    ours, _ = load_final(tmp_path / "run")
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert (ours(x) - model(x).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "arch, edit, key",
    [
        # Qwen2 with a window on layers 1 and up only: a mixture loomtrain has no setting for
        ("Qwen2ForCausalLM", dict(max_window_layers=1, layer_types=None), "layer_types"),
        ("Qwen3ForCausalLM", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        ("Qwen3ForCausalLM", dict(attention_bias=True), "attention_bias"),
        ("MistralForCausalLM", dict(hidden_act="gelu"), "hidden_act"),
        # transformers' Mistral would put the window on both layers anyway
        ("MistralForCausalLM", dict(layer_types=["full_attention", "full_attention"]), "layer_types"),
        ("LlamaForCausalLM", dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
        ("LlamaForCausalLM", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_parameters"),
        ("LlamaForCausalLM", dict(mlp_bias=True), "mlp_bias"),
        ("Qwen2ForCausalLM", dict(attention_dropout=0.1), "attention_dropout"),
        ("Qwen2ForCausalLM", dict(architectures=["Qwen2MoeForCausalLM"]), "architectures"),
    ],
)
def test_what_loomtrain_cannot_compute_is_refused_naming_the_key(tmp_path, capsys, bpe, arch, edit, key):
    src = tmp_path / "hf"
    tiny_family(src, bpe, arch)
    config = json.loads((src / "config.json").read_text())
    for k, v in edit.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (src / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli.main(["import", str(src), "--output", str(tmp_path / "run")]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"loomtrain import: {src / 'config.json'}: {key}"), line
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def one_step(build, tmp_path_factory, data_cache):
    """Every family's one training step at tp 2 x dp 2: `loomtrain train` of its import's
    config.yaml from model.init_from, the four one after another in one torchrun of 4 ranks
    (tests/cli_driver.py: the ranks' start-up is paid once, not four times) -> the driver's
    folder: ARCH/ (the run), ARCH.rank{R}.out / .err / .rc (what rank R printed, its exit status).
    A family that cannot be built is left out (its own tests say why)."""
    out = tmp_path_factory.mktemp("one_step")
    argv = [ROOT / "tests" / "cli_driver.py", out]
    for arch in FAMILIES:
        try:
            _, hf, _, run = build(arch)
        except Exception:  # noqa: BLE001 (the family's tests build it again and fail on it)
            continue
        argv += ["--variant", arch, "train", run / "config.yaml", f"run.dir={out / arch}"]
        argv += [f"model.init_from={hf}", f"data.tokenizer={hf}", f"data.cache_dir={data_cache}", *ONE_STEP]
    run_child(python_cmd(*argv, nproc=4))
    return out


@pytest.mark.slow
def test_one_step_at_tp2_dp2_exports_a_folder_transformers_loads_with_loomtrains_logits(family, one_step, tmp_path):
    arch, hf, model, run = family
    ft, out = one_step / arch, tmp_path / "export"
    ranks = range(4)
    rcs = [(one_step / f"{arch}.rank{r}.rc").read_text() for r in ranks]
    stdout = "".join((one_step / f"{arch}.rank{r}.out").read_text() for r in ranks)
    stderr = "".join((one_step / f"{arch}.rank{r}.err").read_text() for r in ranks)
    assert rcs == ["0"] * 4, f"exit {rcs}:\n{stdout[-3000:]}{stderr[-5000:]}"
    assert "model.init_from: starting from" in stdout
    assert cli.main(["export", str(ft), "--format", "hf", "--output", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
    exported = load_hf(out)
    trained, _ = load_final(ft)
    x = tokens(model.config.vocab_size)
    with torch.no_grad():
        ours, theirs, before = trained(x), exported(x).logits, model(x).logits
    diff = (ours - theirs).abs().max().item()
    print(f"\n{arch} after one tp2 x dp2 step: max |logit diff| loomtrain vs exported = {diff:.2e}")
    assert diff < 1e-4
    assert (theirs - before).abs().max().item() > 1e-3  # the step changed the weights
