"""One GPU, a ~1 B model, the real training step: tokens/s, MFU and peak memory.

    benchmarks/gpu.sh [--compile] [--ac] [--micro-batch 4] [--steps 20]    # the usual entry
    python benchmarks/gpu_bench.py --tiny                                   # CPU smoke run of this code

The model is configs/gpt-1b.yaml's (d_model 2048, 24 layers, 16 heads, vocab 32768,
seq 2048, RMSNorm/SwiGLU/RoPE, untied: 1.34 B parameters) on one device (tp 1), bf16
under the DeepSpeed engine built by launcher/training/engine.py, one step = launcher/training/loop.py's
`train_step` on a fixed random batch (data loading is not measured). SDPA runs its
flash kernel (--attn flash, the default, insists on it; --attn auto lets torch choose).
--compile compiles each transformer block (parallel.compile: torch.compile, names
unchanged); --ac checkpoints each block's activations (parallel.activation_checkpointing).

Prints tokens/s, MFU (model FLOPs per token x tokens/s / the GPU's dense bf16 peak from
loomtrain.launcher.observe.metrics.GPU_PEAK_FLOPS) and peak memory. Exits 2 with a message when
no CUDA device exists (unless --tiny).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = [
    "model.vocab_size=512",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=null",
    "model.max_seq_len=64",
    "train.seq_len=64",
]


def run_config(args):
    from loomtrain.launcher.config_loader import load_config

    over = [
        "parallel.tp=1",
        f"parallel.zero_stage={args.zero}",
        "ray.num_workers=1",
        f"parallel.activation_checkpointing={str(args.ac).lower()}",
        f"parallel.compile={str(args.compile).lower()}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        f"train.precision={args.precision}",
        f"train.device={'cpu' if args.tiny else 'cuda'}",
        "train.warmup_steps=1",
        "run.dir=/tmp/loomtrain-bench/gpu",
    ]
    if args.tiny:
        over += TINY_MODEL
    if args.seq_len:
        over += [f"train.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}"]
    return load_config(REPO / "configs" / "gpt-1b.yaml", over, world_size=1)


def si(x: float, unit: str) -> str:
    """1.34e9 -> '1.34 G<unit>'."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def attention_context(args, device: torch.device):
    """--attn flash: SDPA may use its flash kernel only (fail if it cannot)."""
    if args.attn != "flash" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 128, 128, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as exc:
        raise SystemExit(
            f"gpu_bench: SDPA's flash kernel is not available on this GPU ({exc}); rerun with --attn auto"
        ) from exc
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=0, help="override seq len (default: the config's 2048)")
    ap.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--attn", default="flash", choices=["flash", "auto"])
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation happens here)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: exercise this script")
    args = ap.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA device: torch.cuda.is_available() is False. Run this on a machine "
            "with a GPU (or pass --tiny for a CPU smoke run of the script).",
            file=sys.stderr,
        )
        return 2
    wall = time.perf_counter()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    cfg = run_config(args)
    device = torch.device("cpu") if args.tiny else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    from loomtrain.launcher.observe.metrics import gpu_peak_flops, measured_cpu_flops, mfu
    from loomtrain.launcher.training import loop, startup
    from loomtrain.launcher.training.nonfinite import SkipGuard
    from loomtrain.model import Transformer, flops_per_token, param_count

    # The model is built straight on the device (initialising 1.3 B parameters on the host
    # first would take longer than the benchmark), then as startup.build_model does.
    with torch.device(device):
        model = Transformer(cfg.model, seed=cfg.train.seed)
    startup.apply_block_options(model, cfg)  # parallel.activation_checkpointing / .compile
    ctx = common.engine_context(cfg, model=model)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    t = cfg.train
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=g).to(device)
    ctx.train_stream = common.RepeatBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    guard = SkipGuard(ctx.engine, t.max_consecutive_skips, t.precision)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    n = param_count(cfg.model)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"gpu_bench: {name}; {si(n, '')}params (d_model {cfg.model.d_model}, {cfg.model.n_layers} layers, "
        f"{cfg.model.n_heads} heads, vocab {cfg.model.vocab_size}); seq {t.seq_len} x micro batch "
        f"{t.micro_batch_size}; {t.precision}, ZeRO {cfg.parallel.zero_stage}, compile {args.compile}, "
        f"activation checkpointing {args.ac}, attention {args.attn}",
        flush=True,
    )

    def step():
        loss = loop.train_step(ctx, 1, guard).loss
        ctx.state.step += 1
        return loss

    with attention_context(args, device):
        start = time.perf_counter()
        for i in range(args.warmup):
            loss = step()
            print(
                f"  warm-up step {i + 1}/{args.warmup}: loss {loss:.4f} ({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        sync()
        elapsed = time.perf_counter() - start

    tok_s = args.steps * t.micro_batch_size * t.seq_len / elapsed
    fpt = flops_per_token(cfg.model, t.seq_len)
    if device.type == "cuda":
        peak = gpu_peak_flops(name)
        peak_src = "bf16 dense peak" if peak else "unknown GPU: add it to GPU_PEAK_FLOPS"
        mem = torch.cuda.max_memory_allocated(device)
        mem_line = (
            f"peak memory {mem / 2**30:.1f} GiB allocated, {torch.cuda.max_memory_reserved(device) / 2**30:.1f} "
            f"GiB reserved of {torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"
        )
    else:
        peak = measured_cpu_flops(torch.bfloat16 if t.precision == "bf16" else torch.float32)
        peak_src = "measured CPU matmul"
        import psutil

        mem_line = f"process RSS {psutil.Process().memory_info().rss / 2**30:.2f} GiB"
    util = mfu(fpt, tok_s, peak) if peak else float("nan")
    print(f"  {args.steps} steps in {elapsed:.2f} s, last loss {loss:.4f}")
    print(
        f"tokens/s {tok_s:,.0f} | step {1e3 * elapsed / args.steps:.1f} ms | {si(fpt, 'FLOP')}/token | "
        f"{si(fpt * tok_s, 'FLOP/s')} | MFU {100 * util:.1f}% (of {si(peak or float('nan'), 'FLOP/s')}, "
        f"{peak_src}) | {mem_line} | total {time.perf_counter() - wall:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
