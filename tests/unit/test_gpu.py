"""What only a GPU can show: the fused loss on CUDA (same numbers, less memory), training in
bf16 and in fp16 with DeepSpeed's dynamic loss scaling on the device.

Skipped where no CUDA device exists (CI has none); benchmarks/gpu_session.sh runs this
file, on its own, on a leased GPU (`python -m pytest tests/unit/test_gpu.py`).
LOOMTRAIN_GPU_TEST_DEVICE=cpu runs the device-agnostic tests on the CPU, to check the
tests themselves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from loomtrain.launcher.config_loader import load_config
from loomtrain.model import linear_cross_entropy

DEVICE = torch.device(os.environ.get("LOOMTRAIN_GPU_TEST_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"
if ON_CUDA and torch.cuda.is_available():
    # conftest picks DeepSpeed's CPU accelerator for the CPU suite; here DeepSpeed must drive
    # the GPU. It takes effect when this file runs on its own (as gpu_session.sh runs it),
    # before anything imports deepspeed.
    os.environ["DS_ACCELERATOR"] = "cuda"
pytestmark = pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA device")
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="measures CUDA memory or uses fp16")

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _output_layer(dtype: torch.dtype, tokens=4096, d=512, vocab=32768):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, d, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (0.02 * torch.randn(vocab, d, generator=g)).to(DEVICE, dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g).to(DEVICE)
    return h, w, t


def _grads(loss, h, w):
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.detach().float(), gh.float(), gw.float()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fused_loss_matches_logits_then_cross_entropy(dtype, tol):
    h, w, t = _output_layer(dtype)
    want = _grads(F.cross_entropy((h @ w.t()).float(), t), h, w)
    got = _grads(linear_cross_entropy(h, w, t), h, w)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= tol * b.abs().max(), (a - b).abs().max()


@needs_cuda
def test_fused_loss_needs_a_fraction_of_the_memory():
    h, w, t = _output_layer(torch.bfloat16, tokens=16384, d=2048)
    peaks = {}
    for name, fn in (
        ("plain", lambda: F.cross_entropy((h @ w.t()).float(), t)),
        ("fused", lambda: linear_cross_entropy(h, w, t)),
    ):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn().backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    print(f"\npeak above inputs: plain {peaks['plain'] / 2**20:,.0f} MiB, fused {peaks['fused'] / 2**20:,.0f} MiB")
    assert peaks["fused"] < peaks["plain"] / 2


def _train(tmp_path: Path, *overrides: str) -> list[dict]:
    from loomtrain.launcher.training.loop import run_training

    cfg = load_config(
        TINY,
        [
            "train.max_steps=40",
            "train.seq_len=64",
            "model.max_seq_len=64",
            "data.max_files=100",
            "eval.every_steps=0",
            "eval.num_samples=0",
            "checkpoint.every_steps=0",
            "log.tensorboard=false",
            "log.progress=plain",
            f"train.device={DEVICE.type}",
            f"run.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            *overrides,
        ],
    )
    run_training(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_bf16_training_on_the_device_learns(tmp_path):
    rows = _train(tmp_path, "train.precision=bf16", "parallel.zero_stage=1")
    losses = [r["loss"] for r in rows]
    assert len(losses) == 40 and all(x is not None for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses


@needs_cuda
def test_fp16_dynamic_loss_scaling_skips_a_few_overflows_then_learns(tmp_path):
    rows = _train(tmp_path, "train.precision=fp16", "parallel.zero_stage=1")
    skipped = rows[-1]["skipped_steps"]
    finite = [r["loss"] for r in rows if r["loss"] is not None]
    print(f"\nfp16: {skipped} of 40 steps skipped while the loss scale settled; losses {finite[:3]} ... {finite[-3:]}")
    assert skipped <= 10  # the scale starts at 2^16 and halves on each overflow
    assert sum(finite[-5:]) / 5 < sum(finite[:5]) / 5 - 1.0, finite
