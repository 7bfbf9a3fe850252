"""The arithmetic behind `loomtrain plan` and `loomtrain dryrun`: memory, FLOPs and
communication of one rank of a TP x DP x ZeRO run, from the config alone.

Every figure is per rank and per optimizer step unless its name says otherwise.
Sources, so that a reader can check each number:

* Model states (ZeRO paper, Rajbhandari et al. 2020, sec. 3 and 5): mixed precision
  keeps 2 (16-bit params) + 2 (16-bit grads) + 12 (fp32 master, Adam m, Adam v)
  bytes per parameter. Stage 0 replicates all three over the data-parallel group,
  stage 1 shards the optimizer states, stage 2 also the gradients, stage 3 also the
  parameters. fp32 training keeps 4 + 4 + 8 (m, v; the optimizer updates the fp32
  model params in place) -- except that DeepSpeed's ZeRO optimizers (stages 1-3)
  keep their own fp32 copy of each partition even when the model is fp32, so fp32
  at stages 1-3 is 4 + 4 + 12 (measured in tests/distributed/test_zero.py). Tensor
  parallelism divides the sharded layers by tp before ZeRO divides by dp; norms,
  row-parallel biases and learned positions stay replicated. The vocabulary is
  padded to a multiple of tp (the vocab-parallel embedding's rows).
  With model.lora the optimizer, the gradients and ZeRO's split see only the adapters
  (r * (in + out) per adapted layer, split over TP like their layer: `count_params`); the
  frozen base adds its parameters alone, in the training dtype, never partitioned.
* Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 1-5):
  s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations. loomtrain's attention
  is torch SDPA, which on GPU runs the flash / memory-efficient kernels that keep no
  s x s score matrix, so the primary estimate drops the 5*a*s/h term (the "flash"
  variant; the eager figure is reported next to it). The 34 is generalized to the
  config's shape (GQA: K and V are kv_heads/n_heads wide; SwiGLU: 4*ffn instead of
  2*ffn stored in the MLP; dropout masks only when dropout > 0). Without sequence
  parallelism the 10*s*b*h of norm inputs, QKV/MLP inputs and dropout masks are
  replicated over TP (eq. 4); with it everything is divided by tp (eq. 5). Full
  activation checkpointing keeps only each block's input (2*s*b*h per layer, /tp with
  SP) plus one block's working set during its recomputation. The output layer with
  tp > 1 adds s*b*V/tp logits in the compute dtype plus an fp32 copy for the loss;
  at tp = 1 it is loomtrain.model.loss's fused chunked loss: one chunk of logits (both
  dtypes), the hidden states' gradient (s*b*h) and the weight's fp32 gradient (V*h*4).
* FLOPs (PaLM, Chowdhery et al. 2022, appendix B): 6*N + 12*L*d*s per token, N the
  parameters that take part in matmuls (everything but the embedding lookups; the
  output projection counts even when tied). Full recomputation runs the forward twice:
  8*N + 16*L*d*s hardware FLOPs per token; MFU always uses the 6*N figure.
* TP communication (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022): per
  layer and micro-batch, 2 all-reduces of s*b*h activations forward and 2 backward
  (with SP: all-gathers + reduce-scatters of the same total volume), 2 more when the
  forward is recomputed; plus the vocab-parallel embedding (forward) and output
  layer (backward) all-reduces and the cross-entropy's three s*b fp32 all-reduces.
  Ring all-reduce of M bytes sends 2*(t-1)/t*M bytes per rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psutil
from loomtrain.launcher.observe.metrics import GPU_PEAK_FLOPS
from loomtrain.launcher.planning.host_model import GiB, HostPlan, host_plan
from loomtrain.launcher.training.engine import ds_config
from loomtrain.model import meta_transformer
from loomtrain.model.config import ModelConfig
from loomtrain.model.flops import param_count
from loomtrain.model.lora import lora_layers
from loomtrain.model.loss import chunk_rows
from loomtrain.parallel.plan import shard_spec
from loomtrain.parallel.topology import padded_vocab_size


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float  # what torch.cuda.get_device_properties reports as total
    bf16_tflops: float  # dense peak, bf16/fp16 tensor cores (a GPU's: metrics.GPU_PEAK_FLOPS, MFU's too)
    fp32_tflops: float  # dense peak, fp32 without TF32
    note: str = ""


DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM 80GB", 79.6, GPU_PEAK_FLOPS["h100"] / 1e12, 67.0),
    "h200": Device("H200 SXM 141GB", 139.8, GPU_PEAK_FLOPS["h200"] / 1e12, 67.0),
    "a100": Device("A100 SXM 80GB", 79.3, GPU_PEAK_FLOPS["a100"] / 1e12, 19.5),
    "l40s": Device("L40S 48GB", 44.4, GPU_PEAK_FLOPS["l40s"] / 1e12, 91.6),
    # The 2-core CI box: measured fp32 ~180 and bf16 ~410 GFLOP/s matmul throughput; memory is host RAM.
    "cpu": Device("CPU (2 cores, measured)", 0.0, 0.41, 0.18, note="memory = host RAM"),
}

# Assumed model-FLOPs utilization for the step-time prediction: between torchtitan's
# 33-39% (Llama-3 8B, 8 x H100: 5,762 tok/s/GPU eager, 6,667 compiled) and Megatron-LM's up to
# 47% on H100 clusters, both as published by those projects.
DEFAULT_MFU = 0.40
# CUDA context, NCCL buffers and allocator fragmentation on a GPU: a fixed allowance, not
# derived (typically ~1 GiB). DeepSpeed's own working buffers are computed (ds_buffers).
RESERVE_GIB = 1.0
DS_BUCKET_ELEMS = 500_000_000  # DeepSpeed's default reduce / all-reduce bucket (elements)

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def host_memory_gib() -> float:
    return psutil.virtual_memory().total / GiB


def device_spec(name: str) -> Device:
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"--gpu: unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    if key == "cpu":  # its memory is this host's RAM
        return replace(DEVICES[key], memory_gib=round(host_memory_gib(), 1))
    return DEVICES[key]


# --------------------------------------------------------------------------- params
@dataclass
class ParamCount:
    total: int  # the plain model
    per_rank: int  # one TP rank's parameters (what ZeRO then divides by dp)
    embedding: int  # input-lookup parameters of the plain model (tok_emb, pos_emb)
    matmul: int  # parameters in matmuls, for 6N (output projection counted when tied)
    replicated_per_rank: int  # parameters every TP rank holds in full
    adapters: int = 0  # model.lora: the LoRA factors of the plain model (not in `total`)
    adapters_per_rank: int = 0  # ... one TP rank's (A or B split like its layer, see shard_spec)


def count_params(model: Any, tp: int) -> ParamCount:
    """Count a plain (unsharded) model's parameters, e.g. one built on the meta device;
    the per-rank figures ask the TP plan's layout (`loomtrain.parallel.plan.shard_spec`).

    Shared (tied) parameters count once, as `named_parameters` yields them once.
    """
    cfg = model.cfg
    total = per_rank = emb = rep = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        spec = shard_spec(name, p.shape, cfg, tp)  # TP rank 0; every rank holds as many
        per_rank += spec.local_numel
        if spec.replicated:
            rep += n
        if name.split(".")[0] in ("tok_emb", "pos_emb"):
            emb += n
    matmul = total - emb + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)
    return ParamCount(total, per_rank, emb, matmul, rep, *lora_param_count(model, cfg, tp))


def lora_param_count(model: Any, cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(LoRA factors of the plain model, of one TP rank) for cfg.lora; (0, 0) without it."""
    lora = cfg.lora
    if not lora.enabled:
        return 0, 0
    total = per_rank = 0
    for name, parent, attr in lora_layers(model, lora):
        layer = getattr(parent, attr)
        for factor, shape in (("lora_A", (lora.rank, layer.in_features)), ("lora_B", (layer.out_features, lora.rank))):
            total += shape[0] * shape[1]
            per_rank += shard_spec(f"{name}.{factor}", shape, cfg, tp).local_numel
    return total, per_rank


# --------------------------------------------------------------------- model states
@dataclass
class ModelStates:
    params: float
    grads: float
    optimizer: float
    offloaded: float = 0.0  # optimizer bytes held in host memory instead (offload)
    bytes_per_param: tuple[float, float, float] = (0, 0, 0)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    n_rank: int, stage: int, dp: int, precision: str, offload: bool = False, frozen: int = 0
) -> ModelStates:
    """Bytes per rank of params, grads and optimizer states for `n_rank` trainable params per TP
    rank, plus `frozen` params per TP rank (model.lora's base: the params alone, never partitioned,
    since ZeRO 1-2 partition only what the optimizer holds and LoRA refuses ZeRO-3)."""
    p_b = g_b = _DTYPE_BYTES[precision]  # RunConfig holds the stage and precision to their choices
    o_b = 8 if precision == "fp32" and stage == 0 else 12  # m, v (+ an fp32 master: module docstring)
    params = p_b * n_rank / (dp if stage >= 3 else 1) + p_b * frozen
    grads = g_b * n_rank / (dp if stage >= 2 else 1)
    optim = o_b * n_rank / (dp if stage >= 1 else 1)
    offloaded = 0.0
    if offload:
        offloaded, optim = optim, 0.0
    return ModelStates(params, grads, optim, offloaded, (p_b, g_b, o_b))


def ds_buffers(
    n_rank: int, stage: int, dp: int, precision: str, offload: bool = False, bucket_elems: int = DS_BUCKET_ELEMS
) -> tuple[float, float]:
    """(reduce bucket, fp32 gradient copy) bytes DeepSpeed allocates besides the model states.

    The ZeRO paper counts such constant-size buffers as residual states, not model states.
    Stages 1-3 allocate a contiguous reduce bucket of `reduce_bucket_size` elements in the
    gradient dtype (in full, even for a smaller model); stage 0 flattens gradients into
    all-reduce buckets of up to that size. In mixed precision the optimizer step works on
    an fp32 copy of the (partitioned) gradients: 4 B/param / dp at stages 1-3, 4 B/param at
    stage 0 (DeepSpeed's bf16/fp16 optimizer); with offload that copy is in host memory.
    """
    g = _DTYPE_BYTES[precision]
    bucket = g * (bucket_elems if stage >= 1 else min(bucket_elems, n_rank))
    fp32_grads = 0.0
    if not offload and (precision != "fp32" or stage >= 1):
        fp32_grads = 4 * n_rank / (dp if stage >= 1 else 1)
    return float(bucket), fp32_grads


# ---------------------------------------------------------------------- activations
@dataclass
class Activations:
    per_layer: float  # one transformer block, one micro-batch, as stored for backward
    layers: float  # all blocks (checkpointed: inputs + one block's working set)
    output: float  # output layer + loss working set, final norm
    total: float
    eager_total: float  # same with an s x s attention matrix (no flash kernel)
    variant: str


def output_layer_bytes(
    cfg: ModelConfig, seq: int, micro: int, tp: int, precision: str, device_type: str = "cuda"
) -> float:
    """What the output layer and the loss hold between forward and backward (peak)."""
    p, tokens = _DTYPE_BYTES[precision], seq * micro
    if tp > 1:  # vocab-parallel: this rank's logits and the loss's float32 working copy
        return tokens * (padded_vocab_size(cfg.vocab_size, tp) // tp) * (p + 4)
    rows = min(tokens, chunk_rows(cfg.vocab_size, device_type))
    chunk = rows * cfg.vocab_size * (p + (4 if p != 4 else 0))  # compute dtype (+ float32 copy)
    return chunk + tokens * cfg.d_model * p + cfg.vocab_size * cfg.d_model * 4


def activation_bytes(
    cfg: ModelConfig,
    seq: int,
    micro: int,
    tp: int,
    precision: str,
    sequence_parallel: bool = False,
    checkpointing: bool = False,
    device_type: str = "cuda",
    cp: int = 1,
) -> Activations:
    """Per rank. With context parallelism (cp > 1) a rank holds seq / cp tokens of each sequence,
    and each layer's attention also keeps the whole window's K and V (all-gathered over the CP
    group, saved for its backward): (seq - seq / cp) more tokens of K and V per layer."""
    s, b, h, a, L = seq // cp, micro, cfg.d_model, cfg.n_heads, cfg.n_layers  # s: this rank's tokens
    p = _DTYPE_BYTES[precision]
    f = cfg.ffn_dim
    kv = cfg.kv_heads * cfg.head_width
    q = cfg.n_heads * cfg.head_width  # d_model unless model.head_dim overrides it (Qwen3)
    drop = 1 if cfg.dropout > 0 else 0
    # Elements per token, split into what TP shards and what it replicates (no SP).
    replicated = p * (4 * h) + drop * 2 * h  # 2 norm inputs, QKV input, MLP input; 2 masks
    sharded = p * (q + 2 * kv + q)  # Q, K, V, attention output (wo input)
    sharded += p * (4 * f if cfg.activation == "swiglu" else 2 * f)  # MLP inner tensors
    scores = drop * 5 * a * seq + (1 - drop) * 2 * a * seq  # softmax out (+mask, dropout out), eager only
    rep_div = tp if sequence_parallel else 1
    gathered_kv = (seq - s) * b * p * 2 * kv / tp  # CP: the other ranks' keys and values
    per_layer = s * b * (replicated / rep_div + sharded / tp) + gathered_kv
    per_layer_eager = per_layer + s * b * (scores * p / 2) / tp
    if checkpointing:
        inputs = L * s * b * p * h / rep_div
        layers, layers_eager = inputs + per_layer, inputs + per_layer_eager
    else:
        layers, layers_eager = L * per_layer, L * per_layer_eager
    output = output_layer_bytes(cfg, s, b, tp, precision, device_type) + s * b * h * p * 2 / rep_div  # + final norm
    return Activations(
        per_layer,
        layers,
        output,
        layers + output,
        layers_eager + output,
        "flash/SDPA (no s x s scores)"
        + (f", seq / cp {cp} per rank" if cp > 1 else "")
        + (", full recompute" if checkpointing else ""),
    )


def run_activation_bytes(run: Any, gpu: str, cp: int) -> Activations:
    """activation_bytes of `run` (a RunConfig) on `gpu`, its sequences split `cp` ways."""
    par, tr = run.parallel, run.train
    return activation_bytes(
        run.model,
        tr.seq_len,
        tr.micro_batch_size,
        par.tp,
        tr.precision,
        par.sequence_parallel,
        par.activation_checkpointing,
        "cpu" if gpu == "cpu" else "cuda",
        cp,
    )


# ---------------------------------------------------------------- FLOPs and comm
def tp_comm_bytes_per_microbatch(
    cfg: ModelConfig, seq: int, micro: int, tp: int, precision: str, recompute: bool = False
) -> tuple[float, float]:
    """(payload bytes all-reduced, bytes each rank sends on a ring) per micro-batch."""
    if tp == 1:
        return 0.0, 0.0
    act = seq * micro * cfg.d_model * _DTYPE_BYTES[precision]
    n_ar = cfg.n_layers * (4 + (2 if recompute else 0)) + 2
    payload = n_ar * act + 3 * seq * micro * 4
    return payload, payload * 2 * (tp - 1) / tp


def dp_comm_bytes_per_step(n_rank: int, stage: int, dp: int, precision: str) -> float:
    """Bytes each rank sends for the data-parallel gradient (and ZeRO-3 param) traffic."""
    if dp == 1:
        return 0.0
    g = _DTYPE_BYTES[precision]
    ring = (dp - 1) / dp
    # reduce-scatter + all-gather (stages 0-2: 2 psi; stage 3: an extra param all-gather).
    return n_rank * g * ring * (3 if stage == 3 else 2)


# ---------------------------------------------------------------------------- plan
@dataclass
class Plan:
    world_size: int
    tp: int
    dp: int
    zero_stage: int
    precision: str
    grad_accum: int
    micro_batch: int
    seq_len: int
    tokens_per_step: int
    params: ParamCount
    analytic_params: int
    states: ModelStates
    activations: Activations
    reserve: float  # CUDA context / NCCL allowance (GPU only)
    ds_bucket: float
    ds_fp32_grads: float
    total_per_rank: float
    device: Device
    fits: bool
    flops_per_token: float
    hw_flops_per_token: float
    flops_per_step: float
    tp_comm_payload: float
    tp_comm_sent: float
    dp_comm_sent: float
    assumed_mfu: float
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_rank: float
    host: HostPlan  # host RAM per node, checkpoint size, save time
    notes: list[str] = field(default_factory=list)
    cp: int = 1  # context parallel: dp above is ZeRO's group, data x cp; samples split dp / cp ways
    cp_that_fits: int | None = None  # when it does not fit: the smallest parallel.cp whose activations would

    def as_dict(self) -> dict:
        d = asdict(self)
        d["states"]["total"] = self.states.total
        d["host"]["startup_fits"], d["host"]["save_fits"] = self.host.startup_fits, self.host.save_fits
        return d


def make_plan(run: Any, world_size: int, gpu: str = "h100", mfu: float = DEFAULT_MFU, **host: Any) -> Plan:
    """Predict one rank of `run` (a RunConfig) on `world_size` ranks of `gpu`. `host`: keyword
    arguments of host_model.host_plan (gpus_per_node, node_ram_gib, storage_gbps)."""
    cfg: ModelConfig = run.model
    par, tr = run.parallel, run.train
    tp, stage, prec, cp = par.tp, par.zero_stage, tr.precision, par.cp
    if world_size < 1 or world_size % (tp * cp):
        raise ValueError(
            f"--world-size {world_size} must be a positive multiple of parallel.tp={tp}"
            + (f" x parallel.cp={cp}" if cp > 1 else "")
        )
    dp = world_size // tp  # ZeRO's group: data x cp (the ranks holding the same parameters)
    # The DeepSpeed config the engine will use (it refuses a batch that does not split and an
    # offload at a stage that cannot take it): its accumulation and its reduce bucket.
    ds = ds_config(run, dp)
    accum = ds["gradient_accumulation_steps"]
    bucket_elems = int(ds["zero_optimization"].get("reduce_bucket_size", DS_BUCKET_ELEMS))
    dev = device_spec(gpu)
    model = meta_transformer(cfg)  # the full-size model with empty (meta) weights: no memory
    pc = count_params(model, tp)
    # model.lora: the optimizer, gradients and ZeRO see only the adapters; the base is frozen
    trainable, frozen = (pc.adapters_per_rank, pc.per_rank) if pc.adapters else (pc.per_rank, 0)
    states = model_state_bytes(trainable, stage, dp, prec, par.offload_optimizer, frozen)
    acts = run_activation_bytes(run, gpu, cp)
    reserve = RESERVE_GIB * GiB if gpu != "cpu" else 0.0
    bucket, fp32_grads = ds_buffers(trainable, stage, dp, prec, par.offload_optimizer, bucket_elems)
    total = states.total + acts.total + reserve + bucket + fp32_grads
    fits = dev.memory_gib * GiB >= total
    tokens = tr.global_batch_size * tr.seq_len
    fpt = float(model.flops_per_token(tr.seq_len))
    hw = fpt * 4 / 3 if par.activation_checkpointing else fpt  # recompute: 8 N + 16 L d s, the forward twice
    peak = (dev.fp32_tflops if prec == "fp32" else dev.bf16_tflops) * 1e12
    # The assumed MFU holds for the hardware FLOPs; recomputation adds work MFU ignores.
    step_time = hw * tokens / (world_size * peak * mfu)
    payload, sent = tp_comm_bytes_per_microbatch(
        cfg, tr.seq_len // cp, tr.micro_batch_size, tp, prec, par.activation_checkpointing
    )
    on_host = (states.total + acts.total + bucket + fp32_grads) if gpu == "cpu" else states.offloaded
    hp = host_plan(
        total_params=pc.total,
        largest_param=max(p.numel() for p in model.parameters()),
        tp=tp,
        dp=dp,
        world_size=world_size,
        zero_stage=stage,
        device_states_on_host=on_host,
        on_cpu=gpu == "cpu",
        checkpoint_params=pc.adapters or pc.total,  # model.lora: checkpoints hold the adapters only
        checkpoint_per_rank=pc.adapters_per_rank or pc.per_rank,
        **host,
    )
    notes = []
    if prec == "bf16" and stage == 0:
        notes.append(
            "bf16 at ZeRO-0 runs DeepSpeed's FP16_UnfusedOptimizer, whose first AdamW update differs "
            "from a plain fp32-master AdamW in ~57% of elements here (ZeRO-1 matches it exactly); "
            "prefer parallel.zero_stage >= 1 (at dp=1 it holds the same bytes)"
        )
    if pc.adapters:
        notes.append(
            f"LoRA rank {cfg.lora.rank}: {pc.adapters_per_rank:,} adapter params train on each rank "
            f"({pc.adapters_per_rank / max(1, pc.per_rank):.2%} of its {pc.per_rank:,}); the base is frozen "
            f"(its {_DTYPE_BYTES[prec]} B/param only: no gradient, no optimizer state)"
        )
    if cfg.vocab_size % tp:
        notes.append(f"vocab {cfg.vocab_size} padded to {padded_vocab_size(cfg.vocab_size, tp)} for tp={tp}")
    return Plan(
        world_size=world_size,
        tp=tp,
        dp=dp,
        zero_stage=stage,
        precision=prec,
        grad_accum=accum,
        micro_batch=tr.micro_batch_size,
        seq_len=tr.seq_len,
        tokens_per_step=tokens,
        params=pc,
        analytic_params=param_count(cfg),  # from ModelConfig's arithmetic alone
        states=states,
        activations=acts,
        reserve=reserve,
        ds_bucket=bucket,
        ds_fp32_grads=fp32_grads,
        total_per_rank=total,
        device=dev,
        fits=fits,
        flops_per_token=fpt,
        hw_flops_per_token=hw,
        flops_per_step=fpt * tokens,
        tp_comm_payload=payload * accum,
        tp_comm_sent=sent * accum,
        dp_comm_sent=dp_comm_bytes_per_step(trainable, stage, dp, prec),
        assumed_mfu=mfu,
        step_time_s=step_time,
        tokens_per_s=tokens / step_time,
        tokens_per_s_per_rank=tokens / step_time / world_size,
        host=hp,
        notes=notes,
        cp=cp,
        cp_that_fits=None if fits else _cp_that_fits(run, world_size, total - acts.total, dev, gpu),
    )


def _cp_that_fits(run: Any, world_size: int, rest: float, dev: Device, gpu: str) -> int | None:
    """The smallest parallel.cp above the run's whose activations, with everything else as it is
    (ZeRO's group stays data x cp), fit the device; None if none does at this world size."""
    par, tr = run.parallel, run.train
    cp = par.cp * 2
    while world_size % (par.tp * cp) == 0 and tr.seq_len % (2 * cp) == 0:
        data = world_size // (par.tp * cp)
        if tr.global_batch_size % (tr.micro_batch_size * data) == 0:
            if rest + run_activation_bytes(run, gpu, cp).total <= dev.memory_gib * GiB:
                return cp
        cp *= 2
    return None
