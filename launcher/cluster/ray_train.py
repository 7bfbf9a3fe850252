"""`loomtrain train CONFIG --ray`: every rank as a Ray Train worker (TorchTrainer, V2 API).

Driver (`train_on_ray`): connects to `ray.address` (else RAY_ADDRESS; `auto` = the
cluster running on this machine); with neither it starts a local Ray instance
sized to the request. Then it runs a `TorchTrainer` with

* `ScalingConfig(num_workers=ray.num_workers, use_gpu=ray.use_gpu,
  resources_per_worker={"CPU": ray.cpus_per_worker[, "GPU": 1]})`;
* `RunConfig(storage_path=ray.storage or {run.storage}/ray or RUN_DIR/ray, name="ray_train",
  failure_config=FailureConfig(max_failures=ray.max_failures, controller_failure_limit=0))`;
* `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=ray.start_timeout_s`: a request the
  cluster can never satisfy ends the run after that long with one clear message
  (no controller retries), instead of waiting for ever.

Workers (`train_worker`): torch.distributed is already up (gloo on CPU, nccl on
GPU); each worker calls the SAME `run_training(cfg)` as torchrun and the local
run, with one extra hook, `RayReportHook`. loop.py has no Ray code.

Checkpoint hand-back (the decision, and why):
  Our checkpoint protocol (launcher/checkpoints/store.py) already makes every checkpoint
  atomic, verified and discoverable in RUN_DIR/checkpoints. Copying it into
  Ray's storage would double the disk use and block training on the copy (the
  Ray issues #48801, #43917). So Ray gets a *pointer*: after a step at which a
  checkpoint was published (every rank wrote its shard, rank 0 published after
  the barrier), all ranks call `ray.train.report(metrics, checkpoint=...)` and
  rank 0's checkpoint is a tiny directory holding `loomtrain_pointer.json`
  ({"path", "step"}). Our retention (checkpoint.keep_last / keep_every) owns
  the real files; Ray keeps only the newest pointer (`CheckpointConfig(
  num_to_keep=1)`), so Ray never deletes checkpoint data and never keeps a
  list of its own that could point at files our retention removed. A pointer
  uploaded by a worker that died before Ray registered it is removed at the
  next (re)start (`clean_orphan_pointers`).
  On a restart, the resume source is our own scan of RUN_DIR/checkpoints (the
  newest complete one), which also finds a checkpoint that was published but
  not yet reported when a worker died; Ray's handed-back pointer is only
  cross-checked and logged. With checkpoint.resume=never or =PATH, a restart
  resumes from the newest complete checkpoint written *by this run* (manifest
  time >= the driver's start), so a restart never throws progress away.

Restart history: rank 0 appends one line per (re)start to
RUN_DIR/ray_attempts.jsonl: {"attempt", "start_step", "ray_checkpoint_step", "time"}, and
from the second attempt on "previous_end": why the attempt before it ended (the hang
watchdog's one line when it ended that attempt, else "a worker process died"). With run.storage
a URI the file (and rank 0's progress record) also lives in the store, where the next
attempt's rank 0 finds it on whatever host it runs (recovery.py).

Hangs: every worker runs the loop's watchdog (loomtrain.launcher.observe.watchdog). When a
worker stops making progress, the live workers dump their stacks into
RUN_DIR/logs/rank_NNNNN.log, the lowest live one SIGKILLs stuck workers on its host
(a stopped process is killed, not waited for) and they all exit: Ray sees the worker
group fail and restarts it from the newest checkpoint (ray.max_failures).

Stopping: SIGTERM, SIGINT or SIGHUP to the driver (`loomtrain stop` of a Ray job sends
SIGTERM to it) writes RUN_DIR/STOP; rank 0 sees it within a second, every rank saves a
checkpoint at the next step and the run ends; the driver then exits like a local run
(SIGTERM 0, SIGINT 130, SIGHUP 129; loomtrain.launcher.training.stopping).

A plugin (LOOMTRAIN_PLUGIN, loomtrain.launcher.training.plugins) is the driver's: it hands
LOOMTRAIN_PLUGIN and LOOMTRAIN_PLUGIN_* to the workers, whose environment is not its own; a
plugin's hooks run before `RayReportHook`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from loomtrain.durable import atomic_write, replace_dir, temp_name
from loomtrain.launcher.cluster.recovery import Recovery, restart_note
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.hooks import Hooks, TrainContext
from loomtrain.launcher.training import plugins
from loomtrain.launcher.training.stopping import signal_name
from loomtrain.storage import absolute, join

RAY_RUN_NAME = "ray_train"
POINTER_FILE = "loomtrain_pointer.json"
ATTEMPTS_FILE = "ray_attempts.jsonl"


# ----------------------------------------------------------------- helpers


def absolutize(cfg: RunConfig) -> RunConfig:
    """Workers run in a directory Ray chooses: a copy of the config whose paths
    (RunConfig.local_paths) are absolute; a model id in the Hugging Face cache stays one."""
    from loomtrain.hf_cache import looks_like_model_id

    cfg = copy.deepcopy(cfg)
    for section, name, key in cfg.local_paths():
        value = getattr(section, name)
        model_id = key in ("data.tokenizer", "model.init_from") and looks_like_model_id(value)
        if not model_id or Path(os.path.expanduser(value)).exists():
            setattr(section, name, absolute(value))
    return cfg


def storage_path(cfg: RunConfig) -> str:
    """ray.storage, else beside the checkpoints: {run.storage}/ray, or RUN_DIR/ray."""
    if cfg.ray.storage:
        return cfg.ray.storage
    return join(cfg.run.storage, "ray") if cfg.run.storage else str(Path(cfg.run.dir) / "ray")


def _store(cfg: RunConfig):
    """The run's checkpoints: RUN_DIR/checkpoints, or {run.storage}/checkpoints (a URI); only
    listed and verified here (retention is the checkpoint hook's)."""
    from loomtrain.launcher.checkpoints.store import CheckpointStore
    from loomtrain.launcher.rundir import checkpoint_location

    return CheckpointStore(checkpoint_location(cfg))


def newest_complete(cfg: RunConfig, since: float | None = None) -> Path | str | None:
    """Newest published checkpoint with intact manifest and sizes (written at/after `since`, by
    its manifest's time); a folder, or a URI when run.storage is one."""
    store = _store(cfg)
    for _, path in reversed(store.published()):
        verdict = store.verify(path, checksums=False)
        if verdict.ok and (since is None or float(verdict.manifest.get("time", 0.0)) >= since):
            return path
    return None


def read_pointer(checkpoint) -> dict | None:
    """The {"path", "step"} a Ray checkpoint of ours points at (None if not ours)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        p = Path(d) / POINTER_FILE
        return json.loads(p.read_text()) if p.is_file() else None


def clean_orphan_pointers(cfg: RunConfig, keep) -> list[str]:
    """Remove pointer dirs in Ray's storage that Ray never registered.

    A worker that dies right after `report` can leave an uploaded pointer dir the
    controller never learnt of; Ray's retention would never delete it. With
    num_to_keep=1 the only registered one is the checkpoint Ray hands back
    (`keep`), so at a (re)start every other `checkpoint_*` dir of our Ray run is
    such an orphan. Called on rank 0 before any report of this attempt.
    """
    import pyarrow.fs as pafs

    try:
        fs, root = pafs.FileSystem.from_uri(storage_path(cfg))
        infos = fs.get_file_info(pafs.FileSelector(f"{root.rstrip('/')}/{RAY_RUN_NAME}", allow_not_found=True))
    except (OSError, ValueError):
        return []
    keep_name = Path(keep.path).name if keep is not None else None
    removed = []
    for info in infos:
        name = info.base_name
        if info.type == pafs.FileType.Directory and name.startswith("checkpoint_") and name != keep_name:
            fs.delete_dir(info.path)
            removed.append(info.path)
    return removed


# ----------------------------------------------------------------- worker side


class RayReportHook(Hooks):
    """Reports a published checkpoint to Ray (as a pointer) with that step's metrics.

    All ranks call `ray.train.report` together (it is a barrier in Ray Train V2);
    whether a checkpoint was published at this step is rank 0's view of the
    store, broadcast so that every rank makes the same call.
    """

    def __init__(self, cfg: RunConfig, ray_step: int | None = None, recovery: Recovery | None = None):
        self.cfg = cfg
        self.last_reported = -1
        self.ray_step = ray_step
        self.pointer_root = Path(cfg.run.dir) / "ray" / ".pointers"
        self.recovery = recovery  # what a restart cost (launcher/cluster/recovery.py)

    # -- helpers
    def _published_now(self, ctx: TrainContext) -> str | None:
        from loomtrain.launcher.distributed import broadcast_str

        found = None
        if ctx.dist.rank == 0:
            # The newest one not yet reported: with checkpoint.async_save a checkpoint is
            # published a few steps after the step it holds.
            pub = _store(self.cfg).published()
            if pub and pub[-1][0] > self.last_reported:
                found = str(pub[-1][1])
        return broadcast_str(found)

    def _report(self, ctx: TrainContext, metrics: dict[str, Any], path: str | None) -> None:
        import ray.train

        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        clean["step"] = ctx.state.step
        if path is None:
            ray.train.report(clean)
            return
        step = int(Path(path).name.split("_")[-1])  # the checkpoint's step (<= this step)
        self.last_reported = step
        if ctx.dist.rank != 0:
            ray.train.report(clean, checkpoint=None)
            return
        # Written under a temp name and renamed: a kill inside this report leaves either nothing
        # or a complete pointer under step_*, never an empty JSON.
        tmp = self.pointer_root / f"step_{step:08d}"
        staging = temp_name(tmp)
        staging.mkdir(parents=True)
        (staging / POINTER_FILE).write_text(json.dumps({"path": path, "step": step}) + "\n")
        replace_dir(staging, tmp)
        try:
            ray.train.report(clean, checkpoint=ray.train.Checkpoint.from_directory(str(tmp)))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- hooks
    def on_train_start(self, ctx: TrainContext) -> None:
        # Runs after the checkpoint hook resumed: ctx.state.step is where we start.
        path = Path(self.cfg.run.dir) / ATTEMPTS_FILE
        if ctx.dist.rank == 0 and self.recovery is not None:
            self.recovery.restore(path)  # run.storage: the last attempt's rank 0 may have run elsewhere
        lines = path.read_text().splitlines() if ctx.dist.rank == 0 and path.exists() else []
        previous = json.loads(lines[-1]) if lines else None  # the last attempt's record
        # Leftovers of a report killed mid-way, on every host of this attempt: the rank 0 that staged
        # one may have run on a host where no rank 0 runs now. Before the all-gather below, so no
        # rank 0 has staged this attempt's first pointer yet.
        shutil.rmtree(self.pointer_root, ignore_errors=True)
        extra = {}
        if self.recovery is not None:  # every rank: the hosts are all-gathered
            extra = self.recovery.attempt_fields(ctx, len(lines) + 1, previous)
        if ctx.dist.rank == 0:
            rec = {
                "attempt": len(lines) + 1,
                "start_step": ctx.state.step,
                "ray_checkpoint_step": self.ray_step,
                "time": time.time(),
                **extra,
            }
            if previous is not None:
                rec["previous_end"] = _previous_end(path.parent, previous.get("time", 0.0))
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if self.recovery is not None:
                self.recovery.publish(path)
        self.last_reported = ctx.state.step  # a resumed-from checkpoint is not re-reported

    def on_step_end(self, ctx: TrainContext, metrics: dict[str, Any]) -> None:
        if self.recovery is not None:
            self.recovery.on_step_end(ctx)
        if not self._looks_this_step(ctx, metrics):
            return
        path = self._published_now(ctx)
        if path is not None:
            self._report(ctx, metrics, path)

    def _looks_this_step(self, ctx: TrainContext, metrics: dict[str, Any]) -> bool:
        """Whether to look for a newly published checkpoint (rank 0 scans the store and
        broadcasts what it found): on a log step (its metrics hold the loss), a checkpoint step
        or a stop, the same on every rank. Between them a step adds no collective; an async save
        published meanwhile is reported at the next of them (a restart resumes from what
        loomtrain's own scan finds, not from what Ray was told)."""
        every = self.cfg.checkpoint.every_steps
        return "loss" in metrics or ctx.stop_requested or (every > 0 and ctx.state.step % every == 0)

    def on_train_end(self, ctx: TrainContext) -> None:
        if ctx.dist.rank == 0:  # why this attempt ended, for the next one's record
            done = "finished" if ctx.state.step >= self.cfg.train.max_steps else "stopped (checkpoint.stop_at_step)"
            reason = f"stopped by {signal_name(ctx.stop_signal)}" if ctx.stop_signal else done
            _write_end(Path(self.cfg.run.dir), f"{reason} at step {ctx.state.step}")
        # A final checkpoint (published by the checkpoint hook's on_train_end) or,
        # without one, the final metrics so that the driver's Result has them.
        path = self._published_now(ctx)
        if path is not None or ctx.state.step > self.last_reported:
            self._report(ctx, ctx.last_metrics or {}, path)


END_FILE = "attempt_end.json"


def _write_end(run_dir: Path, reason: str) -> None:
    from loomtrain.launcher.observe.ranklog import logs_dir

    atomic_write(logs_dir(run_dir) / END_FILE, json.dumps({"line": reason, "time": time.time()}) + "\n")


def _previous_end(run_dir: Path, last_start: float) -> str:
    """Why the attempt that started at `last_start` ended: its own end record, the hang
    watchdog's line, else a death."""
    from loomtrain.launcher.observe.ranklog import logs_dir

    ends = []
    for name in (END_FILE, "hang.json"):
        try:
            rec = json.loads((logs_dir(run_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        if rec.get("time", 0) >= last_start:
            ends.append((rec["time"], rec["line"]))
    return max(ends)[1] if ends else f"a worker process died (see {logs_dir(run_dir)}/rank_*.log)"


def train_worker(config: dict) -> None:
    """Ray Train's per-worker function: the same run_training as everywhere else."""
    import ray.train

    plugins.adopt_env(config["plugin_env"])  # before run_training reads LOOMTRAIN_PLUGIN
    from loomtrain.launcher.config_loader import config_from_dict
    from loomtrain.launcher.training.loop import run_training

    world = ray.train.get_context().get_world_size()
    rank0 = ray.train.get_context().get_world_rank() == 0
    cfg = config_from_dict(config["cfg"], world_size=world)
    if cfg.ray.elastic and rank0:
        dp = cfg.data_ranks(world)
        print(
            f"loomtrain: elastic: {world} of {cfg.ray.least_workers}-{cfg.ray.num_workers} workers this attempt "
            f"(dp {dp}, gradient accumulation {cfg.train.grad_accum_steps(dp)}, "
            f"global batch {cfg.train.global_batch_size})",
            flush=True,
        )
    handed_back = ray.train.get_checkpoint()
    pointer = read_pointer(handed_back)
    ray_step = pointer["step"] if pointer else None
    if rank0:
        for path in clean_orphan_pointers(cfg, handed_back):
            print(f"loomtrain: removed unregistered Ray checkpoint pointer {path}", flush=True)
    # Restart after a failure: our scan is the source of truth (it also sees a
    # checkpoint published but not yet reported); Ray's pointer is a cross-check.
    if cfg.checkpoint.resume != "auto":
        mine = newest_complete(cfg, since=config["started_at"])
        if mine is not None:
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=str(mine)))
    if rank0 and pointer is not None:
        found = newest_complete(cfg)
        found_step = int(str(found).rsplit("_", 1)[-1]) if found else None
        note = "" if found_step == ray_step else " (newer than Ray's: written but not yet reported)"
        print(
            f"loomtrain: Ray handed back step {ray_step}; newest complete checkpoint in "
            f"{cfg.run.dir}: step {found_step}{note}",
            flush=True,
        )
    recovery = Recovery(cfg.run.dir, ray.util.get_node_ip_address(), config["started_at"], storage=cfg.run.storage)
    run_training(cfg, hooks=[RayReportHook(cfg, ray_step=ray_step, recovery=recovery)])


# ----------------------------------------------------------------- driver side


def _connect(cfg: RunConfig, need_cpus: int) -> None:
    import ray
    from loomtrain.launcher.cluster.ray_console import DriverConsole

    if ray.is_initialized():
        return
    quiet = DriverConsole.connect_kwargs  # no process's output streamed here: loomtrain carries its own
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    # No runtime_env here: inside a Ray Job the job's own (working_dir) applies.
    if address:  # "auto" = the cluster `ray start` runs on this machine
        ray.init(address=address, **quiet)
        return
    cpus = os.cpu_count() or 1
    if need_cpus > cpus:
        print(
            f"loomtrain: local Ray instance: {need_cpus} CPUs requested on a {cpus}-core machine "
            "(oversubscribed: slower, but it runs)",
            file=sys.stderr,
        )
    ray.init(num_cpus=max(cpus, need_cpus), **quiet)


def _resources(cfg: RunConfig) -> dict[str, float]:
    res = {"CPU": float(cfg.ray.cpus_per_worker)}
    if cfg.ray.use_gpu:
        res["GPU"] = 1.0
    return res


def _startup_error(exc: BaseException) -> bool:
    from ray.train.v2._internal.exceptions import (
        InsufficientClusterResourcesError,
        WorkerGroupStartupTimeoutError,
    )

    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (WorkerGroupStartupTimeoutError, InsufficientClusterResourcesError)):
            return True
        e = getattr(e, "controller_failure", None) or e.__cause__ or e.__context__
    return "WorkerGroupStartupTimeoutError" in str(exc) or "Insufficient cluster resources" in str(exc)


def build_trainer(cfg: RunConfig, started_at: float):
    from loomtrain.launcher.cluster.elastic import LoomTorchTrainer
    from loomtrain.launcher.cluster.ray_backend import LoomtrainTorchConfig
    from loomtrain.launcher.config_loader import to_dict
    from loomtrain.launcher.distributed import collective_timeout_s
    from ray.train import CheckpointConfig, FailureConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig

    return LoomTorchTrainer(
        loom_cfg=cfg,
        train_loop_per_worker=train_worker,
        train_loop_config={
            "cfg": to_dict(cfg),
            "started_at": started_at,
            "plugin_env": plugins.forwarded_env(),
        },
        torch_config=LoomtrainTorchConfig(timeout_s=collective_timeout_s(cfg), run_dir=cfg.run.dir),
        scaling_config=ScalingConfig(
            # elastic: any usable size in [min, max] (loomtrain.launcher.cluster.elastic)
            num_workers=(cfg.ray.least_workers, cfg.ray.num_workers) if cfg.ray.elastic else cfg.ray.num_workers,
            elastic_resize_monitor_interval_s=cfg.ray.elastic_resize_interval_s,
            use_gpu=cfg.ray.use_gpu,
            resources_per_worker=_resources(cfg),
        ),
        run_config=RayRunConfig(
            name=RAY_RUN_NAME,
            storage_path=storage_path(cfg),
            failure_config=FailureConfig(max_failures=cfg.ray.max_failures, controller_failure_limit=0),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
        ),
    )


def _worker_count(cfg: RunConfig) -> str:
    r = cfg.ray
    if not r.elastic:
        return str(r.num_workers)
    return f"{r.least_workers}-{r.num_workers} (elastic, resize check every {r.elastic_resize_interval_s:g} s)"


def run(cfg: RunConfig, stop=None):
    """Run `cfg` on Ray; returns Ray's Result. Raises RayRunError / Ray's errors.
    `stop` (a StopRequest) is installed once Ray is connected: ray.init sets its own
    SIGTERM handler (sys.exit), which would end the driver without a save."""
    import ray  # its loggers exist before the console takes them over
    from loomtrain.launcher.cluster.ray_console import DriverConsole

    cfg = absolutize(cfg)
    with DriverConsole(cfg.run.dir) as console:
        ours = not ray.is_initialized()  # connected here (the CLI), not by a caller that goes on using it
        try:
            return _run(cfg, stop, console)
        finally:
            if ours and ray.is_initialized():
                # Disconnect while Ray's lines go to ray_driver.log: Ray's error listener lives until
                # the disconnect, and the disconnect itself prints what Ray's deduplicator held back
                # (a lost node's "Raylet is terminated ..."), from this thread.
                console.flush()
                with console.to_log():
                    ray.shutdown()


def _run(cfg: RunConfig, stop, console):
    # Read by Ray Train's controller (propagated from this driver's environment).
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(cfg.ray.start_timeout_s)
    # Our logging rank prints its own progress; Ray's print patch would echo it twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    need = cfg.ray.num_workers * cfg.ray.cpus_per_worker
    _connect(cfg, need)
    console.start()  # the workers' lines, once Ray is connected
    if stop is not None:
        stop.install()
    import ray

    total = ray.cluster_resources()
    want = {k: v * cfg.ray.least_workers for k, v in _resources(cfg).items()}  # elastic: the least it runs with
    short = {k: (v, total.get(k, 0.0)) for k, v in want.items() if v > total.get(k, 0.0)}
    if short:
        print(
            "loomtrain: the cluster has less than this run asks for right now "
            f"({', '.join(f'{k}: {v:g} wanted, {h:g} there' for k, (v, h) in short.items())}); "
            f"waiting up to ray.start_timeout_s={cfg.ray.start_timeout_s} s for it (autoscaling)",
            file=sys.stderr,
        )
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    print(
        f"loomtrain: Ray Train: {_worker_count(cfg)} workers x {_resources(cfg)}, "
        f"run dir {cfg.run.dir}, Ray storage {storage_path(cfg)}",
        flush=True,
    )
    started_at = time.time()
    trainer = build_trainer(cfg, started_at=started_at)
    try:
        try:
            return trainer.fit()
        finally:
            console.flush()  # every worker line before the driver says how the run ended
    except Exception as exc:
        if _startup_error(exc):
            now = ray.cluster_resources()  # a node lost mid-run took its share with it
            alive = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
            attempts = join(cfg.run.storage, ATTEMPTS_FILE) if cfg.run.storage else Path(cfg.run.dir) / ATTEMPTS_FILE
            restart = restart_note(attempts, started_at, alive)
            raise RayRunError(
                f"Ray could not place {cfg.ray.num_workers} workers x {_resources(cfg)}{restart} "
                f"within ray.start_timeout_s={cfg.ray.start_timeout_s} s; the cluster has "
                f"{ {k: now.get(k, 0.0) for k in want} } now. Lower ray.num_workers / "
                "ray.cpus_per_worker / ray.use_gpu, or grow the cluster."
            ) from exc
        raise


class RayRunError(RuntimeError):
    """A Ray run that could not start (its worker group not placed in time) or failed for good;
    its message is one line for the user."""


def _stop_for_workers(run_dir: str | os.PathLike):
    """Driver: a signal becomes RUN_DIR/STOP, which the workers' rank 0 watches."""
    from loomtrain.launcher.training.stopping import StopRequest, request_stop

    def forward(signum: int) -> None:
        request_stop(run_dir, signum)
        print(
            f"loomtrain: {signal_name(signum)}: asking the workers to save a checkpoint and stop",
            file=sys.stderr,
            flush=True,
        )

    return StopRequest(on_signal=forward)


def train_on_ray(cfg: RunConfig) -> int:
    """The `train --ray` driver: run, say how the run ended, return the exit status of a local run
    stopped the same way (SIGTERM 0, SIGINT 130, SIGHUP 129). Raises RayRunError."""
    from loomtrain.launcher.training.stopping import exit_code
    from ray.train import TrainingFailedError

    run_dir = Path(absolutize(cfg).run.dir)
    stop = _stop_for_workers(run_dir)
    try:
        result = run(cfg, stop=stop)
    except TrainingFailedError as exc:
        raise RayRunError(f"Ray Train run failed: {exc}") from exc
    finally:
        stop.uninstall()
    pointer = read_pointer(result.checkpoint)
    metrics = result.metrics or _last_record(run_dir / "metrics.jsonl")
    if stop.signum:
        print(f"loomtrain: stopped at step {metrics.get('step')} (checkpoint saved)")
    else:
        print(f"loomtrain: Ray Train run finished: step {metrics.get('step')}, loss {metrics.get('loss')}")
    if pointer:
        print(f"loomtrain: last checkpoint reported to Ray: {pointer['path']}")
    return exit_code(stop.signum)


def _last_record(path: Path) -> dict:
    try:
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return {}
    train = [r for r in lines if "loss" in r]
    return train[-1] if train else {}
