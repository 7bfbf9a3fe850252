"""`loomtrain plan`: the memory / FLOPs arithmetic and the command's report."""

from __future__ import annotations

import json
import os

import psutil
import pytest
from launch import run_loomtrain
from loomtrain.launcher.cli import plan
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.planning import memory_model as mm
from loomtrain.model import ModelConfig, meta_transformer
from loomtrain.model.flops import param_count
from small_configs import LLAMA_STYLE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

LLAMA_70B = dict(
    **LLAMA_STYLE,
    vocab_size=128256,
    d_model=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    ffn_hidden=28672,
    max_seq_len=8192,
)


def test_zero_paper_arithmetic():
    # ZeRO paper, Figure 1: Psi = 7.5 B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB.
    psi, gb = 7.5e9, 1e9
    expect = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, want in expect.items():
        st = mm.model_state_bytes(int(psi), stage, 64, "bf16")
        assert st.total / gb == pytest.approx(want, abs=0.06), stage
    # fp32: 4 + 4 + 8 at stage 0; DeepSpeed's ZeRO optimizers add an fp32 partition copy.
    assert mm.model_state_bytes(100, 0, 4, "fp32").total == 1600
    st = mm.model_state_bytes(100, 1, 4, "fp32")
    assert (st.params, st.grads, st.optimizer) == (400, 400, 300)
    st = mm.model_state_bytes(100, 3, 4, "fp32", offload=True)
    assert (st.params, st.grads, st.optimizer, st.offloaded) == (100, 100, 0, 300)


def test_activation_formula_matches_korthikanti():
    # GPT-3-like block with dropout: per layer s*b*h*(34 + 5*a*s/h) bytes (eager attention).
    cfg = ModelConfig(
        vocab_size=1024, d_model=1024, n_layers=1, n_heads=16, max_seq_len=2048, activation="gelu", dropout=0.1
    )
    s, b, h, a = 2048, 2, 1024, 16
    act = mm.activation_bytes(cfg, s, b, tp=1, precision="bf16")
    assert act.per_layer == s * b * h * 34
    eager_layer = act.eager_total - act.output
    assert eager_layer == s * b * h * (34 + 5 * a * s / h)
    # Tensor parallel without / with sequence parallelism (eq. 4 and 5).
    assert mm.activation_bytes(cfg, s, b, 4, "bf16").per_layer == s * b * h * (10 + 24 / 4)
    assert mm.activation_bytes(cfg, s, b, 4, "bf16", sequence_parallel=True).per_layer == s * b * h * 34 / 4
    # Full recompute keeps 2*s*b*h per layer plus one block's working set.
    cfg8 = ModelConfig(**{**cfg.__dict__, "n_layers": 8})
    ck = mm.activation_bytes(cfg8, s, b, 1, "bf16", checkpointing=True)
    assert ck.layers == 8 * 2 * s * b * h + s * b * h * 34


def test_meta_count_matches_config_arithmetic_for_70b_without_memory():
    cfg = ModelConfig(**LLAMA_70B)
    rss = psutil.Process().memory_info().rss
    model = meta_transformer(cfg)
    grown = psutil.Process().memory_info().rss - rss
    assert all(p.device.type == "meta" for p in model.parameters())
    assert grown < 512 * 2**20, f"building the meta model grew RSS by {grown / 2**20:.0f} MiB"
    counted = mm.count_params(model, tp=8)
    assert counted.total == param_count(cfg)
    assert 70.0e9 < counted.total < 71.0e9
    # tp=8: everything but the norms is split 8 ways (GQA with 8 KV heads: one per rank).
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert counted.replicated_per_rank == norms
    assert counted.per_rank == (counted.total - norms) // 8 + norms


def test_tied_embedding_counts_once_and_vocab_padding():
    cfg = ModelConfig(vocab_size=1001, d_model=64, n_layers=2, n_heads=4, tie_embeddings=True)
    model = meta_transformer(cfg)
    assert mm.count_params(model, 1).total == param_count(cfg)
    per2 = mm.count_params(model, 2).per_rank
    per1 = mm.count_params(model, 1).per_rank
    # 1001 rows padded to 1002 across 2 ranks: 501 local rows.
    emb_local = 501 * 64
    assert (
        per2 - emb_local
        == (per1 - 1001 * 64 - mm.count_params(model, 1).replicated_per_rank) // 2
        + mm.count_params(model, 1).replicated_per_rank
    )


@pytest.mark.parametrize(
    "name,world", [("tiny.yaml", 1), ("dryrun-1gpu.yaml", 1), ("gpt-1b.yaml", 8), ("gpt-7b.yaml", 32)]
)
def test_plan_on_configs(name, world, capsys):
    rc = plan.main([os.path.join(CONFIGS, name), "--world-size", str(world), "--gpu", "h100"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for text in (
        "memory per rank",
        "optimizer states",
        "activations",
        "model FLOPs per step",
        "step time",
        "tokens/s",
        "TP ",
        "FITS:",
    ):
        assert text in out


def test_plan_gpt1b_numbers():
    run = load_config(os.path.join(CONFIGS, "gpt-1b.yaml"), [], world_size=8)
    p = mm.make_plan(run, 8, "h100")
    assert (p.tp, p.dp, p.grad_accum) == (2, 4, 16)
    n = p.params.per_rank
    # ZeRO-1 bf16: 2 + 2 bytes replicated, 12 bytes over dp=4.
    assert p.states.total == pytest.approx(n * (2 + 2 + 12 / 4))
    assert p.flops_per_step == pytest.approx(
        6 * param_count(run.model, True) * p.tokens_per_step + 12 * 24 * 2048 * 2048 * p.tokens_per_step
    )
    assert p.step_time_s == pytest.approx(p.flops_per_step / (8 * 989e12 * 0.4))


def test_will_not_fit_message(capsys):
    cfg = os.path.join(CONFIGS, "gpt-7b.yaml")
    rc = plan.main([cfg, "--world-size", "8", "--gpu", "l40s", "parallel.tp=1", "parallel.zero_stage=0"])
    out = capsys.readouterr().out
    assert rc == 1
    line = next(x for x in out.splitlines() if x.startswith("WILL NOT FIT"))
    assert "needs" in line and "GiB per rank, the GPU has 44.4 GiB" in line
    assert "parallel.zero_stage=1" in out


def test_plan_json_and_bad_config(capsys):
    rc = plan.main([os.path.join(CONFIGS, "gpt-1b.yaml"), "--world-size", "8", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["dp"] == 4 and data["fits"] is True
    rc = plan.main([os.path.join(CONFIGS, "gpt-1b.yaml"), "--world-size", "3"])
    assert rc == 2
    assert "parallel.tp" in capsys.readouterr().err


def test_cli_dispatch():
    out = run_loomtrain("plan", os.path.join(CONFIGS, "tiny.yaml"), "--world-size", "1", "--gpu", "cpu")
    assert "FITS" in out.stdout


def test_output_layer_at_tp1_is_the_fused_loss_working_set_not_the_logits():
    # tp = 1: loomtrain.model.loss keeps one chunk of logits, grad of the hidden states
    # and the weight's fp32 gradient; tp > 1 keeps this rank's logits (+ fp32 copy).
    cfg = ModelConfig(vocab_size=50304, d_model=2048, n_layers=1, n_heads=16, max_seq_len=2048)
    s, b, v, h = 2048, 8, 50304, 2048
    from loomtrain.model.loss import chunk_rows

    rows = chunk_rows(v, "cuda")
    assert mm.output_layer_bytes(cfg, s, b, 1, "bf16") == rows * v * 6 + s * b * h * 2 + v * h * 4
    assert mm.output_layer_bytes(cfg, s, b, 1, "bf16") < s * b * v * 6 / 4  # vs 9.9 GB of logits
    assert mm.output_layer_bytes(cfg, s, b, 2, "bf16") == s * b * (v // 2) * 6
    assert (
        mm.output_layer_bytes(cfg, s, b, 1, "fp32", "cpu") == chunk_rows(v, "cpu") * v * 4 + s * b * h * 4 + v * h * 4
    )
