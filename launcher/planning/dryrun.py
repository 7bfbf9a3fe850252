"""One rank of a cluster config run on this machine (`loomtrain dryrun`, launcher/cli/dryrun.py).

Runs exactly one rank of a cluster config on this machine (its GPU, else the CPU) and
reports what it measured next to `plan`'s prediction, as a table (`dry_run`).

One rank's shard, without its peers: the full-size model is built on the meta device
(no memory), then the real TP plan (`loomtrain.parallel.parallelize`, through
`loomtrain.parallel.materialize.sharded_meta_model`) shards it for TP rank 0 of `parallel.tp` through a
stand-alone topology whose TP group is None, which loomtrain's collectives treat as a
group of one (every TP all-reduce / all-gather is the identity). So the modules,
shapes, dtypes and parameter attributes are exactly one cluster rank's; only the
communication is missing (the TP bytes `plan` predicts are not moved). The shard is
then materialized on the local device by the training start-up's own path
(`loomtrain.parallel.materialize`: the seeded init one full parameter at a time, this
rank's slice kept; for a 70 B config that generates every full parameter once on the
CPU, which takes minutes), and trained through the real DeepSpeed engine
(`engine.build_engine`) at the config's ZeRO stage and precision with dp = 1 and one
micro-batch per step, on random tokens. With dp = 1 ZeRO divides nothing, so the
table has three columns: plan for one rank of the cluster, plan for this dry run
(the same rank at dp = 1), and the measurement, which checks the arithmetic that the
cluster column extrapolates.

On a GPU, accelerate's `find_executable_batch_size` then searches the largest
micro-batch that fits (from --max-micro down); on a CPU the table reports plan's
estimate from free host memory instead.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import time
from dataclasses import dataclass

import psutil
import torch
from accelerate.utils import find_executable_batch_size
from loomtrain.launcher.distributed import init_distributed
from loomtrain.launcher.observe.host_memory import peak_rss_bytes
from loomtrain.launcher.observe.metrics import device_peak_flops, memory_bytes
from loomtrain.launcher.planning import memory_model as mm
from loomtrain.launcher.planning.memory_measure import GradPeak, measure
from loomtrain.launcher.training.engine import build_engine
from loomtrain.launcher.training.startup import apply_block_options
from loomtrain.model import init_tensors
from loomtrain.parallel.context import stand_in_context_parallel
from loomtrain.parallel.lora import apply_lora_parallel
from loomtrain.parallel.materialize import materialize, sharded_meta_model

GiB = mm.GiB


@dataclass
class OneRankTopology:
    """TP rank `tp_rank` of a `tp_size`-way group, alone (no process group, dp = 1).

    Duck-types loomtrain.parallel.Topology for `parallelize` (and its vocab-parallel loss); a TP
    group of None makes every collective in loomtrain.parallel.collectives the identity.
    """

    tp_size: int
    tp_rank: int = 0
    tp_group: object = None
    dp_group: object = None
    dp_size: int = 1
    dp_rank: int = 0
    # no context parallelism: the data split is the DP one
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: object = None
    data_size: int = 1
    data_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def rank(self) -> int:
        return self.tp_rank

    def tp_subgroup(self, size: int):
        return None


def build_rank_shard(cfg, device: torch.device) -> torch.nn.Module:
    """TP rank 0's shard of the cluster model, materialized on `device` only, by the training
    start-up's own path (meta model, TP plan, seeded init one full parameter at a time)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    topology = OneRankTopology(cfg.parallel.tp)
    model = sharded_meta_model(cfg.model, topology, cfg.parallel.sequence_parallel)
    materialize(model, init_tensors(cfg.model, cfg.train.seed), device=device, dtype=dtype)
    model = apply_lora_parallel(model, cfg.model.lora, topology, seed=cfg.train.seed)  # model.lora
    model = stand_in_context_parallel(model, cfg.parallel.cp)  # parallel.cp: seq / cp tokens, the window's K/V
    return apply_block_options(model, cfg)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Measured:
    states: dict
    step_times: list[float]
    peak_bytes: int  # device peak (CUDA) or peak RSS growth (CPU)
    largest_micro: int | None = None
    micro_note: str = ""
    skipped: int = 0  # steps DeepSpeed skipped (non-finite gradients)


def run_steps(cfg, device: torch.device, steps: int, search_from: int, log) -> Measured:
    """`log` hears one line when the shard is built and one per step."""
    t = cfg.train
    base_rss = memory_bytes(torch.device("cpu"))  # the process RSS
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model = build_rank_shard(cfg, device)
    log(f"dryrun: shard built in {_t(time.perf_counter() - start)}")
    engine, _, _ = build_engine(cfg, model, dp_size=1)
    peak = GradPeak(engine)
    gen = torch.Generator(device="cpu").manual_seed(t.seed)

    def one_step(micro: int) -> float:
        tokens = torch.randint(0, cfg.model.vocab_size, (micro, t.seq_len + 1), generator=gen).to(device)
        _sync(device)
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], targets=tokens[:, 1:])
        engine.backward(loss)
        peak.sample()
        engine.step()
        _sync(device)
        return time.perf_counter() - start

    times = []
    states = None
    for i in range(steps):
        times.append(one_step(t.micro_batch_size))
        log(f"dryrun: step {i + 1}/{steps}: {_t(times[-1])}" + (" (warm-up)" if i == 0 else ""))
        if i == 0:
            states = measure(engine, peak)
            peak.remove()
    # the device's peak allocation (CUDA), or the growth of the process's peak RSS (CPU)
    peak_bytes = memory_bytes(device) if device.type == "cuda" else peak_rss_bytes() - base_rss
    result = Measured(states, times, peak_bytes, skipped=int(engine.skipped_steps))
    if device.type == "cuda":

        @find_executable_batch_size(starting_batch_size=search_from)
        def largest(batch_size: int) -> int:
            one_step(batch_size)
            return batch_size

        try:
            result.largest_micro = largest()
            result.micro_note = f"largest that fits, searched down from {search_from}"
        except Exception as exc:  # noqa: BLE001 - e.g. DeepSpeed state left broken by an OOM
            result.micro_note = f"search stopped: {type(exc).__name__}: {str(exc)[:200]}"
    return result


def _row(label: str, *cells: str) -> str:
    return f"  {label:<34}" + "".join(f"{c:>22}" for c in cells)


def _t(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    scale, unit = (1, "s") if seconds >= 1 else (1e3, "ms") if seconds >= 1e-3 else (1e6, "us")
    return f"{seconds * scale:.3g} {unit}"


def _g(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x / GiB:.3f} GiB" if abs(x) >= GiB else f"{x / 2**20:.2f} MiB"


def format_table(
    cfg,
    cluster: mm.Plan,
    local: mm.Plan,
    meas: Measured,
    device: torch.device,
    local_peak: float,
    mfu: float,
    cpu_micro_estimate: int | None,
    changed: list[str] = (),
) -> str:
    t = cfg.train
    st = meas.states
    tokens = t.micro_batch_size * t.seq_len
    # One micro-batch step of this rank: 1/tp of the model FLOPs (TP splits every matmul).
    flops_rank = cluster.flops_per_token * tokens / cluster.tp
    hw_rank = cluster.hw_flops_per_token * tokens / cluster.tp
    cluster_peak = (cluster.device.fp32_tflops if t.precision == "fp32" else cluster.device.bf16_tflops) * 1e12
    steps = meas.step_times[1:] or meas.step_times
    measured_t = statistics.median(steps)
    plan_local_t = hw_rank / (local_peak * mfu) if local_peak and math.isfinite(local_peak) else float("nan")
    plan_cluster_t = hw_rank / (cluster_peak * mfu)
    act_meas = None
    if device.type == "cuda":
        act_meas = meas.peak_bytes - st["model_states"] - st["buffers"]
    peak_label = "peak allocated (CUDA)" if device.type == "cuda" else "peak RSS growth (CPU)"
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = (
        f"dryrun: one rank of {cluster.world_size} = tp {cluster.tp} x "
        + (f"cp {cluster.cp} x dp {cluster.dp // cluster.cp}" if cluster.cp > 1 else f"dp {cluster.dp}")
        + f", ZeRO-{cluster.zero_stage}, "
        f"{t.precision}, micro-batch {t.micro_batch_size} x seq {t.seq_len}, "
        f"{cluster.params.per_rank / 1e6:,.1f} M params on this rank; measured on {dev_name}"
    )
    lines = [head]
    if changed:  # a shrunk model: every column describes it, the cluster's too
        lines.append(
            f"model changed on the command line: {', '.join(changed)}; both plans and the "
            "measurement are for this model, not the config's"
        )
    lines += [
        "",
        _row("", "plan: cluster rank", "plan: this dry run", "measured here"),
        _row("", f"{cluster.device.name[:20]}", f"dp 1, {device.type}", f"dp 1, {device.type}"),
        _row("parameters", _g(cluster.states.params), _g(local.states.params), _g(st["params"])),
        _row("gradients (peak)", _g(cluster.states.grads), _g(local.states.grads), _g(st["grads"])),
        _row("optimizer states", _g(cluster.states.optimizer), _g(local.states.optimizer), _g(st["optimizer"])),
        _row("model states", _g(cluster.states.total), _g(local.states.total), _g(st["model_states"])),
        _row("DeepSpeed reduce bucket", _g(cluster.ds_bucket), _g(local.ds_bucket), _g(st["buffers"])),
        _row("activations, 1 micro-batch", _g(cluster.activations.total), _g(local.activations.total), _g(act_meas)),
        _row(
            peak_label if device.type == "cuda" else "total / " + peak_label,
            _g(cluster.total_per_rank),
            _g(local.total_per_rank - local.reserve),
            _g(meas.peak_bytes),
        ),
        _row("time per micro-batch step", _t(plan_cluster_t), _t(plan_local_t), _t(measured_t)),
        _row(
            "tokens/s (this rank)",
            f"{tokens / plan_cluster_t:,.0f}",
            f"{tokens / plan_local_t:,.0f}" if math.isfinite(plan_local_t) else "-",
            f"{tokens / measured_t:,.0f}",
        ),
        _row(
            "MFU",
            f"{mfu:.0%} (assumed)",
            f"{mfu:.0%} (assumed)",
            f"{flops_rank / measured_t / local_peak:.1%}" if math.isfinite(local_peak) else "-",
        ),
        "",
        f"cluster step: {cluster.grad_accum} micro-batches x {plan_cluster_t:.3f} s -> {cluster.step_time_s:.2f} s "
        f"predicted ({cluster.tokens_per_s:,.0f} tokens/s over {cluster.world_size} ranks); "
        + ("fits" if cluster.fits else "WILL NOT FIT")
        + f" in {cluster.device.memory_gib:.1f} GiB "
        f"({cluster.total_per_rank / GiB:.2f} GiB per rank)",
        f"local peak {local_peak / 1e12:.3g} TFLOP/s ({'measured matmul' if device.type == 'cpu' else 'datasheet'}); "
        f"steps timed: {', '.join(f'{x:.3f}' for x in meas.step_times)} s (first = warm-up, excluded); "
        "the measured step includes the optimizer step, which the cluster amortizes over "
        f"{cluster.grad_accum} micro-batches, and no TP/DP communication.",
    ]
    if meas.skipped:
        lines.append(
            f"WARNING: {meas.skipped} of {len(meas.step_times)} steps were skipped (non-finite gradients); "
            "Adam's states exist only after an applied step."
        )
    if meas.largest_micro is not None or meas.micro_note:
        lines.append(f"largest micro-batch on this {device.type}: {meas.largest_micro} ({meas.micro_note})")
    elif cpu_micro_estimate is not None:
        lines.append(
            f"largest micro-batch on this host (plan's estimate from free memory; no search on CPU): "
            f"{cpu_micro_estimate}"
        )
    return "\n".join(lines)


def init_rate(n: int = 1 << 22) -> float:
    """Values per second this CPU draws from a normal distribution: the seeded init of the
    full-size model (every full parameter once, this rank's slice kept) is bound by it."""
    torch.randn(1024)
    start = time.perf_counter()
    torch.randn(n)
    return n / max(time.perf_counter() - start, 1e-9)


def cpu_estimate_line(cfg, cluster: mm.Plan, steps: int, local_peak: float, mfu: float) -> str:
    """Said before a CPU dry run starts, which for a big config takes minutes with nothing to
    show: how long building the shard and the steps should take."""
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    step_s = cluster.hw_flops_per_token * tokens / cluster.tp / (local_peak * mfu)
    build_s = cluster.params.total / init_rate()
    return (
        f"dryrun: on this CPU, about {_t(build_s)} to build the shard (the seeded init draws all "
        f"{cluster.params.total / 1e6:,.0f} M parameters once) and about {_t(step_s)} per step x {steps} "
        f"(plan at MFU {mfu:.0%} of the measured peak): about {_t(build_s + steps * step_s)} in all"
    )


def dry_run(
    cfg,
    cluster: mm.Plan,
    steps: int,
    gpu: str,
    mfu: float,
    max_micro: int = 0,
    changed: list[str] = (),
) -> str:
    """Run `steps` optimizer steps of `cfg`'s rank 0 on this machine; the table comparing them with
    `cluster` (the plan for one rank of the cluster) and with the plan for this dry run. `changed`:
    the model fields the command line changed from the config's (named under the headline). On a
    CPU it says up front how long it should take; its progress goes to stderr."""
    # This machine: the same rank at dp = 1, one micro-batch per optimizer step.
    cfg.train.global_batch_size = cfg.train.micro_batch_size
    device = init_distributed(cfg).device  # a lone process: train.device, its GPU or the CPU
    local_gpu = "cpu" if device.type == "cpu" else gpu
    # parallel.cp: this rank's seq / cp tokens at a world of one CP group (its plan divides ZeRO's
    # states over those cp ranks, which the dry run at dp 1 holds whole)
    local = mm.make_plan(cfg, cfg.parallel.tp * cfg.parallel.cp, local_gpu, mfu)

    log = functools.partial(print, file=sys.stderr, flush=True)
    peak = device_peak_flops(device, cfg.train.precision)
    if device.type == "cpu":
        log(cpu_estimate_line(cfg, cluster, steps, peak, mfu))
    meas = run_steps(cfg, device, steps, max_micro or 4 * cfg.train.micro_batch_size, log=log)
    cpu_estimate = None
    if device.type == "cpu":
        per_sample = local.activations.total / cfg.train.micro_batch_size
        room = psutil.virtual_memory().available + meas.peak_bytes - local.states.total
        cpu_estimate = max(0, int(room // per_sample))
    return format_table(cfg, cluster, local, meas, device, peak, mfu, cpu_estimate, changed)
