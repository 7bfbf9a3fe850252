"""What the DeepSpeed engine costs: loomtrain's training step against a plain torch loop, world size 1.

    python benchmarks/engine_overhead.py                   # fp32, ZeRO 0, 2 threads
    python benchmarks/engine_overhead.py --zero 0 1 --rounds 20 --profile

Both train the cpu_vs_hf model (Llama flavour, d_model 256, 4 layers, 8 heads,
vocab 8192, seq 256, batch 8) from the same weights on the same batch:

* engine: the real loop path: the RunConfig -> launcher/training/engine.py's build_engine
  (DeepSpeed engine, client torch AdamW, LambdaLR) -> launcher/training/loop.py's
  `train_step` (engine forward, loss, engine.backward, grad norm, engine.step),
  exactly what `loomtrain train` runs per step;
* plain: forward, cross-entropy, backward, torch.nn.utils.clip_grad_norm_, AdamW
  step (the same param groups), LambdaLR step, zero_grad;
* before: the engine step as the loop ran it before its steps stopped reading back
  (December 2026): the grad norm from each gradient's squares copied to the CPU one by one,
  the loss and the norm read back every step, the stop vote every step. `engine` is a
  step between log steps now: nothing read back (at fp32 ZeRO-0 the skip guard still reads
  the one norm it decides on).

Measured alternately in many short rounds (the order flips every round); reported:
median tokens/s of each and the median per-round ratio engine/plain (target >= 0.95),
and engine/before.
With --precision bf16 the engine keeps bf16 weights and fp32 master weights
(DeepSpeed's bf16 optimizer) while the plain loop uses torch.autocast: not the same
arithmetic, shown for information only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run_config(shape: dict, precision: str, zero: int):
    from loomtrain.launcher.config_loader import load_config

    over = [
        f"model.vocab_size={shape['vocab']}",
        f"model.d_model={shape['d_model']}",
        f"model.n_layers={shape['layers']}",
        f"model.n_heads={shape['heads']}",
        "model.n_kv_heads=null",
        f"model.max_seq_len={shape['seq']}",
        "model.norm=rmsnorm",
        "model.activation=swiglu",
        "model.positions=rope",
        "model.tie_embeddings=false",
        f"train.seq_len={shape['seq']}",
        f"train.micro_batch_size={shape['batch']}",
        f"train.global_batch_size={shape['batch']}",
        f"train.precision={precision}",
        f"parallel.zero_stage={zero}",
        "train.device=cpu",
        "train.grad_clip=1.0",
        "run.dir=/tmp/loomtrain-bench/engine_overhead",
    ]
    return load_config(REPO / "configs" / "tiny.yaml", over, world_size=1)


def plain_step_fn(cfg, x, y, bf16: bool):
    from loomtrain.launcher.training.engine import build_optimizer, lr_lambda
    from loomtrain.model import Transformer

    model = Transformer(cfg.model, seed=cfg.train.seed).train()
    opt = build_optimizer(cfg, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, targets=y)  # the loop's loss path, so only the engine differs
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach()), float(norm)

    return step


def per_gradient_norm(model: torch.nn.Module) -> float:
    """The grad norm as launcher/training/engine.py computed it before: each gradient's squares summed and
    copied to the CPU, one by one (world 1, so no TP all-reduce)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            total += p.grad.detach().float().pow(2).sum().double().cpu()
    return float(total.sqrt())


def engine_before_step_fn(cfg, x, y):
    """The loop's step before it stopped reading back (grad_accum 1, world 1): what it read every step."""
    from loomtrain.launcher.training.engine import records_grad_norm
    from loomtrain.launcher.training.nonfinite import SkipGuard
    from loomtrain.launcher.training.stopping import StopRequest

    ctx = common.engine_context(cfg)
    engine = ctx.engine
    guard = SkipGuard(engine, cfg.train.max_consecutive_skips, cfg.train.precision)
    stop = StopRequest()

    def step():
        loss = engine(x, targets=y)
        engine.backward(loss)
        norm = None if records_grad_norm(engine) else per_gradient_norm(ctx.model)
        with guard.step(norm):
            engine.step()
        recorded = engine.get_global_grad_norm()
        if recorded is not None:
            norm = float(recorded)
        stop.agree(ctx.dist.device)
        ctx.state.step += 1
        return float(loss.detach().float()), float("nan") if norm is None else norm

    return step


def engine_step_fn(cfg, x, y):
    from loomtrain.launcher.training import loop
    from loomtrain.launcher.training.nonfinite import SkipGuard

    ctx = common.engine_context(cfg)
    ctx.train_stream = common.RepeatBatch(x, y)
    guard = SkipGuard(ctx.engine, cfg.train.max_consecutive_skips, cfg.train.precision)

    def step():
        out = loop.train_step(ctx, 1, guard)
        ctx.state.step += 1
        return out

    def read(out) -> tuple[float, float]:  # what a log step reads back
        fig = loop.dp_reduce([out], ctx)[0]
        return fig.loss, fig.grad_norm

    return step, read


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--zero", nargs="+", type=int, default=[0], choices=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of each step")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (smoke test of the script)")
    args = ap.parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "cpu"
    torch.set_num_threads(args.threads)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    shape = common.TINY if args.tiny else common.SHAPE
    x, y = common.batch(shape)
    tokens = x.numel()
    print(f"torch {torch.__version__}, {args.threads} threads, shape {shape}")
    results = []
    for precision in args.precision:
        for zero in args.zero:
            cfg = run_config(shape, precision, zero)
            engine_step, engine_read = engine_step_fn(cfg, x, y)
            steps = {
                "engine": engine_step,
                "before": engine_before_step_fn(cfg, x, y),
                "plain": plain_step_fn(cfg, x, y, precision == "bf16"),
            }
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            print(f"\n== {precision}, ZeRO {zero}: load average {common.loadavg()}")
            first = {name: fn() for name, fn in steps.items()}  # warm-up; same weights, same batch
            first["engine"] = engine_read(first["engine"])
            print(
                "  first step (loss, grad norm): "
                + " | ".join(f"{name} {loss:.5f}, {norm:.5f}" for name, (loss, norm) in first.items())
            )
            for fn in steps.values():
                fn()
            t = {name: [] for name in steps}
            ratios, vs_before = [], []
            for r in range(args.rounds):
                order = list(steps) if r % 2 == 0 else list(reversed(steps))
                for name in order:
                    t[name].append(common.timed(steps[name], args.steps_per_round))
                ratios.append(t["plain"][-1] / t["engine"][-1])
                vs_before.append(t["before"][-1] / t["engine"][-1])
                print(
                    f"  round {r + 1:2d}/{args.rounds}: "
                    + "  ".join(f"{name} {t[name][-1]:.3f} s" for name in steps)
                    + f"  ratio {ratios[-1]:.3f}, engine/before {vs_before[-1]:.3f}",
                    flush=True,
                )
            res = {
                "precision": precision,
                "zero": zero,
                "engine_tok_s": tokens / common.median(t["engine"]),
                "before_tok_s": tokens / common.median(t["before"]),
                "plain_tok_s": tokens / common.median(t["plain"]),
                "ratio": common.median(ratios),
                "vs_before": common.median(vs_before),
                "ratio_of_medians": common.median(t["plain"]) / common.median(t["engine"]),
                "loadavg": common.loadavg(),
            }
            results.append(res)
            print(
                f"  engine {res['engine_tok_s']:,.0f} tok/s | before {res['before_tok_s']:,.0f} tok/s "
                f"(engine/before {res['vs_before']:.3f}) | plain {res['plain_tok_s']:,.0f} tok/s | ratio "
                f"engine/plain {res['ratio']:.3f} (median of {args.rounds} rounds, range {min(ratios):.3f}.."
                f"{max(ratios):.3f}; ratio of medians {res['ratio_of_medians']:.3f}); load average {res['loadavg']}"
            )
            if args.profile:
                for name, fn in steps.items():
                    common.profile(fn, 3, f"{name} {precision} ZeRO {zero}")
    print("\nsummary")
    for r in results:
        print(
            f"  {r['precision']} ZeRO {r['zero']}: engine {r['engine_tok_s']:,.0f} tok/s, before "
            f"{r['before_tok_s']:,.0f} tok/s (engine/before {r['vs_before']:.3f}), plain "
            f"{r['plain_tok_s']:,.0f} tok/s, ratio {r['ratio']:.3f} (target >= 0.95), load average {r['loadavg']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
