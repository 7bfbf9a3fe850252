"""THE training loop: one for the local run, torchrun and Ray workers (no Ray code here).

    result = run_training(cfg)                 # in-process (tests, Ray workers)
    result.losses                              # per-step loss, DP-averaged

Each optimizer step runs grad_accum micro steps of
`loss = engine(x, targets=y); engine.backward(loss); engine.step()` (the model's output
layer computes the loss, see loomtrain.model.loss)
(DeepSpeed scales the loss by 1/grad_accum and steps the optimizer and the LR
schedule at the boundary). The step's reported loss is the mean over its micro
batches, all-reduced (mean) over the data-parallel group, so it equals the
single-process loss on the same global batch.

Plug-in points: `hooks` (see loomtrain.launcher.hooks) for checkpoints and Ray;
`components.build_model` for TP; `engine.build_engine` for ZeRO / precision;
`weights.save_final_sharded` for the final weights (each rank writes its share).
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loomtrain.launcher import components, weights
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.config_loader import save_config, to_dict, validate
from loomtrain.launcher.distributed import barrier, init_distributed
from loomtrain.launcher.engine import build_engine, grad_norm, records_grad_norm
from loomtrain.launcher.faults import Faults
from loomtrain.launcher.hooks import HookList, Hooks, TrainContext, TrainState, default_hooks
from loomtrain.launcher.metrics import MetricsLogger, device_peak_flops, gather_rank_stats, memory_bytes, mfu
from loomtrain.launcher.nonfinite import NonFiniteError, SkipGuard, inject
from loomtrain.launcher.profiling import StepProfiler
from loomtrain.launcher.ranklog import RankLog, logs_dir
from loomtrain.launcher.stopping import StopRequest, signal_name
from loomtrain.launcher.watchdog import Watchdog, io_phase
from loomtrain.model import flops_per_token as model_flops_per_token
from loomtrain.model import param_count


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # steps run by this call, in order
    steps: list[int] = field(default_factory=list)  # their step numbers (1-based)
    evals: dict[int, float] = field(default_factory=dict)  # step -> eval/loss
    final_dir: Path | None = None
    state: TrainState | None = None
    wall_s: float = 0.0
    stopped_by: int = 0  # the signal that stopped the run early (0: it was not stopped)


def _dp_mean(value: torch.Tensor, ctx: TrainContext) -> float:
    """Mean over the data-parallel group (TP ranks already agree)."""
    if ctx.topology.dp_size > 1:
        value = value.detach().clone().float()
        dist.all_reduce(value, group=ctx.topology.dp_group)
        value /= ctx.topology.dp_size
    return float(value)


def _to(batch, device):
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train_step(ctx: TrainContext, grad_accum: int, guard: SkipGuard | None = None) -> tuple[float, float]:
    """One optimizer step -> (loss averaged over micro batches and DP, grad norm); the
    seconds this rank waited for data go to ctx.extras["data_wait_s"].
    A non-finite step is skipped (see loomtrain.launcher.nonfinite); `guard` covers the
    one path DeepSpeed does not guard itself (fp32 at ZeRO 0)."""
    engine, device = ctx.engine, ctx.dist.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    norm = None
    data_wait = 0.0
    for micro in range(grad_accum):
        t0 = time.perf_counter()
        batch = next(ctx.train_stream)
        data_wait += time.perf_counter() - t0
        x, y = _to(batch, device)
        loss = inject(engine(x, targets=y), ctx.state.step + 1, ctx.dist.rank)  # test-only faults
        engine.backward(loss)
        own_norm = None
        if micro == grad_accum - 1 and not records_grad_norm(engine):
            norm = own_norm = grad_norm(ctx.model, engine.mpu)
        with guard.step(own_norm) if guard is not None else contextlib.nullcontext():
            engine.step()
        total += loss.detach().float()
    recorded = engine.get_global_grad_norm()
    if recorded is not None:
        norm = float(recorded)
    ctx.extras["data_wait_s"] = data_wait
    return _dp_mean(total / grad_accum, ctx), float("nan") if norm is None else norm


@torch.no_grad()
def evaluate(ctx: TrainContext) -> dict[str, float]:
    """eval/loss and eval/ppl over eval.batches micro batches of the val split per DP rank."""
    engine, device = ctx.engine, ctx.dist.device
    stream = components.val_stream(ctx.cfg, ctx.shard_dir, ctx.topology, ctx.tokenizer)
    engine.eval()
    try:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for _ in range(ctx.cfg.eval.batches):
            x, y = _to(next(stream), device)
            total += engine(x, targets=y).float()
    finally:
        stream.close()
        engine.train()
    loss = _dp_mean(total / ctx.cfg.eval.batches, ctx)
    return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0))}


@torch.no_grad()
def samples(ctx: TrainContext) -> list[str]:
    """A few continuations of eval.prompt (every rank runs it, in step; rank 0 logs them).

    Skipped where the model cannot run alone: ZeRO-3 partitions, sequence parallelism.
    """
    e = ctx.cfg.eval
    if e.num_samples == 0 or e.sample_tokens == 0:
        return []
    if ctx.cfg.parallel.zero_stage == 3 or ctx.cfg.parallel.sequence_parallel:
        return []
    from loomtrain.parallel import gathered_logits

    prompt = ctx.tokenizer.encode(e.prompt) or [ctx.tokenizer.eos_id]
    room = ctx.cfg.model.max_seq_len - len(prompt)
    if room <= 0:
        return []
    tokens = torch.tensor([prompt] * e.num_samples, dtype=torch.long, device=ctx.dist.device)
    gen = torch.Generator(device=ctx.dist.device).manual_seed(ctx.cfg.train.seed + ctx.state.step)
    with gathered_logits(ctx.model) as model:
        out = model.generate(
            tokens,
            min(e.sample_tokens, room),
            temperature=e.temperature,
            top_k=e.top_k or None,
            generator=gen,
        )
    return [ctx.tokenizer.decode(row.tolist()) for row in out]


def _is_final(step: int, cfg: RunConfig) -> bool:
    return step == cfg.train.max_steps


def run_training(cfg: RunConfig, hooks: Iterable[Hooks] = ()) -> TrainResult:
    """Train per `cfg` on this rank; every rank of the job calls it.

    Everything this rank prints from here on is also appended to RUN_DIR/logs/rank_NNNNN.log
    (loomtrain.launcher.ranklog); a watchdog ends the run with one line naming the stuck
    rank when a step makes no progress for parallel.timeout_s (loomtrain.launcher.watchdog);
    SIGTERM / SIGINT / SIGHUP save a checkpoint and stop (loomtrain.launcher.stopping)."""
    wall_start = time.perf_counter()
    env = init_distributed(cfg)
    validate(cfg, env.world_size)  # batch-size rules against the real world size
    run_dir = components.run_dir(cfg)
    if env.is_logging_rank:
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier()  # the rank logs go into the directory rank 0 just made
    rank_log = RankLog(run_dir, env.rank, env.world_size, env.launcher).install()
    stop = StopRequest(run_dir, watch_file=env.is_logging_rank).install()
    if env.is_logging_rank:
        stop.clear_file()  # a request left by an earlier run is not for this one
    try:
        return _train(cfg, env, run_dir, list(hooks), stop, rank_log, wall_start)
    except BaseException:
        # what ended this rank, in its own log (a launcher may print it elsewhere, or not at all)
        rank_log.write("loomtrain: this rank failed:\n" + traceback.format_exc())
        raise
    finally:
        stop.uninstall()
        rank_log.close()


def _train(
    cfg: RunConfig, env, run_dir: Path, hooks: list[Hooks], stop: StopRequest, rank_log: RankLog, wall_start: float
) -> TrainResult:
    components.seed_everything(cfg.train.seed)
    topology = components.build_topology(cfg, env)
    ctx = TrainContext(cfg=cfg, dist=env, topology=topology, run_dir=run_dir)
    say = print if env.is_logging_rank else (lambda *a, **k: None)
    ctx.shard_dir, ctx.tokenizer, ctx.train_stream = components.build_data(cfg, topology, env, log=say)
    if cfg.eval.every_steps:  # an unusable val split fails now, not at the first eval
        components.val_stream(cfg, ctx.shard_dir, topology, ctx.tokenizer).close()
    ctx.model = components.build_model(cfg, topology, env.device)
    ctx.engine, ctx.optimizer, ctx.scheduler = build_engine(cfg, ctx.model, topology.dp_size, mpu=topology.mpu)
    ctx.model = ctx.engine.module
    grad_accum = cfg.train.grad_accum_steps(topology.dp_size)

    hook = HookList([*default_hooks(cfg), *hooks])
    hook.on_train_start(ctx)  # resume happens here
    if env.is_logging_rank:  # after the resume: a refused one leaves the earlier config.yaml as it was
        save_config(cfg, run_dir / "config.yaml")

    t = cfg.train
    start_step = ctx.state.step
    ctx.metrics = MetricsLogger(
        run_dir,
        t.max_steps,
        enabled=env.is_logging_rank,
        tensorboard=cfg.log.tensorboard,
        progress=cfg.log.progress,
        start_step=start_step,
    )
    log = ctx.metrics
    n_params = param_count(cfg.model)
    log.message(
        f"loomtrain: {cfg.run.name}: {n_params / 1e6:.2f} M params, world {env.world_size} "
        f"(tp {topology.tp_size} x dp {topology.dp_size}), {env.device.type}, {t.precision}, "
        f"zero {cfg.parallel.zero_stage}, grad_accum {grad_accum}, steps {start_step}->{t.max_steps}"
    )
    if start_step >= t.max_steps:
        log.message(
            f"nothing to train: {run_dir} is already at step {start_step} (train.max_steps={t.max_steps}); "
            f"raise train.max_steps to continue, or pick another run.dir / checkpoint.resume=never"
        )
    log.hparams(to_dict(cfg))
    flops_per_token = model_flops_per_token(cfg.model, t.seq_len)
    peak = device_peak_flops(env.device, t.precision) * env.world_size  # NaN for an unknown GPU
    tokens_per_step = t.global_batch_size * t.seq_len

    result = TrainResult(run_dir=run_dir, state=ctx.state)
    guard = SkipGuard(ctx.engine, t.max_consecutive_skips, t.precision)
    faults = Faults.from_env()  # test-only; NO_FAULTS in a real run
    profiler = StepProfiler(cfg, env.rank, run_dir, env.device)
    dog = Watchdog(
        run_dir, env.rank, env.world_size, cfg.parallel.timeout_s, cfg.checkpoint.timeout_s, rank_log=rank_log
    ).start()
    try:
        ctx.engine.train()
        loop_start, elapsed_at_start = time.perf_counter(), ctx.state.elapsed
        while ctx.state.step < t.max_steps and not ctx.stop_requested:
            step_start = time.perf_counter()
            profiler.before_step(ctx.state.step + 1)
            lr = float(ctx.engine.get_lr()[0])  # what this step uses (the schedule steps after it)
            loss, norm = train_step(ctx, grad_accum, guard)
            if faults.active:
                faults.during_step(env.rank, ctx.state.step + 1)
            step_time = time.perf_counter() - step_start
            ctx.state.step += 1
            ctx.state.tokens_seen += tokens_per_step
            ctx.state.elapsed = elapsed_at_start + time.perf_counter() - loop_start
            step = ctx.state.step
            dog.beat(step)
            tps = tokens_per_step / step_time
            metrics: dict[str, Any] = {
                "loss": loss,
                "lr": lr,
                "grad_norm": norm,
                "tokens_per_s": tps,
                "mfu": mfu(flops_per_token, tps, peak),
                "step_time_s": step_time,
                "mem_bytes": memory_bytes(env.device),
                "tokens_seen": ctx.state.tokens_seen,
                "skipped_steps": guard.skipped_steps,
            }
            result.losses.append(loss)
            result.steps.append(step)
            ctx.last_metrics = metrics
            if step % cfg.log.every_steps == 0 or _is_final(step, cfg):
                # every rank, same step: the job-wide straggler figures (one small all-gather)
                metrics.update(
                    gather_rank_stats(step_time, ctx.extras.get("data_wait_s", 0.0), metrics["mem_bytes"], env.device)
                )
                log.log(step, metrics)
                log.console(step, metrics, time.perf_counter() - loop_start, step - start_step)
            if profiler.enabled:  # writing a trace may take long: it is I/O, not a hang
                with dog.phase("profiler trace export", cfg.checkpoint.timeout_s):
                    table = profiler.after_step(step)
                if table is not None:
                    log.text("profile/top_ops", "```\n" + table + "\n```", step, raw=True)
            if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or _is_final(step, cfg)):
                ev = evaluate(ctx)
                result.evals[step] = ev["eval/loss"]
                log.log(step, ev)
                log.message(f"eval step {step}: loss {ev['eval/loss']:.4f} | ppl {ev['eval/ppl']:.2f}")
                for i, text in enumerate(samples(ctx)):
                    log.text(f"samples/{i}", text, step)
                    if i == 0:
                        log.message(f"sample: {text[:200]!r}")
                hook.on_eval_end(ctx, ev)
                log.flush()
                dog.beat(step, "eval")
            signum = stop.agree(env.device)  # every rank, same step: one tiny all-reduce
            if signum:
                ctx.stop_requested = True
                ctx.extras["stop_signal"] = signum
            hook.on_step_end(ctx, metrics)
            dog.beat(step)
            if faults.active:
                faults.after_step(env.rank, step, run_dir)
            try:
                guard.after_step(step, loss)
            except NonFiniteError as exc:
                log.message(f"error: {exc}")
                log.close()
                ctx.train_stream.close()
                raise
        profiler.finish(ctx.state.step)
        hook.on_train_end(ctx)
        if ctx.state.step >= t.max_steps:
            result.final_dir = _save_final(ctx)
    finally:
        dog.stop()
    ctx.train_stream.close()
    result.wall_s = time.perf_counter() - wall_start
    result.stopped_by = ctx.extras.get("stop_signal", 0)
    if result.stopped_by:
        if env.is_logging_rank:
            stop.clear_file()
        log.message(
            f"loomtrain: {signal_name(result.stopped_by)}: stopped at step {ctx.state.step} "
            f"(checkpoint saved); the same command resumes from it"
        )
    elif ctx.state.step > start_step and result.losses:
        log.message(
            f"done: step {ctx.state.step}, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
            f"{ctx.state.elapsed:.0f} s training, {result.wall_s:.0f} s total"
        )
    log.message(f"run directory: {run_dir.absolute()}")
    if cfg.log.tensorboard:
        log.message(f"TensorBoard logs: {log.tb_dir.absolute()}  (tensorboard --logdir {run_dir.absolute().parent})")
    log.message(f"rank logs: {logs_dir(run_dir).absolute()}/")
    log.close()
    return result


def _save_final(ctx: TrainContext) -> Path | None:
    """final/: every rank writes its share of the full weights (see weights.save_final_sharded)."""
    final = ctx.run_dir / "final"
    with io_phase("final weights"):
        weights.save_final_sharded(ctx.engine, ctx.topology, ctx.cfg.model, ctx.tokenizer, final)
    ctx.metrics.message(f"final weights: {final.absolute()}")
    return final
