"""Shared pieces of the CPU benchmarks: the benchmark model, one training step, timing helpers.

The scripts put this folder on sys.path themselves (it is where they live), so
`import common` works from any working directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# The shape: d_model 256, 4 layers, 8 heads, vocab 8192, seq 256, batch 8;
# Llama flavour (RMSNorm, SwiGLU, RoPE, untied, no biases).
SHAPE = dict(vocab=8192, d_model=256, layers=4, heads=8, seq=256, batch=8)
TINY = dict(vocab=512, d_model=64, layers=2, heads=4, seq=32, batch=2)


def loomtrain_config(shape: dict):
    from loomtrain.model import ModelConfig

    return ModelConfig(
        vocab_size=shape["vocab"],
        d_model=shape["d_model"],
        n_layers=shape["layers"],
        n_heads=shape["heads"],
        max_seq_len=shape["seq"],
        norm="rmsnorm",
        activation="swiglu",
        positions="rope",
        tie_embeddings=False,
        bias=False,
        dropout=0.0,
        norm_eps=1e-5,
    )


def loadavg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def batch(shape: dict, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_step(
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    params: list[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    bf16: bool,
    clip: float | None = None,
) -> torch.Tensor:
    """loss_of(x, y) (forward + float32 cross-entropy, each contender its own way), backward,
    (clip), AdamW step: the same for every contender."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_of(x, y)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def matmul_flops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of a square [size x size] @ [size x size] matmul, run for about `seconds`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b
    n, start = 0, time.perf_counter()
    while True:
        a @ b
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n * 2 * size**3 / elapsed


def timed(fn: Callable[[], object], steps: int) -> float:
    """Seconds per call of fn, over `steps` calls."""
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def profile(fn: Callable[[], object], steps: int, title: str, rows: int = 18) -> None:
    """torch.profiler table (self CPU time) over `steps` calls of fn."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    print(f"\n--- profile: {title} ({steps} steps, sorted by self CPU time) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


# The real loop path: a RunConfig -> DeepSpeed engine + TrainContext --------------------------
def engine_context(cfg, model=None, run_dir: str = "/tmp/loomtrain-bench"):
    """The pieces loomtrain.launcher.training.loop.run_training builds before its first step (the
    process group, topology, model, then engine and context via loop.build_context) as a
    TrainContext, so `loop.train_step(ctx, grad_accum, guard)` runs exactly the loop's step.
    `model`: an already built model to use instead of startup.build_model's."""
    from pathlib import Path

    from loomtrain.launcher.distributed import init_distributed
    from loomtrain.launcher.training import startup
    from loomtrain.launcher.training.loop import build_context

    env = init_distributed(cfg)
    topology = startup.build_topology(cfg, env)
    if model is None:
        model = startup.build_model(cfg, topology, env.device)
    # no data: the caller sets ctx.train_stream (e.g. RepeatBatch)
    ctx = build_context(cfg, env, topology, Path(run_dir), model, None, None, None)
    ctx.engine.train()
    return ctx


def checkpoint_rig(model_args: list[str], tp: int, run_dir: str | Path):
    """(ctx, training) of one rank of the checkpoint benchmarks: configs/tiny.yaml with
    `model_args`, fp32 on the CPU, ZeRO 0 alone or ZeRO 1 at world > 1, one sample per DP rank,
    and the Training parts a save and a resume take. Each rank in its own process (torchrun)."""
    from loomtrain.launcher.checkpoints.parts import Training
    from loomtrain.launcher.config_loader import load_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    zero = 0 if world == 1 else 1
    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
        [
            *model_args,
            "model.max_seq_len=64",
            "train.seq_len=64",
            f"parallel.tp={tp}",
            f"parallel.zero_stage={zero}",
            "train.precision=fp32",
            "train.device=cpu",
            "train.micro_batch_size=1",
            f"train.global_batch_size={world // tp}",
            "log.tensorboard=false",
        ],
        world_size=world,
    )
    ctx = engine_context(cfg, run_dir=str(run_dir))
    # staging: the async snapshot's host buffers kept from one save to the next, as the checkpoint hook keeps them
    return ctx, Training(ctx.engine, ctx.topology, zero_stage=zero, staging={})


class RepeatBatch:
    """A stand-in for the token stream: the same (inputs, targets) batch forever."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        return self

    def __next__(self):
        return self.x, self.y

    def close(self) -> None:
        pass


def keep_freed_memory() -> bool:
    """glibc malloc: serve every allocation from the heap and never hand freed memory back.

    By default glibc mmaps each block over 32 MB (the logits, log-softmax and their
    gradients here: [2048, 8192] fp32 = 64 MB each) and unmaps it on free, so every step
    page-faults those blocks in again: ~20 ms per 64 MB block on this machine, ~14% of a
    training step of the benchmark model. (jemalloc/tcmalloc via LD_PRELOAD do the same
    job.) Affects the whole process; returns False where mallopt is not there (non-glibc).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**30))
    except (OSError, AttributeError):
        return False


# Scripts that run one worker per layout (checkpoint_scale.py, checkpoint_speed.py) ---------
def add_worker_args(ap: argparse.ArgumentParser) -> None:
    """The hidden arguments run_layout passes to the script's own --worker mode."""
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)


def write_row(out: str | Path, rank: int, row: dict) -> None:
    """One rank's figures, in a file of its own beside --out (run_layout reads them all). A file
    per rank, not a gather to rank 0: an all_gather_object as the last act of a gloo process
    lets a gloo thread drop the gathered tensors while Python shuts down, and the process
    aborts on the way out ("terminate called without an active exception": seen in 7 of 42
    two-rank runs of checkpoint_speed.py --tiny)."""
    Path(f"{out}.rank{rank:05d}").write_text(json.dumps(row))


def run_layout(
    script: Path, tp: int, dp: int, tmp: Path, extra: list[str], env: dict[str, str], timeout: int = 3600
) -> list[dict]:
    """`script --worker` at tp x dp in processes of its own (torchrun above one rank), with a run
    directory and an --out path under tmp; returns the rows the ranks wrote (write_row), in rank
    order. The run directory goes afterwards: GBs at a full size, so one layout at a time."""
    world = tp * dp
    out, run_dir = tmp / f"tp{tp}dp{dp}.json", tmp / f"run_tp{tp}dp{dp}"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", **env}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    head = [sys.executable]
    if world > 1:
        head += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    cmd = [*head, str(script), "--worker", "--tp", str(tp), "--run-dir", str(run_dir), "--out", str(out), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=script.parents[1])
    shutil.rmtree(run_dir, ignore_errors=True)
    if p.returncode != 0:
        sys.exit(f"{script.stem}: tp {tp} x dp {dp} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return [json.loads(out.with_name(f"{out.name}.rank{rank:05d}").read_text()) for rank in range(world)]
