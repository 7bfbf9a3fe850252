"""torch.profiler around chosen steps, and a CUDA memory snapshot.

    log.profile_steps: [START, END]   profile steps START..END (1-based, inclusive)
    log.profile_ranks: [0, 7]         on these global ranks only ([] = every rank)
    log.memory_snapshot_step: N       on CUDA: record allocations from the start, dump after step N

Output, per rank, in RUN_DIR/profile/rank_NNNNN/:
* `trace_steps_START-END.json`: a Chrome trace (chrome://tracing, ui.perfetto.dev), with
  CPU (and CUDA) activities, shapes, memory and Python stacks;
* `top_ops_steps_START-END.txt`: the operators by self time; the logging rank also puts
  this table into TensorBoard text (`profile/top_ops`);
* `memory_snapshot_step_N.pickle`: opens in https://pytorch.org/memory_viz.
Without log.profile_steps nothing is recorded and the loop pays one attribute test per step.
"""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, cfg, rank: int, run_dir: Path, device: torch.device) -> None:
        steps, ranks = list(cfg.log.profile_steps), list(cfg.log.profile_ranks)
        self.on_this_rank = not ranks or rank in ranks
        self.start, self.end = (steps[0], steps[1]) if steps and self.on_this_rank else (0, -1)
        self.dir = Path(run_dir) / "profile" / f"rank_{rank:05d}"
        self.device = device
        self.snapshot_step = cfg.log.memory_snapshot_step if device.type == "cuda" and self.on_this_rank else 0
        self._prof = None
        self.enabled = self.end >= self.start > 0 or self.snapshot_step > 0
        if self.snapshot_step:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def before_step(self, step: int) -> None:
        """`step` is the 1-based number of the step about to run."""
        if not self.enabled:
            return
        if step == self.start or (self.start < step <= self.end and self._prof is None):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                profile_memory=True,
                with_stack=True,
            )
            self._prof.__enter__()
            self._first = step

    def after_step(self, step: int) -> str | None:
        """After step `step`: the top-ops table when a profiled range just ended, else None."""
        if self.snapshot_step and step == self.snapshot_step:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_snapshot_step_{step}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_step = 0
        if self._prof is not None and step >= self.end:
            return self.finish(step)
        return None

    def finish(self, last_step: int) -> str | None:
        """Stop a running profile (also when the run stops inside the range)."""
        if self._prof is None:
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        span = f"{self._first}-{last_step}"
        prof.export_chrome_trace(str(self.dir / f"trace_steps_{span}.json"))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = _top_ops(prof.key_averages(), sort)
        (self.dir / f"top_ops_steps_{span}.txt").write_text(table + "\n")
        return f"steps {span}, sorted by {sort}\n\n{table}"

    def close(self) -> None:
        """Stop a profile or a memory history still running when the run fails, writing nothing."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
        if self.snapshot_step:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_step = 0


def _top_ops(averages, sort: str, rows: int = 25) -> str:
    """The operators' table, without the Python-frame rows that `with_stack` adds."""
    from torch.autograd.profiler_util import EventList

    ops = EventList([e for e in averages if ".py(" not in e.key and not e.key.startswith("<built-in")])
    return ops.table(sort_by=sort, row_limit=rows)
