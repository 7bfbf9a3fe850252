"""THE training loop: one for the local run, torchrun and Ray workers (no Ray code here).

    result = run_training(cfg)                 # in-process (tests, Ray workers)
    result.losses                              # per-step loss, DP-averaged

`run_training` is set-up (`_set_up`: process group, data, model, engine, resume, metrics,
watchdog), the loop (`_loop`: the optimizer steps, with evaluation and samples every
eval.every_steps in `_evaluate_and_sample`) and the finish (`_finish`: the end-of-training
hooks, the final weights, the summary). Everything set-up opens goes onto one ExitStack, so
however the run ends (the last step, a stop signal, or any exception) the data stream's
prefetch thread, the metrics file and TensorBoard writer, the watchdog, a running profile and
the signal handlers are closed, in reverse order, and the rank log last.

Each optimizer step runs grad_accum micro steps of
`loss = engine(x, targets=y); engine.backward(loss); engine.step()` (the model's output
layer computes the loss, see loomtrain.model.loss)
(DeepSpeed scales the loss by 1/grad_accum and steps the optimizer and the LR
schedule at the boundary). The step's loss is the mean over the target tokens of the
whole global batch (every micro batch, every DP rank), not a mean of per-micro-batch
means: with loss masks or packed documents each micro batch's mean is weighted by its
share of the step's targets (`_loss_weights`), so the same data gives the same loss and
gradients at any micro-batch size, accumulation or DP size; plain text in full windows,
where every micro batch has as many targets, needs no weights (the step is unchanged).
The reported loss is that mean (each rank's part all-reduced over the data-parallel
group), so it equals the single-process loss on the same global batch.

A step between log steps reads nothing back to the host and adds no collective to
DeepSpeed's own: its loss (and grad norm) stay on the device until the next log step,
which averages all of them over DP in one all-reduce and reads them in one copy
(`_report_pending`); the ranks vote on a stop request on log steps and every
train.stop_check_every_steps (`_votes_at`). tests/distributed/test_step_syncs.py counts them.

Plug-in points: `hooks` (see loomtrain.launcher.hooks) for checkpoints and Ray;
`startup.build_model` for TP; `engine.build_engine` for ZeRO / precision;
`checkpoints.final.save_final_sharded` for the final weights (each rank writes its share);
LOOMTRAIN_PLUGIN for hooks from outside the package (loomtrain.launcher.training.plugins).
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from loomtrain.data_pipeline import TokenStream
from loomtrain.data_pipeline.tokenizer import Tokenizer
from loomtrain.launcher import rundir
from loomtrain.launcher.checkpoints.final import final_location, save_final_sharded
from loomtrain.launcher.checkpoints.hook import CheckpointHook
from loomtrain.launcher.checkpoints.weight_source import check_init_from
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.config_loader import save_config, to_dict, validate
from loomtrain.launcher.distributed import DistEnv, barrier, init_distributed, master_address
from loomtrain.launcher.hooks import HookList, Hooks, TrainContext, TrainState
from loomtrain.launcher.observe import host_memory
from loomtrain.launcher.observe.metrics import MetricsLogger, device_peak_flops, gather_rank_stats, memory_bytes, mfu
from loomtrain.launcher.observe.mirror import tb_uri
from loomtrain.launcher.observe.profiling import StepProfiler
from loomtrain.launcher.observe.ranklog import RankLog, logs_dir
from loomtrain.launcher.observe.watchdog import Watchdog, io_phase
from loomtrain.launcher.timeouts import EVALUATION, SAMPLES, allowances
from loomtrain.launcher.training import plugins, startup
from loomtrain.launcher.training.engine import build_engine, grad_norm, records_grad_norm
from loomtrain.launcher.training.nonfinite import NonFiniteError, SkipGuard
from loomtrain.launcher.training.stopping import StopRequest, signal_name
from loomtrain.model import flops_per_token as model_flops_per_token
from loomtrain.model import param_count
from loomtrain.model.loss import IGNORE_INDEX
from loomtrain.parallel import Topology, gathered_logits
from loomtrain.parallel.context import chunk_index
from loomtrain.parallel.topology import describe_hosts
from torch import nn

# data/samples_hash is the samples' digest sum modulo 2**40: each DP rank sends its part
# already reduced, so the float64 all-reduce of up to 8192 parts stays exact.
SAMPLES_HASH_MODULUS = 2**40


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # steps run by this call, in order
    steps: list[int] = field(default_factory=list)  # their step numbers (1-based)
    evals: dict[int, float] = field(default_factory=dict)  # step -> eval/loss
    final_dir: Path | str | None = None  # a URI with run.storage
    state: TrainState | None = None
    wall_s: float = 0.0  # this call, set-up and final weights included
    train_s: float = 0.0  # this call's training loop (at most wall_s; state.elapsed sums all calls)
    stopped_by: int = 0  # the signal that stopped the run early (0: it was not stopped)


class StepOutput(NamedTuple):
    loss: torch.Tensor  # this rank's part of the step's loss x dp, on the device (dp_reduce averages it over DP)
    grad_norm: torch.Tensor | float | None  # None where none was computed; a tensor stays on the device
    data_wait_s: float  # how long this rank waited for its batches
    samples_digest: int | None = None  # this rank's share of the samples' digest (see dp_reduce)


class StepFigures(NamedTuple):
    """A step's figures as the host sees them, once reduced over DP (see dp_reduce)."""

    loss: float  # averaged over the micro batches and the DP group
    grad_norm: float  # NaN where none was computed
    samples_hash: str | None  # the global batch's sample ids, hashed; None where the stream keeps none


@dataclass
class _Run:
    """What set-up hands to the loop and the finish."""

    ctx: TrainContext
    hooks: HookList
    log: MetricsLogger
    stop: StopRequest
    dog: Watchdog
    profiler: StepProfiler
    guard: SkipGuard
    result: TrainResult
    grad_accum: int
    start_step: int  # where this call started (after a resume)
    flops_per_token: float
    peak_flops: float  # the whole job's (NaN for an unknown GPU)
    pending: list[tuple[int, StepOutput]] = field(default_factory=list)  # steps not yet read back
    interval_time: float = 0.0  # world step time of the steps since the last log step
    interval_steps: int = 0
    loop_start: float = 0.0  # perf_counter at the first step of this call
    last_step_end: float = 0.0  # perf_counter when the previous step's compute ended (the loop start at first)
    outside_steps_at_end: float = 0.0  # dog.outside_steps_s then


def dp_reduce(outs: list[StepOutput], ctx: TrainContext) -> list[StepFigures]:
    """Steps' losses averaged over the DP group and their samples' digests summed over it, in
    one all-reduce, and their grad norms, read back in one copy -> each step's figures.

    Each number is what a per-step reduction gives: a loss is sent as float64 next to its digest
    (float32 where the stream keeps no digest) and divided by the DP size on the host. The digest
    sum is the same for the same global batch at any DP size, so two runs (say, one that lost a
    node and went on at a smaller DP) can be compared step by step."""
    if not outs:
        return []
    dp = ctx.topology.dp_size
    losses = torch.stack([o.loss.detach().reshape(()) for o in outs])
    digests = [o.samples_digest for o in outs]
    keep_digest = all(d is not None for d in digests)
    if keep_digest:
        digest_col = torch.tensor([float(d % SAMPLES_HASH_MODULUS) for d in digests], dtype=torch.float64)
        both = torch.stack([losses.double(), digest_col.to(losses.device)])
        loss_sums, digest_sums = _sum_over_dp(both, ctx).tolist()
        loss_list = [v / dp for v in loss_sums]
        hashes = [f"{int(v) % SAMPLES_HASH_MODULUS:010x}" for v in digest_sums]
    else:
        loss_list, hashes = (_sum_over_dp(losses.float(), ctx) / dp).tolist(), [None] * len(outs)
    return [StepFigures(loss, norm, h) for loss, norm, h in zip(loss_list, _read_norms(outs), hashes)]


def _sum_over_dp(t: torch.Tensor, ctx: TrainContext) -> torch.Tensor:
    """`t` summed over the data-parallel group, in place (no collective at DP 1)."""
    if ctx.topology.dp_size > 1:
        dist.all_reduce(t, group=ctx.topology.dp_group)
    return t


def _read_norms(outs: list[StepOutput]) -> list[float]:
    """The steps' grad norms as floats (NaN where none was computed), the device ones in one copy."""
    on_device = [o.grad_norm.detach().reshape(()).double() for o in outs if isinstance(o.grad_norm, torch.Tensor)]
    read = iter(torch.stack(on_device).tolist() if on_device else [])
    return [
        next(read) if isinstance(o.grad_norm, torch.Tensor) else float("nan" if o.grad_norm is None else o.grad_norm)
        for o in outs
    ]


def _forward(engine, batch, device):
    """The mean loss of one micro batch (inputs, targets[, document_ids]), moved to `device`, over
    its targets (those not -100); packed documents (a third tensor, the stream's document ids)
    attend and count positions each on its own."""
    x, y, *docs = (t.to(device, non_blocking=True) for t in batch)
    return engine(x, targets=y, document_ids=docs[0]) if docs else engine(x, targets=y)


def _own_targets(batch, topology) -> int:
    """The targets (not -100) of a micro batch that this rank's loss covers: with parallel.cp, its
    chunks of the window only (the stream hands every CP rank the whole window)."""
    y, cp = batch[1], getattr(topology, "cp_size", 1)
    if cp > 1:
        y = y[:, chunk_index(y.shape[1], cp, topology.cp_rank)]
    return int((y != IGNORE_INDEX).sum())


def _loss_weights(batches, ctx: TrainContext, grad_accum: int) -> list[torch.Tensor] | None:
    """What each micro batch's mean loss is multiplied by so that the step's loss is the mean over
    the target tokens of the whole global batch: n_micro * dp * grad_accum / N_global, where N_global,
    the step's target count over every micro batch and DP rank, is one all-reduce over DP (DeepSpeed
    then divides by grad_accum and averages over DP). None where every micro batch has the same
    count (plain text in full windows: every token a target): there the mean of the micro batches'
    means already is that mean, and the step is as it was, bitwise, with no collective added."""
    stream = ctx.train_stream
    if not (getattr(stream, "document_masking", False) or getattr(stream, "loss_masked", False)):
        return None
    counts = [_own_targets(b, ctx.topology) for b in batches]  # on the host: the stream's tensors
    # float64: a count is exact to 2**53 (float32: 2**24); the share, in float32 again, is the
    # float32 quotient's own value below 2**24 (a double rounding of a quotient is exact there)
    total = _sum_over_dp(torch.tensor(float(sum(counts)), dtype=torch.float64, device=ctx.dist.device), ctx)
    share = ((ctx.topology.dp_size * grad_accum) / total.clamp(min=1.0)).float()
    return [share * n for n in counts]


def train_step(ctx: TrainContext, grad_accum: int, guard: SkipGuard | None = None) -> StepOutput:
    """One optimizer step. A non-finite step is skipped (see loomtrain.launcher.training.nonfinite);
    `guard` covers the one path DeepSpeed does not guard itself (fp32 at ZeRO 0)."""
    engine, device = ctx.engine, ctx.dist.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    norm = None
    t0 = time.perf_counter()
    batches = [next(ctx.train_stream) for _ in range(grad_accum)]  # all first: the step's target count
    data_wait = time.perf_counter() - t0
    weights = _loss_weights(batches, ctx, grad_accum)
    for micro, batch in enumerate(batches):
        loss = _forward(engine, batch, device)
        if weights is not None:
            loss = loss * weights[micro]
        engine.backward(loss)
        own_norm = None
        if micro == grad_accum - 1 and not records_grad_norm(engine):
            norm = own_norm = grad_norm(ctx.model, engine.mpu)  # on the device (the guard's skip flag)
        with guard.step(own_norm, ctx.state.step + 1) if guard is not None else contextlib.nullcontext():
            engine.step()
        total += loss.detach().float()
    recorded = engine.get_global_grad_norm()
    if recorded is not None:
        norm = recorded
    take_digest = getattr(ctx.train_stream, "take_samples_digest", None)  # benchmarks feed fixed batches
    digest = take_digest() if take_digest else None
    if digest is not None and getattr(ctx.topology, "cp_rank", 0) > 0:  # a CP group reads one window: count it once
        digest = 0
    return StepOutput(total / grad_accum, norm, data_wait, digest)


@torch.no_grad()
def evaluate(ctx: TrainContext) -> dict[str, float]:
    """eval/loss and eval/ppl over eval.batches micro batches of the val split per DP rank.

    The loss is the mean over the target tokens of all those batches on every DP rank, as the
    train loss is over a global batch (`_loss_weights`): for instruction or chat data only the
    answers count, and a batch holding few of them counts little. Plain text in full windows,
    where every batch has as many targets, takes the mean of the batches' means, as before."""
    engine, device = ctx.engine, ctx.dist.device
    stream = startup.val_stream(ctx.cfg, ctx.shard_dir, ctx.topology, ctx.tokenizer)
    weighted = getattr(stream, "document_masking", False) or getattr(stream, "loss_masked", False)
    engine.eval()
    try:
        total = torch.zeros((), dtype=torch.float64 if weighted else torch.float32, device=device)
        targets = 0
        for _ in range(ctx.cfg.eval.batches):
            batch = next(stream)
            loss = _forward(engine, batch, device)
            if weighted:  # this batch's mean x its targets (counted on the host: the stream's tensors)
                n = _own_targets(batch, ctx.topology)
                total += loss.double() * n
                targets += n
            else:
                total += loss.float()
    finally:
        stream.close()
        engine.train()
    if weighted:  # the DP group's sum of per-target losses / its count of targets, in one all-reduce
        both = torch.stack([total, torch.tensor(float(targets), dtype=torch.float64, device=device)])
        loss_sum, targets_all = _sum_over_dp(both, ctx).tolist()
        loss = loss_sum / max(targets_all, 1.0)
    else:
        loss = dp_reduce([StepOutput(total / ctx.cfg.eval.batches, None, 0.0)], ctx)[0].loss
    return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0))}


class Sample(NamedTuple):
    """One evaluation sample: the prompt, the generated text, and both as one decoded row."""

    prompt: str
    answer: str
    text: str
    answers_a_record: bool  # the prompt is a held-out instruction or chat record's question


@torch.no_grad()
def samples(ctx: TrainContext) -> list[Sample]:
    """Evaluation samples; every rank runs them, in step (the same prompts and seed); rank 0 logs them.

    Instruction or chat data (shards with a loss mask) and no eval.prompt: the questions of the
    first eval.num_samples records of the validation split (startup.held_out_questions), each
    answered on its own until its end-of-text or eval.sample_tokens, so a sample is the model's
    answer to a question it never trained on. Otherwise eval.num_samples continuations of
    eval.prompt, or of a held-out document's start when it is empty (startup.sample_prompt).

    Skipped where the model cannot run alone: ZeRO-3 partitions, sequence parallelism.
    """
    e = ctx.cfg.eval
    if e.num_samples == 0 or e.sample_tokens == 0:
        return []
    if ctx.cfg.parallel.zero_stage == 3 or ctx.cfg.parallel.sequence_parallel:
        return []
    tok, device = ctx.tokenizer, ctx.dist.device
    gen = torch.Generator(device=device).manual_seed(ctx.cfg.train.seed + ctx.state.step)
    questions = [] if e.prompt else startup.held_out_questions(ctx.cfg, ctx.shard_dir, ctx.topology, tok, e.num_samples)
    if questions:
        rows = [_generate(ctx, [q], gen, eos_id=tok.eos_id) for q in questions]
    else:
        prompt = startup.sample_prompt(ctx.cfg, ctx.shard_dir, ctx.topology, tok)
        rows = [_generate(ctx, [prompt] * e.num_samples, gen)]
    out = []
    for prompt, new in filter(None, rows):
        for row in new:
            answer = row[: row.index(tok.eos_id)] if questions and tok.eos_id in row else row
            out.append(Sample(tok.decode(prompt), tok.decode(answer), tok.decode(prompt + row), bool(questions)))
    return out


def _generate(ctx: TrainContext, prompts: list[list[int]], gen: torch.Generator, eos_id: int | None = None):
    """(prompt, [new token ids per row]) for a batch of one prompt repeated, or None where the
    prompt fills the model's context."""
    e = ctx.cfg.eval
    room = ctx.cfg.model.max_seq_len - len(prompts[0])
    if room <= 0:
        return None
    tokens = torch.tensor(prompts, dtype=torch.long, device=ctx.dist.device)
    with gathered_logits(ctx.model) as model:
        out = model.generate(
            tokens,
            min(e.sample_tokens, room),
            temperature=e.temperature,
            top_k=e.top_k or None,
            eos_id=eos_id,
            generator=gen,
        )
    return prompts[0], [row[len(prompts[0]) :] for row in out.tolist()]


def _is_final(step: int, cfg: RunConfig) -> bool:
    return step == cfg.train.max_steps


def _logs_at(step: int, cfg: RunConfig) -> bool:
    """A log step: the pending steps' losses are read back and this one is logged."""
    return step % cfg.log.every_steps == 0 or _is_final(step, cfg)


def _votes_at(step: int, cfg: RunConfig) -> bool:
    """The ranks vote on a stop request (a collective and a read-back) only on these steps."""
    return _logs_at(step, cfg) or step % cfg.train.stop_check_every_steps == 0


def run_training(cfg: RunConfig, hooks: Iterable[Hooks] = ()) -> TrainResult:
    """Train per `cfg` on this rank; every rank of the job calls it.

    Everything this rank prints from here on is also appended to RUN_DIR/logs/rank_NNNNN.log
    (loomtrain.launcher.observe.ranklog); a watchdog ends the run with one line naming the stuck
    rank when a step makes no progress for parallel.timeout_s (loomtrain.launcher.observe.watchdog);
    SIGTERM / SIGINT / SIGHUP save a checkpoint and stop (loomtrain.launcher.training.stopping)."""
    wall_start = time.perf_counter()
    hooks = [*plugins.hooks(cfg), *hooks]  # LOOMTRAIN_PLUGIN's, read once: after the checkpoint hook, before Ray's
    env = init_distributed(cfg)
    validate(cfg, env.world_size)  # batch-size rules against the real world size
    check_init_from(cfg)
    run_dir = rundir.run_dir(cfg)
    if env.is_logging_rank:
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier()  # the rank logs go into the directory rank 0 just made
    with contextlib.ExitStack() as opened:
        rank_log = RankLog(
            run_dir, env.rank, env.world_size, env.launcher, host=env.host, interface=env.interface
        ).install()
        opened.callback(rank_log.close)
        try:
            run = _set_up(cfg, env, run_dir, hooks, rank_log, opened)
            _loop(run)
            return _finish(run, wall_start)
        except BaseException:
            # what ended this rank, in its own log (a launcher may print it elsewhere, or not at all)
            rank_log.write("loomtrain: this rank failed:\n" + traceback.format_exc())
            raise


def build_context(
    cfg: RunConfig,
    env: DistEnv,
    topology: Topology,
    run_dir: Path,
    model: nn.Module,
    tokenizer: Tokenizer | None,
    shard_dir: Path | list[tuple[Path, float]] | None,
    train_stream: TokenStream | None,
) -> TrainContext:
    """The DeepSpeed engine around `model`, in the TrainContext that train_step and the hooks
    see (benchmarks pass no data and set ctx.train_stream themselves)."""
    engine, _, scheduler = build_engine(cfg, model, topology.dp_size, mpu=topology.mpu)
    return TrainContext(
        cfg=cfg,
        dist=env,
        topology=topology,
        run_dir=run_dir,
        engine=engine,
        model=engine.module,
        scheduler=scheduler,
        tokenizer=tokenizer,
        shard_dir=shard_dir,
        train_stream=train_stream,
    )


def _set_up(
    cfg: RunConfig,
    env: DistEnv,
    run_dir: Path,
    hooks: Iterable[Hooks],
    rank_log: RankLog,
    opened: contextlib.ExitStack,
) -> _Run:
    """Everything the first step needs, the resume included; what it opens goes onto `opened`."""
    stop = StopRequest(run_dir, watch_file=env.is_logging_rank).install()
    opened.callback(stop.uninstall)
    if env.is_logging_rank:
        stop.clear_file()  # a request left by an earlier run is not for this one
    startup.seed_everything(cfg.train.seed)
    topology = startup.build_topology(cfg, env)
    shard_dir, tokenizer, train_stream = startup.build_data(cfg, topology, env)  # rank 0 reports
    opened.callback(train_stream.close)
    if cfg.eval.every_steps:  # an unusable val split fails now, not at the first eval
        startup.val_stream(cfg, shard_dir, topology, tokenizer).close()
    # Every run checkpoints; a launcher adds its own hooks (Ray's report hook).
    hook_list = HookList([CheckpointHook(cfg), *hooks])
    with host_memory.start_up_allocations():  # full-size buffers, once freed, leave the process
        model = startup.build_model(cfg, topology, env.device)
        ctx = build_context(cfg, env, topology, run_dir, model, tokenizer, shard_dir, train_stream)
        hook_list.on_train_start(ctx)  # resume happens here
    rank_log.write(f"start-up: peak RSS {host_memory.peak_rss_bytes() / 2**30:.3f} GiB")
    grad_accum = cfg.train.grad_accum_steps(topology.data_size)
    if env.is_logging_rank:  # after the resume: a refused one leaves the earlier config.yaml as it was
        save_config(cfg, run_dir / "config.yaml")

    t = cfg.train
    start_step = ctx.state.step
    log = ctx.metrics = MetricsLogger(
        run_dir,
        t.max_steps,
        enabled=env.is_logging_rank,
        tensorboard=cfg.log.tensorboard,
        progress=cfg.log.progress,
        start_step=start_step,
        storage=cfg.run.storage,  # with a URI, TensorBoard follows a mirror there
    )
    opened.callback(log.close)
    opened.callback(hook_list.close)  # before the log closes: a save that publishes meanwhile reports there
    log.message(
        f"loomtrain: {cfg.run.name}: {param_count(cfg.model) / 1e6:.2f} M params, world {env.world_size} "
        f"on {env.n_hosts} host{'s' if env.n_hosts > 1 else ''} "
        f"(tp {topology.tp_size} x {f'cp {topology.cp_size} x ' if topology.cp_size > 1 else ''}"
        f"dp {topology.data_size}), {env.device.type}, {t.precision}, "
        f"zero {cfg.parallel.zero_stage}, grad_accum {grad_accum}, steps {start_step}->{t.max_steps}"
    )
    if env.n_hosts > 1:
        log.message(f"loomtrain: {describe_hosts(env.hosts)}; process group over {env.interface}")
    if cfg.model.lora.enabled:
        held = [(p.numel(), p.requires_grad) for p in ctx.model.parameters()]
        adapters, every = sum(n for n, trains in held if trains), sum(n for n, _ in held)
        log.message(
            f"loomtrain: LoRA rank {cfg.model.lora.rank} on {', '.join(cfg.model.lora.targets)}: "
            f"{adapters:,} adapter params train ({adapters / every:.2%} of this rank's); the base is frozen"
        )
    if getattr(train_stream, "document_masking", False):
        log.message(
            "loomtrain: document masking: attention stays inside each packed document and positions restart "
            "(kernel: blocked attention, each query block's mask built from the document ids: O(T) mask memory)"
        )
    if start_step >= t.max_steps:
        log.message(
            f"nothing to train: {run_dir} is already at step {start_step} (train.max_steps={t.max_steps}); "
            f"raise train.max_steps to continue, or pick another run.dir / checkpoint.resume=never"
        )
    log.hparams(to_dict(cfg))

    profiler = StepProfiler(cfg, env.rank, run_dir, env.device)
    opened.callback(profiler.close)
    dog = Watchdog(
        run_dir,
        env.rank,
        env.world_size,
        allowances(cfg),
        rank_log=rank_log,
        host=env.host,
        master=master_address(),
    ).start()
    opened.callback(dog.stop)
    return _Run(
        ctx=ctx,
        hooks=hook_list,
        log=log,
        stop=stop,
        dog=dog,
        profiler=profiler,
        guard=SkipGuard(ctx.engine, t.max_consecutive_skips, t.precision),
        result=TrainResult(run_dir=run_dir, state=ctx.state),
        grad_accum=grad_accum,
        start_step=start_step,
        flops_per_token=model_flops_per_token(cfg.model, t.seq_len),
        peak_flops=device_peak_flops(env.device, t.precision) * env.world_size,
    )


def _loop(run: _Run) -> None:
    """Optimizer steps until train.max_steps, or until the ranks agree to stop."""
    ctx, cfg = run.ctx, run.ctx.cfg
    ctx.engine.train()
    run.loop_start, elapsed_at_start = time.perf_counter(), ctx.state.elapsed
    run.last_step_end, run.outside_steps_at_end = run.loop_start, run.dog.outside_steps_s
    while ctx.state.step < cfg.train.max_steps and not ctx.stop_requested:
        metrics, data_wait, own_time = _train_and_count(run)
        step = ctx.state.step
        run.result.train_s = time.perf_counter() - run.loop_start
        ctx.state.elapsed = elapsed_at_start + run.result.train_s
        run.dog.beat(step)
        ctx.last_metrics = metrics
        if _logs_at(step, cfg):
            _log_step(run, step, metrics, data_wait, own_time)
        if run.profiler.enabled:
            _profile(run, step)
        if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or _is_final(step, cfg)):
            _evaluate_and_sample(run, step)
        if _votes_at(step, cfg):
            signum = run.stop.agree(ctx.dist.device)  # every rank, same step: one tiny all-reduce
            if signum:
                ctx.stop_requested, ctx.stop_signal = True, signum
        run.hooks.on_step_end(ctx, metrics)
        if run.log.mirror is not None and ctx.checkpoint_saves and ctx.checkpoint_saves[-1]["step"] == step:
            run.log.mirror.sync_metrics()  # run.storage: the steps a resume elsewhere keeps
        run.dog.beat(step)
        try:
            run.guard.after_step(step, _loss_reader(run, step, metrics))
        except NonFiniteError as exc:
            run.log.message(f"error: {exc}")
            raise
    _report_pending(run, ctx.last_metrics)  # a stop between log steps: every rank leaves at the same step


def _loss_reader(run: _Run, step: int, metrics: dict[str, Any]):
    """The step's DP-mean loss for the non-finite guard: read already on a log step, else
    read (one all-reduce) only if the guard asks, on a skipped step, which every rank sees alike."""
    if "loss" in metrics:
        return metrics["loss"]
    out = next(o for s, o in run.pending if s == step)
    return lambda: dp_reduce([out], run.ctx)[0].loss


def _report_pending(run: _Run, metrics: dict[str, Any]) -> None:
    """Read back the steps not yet read (one all-reduce over DP, one copy): their losses go into
    the result, and the last one's loss, grad norm and samples hash into `metrics`."""
    if not run.pending:
        return
    run.guard.read()  # skips decided on the device (fp32 ZeRO 0), read with the losses
    figures = dp_reduce([out for _, out in run.pending], run.ctx)
    for (step, _), fig in zip(run.pending, figures):
        run.result.losses.append(fig.loss)
        run.result.steps.append(step)
    run.pending.clear()
    last = figures[-1]
    metrics.update(loss=last.loss, grad_norm=last.grad_norm)
    if last.samples_hash is not None:
        metrics["data/samples_hash"] = last.samples_hash


def _train_and_count(run: _Run) -> tuple[dict[str, Any], float, float]:
    """One optimizer step, counted in ctx.state -> (its metrics, this rank's data wait, this
    rank's own time in the step)."""
    ctx = run.ctx
    t, env = ctx.cfg.train, ctx.dist
    step_start = time.perf_counter()
    run.profiler.before_step(ctx.state.step + 1)
    lr = float(ctx.engine.get_lr()[0])  # what this step uses (the schedule steps after it)
    out = train_step(ctx, run.grad_accum, run.guard)
    step = ctx.state.step + 1
    run.pending.append((step, out))
    own_time = time.perf_counter() - step_start  # this rank's own work, before it waits for the others
    read: dict[str, Any] = {}
    if _logs_at(step, ctx.cfg):
        _report_pending(run, read)  # its all-reduce waits for the slowest rank's step
    step_time = _world_step_time(run, time.perf_counter())
    if read:  # a log step: the mean step time since the last one (the device ran them up to here)
        step_time = (run.interval_time + step_time) / (run.interval_steps + 1)
        run.interval_time, run.interval_steps = 0.0, 0
    else:
        run.interval_time, run.interval_steps = run.interval_time + step_time, run.interval_steps + 1
    tokens_per_step = t.global_batch_size * t.seq_len
    ctx.state.step = step
    ctx.state.tokens_seen += tokens_per_step
    tps = tokens_per_step / step_time
    metrics = {
        "lr": lr,
        "tokens_per_s": tps,
        "mfu": mfu(run.flops_per_token, tps, run.peak_flops),
        "step_time_s": step_time,
        "mem_bytes": memory_bytes(env.device),
        "tokens_seen": ctx.state.tokens_seen,
        "skipped_steps": run.guard.skipped_steps,
    }
    if read:  # in metrics.jsonl's order: loss, lr, grad_norm, ..., data/samples_hash
        metrics = {"loss": read.pop("loss"), "lr": lr, "grad_norm": read.pop("grad_norm"), **metrics, **read}
    return metrics, out.data_wait_s, own_time


def _world_step_time(run: _Run, end: float) -> float:
    """The step that just ended, as the whole world took it: wall time on this rank since the
    previous step's compute ended, less the announced phases in between (evaluation, samples,
    checkpoint I/O, profiler export). A log step ends in a collective (the loss all-reduce), so
    over the steps since the last log step (the figure logged, see _train_and_count) this rank's
    waits for a slower one, and for its own device, are in it: the slowest rank's pace, end to
    end, with no collective added. A single step between log steps is only the host's time."""
    outside = run.dog.outside_steps_s - run.outside_steps_at_end
    took = end - run.last_step_end - outside
    run.last_step_end, run.outside_steps_at_end = end, run.dog.outside_steps_s
    return max(took, 1e-9)


def _log_step(run: _Run, step: int, metrics: dict[str, Any], data_wait: float, own_time: float) -> None:
    """metrics.jsonl, TensorBoard and the console; every rank calls it at the same step."""
    # the job-wide straggler figures from each rank's own work in the step (one small all-gather)
    metrics.update(gather_rank_stats(own_time, data_wait, metrics["mem_bytes"], run.ctx.dist.device))
    run.log.log(step, metrics)
    run.log.console(step, metrics, time.perf_counter() - run.loop_start, step - run.start_step)


def _profile(run: _Run, step: int) -> None:
    """The profiler's work after a step; writing a trace may take long: it is I/O, not a hang."""
    with run.dog.phase("profiler trace export"):  # I/O: checkpoint.timeout_s
        table = run.profiler.after_step(step)
    if table is not None:
        run.log.text("profile/top_ops", "```\n" + table + "\n```", step, raw=True)


def _evaluate_and_sample(run: _Run, step: int) -> None:
    """eval/loss and eval/ppl, then a few text samples: logged, kept in the result, and
    handed to the hooks (on_eval_end)."""
    ctx, log = run.ctx, run.log
    with run.dog.phase(EVALUATION):  # the watchdog allows it by eval.batches (and its compile, once)
        ev = evaluate(ctx)
    run.result.evals[step] = ev["eval/loss"]
    log.log(step, ev)
    log.message(f"eval step {step}: loss {ev['eval/loss']:.4f} | ppl {ev['eval/ppl']:.2f}")
    with run.dog.phase(SAMPLES):
        shown = samples(ctx)
    for i, sample in enumerate(shown):
        _log_sample(log, i, sample, step)
    run.hooks.on_eval_end(ctx, ev)
    log.flush()


def _log_sample(log: MetricsLogger, i: int, sample: Sample, step: int) -> None:
    """TensorBoard's samples/i; on the console the first continuation, or every answer to a
    held-out question with its prompt."""
    if not sample.answers_a_record:
        log.text(f"samples/{i}", sample.text, step)
        if i == 0:
            log.message(f"sample: {sample.text[:200]!r}")
        return
    fence = "```"
    shown = f"prompt:\n{fence}\n{sample.prompt}\n{fence}\n\nanswer:\n{fence}\n{sample.answer}\n{fence}"
    log.text(f"samples/{i}", shown, step, raw=True)
    log.message(f"sample {i}: prompt {sample.prompt[-200:]!r}")
    log.message(f"sample {i}: answer {sample.answer[:200]!r}")


def _finish(run: _Run, wall_start: float) -> TrainResult:
    """The end-of-training hooks (a final checkpoint), the final weights and the summary."""
    ctx, log, result = run.ctx, run.log, run.result
    run.profiler.finish(ctx.state.step)
    run.hooks.on_train_end(ctx)
    if ctx.state.step >= ctx.cfg.train.max_steps:
        result.final_dir = _save_final(ctx)
    result.wall_s = time.perf_counter() - wall_start
    result.stopped_by = ctx.stop_signal
    if result.stopped_by:
        if ctx.dist.is_logging_rank:
            run.stop.clear_file()
        log.message(
            f"loomtrain: {signal_name(result.stopped_by)}: stopped at step {ctx.state.step} "
            f"(checkpoint saved); the same command resumes from it"
        )
    elif ctx.state.step > run.start_step and result.losses:
        log.message(done_line(result, run.start_step, ctx.state.elapsed))
    run_dir = ctx.run_dir.absolute()
    log.message(f"run directory: {run_dir}")
    if ctx.cfg.log.tensorboard:
        log.message(f"TensorBoard logs: {run_dir}  (tensorboard --logdir {run_dir.parent})")
        if ctx.cfg.run.storage:
            where = tb_uri(ctx.cfg.run.storage)
            log.message(f"TensorBoard mirror: {where}  (tensorboard --logdir {where} --load_fast=false)")
    log.message(f"rank logs: {logs_dir(run_dir)}/")
    return result


def done_line(result: TrainResult, start_step: int, elapsed: float) -> str:
    """The summary of a call that trained: its own training and wall time (training <= total);
    after a resume, also the training time summed since step 0 (`state.elapsed`), named as such."""
    line = (
        f"done: step {result.steps[-1]}, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
        f"{result.train_s:.0f} s training, {result.wall_s:.0f} s total"
    )
    if start_step > 0:
        line += f" (resumed at step {start_step}; {elapsed:.0f} s training since step 0)"
    return line


def _save_final(ctx: TrainContext) -> Path | str:
    """final/ (RUN_DIR/final, or {run.storage}/final): every rank streams its share of the full
    weights there (see checkpoints.final.save_final_sharded)."""
    final = final_location(ctx.cfg.run.storage, ctx.run_dir)
    with io_phase("final weights"):
        save_final_sharded(ctx.engine, ctx.topology, ctx.cfg.model, ctx.tokenizer, final)
    ctx.metrics.message(f"final weights: {final if isinstance(final, str) else final.absolute()}")
    return final
