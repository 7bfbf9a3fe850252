"""Engine pieces without a process group: DeepSpeed config, weight-decay groups, LR schedule, metrics helpers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from loomtrain.launcher.config import OFFLOAD_ZERO_STAGES, ConfigError
from loomtrain.launcher.config_loader import load_config, resolve, validate
from loomtrain.launcher.observe.metrics import MetricsLogger, gpu_peak_flops
from loomtrain.launcher.planning import memory_model
from loomtrain.launcher.training.engine import ds_config, lr_lambda, param_groups

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_ds_config_derives_accumulation_from_global_micro_and_dp():
    cfg = load_config(
        TINY,
        [
            "train.micro_batch_size=4",
            "train.global_batch_size=32",
            "train.precision=bf16",
            "parallel.zero_stage=2",
            "train.grad_clip=0.5",
        ],
        world_size=2,
    )
    ds = ds_config(cfg, dp_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 4  # 32 / (4 * 2)
    assert ds["train_batch_size"] == 32
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]


def refusal(call) -> str | None:
    """The ConfigError's message, or None when the call is accepted."""
    try:
        call()
    except ConfigError as exc:
        return str(exc)
    return None


def test_grad_accumulation_and_batch_rule_agree_in_loader_engine_and_plan():
    cfg = resolve(TINY, ["train.micro_batch_size=4", "train.global_batch_size=32"])
    assert cfg.train.grad_accum_steps(2) == 4
    assert ds_config(cfg, dp_size=2)["gradient_accumulation_steps"] == 4
    assert memory_model.make_plan(cfg, 2, "cpu").grad_accum == 4
    # dp 3: 32 does not split into micro-batches of 4 over 3 ranks; all three refuse it alike
    messages = {
        refusal(lambda: validate(cfg, world_size=3)),
        refusal(lambda: ds_config(cfg, dp_size=3)),
        refusal(lambda: memory_model.make_plan(cfg, 3, "cpu")),
    }
    assert messages == {
        "train.global_batch_size: expected a multiple of train.micro_batch_size * dp_size = 4 * 3, got 32"
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_offload_stages_agree_in_loader_engine_and_plan(stage):
    cfg = resolve(TINY, [f"parallel.zero_stage={stage}", "parallel.offload_optimizer=true"])
    loader = refusal(lambda: validate(cfg))
    engine = refusal(lambda: ds_config(cfg, dp_size=1))
    plan = refusal(lambda: memory_model.make_plan(cfg, 1, "cpu"))
    assert loader == engine == plan
    if stage in OFFLOAD_ZERO_STAGES:
        assert loader is None and ds_config(cfg, dp_size=1)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    else:
        assert loader == (
            f"parallel.offload_optimizer: expected false unless parallel.zero_stage is 2 or 3 (it is {stage}), got True"
        )


def test_no_weight_decay_on_norms_biases_and_embeddings():
    from loomtrain.model import ModelConfig, Transformer

    for tied, positions in ((True, "rope"), (False, "learned")):
        model = Transformer(
            ModelConfig(
                vocab_size=64,
                d_model=32,
                n_layers=2,
                n_heads=4,
                bias=True,
                tie_embeddings=tied,
                positions=positions,
                norm="layernorm",
            ),
            seed=0,
        )
        decay, no_decay = param_groups(model, 0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)] for p in decay["params"]}
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        assert all(n.endswith("weight") and "norm" not in n and "emb" not in n for n in decayed)
        assert "blocks.0.attn.wq.weight" in decayed and "blocks.1.ffn.down.weight" in decayed
        assert ("lm_head.weight" in decayed) == (not tied)  # tied: it is tok_emb's table
        # every parameter is in exactly one group
        assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule_warmup_then_decay(schedule):
    cfg = load_config(
        TINY,
        [
            f"train.lr_schedule={schedule}",
            "train.lr=1e-3",
            "train.min_lr=1e-4",
            "train.warmup_steps=10",
            "train.max_steps=110",
        ],
    )
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    if schedule == "constant":
        assert f(109) == 1.0
    else:
        assert f(110) == pytest.approx(0.1)  # min_lr / lr at the end
        mid = 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi * 0.5)) if schedule == "cosine" else 0.5)
        assert f(60) == pytest.approx(mid)
        assert all(f(s) >= f(s + 1) for s in range(10, 110))
    # torch's LambdaLR applies it to the optimizer's lr
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4)


def test_gpu_peak_table():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("Some Future GPU") is None


def test_metrics_logger_resume_keeps_earlier_steps(tmp_path):
    log = MetricsLogger(tmp_path, max_steps=4, tensorboard=False, progress="plain")
    for step in (1, 2, 3):
        log.log(step, {"loss": 1.0 / step})
    log.close()
    # resumed from step 2: the record of step 3 will be redone, so it goes
    log = MetricsLogger(tmp_path, max_steps=4, tensorboard=False, progress="plain", start_step=2)
    log.log(3, {"loss": 0.3})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == ['{"step": 1', '{"step": 2', '{"step": 3']
    assert '"loss": 0.3' in lines[-1]
    # a fresh start replaces the file
    MetricsLogger(tmp_path, max_steps=4, tensorboard=False, progress="plain").close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
