"""The model options of Llama 3.x, Qwen2/2.5, Qwen3 and Mistral compute what
transformers computes: tiny random models built with transformers' own classes, their weights
copied into a loomtrain Transformer, give the same fp32 logits (1e-4) and greedy tokens; the
sliding window also with packed documents, past the window in generation, and at tp 2 (with
and without sequence parallelism) equal to tp 1. RoPE scaling's inverse frequencies are
compared with transformers' own functions, and bad option values fail in one line."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from hf_fixtures import spread
from loomtrain.launcher.config_loader import load_config
from loomtrain.model import ModelConfig, Transformer
from loomtrain.model.config import RopeScaling
from loomtrain.model.positions import rope_inv_freq
from s3_server import free_port
from small_configs import HF_TINY
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
SIZES = dict(**HF_TINY, vocab_size=96, rms_norm_eps=1e-6, attn_implementation="eager")
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)

# Each family with what it has switched on; windows (8) are shorter than the sequences (24+).
FAMILIES = {
    "llama3": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SIZES, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=False)
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **SIZES,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
            rope_theta=1000000.0,
        )
    ),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            **SIZES,
            head_dim=24,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
        )
    ),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**SIZES, sliding_window=8, tie_word_embeddings=False)
    ),
}


def build_hf(family: str):
    torch.manual_seed(0)
    return spread(FAMILIES[family](), 1)


def model_config(hf) -> ModelConfig:
    """The loomtrain options of a Llama/Qwen2/Qwen3/Mistral config (H2's importer is the product
    version of this; the test keeps its own so that it checks the model, not the mapping)."""
    c = hf.config
    rope = c.rope_parameters
    scaling = RopeScaling()
    if rope.get("rope_type", "default") == "llama3":
        scaling = RopeScaling(
            "llama3",
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
    sliding = "sliding_attention" in (getattr(c, "layer_types", None) or []) or c.model_type == "mistral"
    q_proj = hf.model.layers[0].self_attn.q_proj
    return ModelConfig(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None),
        ffn_hidden=c.intermediate_size,
        max_seq_len=c.max_position_embeddings,
        norm="rmsnorm",
        activation="swiglu",
        positions="rope",
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        qkv_bias=q_proj.bias is not None,
        qk_norm=hasattr(hf.model.layers[0].self_attn, "q_norm"),
        sliding_window=c.sliding_window if sliding else None,
        tie_embeddings=bool(c.tie_word_embeddings),
        norm_eps=c.rms_norm_eps,
    )


HF_TO_LOOMTRAIN = {
    "model.embed_tokens": "tok_emb",
    "model.norm": "norm",
    "lm_head": "lm_head",
    "self_attn.q_proj": "attn.wq",
    "self_attn.k_proj": "attn.wk",
    "self_attn.v_proj": "attn.wv",
    "self_attn.o_proj": "attn.wo",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.gate_proj": "ffn.gate",
    "mlp.up_proj": "ffn.up",
    "mlp.down_proj": "ffn.down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def loomtrain_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        i, rest = hf_name[len("model.layers.") :].split(".", 1)
        module, leaf = rest.rsplit(".", 1)
        return f"blocks.{i}.{HF_TO_LOOMTRAIN[module]}.{leaf}"
    module, leaf = hf_name.rsplit(".", 1)
    return f"{HF_TO_LOOMTRAIN[module]}.{leaf}"


def from_hf(hf) -> Transformer:
    """A loomtrain Transformer holding `hf`'s weights (every parameter of both is matched)."""
    model = Transformer(model_config(hf), seed=0).eval()
    ours = dict(model.named_parameters())
    theirs = {loomtrain_name(n): p for n, p in hf.named_parameters()}
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    with torch.no_grad():
        for name, p in theirs.items():
            ours[name].copy_(p)
    return model


def tokens(n: int, seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# Equivalence with transformers ------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(family):
    hf = build_hf(family)
    model = from_hf(hf)
    cfg = model.cfg
    expected = {"llama3": "rope_scaling", "qwen2": "qkv_bias", "qwen3": "qk_norm", "mistral": "sliding_window"}
    assert getattr(cfg, expected[family]) not in (None, False, RopeScaling())  # the family's option is on
    if family == "qwen3":
        assert cfg.head_width * cfg.n_heads != cfg.d_model
    ids = tokens(40)
    assert cfg.sliding_window is None or ids.shape[1] > 4 * cfg.sliding_window
    with torch.no_grad():
        ours = model(ids)
    assert max_diff(ours, hf_logits(hf, ids)) <= TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers(family):
    """32 new tokens after a 12-token prompt: past the 8-token window (KV cache), and past
    llama3's original 32 positions."""
    hf = build_hf(family)
    model = from_hf(hf)
    prompt = tokens(12, seed=2, batch=1)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=0)
    ours = model.generate(prompt, max_new_tokens=32)
    assert theirs.shape == (1, 44)
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0, 12:].tolist())) > 3  # not a degenerate repetition


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_sliding_window_with_packed_documents_equals_each_document_alone(family):
    """Documents of 19, 5 and 16 tokens packed in one row of 40 (window 8): each document's
    logits are transformers' on that document alone."""
    hf = build_hf(family)
    model = from_hf(hf)
    lengths = [19, 5, 16]
    ids = tokens(sum(lengths), seed=3, batch=1)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(ids, document_ids=doc)
    start, worst = 0, 0.0
    for n in lengths:
        worst = max(worst, max_diff(packed[:, start : start + n], hf_logits(hf, ids[:, start : start + n])))
        start += n
    assert worst <= TOL
    # The window matters here: the same documents with the full causal context differ.
    full = ModelConfig(**{**vars(model.cfg), "sliding_window": None})
    unwindowed = Transformer(full).eval()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert max_diff(unwindowed(ids, document_ids=doc)[:, :19], packed[:, :19]) > 1e-2


def test_sliding_window_mask_convention():
    """Key j is seen by query i when i - window < j <= i (transformers' sliding_window_overlay
    and causal_mask_function), with and without packed documents."""
    from dense_masks import document_mask
    from loomtrain.model.masking import causal_mask
    from transformers.masking_utils import sliding_window_causal_mask_function

    window, n = 3, 9
    theirs = sliding_window_causal_mask_function(window)
    t = torch.tensor
    expected = torch.tensor([[bool(theirs(t(0), t(0), t(i), t(j))) for j in range(n)] for i in range(n)])
    pos = torch.arange(n)
    assert torch.equal(causal_mask(pos, pos, window), expected)
    assert causal_mask(pos, pos, window).sum(1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3, 3]
    ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1]])
    docs = document_mask(ids, window)[0, 0]
    assert torch.equal(docs[:5, :5], expected[:5, :5]) and torch.equal(docs[5:, 5:], expected[:4, :4])
    assert not docs[5:, :5].any()


def test_cached_decoding_past_the_window_equals_the_full_forward():
    """Logits of a prompt then 1-, 3- and 1-token steps through the KV cache equal one forward."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, positions="rope", norm="rmsnorm", sliding_window=4
    )
    for alibi in (False, True):
        c = ModelConfig(**{**vars(cfg), "positions": "alibi" if alibi else "rope"})
        model = Transformer(c, seed=0).eval()
        ids = tokens(14, seed=4) % c.vocab_size
        cache = model.new_cache(14)
        with torch.no_grad():
            steps = [model(ids[:, a:b], cache) for a, b in ((0, 9), (9, 10), (10, 13), (13, 14))]
            assert max_diff(torch.cat(steps, dim=1), model(ids)) <= 1e-5


# RoPE scaling --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        LLAMA3_ROPE,
        dict(LLAMA3_ROPE, factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=64),
        dict(rope_type="linear", factor=4.0),
    ],
)
def test_rope_inverse_frequencies_equal_transformers(params):
    hf = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=256, rope_theta=500000.0, rope_scaling=params
    )
    theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, torch.device("cpu"))
    kind = params["rope_type"]
    scaling = RopeScaling(
        kind,
        params["factor"],
        params.get("low_freq_factor", 1.0),
        params.get("high_freq_factor", 4.0),
        params.get("original_max_position_embeddings", 8192),
    )
    ours = rope_inv_freq(64, 500000.0, scaling)
    plain = rope_inv_freq(64, 500000.0)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0.0)
    if kind == "llama3":  # all three bands occur: kept, divided by factor, interpolated
        ratio = plain / ours
        assert (ratio == 1).any() and (ratio == params["factor"]).any()
        assert ((ratio > 1.001) & (ratio < params["factor"] - 0.001)).any()


def test_rope_scaling_from_the_command_line_and_back_from_json(tmp_path):
    overrides = [
        "model.positions=rope",
        "model.rope_scaling.type=llama3",
        "model.rope_scaling.factor=8",
        "model.rope_scaling.original_max_position=64",
        "model.head_dim=40",
        "model.qkv_bias=true",
        "model.qk_norm=true",
        "model.sliding_window=16",
    ]
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml", overrides).model
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert (cfg.head_width, cfg.qkv_bias, cfg.qk_norm, cfg.sliding_window) == (40, True, True, 16)
    again = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))  # how final/ stores it
    assert again == cfg and isinstance(again.rope_scaling, RopeScaling)


# Validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(sliding_window=0), "model.sliding_window: must be a positive integer or null, got 0"),
        (dict(sliding_window=2.5), "model.sliding_window: must be a positive integer or null"),
        (dict(head_dim=-4), "model.head_dim: must be a positive integer or null"),
        (dict(head_dim=7, positions="rope"), "model.head_dim: rope needs an even head dim, got 7"),
        (dict(qkv_bias="yes"), "model.qkv_bias: must be true or false"),
        (dict(qk_norm=1), "model.qk_norm: must be true or false"),
        (dict(rope_scaling={"type": "yarn"}, positions="rope"), "model.rope_scaling.type: 'yarn' is not one of"),
        (dict(rope_scaling={"type": "linear"}), "model.rope_scaling.type: linear scales RoPE, but model.positions"),
        (dict(rope_scaling={"factor": 4.0}, positions="rope"), "model.rope_scaling.factor: is 4.0 but"),
        (dict(rope_scaling={"type": "linear", "factor": 0}, positions="rope"), "model.rope_scaling.factor: must be"),
        (
            dict(rope_scaling={"type": "llama3", "low_freq_factor": -1.0}, positions="rope"),
            "model.rope_scaling.low_freq_factor: must be a positive number",
        ),
        (
            dict(rope_scaling={"type": "llama3", "high_freq_factor": 1.0}, positions="rope"),
            "model.rope_scaling.high_freq_factor: must be greater than low_freq_factor",
        ),
        (
            dict(rope_scaling={"type": "llama3", "original_max_position": 0}, positions="rope"),
            "model.rope_scaling.original_max_position: must be a positive integer",
        ),
        (dict(rope_scaling={"kind": "llama3"}), "model.rope_scaling.kind: unknown key"),
        (
            dict(d_model=30, n_heads=4),
            "model.n_heads: d_model=30 must be divisible by n_heads=4 (or set model.head_dim)",
        ),
    ],
)
def test_bad_values_fail_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{"d_model": 32, "n_heads": 4, **overrides})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_head_dim_override_counts_and_shapes():
    """head_dim * n_heads != d_model: the projections, the q/k norms and param_count follow it."""
    from loomtrain.model import param_count

    cfg = ModelConfig(
        d_model=30, n_heads=4, n_kv_heads=2, head_dim=12, positions="rope", qkv_bias=True, qk_norm=True, norm="rmsnorm"
    )
    model = Transformer(cfg, seed=0)
    attn = model.blocks[0].attn
    assert attn.wq.weight.shape == (48, 30) and attn.wk.weight.shape == (24, 30) and attn.wo.weight.shape == (30, 48)
    assert attn.wq.bias is not None and attn.wo.bias is None and model.blocks[0].ffn.up.bias is None
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (12,)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    # `plan` counts the model's matmul parameters as param_count does (its FLOPs are the model's:
    # attention term 12 L H head_dim T, not 12 L d T)
    from loomtrain.launcher.planning.memory_model import count_params
    from loomtrain.model import flops_per_token

    assert count_params(model, 1).matmul == param_count(cfg, exclude_embeddings=True)
    assert flops_per_token(cfg, 64) - 6 * param_count(cfg, exclude_embeddings=True) == 12 * 2 * 4 * 12 * 64


# Tensor parallelism -------------------------------------------------------------------------

TP_VARIANT = dict(
    vocab_size=61,
    n_heads=4,
    n_kv_heads=2,
    head_dim=12,
    positions="rope",
    norm="rmsnorm",
    activation="swiglu",
    qkv_bias=True,
    qk_norm=True,
    sliding_window=3,
    rope_scaling={"type": "llama3", "factor": 4.0, "original_max_position": 8},
    tie_embeddings=False,
)


def _documents_check(topo, sp: bool) -> dict:
    """Packed documents with the window at tp 2: loss and gradients equal the unsharded model's."""
    import copy

    from loomtrain.parallel import parallelize
    from loomtrain.parallel.plan import gather_shards, spec_of
    from test_tp import COMMON

    cfg = ModelConfig(**COMMON, **TP_VARIANT)
    ref = Transformer(cfg, seed=0)
    model = parallelize(copy.deepcopy(ref), topo, sequence_parallel=sp)
    batch = tokens(9, seed=5, batch=2) % cfg.vocab_size
    x, y = batch[:, :-1], batch[:, 1:]
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]])
    ref_loss = ref(x, targets=y, document_ids=doc)
    ref_loss.backward()
    loss = model(x, targets=y, document_ids=doc)
    loss.backward()
    ref_params = dict(ref.named_parameters())
    grad = max(
        max_diff(gather_shards(p.grad, spec_of(p), topo), ref_params[name].grad) for name, p in model.named_parameters()
    )
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": grad}


def _tp_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from loomtrain.parallel import Topology
        from test_tp import _check_variant

        topo = Topology(world, rank, world)
        results = {}
        for sp in (False, True):
            # logits, loss, every gradient, replicated grads equal on both ranks, state dict,
            # and (without SP) greedy generation through the KV cache past the window
            results[f"variant/sp={sp}"] = _check_variant("qwen_like", TP_VARIANT, topo, sp)
            results[f"documents/sp={sp}"] = _documents_check(topo, sp)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_equals_tp1_with_qkv_bias_qk_norm_head_dim_and_window(tmp_path):
    out = tmp_path / "diffs.json"
    mp.start_processes(_tp_worker, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn", join=True)
    results = json.loads(out.read_text())
    assert set(results) == {f"{k}/sp={sp}" for k in ("variant", "documents") for sp in (False, True)}
    for key, diffs in results.items():
        assert all(v <= 1e-5 for v in diffs.values()), (key, diffs)


@pytest.mark.slow
def test_torchrun_tp2_dp2_sp_with_the_family_options_follows_single_process(tmp_path):
    """The real loop (DeepSpeed, ZeRO-1, gradient clipping) with qkv_bias, qk_norm, a head_dim
    override, a window shorter than the sequence and llama3 scaling: tp 2 x dp 2 with sequence
    parallelism follows one process, loss for loss, for 10 steps."""
    from launch import TINY, losses, run_loomtrain
    from test_tp_train import COMMON

    options = [
        "model.head_dim=24",
        "model.qkv_bias=true",
        "model.qk_norm=true",
        "model.sliding_window=8",
        "model.rope_scaling.type=llama3",
        "model.rope_scaling.factor=8",
        "model.rope_scaling.original_max_position=16",
    ]
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    ref_dir, tp_dir = tmp_path / "ref", tmp_path / "tp2"
    run_loomtrain("train", TINY, f"run.dir={ref_dir}", cache, *COMMON, *options)
    tp_options = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=1"]
    run_loomtrain("train", TINY, f"run.dir={tp_dir}", cache, *COMMON, *options, *tp_options, nproc=4)
    ref, tp = list(losses(ref_dir).values()), list(losses(tp_dir).values())
    assert len(ref) == len(tp) == 10
    assert max(abs(a - b) for a, b in zip(ref, tp)) <= 1e-5, list(zip(ref, tp))
    assert tp[-1] < tp[0]
