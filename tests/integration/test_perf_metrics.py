"""MFU as the training metrics compute it: model FLOPs per token x tokens/s / device peak."""

from __future__ import annotations

import pytest
import torch
from loomtrain.launcher.observe import metrics
from loomtrain.model import ModelConfig, Transformer, flops_per_token, param_count
from small_configs import LLAMA_STYLE, llama_style

# The benchmark model (benchmarks/cpu_vs_hf.py): Llama flavour, untied.
BENCH = dict(**LLAMA_STYLE, vocab_size=8192, d_model=256, n_layers=4, n_heads=8, max_seq_len=256)


def test_flops_per_token_by_hand():
    cfg = ModelConfig(**BENCH)
    d, f, v, L = 256, 688, 8192, 4  # SwiGLU width: 2/3 * 4 * 256 rounded up to a multiple of 8
    assert cfg.ffn_dim == f
    per_layer = 4 * d * d + 3 * d * f + 2 * d  # wq wk wv wo, gate up down, two RMSNorm weights
    n = L * per_layer + d + v * d  # + final norm + lm_head; the input table tok_emb is not counted
    assert n == 5_261_568 == param_count(cfg, exclude_embeddings=True)
    attn = 12 * L * 8 * 32 * 256  # 12 * layers * heads * head_dim * seq
    assert flops_per_token(cfg, 256) == 6 * n + attn == 34_715_136
    assert Transformer(cfg).flops_per_token(256) == 34_715_136
    # tied: the shared table is the lm_head matmul, counted once
    tied = ModelConfig(**{**BENCH, "tie_embeddings": True})
    assert param_count(tied, exclude_embeddings=True) == n


def test_mfu_on_known_numbers():
    # the 1.34 B model of benchmarks/gpu.sh on an H100 at 55,000 tokens/s: 8.86 GFLOP/token -> 49%
    cfg = llama_style(vocab_size=32768, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048)
    fpt = flops_per_token(cfg, 2048)
    assert fpt == 6 * param_count(cfg, exclude_embeddings=True) + 12 * 24 * 16 * 128 * 2048
    assert fpt == 8_861_331_456
    assert metrics.mfu(fpt, 55_000, 989e12) == pytest.approx(0.4928, abs=1e-4)
    assert metrics.mfu(1e9, 1e3, 1e13) == pytest.approx(0.1)
    # the peak of a data-parallel job is the sum over its devices
    assert metrics.mfu(1e9, 8e3, 8 * 1e13) == pytest.approx(0.1)


def test_gpu_peak_is_the_bf16_dense_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    for precision in ("bf16", "fp32", "fp16"):  # always against the bf16 dense peak
        assert metrics.device_peak_flops(torch.device("cuda", 0), precision) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert metrics.device_peak_flops(torch.device("cuda", 0), "bf16") == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert metrics.device_peak_flops(torch.device("cuda", 0), "bf16") == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery Accelerator")
    assert metrics.device_peak_flops(torch.device("cuda", 0), "bf16") != metrics.device_peak_flops(
        torch.device("cuda", 0), "bf16"
    )  # NaN: an unknown GPU gives no MFU rather than a made-up one


def test_cpu_peak_is_a_measured_matmul(monkeypatch):
    monkeypatch.setattr(metrics, "_CPU_PEAK", {})
    fp32 = metrics.device_peak_flops(torch.device("cpu"), "fp32")
    bf16 = metrics.device_peak_flops(torch.device("cpu"), "bf16")
    assert fp32 > 1e8 and bf16 > 1e8  # any CPU does 0.1 GFLOP/s
    assert set(metrics._CPU_PEAK) == {torch.float32, torch.bfloat16}
    assert metrics.device_peak_flops(torch.device("cpu"), "fp32") == fp32  # measured once, then cached
    # one core's rate times the cores torch computes on
    monkeypatch.setattr(metrics, "usable_cpus", lambda: 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = metrics.measured_cpu_flops()
        torch.set_num_threads(2)
        assert metrics.measured_cpu_flops() == pytest.approx(2 * one)
        monkeypatch.setattr(metrics, "usable_cpus", lambda: 1)
        assert metrics.measured_cpu_flops() == pytest.approx(one)  # no more cores than it may use
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads


BUSY = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"


def test_cpu_peak_holds_while_other_processes_load_every_core(monkeypatch):
    """The peak is timed in the measuring thread's CPU time: other jobs on the machine take time
    slices away, not FLOPs per CPU-second, so a peak measured under load is not lowered (in
    wall-clock time it halved, and a run that went on after the load stopped showed MFU 150%)."""
    import subprocess
    import sys
    import time

    def measure() -> float:
        monkeypatch.setattr(metrics, "_CPU_PEAK", {})
        return metrics.measured_cpu_flops(torch.float32)

    quiet = max(measure() for _ in range(2))
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2 * metrics.usable_cpus())]
    try:
        time.sleep(1)  # the hogs are spinning
        loaded = max(measure() for _ in range(3))
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    # Timed in wall-clock time the loaded peak was under half the quiet one; in CPU time it
    # loses only what shared caches cost (up to 25% on CI, whose other test process is busy too).
    assert loaded > 0.6 * quiet, (loaded, quiet)


def test_usable_cpus_is_at_most_the_affinity():
    import os

    assert 1 <= metrics.usable_cpus() <= len(os.sched_getaffinity(0))
