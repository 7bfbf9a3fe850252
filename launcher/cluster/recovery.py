"""What a failure cost a Ray run: the hosts lost, the steps redone, the time to the first step after it.

Ray Train restarts the worker group by itself after a worker or a whole node dies; the new
attempt's rank 0 works out what happened from two records in the run directory:

* RUN_DIR/ray_attempts.jsonl (ray_train.py): one line per attempt, which now also holds the
  address of the node each rank ran on (`hosts`, all-gathered at the attempt's start) and the
  driver's start time (`run_started_at`: attempts of one `loomtrain train --ray` share it);
* RUN_DIR/logs/ray_progress.json: rank 0's last completed step and its time, rewritten after
  every step (not fsynced: it is a liveness record, as the watchdog's heartbeats are).

When the previous attempt belongs to the same driver, it failed (a clean end ends the driver's
run). Then: the hosts lost are those of the previous attempt's ranks that no rank of this
attempt runs on (a replacement host has another address; a host that comes back with its old
address counts as a worker that died); the steps redone are the previous attempt's last step
minus this attempt's start step; and the recovery time runs from the last completed step
before the failure (the failure itself is not observed: it came at most one step later) to
the end of this attempt's first step. Rank 0 prints one line at the restart (which host was
lost, from which step it resumes) and one after that first step (how long recovery took),
and writes `fault/recovery_s` and `fault/steps_lost` once, at that step, into metrics.jsonl and
TensorBoard (a record of its own: the step's training record is already written). An elastic
group that grew (more ranks, no host lost) was restarted by Ray on purpose: the same figures
go to `elastic/resize_s` and `elastic/steps_lost`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from loomtrain.durable import atomic_write
from loomtrain.launcher.hooks import TrainContext

PROGRESS_FILE = "ray_progress.json"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ranks_by_host(hosts: list[str], lost: list[str]) -> str:
    return "; ".join(f"host {h} (ranks {', '.join(str(r) for r, x in enumerate(hosts) if x == h)})" for h in lost)


class Recovery:
    """Rank 0's account of a restart, called from RayReportHook (see the module docstring)."""

    def __init__(self, run_dir: str, node_ip: str, run_started_at: float) -> None:
        self.progress_path = Path(run_dir) / "logs" / PROGRESS_FILE
        self.node_ip = node_ip
        self.run_started_at = run_started_at
        self.attempt = 0
        self.pending: dict[str, Any] | None = None  # a failure whose recovery is not yet measured

    def attempt_fields(self, ctx: TrainContext, attempt: int, previous: dict | None) -> dict[str, Any]:
        """Every rank (one all-gather): the fields this attempt adds to its ray_attempts.jsonl line
        (rank 0's are the ones written); on rank 0 after a failure, the restart line."""
        import torch.distributed as dist

        hosts: list[str] = [self.node_ip]
        if dist.is_initialized() and dist.get_world_size() > 1:
            hosts = [""] * dist.get_world_size()
            dist.all_gather_object(hosts, self.node_ip)
        self.attempt = attempt
        fields: dict[str, Any] = {"hosts": hosts, "run_started_at": self.run_started_at}
        if ctx.dist.rank != 0 or not previous or previous.get("run_started_at") != self.run_started_at:
            return fields
        progress = _read_json(self.progress_path)
        if progress and progress.get("attempt") == previous.get("attempt"):
            failed_after, since = int(progress["step"]), float(progress["time"])
        else:  # the previous attempt died before its first step
            failed_after, since = int(previous.get("start_step", 0)), float(previous.get("time", time.time()))
        resumed = ctx.state.step
        lost = sorted(set(previous.get("hosts", [])) - set(hosts))
        # An elastic group that grew (a node joined) was restarted by Ray on purpose: not a fault.
        grew = not lost and len(hosts) > len(previous.get("hosts", []))
        self.pending = {
            "since": since,
            "steps_lost": max(0, failed_after - resumed),
            "prefix": "elastic/resize" if grew else "fault/recovery",
        }
        fields.update(failed_after_step=failed_after, resumed_from_step=resumed, lost_hosts=lost)
        if grew:
            what = f"the elastic group grew from {len(previous['hosts'])} to {len(hosts)} workers"
        else:
            what = f"lost {_ranks_by_host(previous['hosts'], lost)}" if lost else "a worker process died"
        print(
            f"loomtrain: restart (attempt {attempt}): {what} after step {failed_after}; "
            f"resuming from step {resumed} ({failed_after - resumed} steps to redo)",
            flush=True,
        )
        return fields

    def on_step_end(self, ctx: TrainContext) -> None:
        """Rank 0, after every step: the progress record; after the first step since a failure,
        the recovery figures."""
        if ctx.dist.rank != 0:
            return
        now = time.time()
        step = ctx.state.step
        atomic_write(self.progress_path, json.dumps({"attempt": self.attempt, "step": step, "time": now}), fsync=False)
        if self.pending is None:
            return
        recovery_s, steps_lost, prefix = now - self.pending["since"], self.pending["steps_lost"], self.pending["prefix"]
        self.pending = None
        if ctx.metrics is not None:  # fault/recovery_s, fault/steps_lost (elastic/resize_s, ... for a grow)
            ctx.metrics.log(step, {f"{prefix}_s": recovery_s, f"{prefix.split('/')[0]}/steps_lost": steps_lost})
        print(
            f"loomtrain: {'resized' if prefix.startswith('elastic') else 'recovered'}: step {step} done "
            f"{recovery_s:.1f} s after the last step before the restart; {steps_lost} steps redone",
            flush=True,
        )


def restart_note(attempts: Path, run_started_at: float, alive: list[str]) -> str:
    """For the driver's error when a restart could not be placed: ' again after step S (host H
    lost, not replaced)', or '' when this driver's run never started an attempt."""
    try:
        mine = [json.loads(line) for line in attempts.read_text().splitlines()]
    except (OSError, ValueError):
        return ""
    mine = [rec for rec in mine if rec.get("run_started_at") == run_started_at]
    if not mine:
        return ""
    last = mine[-1]
    gone = sorted(set(last.get("hosts", [])) - set(alive))
    lost = f" ({', '.join(f'host {h}' for h in gone)} lost, not replaced)" if gone else ""
    return f" again after attempt {last['attempt']}{lost}"
