"""The memory plan, as `loomtrain plan` prints it (launcher/cli/plan.py) and `dryrun` compares with.

One rank of a run predicted before it is submitted: memory for parameters, gradients
and optimizer states at the configured ZeRO stage and TP, activations, FLOPs per
step, TP/DP communication per step, and step time / tokens/s / MFU on the named
GPU at an assumed MFU; then host RAM per node at start-up and during a save or resume,
the checkpoint's size and the time to save it at a stated storage bandwidth. The model is
built full-size on the meta device (loomtrain.model.meta_transformer), so a 70 B config is
counted without allocating its weights. The arithmetic and its sources are in
`loomtrain.launcher.planning.memory_model` and (host, checkpoint)
`loomtrain.launcher.planning.host_model`; this module loads a config into a Plan
(`load_plan`) and formats it (`format_plan`, `suggestions`).
"""

from __future__ import annotations

from loomtrain.launcher.config_loader import resolve, validate
from loomtrain.launcher.planning import host_model as hm
from loomtrain.launcher.planning import memory_model as mm

GiB = mm.GiB


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def _si(x: float, unit: str = "") -> str:
    for div, suffix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {suffix}{unit}"
    return f"{x:.3g} {unit}"


def format_plan(p: mm.Plan, config: str = "") -> str:
    st, act, pc = p.states, p.activations, p.params
    pb, gb, ob = st.bytes_per_param
    dp_s = f" / dp {p.dp}"
    stage = p.zero_stage
    lines = [
        f"plan {config}: world {p.world_size} = tp {p.tp} x "
        + (f"cp {p.cp} x dp {p.dp // p.cp} (ZeRO over dp x cp = {p.dp})" if p.cp > 1 else f"dp {p.dp}")
        + f", ZeRO-{stage}, {p.precision}, on {p.device.name}",
        f"model      {_si(pc.total)} params (ModelConfig arithmetic: {_si(p.analytic_params)}); "
        f"per TP rank {_si(pc.per_rank)} ({_si(pc.replicated_per_rank)} replicated over TP)",
        f"batch      global {p.tokens_per_step // p.seq_len} x seq {p.seq_len} = {p.tokens_per_step:,} tokens/step; "
        f"micro-batch {p.micro_batch}, gradient accumulation {p.grad_accum}",
        "",
        "memory per rank                                        GiB",
        f"  parameters        {pb:>2g} B/param{dp_s if stage >= 3 else '':<10}             {_gib(st.params)}",
        f"  gradients         {gb:>2g} B/param{dp_s if stage >= 2 else '':<10}             {_gib(st.grads)}",
        f"  optimizer states  {ob:>2g} B/param{dp_s if stage >= 1 else '':<10}             {_gib(st.optimizer)}"
        + (f"   (offloaded to host: {st.offloaded / GiB:.2f} GiB)" if st.offloaded else ""),
        f"  model states                                       {_gib(st.total)}",
        f"  activations, micro-batch {p.micro_batch:<4}                      {_gib(act.total)}"
        f"   ({act.variant}; eager attention {act.eager_total / GiB:.2f})",
        f"  DeepSpeed reduce bucket                            {_gib(p.ds_bucket)}",
        f"  fp32 gradient copy in the optimizer step           {_gib(p.ds_fp32_grads)}",
        f"  CUDA context, NCCL (allowance)                     {_gib(p.reserve)}",
        f"  total                                              {_gib(p.total_per_rank)}"
        f"   of {p.device.memory_gib:.1f} GiB",
        "",
        "compute",
        f"  model FLOPs per token   {_si(p.flops_per_token, 'FLOP')} (6N + 12 L d s)"
        + (
            f"; hardware {_si(p.hw_flops_per_token, 'FLOP')} with full recompute"
            if p.hw_flops_per_token != p.flops_per_token
            else ""
        ),
        f"  model FLOPs per step    {_si(p.flops_per_step, 'FLOP')} "
        f"({_si(p.flops_per_step / p.world_size, 'FLOP')} per rank)",
        f"  at an assumed {p.assumed_mfu:.0%} of {p.device.name}'s "
        f"{'fp32' if p.precision == 'fp32' else 'bf16 dense'} peak "
        f"({(p.device.fp32_tflops if p.precision == 'fp32' else p.device.bf16_tflops):g} TFLOP/s)"
        + (" for the hardware FLOPs" if p.hw_flops_per_token != p.flops_per_token else "")
        + ":",
        f"    step time {p.step_time_s:.3g} s, {p.tokens_per_s:,.0f} tokens/s "
        f"({p.tokens_per_s_per_rank:,.0f} per rank), MFU "
        f"{p.assumed_mfu * p.flops_per_token / p.hw_flops_per_token:.0%}",
        "communication per rank per step (not in the step time: assumed overlapped or inside the MFU)",
        f"  TP   {p.tp_comm_payload / GiB:.2f} GiB all-reduced, {p.tp_comm_sent / GiB:.2f} GiB sent (ring)",
        f"  DP   {p.dp_comm_sent / GiB:.2f} GiB sent (ZeRO-{stage} gradient reduce"
        + (" + parameter all-gathers" if stage == 3 else "")
        + ")",
    ]
    lines += hm.format_host(p.host)
    lines += [f"note: {n}" for n in p.notes]
    lines.append("")
    if p.fits:
        lines.append(
            f"FITS: {p.total_per_rank / GiB:.2f} GiB per rank of {p.device.memory_gib:.1f} GiB "
            f"({p.total_per_rank / (p.device.memory_gib * GiB):.0%})"
        )
    else:
        lines.append(
            f"WILL NOT FIT: needs {p.total_per_rank / GiB:.2f} GiB per rank, the GPU has {p.device.memory_gib:.1f} GiB"
        )
        lines += [f"  try: {h}" for h in suggestions(p)]
    return "\n".join(lines)


def suggestions(p: mm.Plan) -> list[str]:
    out = []
    if p.cp_that_fits:
        out.append(
            f"parallel.cp={p.cp_that_fits} (splits each sequence of {p.seq_len} tokens over {p.cp_that_fits} ranks: "
            f"activations are {p.activations.total / GiB:.1f} GiB)"
        )
    if p.zero_stage < 3 and p.dp > 1:
        out.append(f"parallel.zero_stage={p.zero_stage + 1} (shards more model states over dp={p.dp})")
    if p.activations.total > p.states.total / 4 and p.micro_batch > 1:
        out.append(
            f"train.micro_batch_size={max(1, p.micro_batch // 2)} (activations are {p.activations.total / GiB:.1f} GiB)"
        )
    if "recompute" not in p.activations.variant:
        out.append("parallel.activation_checkpointing=true")
    if p.zero_stage >= 2 and p.states.optimizer:
        out.append("parallel.offload_optimizer=true (optimizer states to host memory)")
    out.append("a larger parallel.tp or --world-size")
    return out


def load_plan(config: str, overrides: list[str], world_size: int | None, gpu: str, mfu: float, **host):
    """(RunConfig validated at its world size, its Plan); the world size defaults to the
    config's ray.num_workers. Shared by `plan` and `dryrun`; raises ConfigError,
    ValueError or FileNotFoundError for bad input."""
    run = resolve(config, overrides)
    world = world_size or run.ray.num_workers
    validate(run, world)
    return run, mm.make_plan(run, world, gpu, mfu, **host)
