"""Run metrics: TensorBoard + metrics.jsonl on the logging rank, console progress, MFU.

Only the logging rank (global rank 0) creates a `MetricsLogger` that writes;
other ranks get one with `enabled=False` that does nothing, so the loop calls
it unconditionally.

* `RUN_DIR/metrics.jsonl`: one JSON object per logged step (train metrics) and
  per evaluation (`eval/loss`, `eval/ppl`), each with `step`;
* TensorBoard event files in RUN_DIR itself, so that `tensorboard --logdir runs/`
  lists each run under its own name: the same scalars under grouped tags
  (`loss/train`, `loss/val`, `perf/tokens_per_s`, `memory/mem_gib`, ...; see `tb_tag`), the
  hyperparameters (HParams plugin), generated text samples and the profiler's
  top-ops table;
* with `run.storage` a URI (RUN_DIR then is this host's alone), the event files and
  metrics.jsonl mirrored to `{run.storage}/tb/`, where TensorBoard follows the run
  (`mirror.py`);
* console: a tqdm bar (step, loss, tok/s, ETA) on a terminal, plain lines
  otherwise (`log.progress: auto | bar | plain`); a line names the slowest rank
  when its step took more than 1.2 x the median over ranks.

Stragglers: at each log step `gather_rank_stats` (one all-gather of three numbers
per rank) collects every rank's step time, data wait and memory, so the logged
`step_time_max_s / step_time_min_s / slowest_rank / data_wait_max_s /
mem_bytes_max / mem_rank_max` describe the whole job, not rank 0 alone. A rank's
step time is measured up to the end of its own work in the step; the time it then
waits for the others (in this gather) is not in it, so the latest rank shows the
largest time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from loomtrain.durable import atomic_write, naming
from loomtrain.launcher.observe.mirror import Mirror, restore_metrics, tb_uri
from tqdm import tqdm

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity); `loomtrain plan`'s devices
# (planning/memory_model.DEVICES) take theirs from here.
GPU_PEAK_FLOPS: dict[str, float] = {
    "h200": 989e12,
    "h100 pcie": 756e12,
    "h100": 989e12,  # SXM
    "h800": 989e12,
    "gh200": 989e12,
    "b200": 2250e12,
    "a100": 312e12,
    "a800": 312e12,
    "l40s": 362e12,
    "l4": 121e12,
    "a10": 125e12,
    "v100": 125e12,  # fp16 tensor cores (no bf16)
}


def gpu_peak_flops(name: str) -> float | None:
    """Peak for a CUDA device name like 'NVIDIA H100 80GB HBM3' (None if unknown)."""
    low = name.lower()
    for key in sorted(GPU_PEAK_FLOPS, key=len, reverse=True):  # 'h100 pcie' before 'h100'
        if key in low:
            return GPU_PEAK_FLOPS[key]
    return None


_CPU_PEAK: dict[torch.dtype, float] = {}  # one core's matmul FLOPs per CPU-second, per dtype


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cpus)


def measured_cpu_flops(dtype: torch.dtype = torch.float32, size: int = 256, trials: int = 48) -> float:
    """Peak matmul FLOP/s of the CPU cores this process computes on: one core's rate, measured
    once per dtype (well under a second), times the cores torch computes on (its threads, at
    most the usable CPUs).

    One core's rate is timed in that thread's own CPU time, not wall-clock time: other jobs on
    the machine only take time slices away, which CPU time does not count, so a peak measured
    while the machine is busy is the same as an idle one's. (Timed in wall-clock time with every
    thread, a peak measured under load was half the real one, and a run that went on after the
    load stopped showed `mfu 149.6%`.) A run cannot get more CPU-seconds per second than its
    threads, nor more FLOPs per CPU-second than a core's matmul, so MFU stays at most 100%.
    The best of many short trials (one matmul each, well under a scheduler time slice): a trial
    that another process interrupts pays for the caches it finds cold, and is not the best one.
    (Trials of 4 matmuls of 512 lost 25% under heavy load; single 256 ones lose nothing.)
    """
    if dtype not in _CPU_PEAK:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the matmul runs on this thread, whose CPU time is timed
        try:
            a @ b  # warm up
            best = 0.0
            for _ in range(trials):
                start = time.thread_time()
                a @ b
                best = max(best, 2 * size**3 / max(time.thread_time() - start, 1e-9))
        finally:
            torch.set_num_threads(threads)
        _CPU_PEAK[dtype] = best
    return _CPU_PEAK[dtype] * min(torch.get_num_threads(), usable_cpus())


def device_peak_flops(device: torch.device, precision: str) -> float:
    if device.type == "cuda":
        peak = gpu_peak_flops(torch.cuda.get_device_name(device))
        # MFU against the bf16 dense peak whatever the run's precision (the usual convention).
        return float("nan") if peak is None else peak
    return measured_cpu_flops(torch.bfloat16 if precision == "bf16" else torch.float32)


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: model FLOPs per token (loomtrain.model.flops, PaLM appendix B)
    x tokens/s / peak FLOP/s (summed over the devices that produced those tokens)."""
    return flops_per_token * tokens_per_s / peak_flops


def memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated on this rank, or the process RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(psutil.Process(os.getpid()).memory_info().rss)


# The job-wide figures of gather_rank_stats: on one process they are the process's own (a flat
# zero for the slowest rank), so TensorBoard gets them only when there is more than one rank.
RANK_STATS = (
    "step_time_max_s",
    "step_time_min_s",
    "step_time_median_s",
    "slowest_rank",
    "data_wait_max_s",
    "mem_bytes_max",
    "mem_rank_max",
)
# metrics.jsonl key -> TensorBoard group: `memory` for mem_*, `perf` for speed and the rank figures;
# any other key (lr, grad_norm, tokens_seen, skipped_steps) is in `train` (keys that already hold a
# "/" keep it).
_TB_GROUPS = {
    k: "memory" if k.startswith("mem_") else "perf"
    for k in ("tokens_per_s", "mfu", "step_time_s", "mem_bytes", *RANK_STATS)
}
# Memory is plotted in GiB (metrics.jsonl keeps bytes): 6e+8 on an axis reads badly.
_TB_GIB = {"mem_bytes": "mem_gib", "mem_bytes_max": "mem_gib_max"}
# What TensorBoard's HPARAMS table shows first: the model's size, the learning rate, the batch
# and the parallel layout (the rest of the config follows in its own order).
HPARAMS_FIRST = (
    "model.d_model",
    "model.n_layers",
    "model.n_heads",
    "model.vocab_size",
    "train.lr",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.seq_len",
    "train.precision",
    "parallel.tp",
    "parallel.zero_stage",
    "ray.num_workers",
)
# The losses in a group of their own, `loss`: TensorBoard orders groups by name, and `loss` comes
# before `memory`, `perf` and `train` (only a run that lost a host or resized has `elastic` and
# `fault` groups above it), so the loss curve is the first chart a user sees; in the group, cards
# are ordered by name too: `train`, then `val` (the validation split's loss) and `val_ppl`.
_TB_TAGS = {"loss": "loss/train", "eval/loss": "loss/val", "eval/ppl": "loss/val_ppl"}
# TensorBoard's Custom Scalars tab: the train and eval loss in one chart.
CUSTOM_SCALARS = {"loss": {"train and eval loss": ["Multiline", ["loss/train", "loss/val"]]}}
STRAGGLER_RATIO = 1.2  # the console names the slowest rank above this x the median


def tb_tag(key: str) -> str:
    """`loss` -> `loss/train`, `eval/loss` -> `loss/val`, `mfu` -> `perf/mfu`, `mem_bytes` ->
    `memory/mem_gib`."""
    if key in _TB_TAGS:
        return _TB_TAGS[key]
    if "/" in key:
        return key
    return f"{_TB_GROUPS.get(key, 'train')}/{_TB_GIB.get(key, key)}"


def tb_scalars(metrics: dict[str, Any], world_size: int) -> dict[str, float]:
    """TensorBoard tag -> value for a step's numeric metrics: memory in GiB, and the job-wide
    rank figures only when the job has more than one rank."""
    out = {}
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if key in RANK_STATS and world_size <= 1:
            continue
        out[tb_tag(key)] = value / 2**30 if key in _TB_GIB else value
    return out


def gather_rank_stats(step_time: float, data_wait: float, mem_bytes: int, device: torch.device) -> dict[str, float]:
    """Every rank's (step time, data wait, memory) -> the job-wide figures (same on all ranks).

    One all-gather of 3 float64 per rank; every rank of the job must call it at the same step.
    """
    mine = torch.tensor([step_time, data_wait, float(mem_bytes)], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        table = torch.stack(parts).cpu()
    else:
        table = mine.cpu().unsqueeze(0)
    times, waits, mems = table[:, 0], table[:, 1], table[:, 2]
    return {
        "step_time_max_s": float(times.max()),
        "step_time_min_s": float(times.min()),
        "step_time_median_s": float(times.median()),
        "slowest_rank": int(times.argmax()),
        "data_wait_max_s": float(waits.max()),
        "mem_bytes_max": int(mems.max()),
        "mem_rank_max": int(mems.argmax()),
    }


def straggler_note(metrics: dict[str, Any]) -> str:
    """' | slowest rank R: X s (median Y s)' when one rank lags, else ''."""
    slow, median = metrics.get("step_time_max_s"), metrics.get("step_time_median_s")
    if slow is None or median is None or not median > 0 or slow <= STRAGGLER_RATIO * median:
        return ""
    return f" | slowest rank {metrics['slowest_rank']}: {slow:.3f} s (median {median:.3f} s)"


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _hparams(flat: dict[str, Any]) -> dict[str, Any]:
    """The flattened config, HPARAMS_FIRST (those present) first, as HParams takes it: bool/int/float/str only."""
    ordered = {**{k: flat[k] for k in HPARAMS_FIRST if k in flat}, **flat}  # a key keeps its first place
    return {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in ordered.items()}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _quiet_tensorboard_thread() -> None:
    """TensorBoard writes its event file on a thread of its own; when a write fails (a full or
    read-only disk) that thread re-raises, Python prints its traceback, and the training thread
    gets the same error at its next TensorBoard call, which ends the run with one line. Only the
    first is noise: an OSError on TensorBoard's writer thread is not printed."""
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        max_steps: int,
        enabled: bool = True,
        tensorboard: bool = True,
        progress: str = "auto",
        start_step: int = 0,
        storage: str = "",
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.max_steps = max_steps
        self.writer = None
        self.bar = None
        self._jsonl = None
        self.mirror = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if storage and start_step:  # run.storage: this RUN_DIR may be a fresh host's (mirror.py)
            restore_metrics(self.run_dir, tb_uri(storage))
        # A fresh start (start_step 0) replaces an earlier run's metrics; a resume keeps
        # the records up to start_step and drops those of the steps it will redo.
        path = self.jsonl_path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines(keepends=True) if start_step and path.exists() else []
        kept = [line for line in lines if _step_of(line) <= start_step]
        atomic_write(path, "".join(kept))  # a crash here keeps the earlier records
        self._jsonl = open(path, "a", buffering=1)
        if tensorboard:
            # Imported here: every rank imports this module, only rank 0 writes (0.3 s a process).
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            # In RUN_DIR itself: TensorBoard names a run after the folder holding its event files, so
            # `tensorboard --logdir runs/` shows NAME, not NAME/tb. purge_step: TensorBoard hides
            # older events from step start_step + 1 on.
            with self._tensorboard():
                self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=start_step + 1)
        if storage:  # TensorBoard follows the run from {run.storage}/tb/
            self.mirror = Mirror(self.run_dir, tb_uri(storage)).start()
        use_bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
        if use_bar:
            self.bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def _tensorboard(self) -> contextlib.AbstractContextManager:
        """Around a TensorBoard call: a failed write names the event file (its thread's error
        reaches us at the next call, without a file name)."""
        file_writer = getattr(self.writer, "file_writer", None)
        event_file = getattr(getattr(file_writer, "event_writer", None), "_file_name", None)
        return naming(event_file or self.run_dir)

    # --- writers ----------------------------------------------------------------
    def hparams(self, config: dict[str, Any], metrics: tuple[str, ...] = ("loss/train", "loss/val")) -> None:
        """The resolved config as TensorBoard hyperparameters (in this run's own event file)."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        exp, ssi, sei = hparams_summary(_hparams(flatten(config)), {m: float("nan") for m in metrics})
        with self._tensorboard():
            fw = self.writer._get_file_writer()
            for summary in (exp, ssi, sei):
                fw.add_summary(summary)
            self.writer.add_custom_scalars(CUSTOM_SCALARS)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One JSON line and one TensorBoard scalar per metric."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with naming(self.jsonl_path):
            self._jsonl.write(json.dumps(record) + "\n")
        if self.writer is not None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            with self._tensorboard():
                for tag, value in tb_scalars(metrics, world).items():
                    self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, text: str, step: int, raw: bool = False) -> None:
        """Markdown text; unless `raw`, fenced as code so that its indentation stays visible."""
        if self.writer is not None:
            with self._tensorboard():
                self.writer.add_text(tag, text if raw else "```\n" + text + "\n```", step)

    def console(self, step: int, metrics: dict[str, float], elapsed: float, done_steps: int) -> None:
        """Progress: a bar update on a terminal, otherwise one plain line."""
        if not self.enabled:
            return
        rate = done_steps / elapsed if elapsed > 0 else float("nan")
        eta = (self.max_steps - step) / rate if rate and rate > 0 else float("nan")
        loss, tps = metrics.get("loss", float("nan")), metrics.get("tokens_per_s", float("nan"))
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(f"loss {loss:.4f} | {tps:,.0f} tok/s" + straggler_note(metrics), refresh=False)
            self.bar.refresh()
        else:
            print(
                f"step {step}/{self.max_steps} | loss {loss:.4f} | lr {metrics.get('lr', float('nan')):.2e} "
                f"| grad_norm {metrics.get('grad_norm', float('nan')):.3f} | {tps:,.0f} tok/s "
                f"| mfu {100 * metrics.get('mfu', float('nan')):.1f}% | ETA {_fmt_time(eta)}" + straggler_note(metrics),
                flush=True,
            )

    def message(self, text: str) -> None:
        """A line on the console that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, flush=True)

    def flush(self) -> None:
        if self.writer is not None:
            with self._tensorboard():
                self.writer.flush()
        if self._jsonl is not None:
            with naming(self.jsonl_path):
                self._jsonl.flush()

    def close(self) -> None:
        """Close the bar, TensorBoard and metrics.jsonl, all of them whatever fails. A failed
        last write is raised (naming its file) after that, unless the run is already ending on
        an error: that one is the cause to report, this one only its echo."""
        failed: OSError | None = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            try:
                with self._tensorboard():
                    self.writer.close()
            except OSError as exc:
                failed = exc
            self.writer = None
        if self._jsonl is not None:
            try:
                with naming(self.jsonl_path):
                    self._jsonl.close()
            except OSError as exc:
                failed = failed or exc
            self._jsonl = None
        if self.mirror is not None:  # the last pass, after the writers flushed and closed
            self.mirror.stop()
            self.mirror = None
        if failed is not None and sys.exc_info()[1] is None:
            raise failed


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value
