"""The run's typed schema: the one place every knob is defined, with its default and its rules.

A YAML config (and `key=value` overrides) is merged onto `RunConfig` with
OmegaConf; see `loomtrain.launcher.config_loader` for loading. Each section checks
its own fields in `validate(prefix)` (prefix: its dotted name in the file), beside
the fields and their allowed values; the loader's `validate` calls every section and
checks the rules that span sections. Every failure is a `ConfigError` whose message
is one line naming the dotted key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loomtrain.hf_cache import ModelIdError, cached_snapshot, looks_like_model_id
from loomtrain.launcher.addresses import check_ray_address
from loomtrain.model.config import ModelConfig
from loomtrain.storage import known_scheme, location_problem, scheme


def cuda_available() -> bool:
    # torch only where a check asks for CUDA: a config (preprocess, plan, a Ray driver, a config
    # error) loads without importing torch (1.8 s).
    import torch

    return torch.cuda.is_available()


class ConfigError(ValueError):
    """A bad config: the message is one line that names the dotted key."""


def check(ok: bool, key: str, expected: str, value: Any) -> None:
    """The one-line error format of every config rule: `<dotted key>: expected ..., got <value>`."""
    if not ok:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


def check_location(key: str, value: Any, local: str = "") -> None:
    """A location written as (or like) a URI: lower-case scheme fsspec knows, two slashes, a
    bucket (storage.location_problem); `S3://b`, `s4://b`, `s3:/b` are refused here, once.
    `local`: only a local path will do, for the reason it says."""
    problem = location_problem(value, local)
    if problem:
        raise ConfigError(f"{key}: {problem}, got {value!r}")


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    check(value in choices, key, "one of " + ", ".join(choices), value)


def check_positive(key: str, value: Any, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    check(ok, key, "a non-negative number" if allow_zero else "a positive number", value)


@dataclass
class RunSection:
    name: str = "run"
    # Where checkpoints, metrics.jsonl, tb/ and the resolved config go: a local folder on
    # each host (logs, metrics and TensorBoard stay here even when run.storage is set).
    dir: str = "runs/${run.name}"
    # Where checkpoints and final weights go instead of run.dir: empty = run.dir, or an
    # object-store URI (s3://bucket/prefix, gs://, az://, file://) that every host reaches.
    # Credentials come from the storage library's standard chain, never from the config.
    storage: str = ""
    # run.storage has one owner at a time: the run holds a lease object there
    # (launcher/lease.py, docs/storage.md), renewed every storage_lease_s / 4 while it runs;
    # another run may take it over once it has not been renewed for storage_lease_s.
    storage_lease_s: float = 120.0
    # Take run.storage's lease now even when another run holds it (that run is known dead).
    storage_take_over: bool = False

    def validate(self, prefix: str) -> None:
        check(bool(self.dir), f"{prefix}.dir", "a directory path", self.dir)
        because = f"checkpoints and final weights go to object storage with {prefix}.storage"
        check_location(f"{prefix}.dir", self.dir, local=because)
        check_location(f"{prefix}.storage", self.storage)
        check(self.storage_lease_s >= 2, f"{prefix}.storage_lease_s", "at least 2 (seconds)", self.storage_lease_s)
        check(
            not self.storage or known_scheme(self.storage),
            f"{prefix}.storage",
            "empty (checkpoints under run.dir) or an object-store URI such as s3://bucket/prefix",
            self.storage,
        )


@dataclass
class DataSource:
    # A directory of token shards made by `loomtrain preprocess`: a path, or a URI
    # (s3://bucket/ds: read in place, window by window).
    path: str = ""
    # Relative share of the samples (normalised over all sources).
    weight: float = 1.0

    # What each field takes, in the errors that name it (here and in the config loader).
    EXPECTED: ClassVar[dict[str, str]] = {
        "path": "a shard directory made by `loomtrain preprocess`",
        "weight": "a positive number (the source's relative share of the samples)",
    }

    def validate(self, prefix: str) -> None:
        check(bool(self.path), f"{prefix}.path", self.EXPECTED["path"], self.path)
        check_location(f"{prefix}.path", self.path)  # a URI: of a scheme fsspec knows
        # A list item: the loader's finite-number rule covers section fields only.
        ok = math.isfinite(self.weight) and self.weight > 0
        check(ok, f"{prefix}.weight", self.EXPECTED["weight"], self.weight)


BUILTIN_TOKENIZERS = ("byte", "bpe")


@dataclass
class DataConfig:
    # A directory of token shards made by `loomtrain preprocess`, or a URI of one in object
    # storage (s3://bucket/ds: read in place, window by window); empty means
    # the embedded corpus: the Python standard library's own .py sources.
    path: str = ""
    # A weighted mixture of shard directories (all made by one tokenizer), instead of `path`.
    sources: list[DataSource] = field(default_factory=list)
    # One of BUILTIN_TOKENIZERS ("bpe" is trained on the corpus), or a path to a tokenizer.json.
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    # Embedded corpus only: cap on the number of stdlib files read (0 = all).
    max_files: int = 0
    val_fraction: float = 0.01
    split_seed: int = 0
    # Where the embedded corpus' shards are cached ("" = RUN_DIR/../.data_cache).
    cache_dir: str = ""
    # Micro-batches made ahead of time by a background thread (0 = none).
    prefetch: int = 2
    # Shards in object storage: bytes of token windows each rank holds in memory, those fetched
    # ahead (up to half of it) and those already read, kept for reuse (a small split's later
    # epochs, a window read twice); 0 = only the windows of the next prefetch + 1 batches.
    cache_bytes: int = 1 << 30
    # Packed documents never see each other: attention stays inside each document, positions
    # restart at each, and a window holds whole documents (data_pipeline/stream.py). null = on
    # for instruction and chat data (`preprocess --format prompt-response|chat`), off for text.
    document_masking: bool | None = None

    def validate(self, prefix: str) -> None:
        tok = self.tokenizer
        found = tok in BUILTIN_TOKENIZERS or Path(tok).is_file() or (Path(tok) / "tokenizer.json").is_file()
        if not found and looks_like_model_id(tok):  # a model id: its folder in the local HF cache
            try:
                found = (cached_snapshot(tok) / "tokenizer.json").is_file()
            except ModelIdError as exc:
                raise ConfigError(f"{prefix}.tokenizer: {exc}") from None
        check(
            found,
            f"{prefix}.tokenizer",
            "byte, bpe, the path of an existing tokenizer.json or a directory holding one "
            "(a Hugging Face model or tokenizer directory, or its model id in the local Hugging Face cache)",
            tok,
        )
        check(0.0 <= self.val_fraction < 1.0, f"{prefix}.val_fraction", "a number in [0, 1)", self.val_fraction)
        check_positive(f"{prefix}.max_files", self.max_files, allow_zero=True)
        check(
            not (self.path and self.sources),
            f"{prefix}.sources",
            f"empty when {prefix}.path is set ({prefix}.path is the one-source form of {prefix}.sources)",
            "a list",
        )
        check_location(f"{prefix}.path", self.path)  # a URI: of a scheme fsspec knows
        check_location(f"{prefix}.cache_dir", self.cache_dir)
        for i, src in enumerate(self.sources):
            src.validate(f"{prefix}.sources[{i}]")
        check_positive(f"{prefix}.prefetch", self.prefetch, allow_zero=True)
        check_positive(f"{prefix}.cache_bytes", self.cache_bytes, allow_zero=True)


ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed also offloads at stage 1, but the memory plan and test_zero's offload runs cover 2 and 3.
OFFLOAD_ZERO_STAGES = (2, 3)


@dataclass
class ParallelConfig:
    tp: int = 1
    # Context parallelism: each sequence split over cp ranks (chunks i and 2cp-1-i of 2cp), keys and
    # values all-gathered per layer; world = tp x cp x dp (loomtrain.parallel.context, docs/long-context.md).
    cp: int = 1
    # One of ZERO_STAGES.
    zero_stage: int = 0
    sequence_parallel: bool = False
    # Optimizer states and the AdamW step in host memory: only at OFFLOAD_ZERO_STAGES.
    offload_optimizer: bool = False
    activation_checkpointing: bool = False
    # torch.compile each transformer block (parameter names, so checkpoints, unchanged)
    compile: bool = False
    # No progress for this long = a hang: every rank dumps its stacks into its log and
    # the run ends naming the stuck rank (the collective timeout is set a minute above the
    # longest allowance). This is a training step's allowance; the phases that are slow and
    # healthy get their own (launcher/observe/watchdog.py; a hang line names the phase and its knob):
    timeout_s: int = 600
    # The first step of an attempt (communicators, allocator and DeepSpeed warm-up); 0 = 3 x timeout_s.
    startup_timeout_s: int = 0
    # One forward pass of evaluation or sampling (an eval batch, a sampled token): evaluation is
    # allowed timeout_s + eval.batches x this, samples timeout_s + eval.sample_tokens x this.
    # 0 = timeout_s / 3 (a forward pass is at most a third of a training step's forward and backward).
    forward_timeout_s: float = 0.0
    # With compile: added to each phase the first time it runs in a process (torch.compile traces
    # and compiles the training step, evaluation's no-grad forward and sampling's shapes once).
    compile_timeout_s: int = 600
    # A tensor-parallel group (tp consecutive ranks) that would span hosts is refused at
    # start: its all-reduces, several per layer, would cross the network. True runs it anyway.
    allow_cross_host_tp: bool = False

    def validate(self, prefix: str) -> None:
        check_positive(f"{prefix}.tp", self.tp)
        check_positive(f"{prefix}.cp", self.cp)
        stages = ", ".join(map(str, ZERO_STAGES[:-1])) + f" or {ZERO_STAGES[-1]}"
        check(self.zero_stage in ZERO_STAGES, f"{prefix}.zero_stage", stages, self.zero_stage)
        self.check_offload(prefix)
        check_positive(f"{prefix}.timeout_s", self.timeout_s)
        for key in ("startup_timeout_s", "forward_timeout_s", "compile_timeout_s"):
            check_positive(f"{prefix}.{key}", getattr(self, key), allow_zero=True)

    def check_offload(self, prefix: str = "parallel") -> None:
        """The offload rule, asked by config validation, the engine and the memory plan alike."""
        stages = " or ".join(map(str, OFFLOAD_ZERO_STAGES))
        check(
            not self.offload_optimizer or self.zero_stage in OFFLOAD_ZERO_STAGES,
            f"{prefix}.offload_optimizer",
            f"false unless {prefix}.zero_stage is {stages} (it is {self.zero_stage})",
            self.offload_optimizer,
        )


PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("cosine", "linear", "constant")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    max_steps: int = 100
    seed: int = 1234
    seq_len: int = 128
    micro_batch_size: int = 8
    global_batch_size: int = 8
    precision: str = "fp32"  # PRECISIONS
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    lr_schedule: str = "cosine"  # LR_SCHEDULES
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # Stop the run after this many consecutive non-finite (skipped) steps.
    max_consecutive_skips: int = 5
    # The ranks agree on a stop request (SIGTERM, Ctrl-C, RUN_DIR/STOP) on log steps and every
    # this many steps: the vote is a collective and a device-to-host read, so a step between
    # votes has none; a stop saves at the first vote after the signal (1 = every step).
    stop_check_every_steps: int = 10
    device: str = "auto"  # DEVICES

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.precision", self.precision, PRECISIONS)
        check_choice(f"{prefix}.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_choice(f"{prefix}.device", self.device, DEVICES)
        check(
            self.device != "cuda" or cuda_available(),
            f"{prefix}.device",
            "auto or cpu on a machine without CUDA",
            self.device,
        )
        for key in ("max_steps", "seq_len", "micro_batch_size", "global_batch_size", "lr", "stop_check_every_steps"):
            check_positive(f"{prefix}.{key}", getattr(self, key))
        for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "eps", "max_consecutive_skips"):
            check_positive(f"{prefix}.{key}", getattr(self, key), allow_zero=True)
        check(self.min_lr <= self.lr, f"{prefix}.min_lr", f"at most {prefix}.lr={self.lr}", self.min_lr)
        for key in ("beta1", "beta2"):
            check(0.0 <= getattr(self, key) < 1.0, f"{prefix}.{key}", "a number in [0, 1)", getattr(self, key))

    def grad_accum_steps(self, dp_size: int) -> int:
        """Micro steps per optimizer step: global_batch_size / (micro_batch_size x dp_size), the one
        place it is derived (engine, loop, memory plan); a global batch that does not split is refused."""
        check(
            self.global_batch_size % (self.micro_batch_size * dp_size) == 0,
            "train.global_batch_size",
            f"a multiple of train.micro_batch_size * dp_size = {self.micro_batch_size} * {dp_size}",
            self.global_batch_size,
        )
        return self.global_batch_size // (self.micro_batch_size * dp_size)


@dataclass
class EvalConfig:
    every_steps: int = 50
    batches: int = 4
    num_samples: int = 2
    sample_tokens: int = 64
    # The text the samples continue; "" = the start of a held-out document (the validation
    # split's first), so that the prompt fits the data whatever it is.
    prompt: str = ""
    temperature: float = 0.8
    top_k: int = 40

    def validate(self, prefix: str) -> None:
        check_positive(f"{prefix}.batches", self.batches)
        for key in ("every_steps", "num_samples", "sample_tokens", "temperature", "top_k"):
            check_positive(f"{prefix}.{key}", getattr(self, key), allow_zero=True)


PROGRESS = ("auto", "bar", "plain")


@dataclass
class LogConfig:
    every_steps: int = 1
    tensorboard: bool = True
    progress: str = "auto"  # PROGRESS
    # [START, END]: torch.profiler traces of these steps into RUN_DIR/profile/ ([] = off).
    profile_steps: list[int] = field(default_factory=list)
    # Global ranks that profile ([] = every rank): one slow rank is what you look for.
    profile_ranks: list[int] = field(default_factory=list)
    # On CUDA, a memory snapshot (for pytorch.org/memory_viz) after this step (0 = none).
    memory_snapshot_step: int = 0

    def validate(self, prefix: str) -> None:
        check_positive(f"{prefix}.every_steps", self.every_steps)
        check_choice(f"{prefix}.progress", self.progress, PROGRESS)
        steps = list(self.profile_steps)
        check(
            not steps or (len(steps) == 2 and 1 <= steps[0] <= steps[1]),
            f"{prefix}.profile_steps",
            "[] or [START, END] with 1 <= START <= END",
            steps,
        )
        ranks = list(self.profile_ranks)
        check(all(r >= 0 for r in ranks), f"{prefix}.profile_ranks", "global ranks (>= 0)", ranks)
        check_positive(f"{prefix}.memory_snapshot_step", self.memory_snapshot_step, allow_zero=True)


# checkpoint.resume besides a PATH (whose existence the loader checks against run.dir).
RESUME_MODES = ("auto", "never")


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0 = only at the end (and on SIGTERM)
    keep_last: int = 3
    keep_every: int = 0  # also keep every M-th step's checkpoint (0 = none)
    resume: str = "auto"  # RESUME_MODES or PATH
    # Save and exit cleanly after this step (0 = never): splits a run across scheduler
    # jobs with a time limit (Megatron's --exit-interval); a later start resumes.
    stop_at_step: int = 0
    # Limit for one checkpoint's I/O: the hang watchdog allows a save this long.
    timeout_s: int = 1800
    # Write checkpoints on a background thread from a host copy taken at the step boundary,
    # so training goes on while the files are written (false: the step waits for the save).
    async_save: bool = True

    def validate(self, prefix: str) -> None:
        check_location(f"{prefix}.resume", self.resume)
        for key in ("keep_last", "timeout_s"):
            check_positive(f"{prefix}.{key}", getattr(self, key))
        for key in ("every_steps", "keep_every", "stop_at_step"):
            check_positive(f"{prefix}.{key}", getattr(self, key), allow_zero=True)


@dataclass
class RayConfig:
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: int = 1
    max_failures: int = 3
    # "" = $RAY_ADDRESS if set, else a new local instance; "auto" = the cluster
    # running on this machine; else HOST:PORT (GCS) or ray://HOST:10001.
    address: str = ""
    # Elastic workers (launcher/cluster/elastic.py): with min_workers < num_workers the run
    # goes on at any usable size in [min_workers, num_workers] after losing a node, at the
    # same global batch, and grows back when nodes return. 0 = num_workers (a fixed size).
    min_workers: int = 0
    # How often a running elastic group checks whether more workers fit (growing is a restart
    # from the newest checkpoint, so not too often).
    elastic_resize_interval_s: float = 60.0
    # A request the cluster can never satisfy fails after this long.
    start_timeout_s: int = 120
    # Ray Train's storage (its run state and our checkpoint pointers): "" = {run.storage}/ray
    # when run.storage is set (every host reaches it), else RUN_DIR/ray; or a shared path or a
    # URI (s3://, gs://).
    storage: str = ""

    @property
    def least_workers(self) -> int:
        """The smallest worker group this run accepts (num_workers when not elastic)."""
        return self.min_workers or self.num_workers

    @property
    def elastic(self) -> bool:
        return self.least_workers < self.num_workers

    def validate(self, prefix: str) -> None:
        check_positive(f"{prefix}.num_workers", self.num_workers)
        check_positive(f"{prefix}.cpus_per_worker", self.cpus_per_worker)
        check_positive(f"{prefix}.max_failures", self.max_failures, allow_zero=True)
        check(
            0 <= self.min_workers <= self.num_workers,
            f"{prefix}.min_workers",
            f"0 (= ray.num_workers, a fixed size) or 1..ray.num_workers={self.num_workers}",
            self.min_workers,
        )
        check_positive(f"{prefix}.elastic_resize_interval_s", self.elastic_resize_interval_s)
        # Ray's own parser would fail later with a traceback, or hang resolving the host
        # (its ValueError becomes a ConfigError in config_loader.validate, as every section's).
        check_ray_address(self.address, f"{prefix}.address")


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def local_paths(self) -> list[tuple[Any, str, str]]:
        """(section, field, dotted key) of every field that names a file or folder: set, not a
        URI, and not one of the names the field also takes (a built-in tokenizer, a resume mode).
        A Ray worker or job runs in a working directory of its own, where such a path differs."""
        d = self.data
        fields = [
            (self.run, "dir", "run.dir", ()),
            (d, "path", "data.path", ()),
            *((s, "path", f"data.sources[{i}].path", ()) for i, s in enumerate(d.sources)),
            (d, "tokenizer", "data.tokenizer", BUILTIN_TOKENIZERS),
            (d, "cache_dir", "data.cache_dir", ()),
            (self.checkpoint, "resume", "checkpoint.resume", RESUME_MODES),
            (self.model, "init_from", "model.init_from", ()),
            (self.ray, "storage", "ray.storage", ()),
        ]
        out = []
        for section, name, key, names in fields:
            value = getattr(section, name)
            if value and not scheme(value) and value not in names:  # a URI reads the same anywhere
                out.append((section, name, key))
        return out

    def model_group(self) -> str:
        """The ranks that hold one copy of the model, as messages name them: `parallel.tp=2`,
        with context parallelism `parallel.tp=2 x parallel.cp=2`."""
        p = self.parallel
        return f"parallel.tp={p.tp}" + (f" x parallel.cp={p.cp}" if p.cp > 1 else "")

    def data_ranks(self, workers: int) -> int:
        """How many ways `workers` ranks split the samples: one way per whole TP x CP group."""
        return workers // (self.parallel.tp * self.parallel.cp)

    def usable_world_size(self, workers: int) -> bool:
        """Whether `workers` ranks can run this config: whole TP x CP groups, and a global batch
        that splits into micro batches over the data ranks (an elastic group's sizes are checked here)."""
        dp, t = self.data_ranks(workers), self.train
        whole_groups = dp > 0 and workers == dp * self.parallel.tp * self.parallel.cp
        return whole_groups and t.global_batch_size % (t.micro_batch_size * dp) == 0
