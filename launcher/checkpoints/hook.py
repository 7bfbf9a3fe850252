"""The checkpoint hook: resume at start, save every N steps, at the end and on SIGTERM.

    checkpoint.every_steps   save after every N-th step (0: only at the end / on SIGTERM)
    checkpoint.keep_last     keep the newest N published checkpoints (0: all)
    checkpoint.keep_every    also keep every M-th step's checkpoint (0: none)
    checkpoint.resume        auto (newest complete one in RUN_DIR/checkpoints, or in
                             {run.storage}/checkpoints when run.storage is a URI; when
                             there are checkpoints but none verifies, the run stops) |
                             never (earlier checkpoints, metrics.jsonl, final/ and tb/ in
                             RUN_DIR, and in run.storage, are moved aside to
                             checkpoints/superseded-TIME/ there; docs/storage.md) |
                             PATH or URI (a checkpoint, or a run directory / storage): seeds the
                             first start only; once RUN_DIR has checkpoints, those win
    checkpoint.stop_at_step  save and exit cleanly after this step (0: never)
    checkpoint.async_save    write in the background (background.py); at most one save in
                             flight, and SIGTERM, stop_at_step and the end wait for it

A stop request (SIGTERM, SIGINT, SIGHUP, `loomtrain stop`; see
loomtrain.launcher.training.stopping) reaches this hook as `ctx.stop_requested` with the signal
in `ctx.stop_signal`, the same on every rank at the same step: the hook
saves, and the loop ends cleanly. Killing the process during the save loses nothing
already published (the save is atomic). Saves run under the watchdog's
`checkpoint.timeout_s` limit, not the step's.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

from loomtrain.launcher.checkpoints.background import BackgroundSave, StagingBuffers
from loomtrain.launcher.checkpoints.parts import Training, params_mismatch, saved_shapes
from loomtrain.launcher.checkpoints.shards import CorruptCheckpoint
from loomtrain.launcher.checkpoints.state import (
    load_checkpoint,
    open_reader,
    take_snapshot,
    write_and_publish,
)
from loomtrain.launcher.checkpoints.store import (
    CheckpointStore,
    is_write_error,
    store_error,
    wait_for_deletions,
    write_error,
)
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.config_loader import ConfigError, to_yaml
from loomtrain.launcher.distributed import all_gather_objects, barrier, broadcast_str
from loomtrain.launcher.hooks import Hooks, TrainContext
from loomtrain.launcher.observe.watchdog import io_phase
from loomtrain.launcher.rundir import checkpoint_location, run_dir, supersede, superseded_name
from loomtrain.storage import below, store_failure


def _other_model_hint(resume: str, folder: Path) -> str:
    """What to do when the checkpoint to resume holds another model: its own folder for this
    config, or this folder started afresh (a resume PATH: a checkpoint of this model config)."""
    if resume in ("auto", ""):
        return (
            f"{folder} holds a run of another model: train this config in a folder of its own "
            f"(run.dir=...), or start {folder} afresh (checkpoint.resume=never; its earlier "
            "output is moved aside)"
        )
    return "give a checkpoint of this model config, or start without one (checkpoint.resume=never)"


def refuse_another_models_checkpoint(cfg: RunConfig) -> None:
    """Before anything is built: ConfigError, in the words of the resume itself, when the checkpoint
    this start would resume holds another model (its trainable parameters' names or full shapes
    are not those of this config's model, built on the meta device). The resume would refuse it
    only after the process group, the model and the engine exist: minutes of a large model's
    start-up, or a Ray worker group placed for nothing. Whatever else keeps a checkpoint from
    loading (an unreachable store, a damaged file) is left to the resume, which says it on every
    rank."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return
    try:
        found = CheckpointStore(checkpoint_location(cfg), log=lambda m: None).resolve_resume(resume, checksums=False)
        if found is None:
            return
        saved = saved_shapes(open_reader(found))
    except Exception:  # noqa: BLE001  (the resume says it, with its own handling, on every rank)
        return
    try:
        shapes = trainable_shapes(cfg)
    except ValueError as exc:  # model.lora.targets that name no layer: the key, in one line
        raise ConfigError(str(exc)) from exc
    why = params_mismatch(shapes, saved)
    if why is not None:
        raise ConfigError(
            f"checkpoint.resume={resume}: checkpoint {below(found)}: {why}; {_other_model_hint(resume, run_dir(cfg))}"
        )


def trainable_shapes(cfg: RunConfig) -> dict[str, list[int]]:
    """The parameters a checkpoint of this config holds, name -> full shape (with model.lora: the
    adapters), from the model built on the meta device: no memory, no process group."""
    from loomtrain.model import meta_transformer
    from loomtrain.model.lora import apply_lora

    model = apply_lora(meta_transformer(cfg.model), cfg.model.lora, cfg.train.seed)
    return {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad}


class CheckpointHook(Hooks):
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.store: CheckpointStore | None = None
        self.last_saved = -1
        self.in_flight: BackgroundSave | None = None
        self.saves: list[dict] = []  # per save: step, blocked_s, write/publish times (ctx.checkpoint_saves)
        # the async snapshots' host buffers, reused (save() waits for the last first)
        self.staging = StagingBuffers()

    # Hooks -----------------------------------------------------------------------------
    def on_train_start(self, ctx: TrainContext) -> None:
        c = self.cfg.checkpoint
        say = ctx.metrics.message if ctx.metrics is not None else (lambda m: print(m, file=sys.stderr, flush=True))
        log = say if ctx.dist.rank == 0 else (lambda m: None)
        # RUN_DIR/checkpoints, or {run.storage}/checkpoints in an object store
        where = checkpoint_location(self.cfg)
        self.store = CheckpointStore(where, keep_last=c.keep_last, keep_every=c.keep_every, log=log)
        ctx.checkpoint_saves = self.saves
        found, error = None, None
        if ctx.dist.rank == 0:
            try:
                self.store.check_reachable()  # run.storage: a missing bucket stops the start, not step N's save
                if c.resume == "never":  # earlier checkpoints and outputs go aside, nothing is deleted
                    aside = self.store.set_aside()  # a folder beside them, or a prefix in the object store
                    self._supersede(ctx, aside, log)
                # Sizes only here: each rank verifies the checksums of what it reads (load_checkpoint).
                path = self.store.resolve_resume(c.resume, checksums=False)
                found = None if path is None else str(path)
                if found is None and c.resume in ("auto", "") and not self.store.objects.local:
                    self._local_checkpoints_left_behind(ctx, where)
            except ValueError as exc:
                error = str(exc)
            except Exception as exc:  # the object store's own errors: one line on every rank, no hang
                if self.store.objects.local:
                    raise
                error = store_error(where, exc)
        error = broadcast_str(error)
        if error:
            raise ConfigError(error)
        found = broadcast_str(found)
        if found is not None and self.store.owns(found):  # named if a later save fails
            self.store.latest_known = found.rstrip("/").rsplit("/", 1)[-1]
        barrier()
        if found is None:
            self._tidy(ctx, fresh=True, log=log)
            return
        t0 = time.perf_counter()
        trainer = self._load_first_good(ctx, found, log)
        self._tidy(ctx, fresh=False, log=log)
        self.last_saved = ctx.state.step
        found = trainer["path"]
        ctx.resumed_from = below(found)
        lay = trainer["layout"]
        log(
            f"resumed from {found} (step {ctx.state.step}, saved at tp {lay['tp']} x dp {lay['dp']} "
            f"zero {lay['zero_stage']}) in {time.perf_counter() - t0:.1f} s"
        )

    def _local_checkpoints_left_behind(self, ctx: TrainContext, storage: str) -> None:
        """A run whose checkpoints are in RUN_DIR and that now names run.storage (which has none)
        would start at step 0 there: stopped in one line that names both and the two ways on
        (checkpoint.resume=RUN_DIR carries them over: they seed the first start in run.storage)."""
        published = CheckpointStore(ctx.run_dir, log=lambda m: None).published()
        if published:
            raise ValueError(
                f"checkpoint.resume=auto: {Path(ctx.run_dir) / 'checkpoints'} holds {len(published)} checkpoint(s) "
                f"(newest {published[-1][1].name}) and run.storage={storage} none; to continue from them set "
                f"checkpoint.resume={ctx.run_dir} (they seed this run's first start in run.storage), or to start "
                "at step 0 in run.storage set checkpoint.resume=never (they stay where they are)"
            )

    def _tidy(self, ctx: TrainContext, fresh: bool, log) -> None:
        """Rank 0, once the start is decided (a refused resume changes no file): drop
        leftovers of interrupted writes; a start at step 0 moves an earlier attempt's
        metrics, final weights and TensorBoard events aside instead of mixing with them."""
        if ctx.dist.rank == 0:
            self.store.clean_temp()
            if fresh:
                self._supersede(ctx, None, log)

    def _supersede(self, ctx: TrainContext, aside, log) -> None:
        """An earlier run's metrics, final weights and TensorBoard files go aside (into `aside`,
        where its checkpoints went, when they went there): in RUN_DIR, and in run.storage (final/,
        tb/) when that is a URI; the same code for both (rundir.supersede). One superseded-TIME
        name for both places, chosen once: two clocks read a second apart would split them."""
        name = str(aside).rstrip("/").rsplit("/", 1)[-1] if aside is not None else superseded_name()
        supersede(Path(ctx.run_dir), name, log=log)
        if self.cfg.run.storage:
            supersede(self.cfg.run.storage, name, log=log)

    def _load_first_good(self, ctx: TrainContext, found: str, log) -> dict:
        """Load `found`; if a rank finds a damaged file while reading, every rank hears of it
        and (checkpoint.resume=auto) the next older complete checkpoint is tried."""
        c = self.cfg.checkpoint
        while True:
            bad = None
            try:
                trainer = load_checkpoint(found, self._training(ctx))
            except CorruptCheckpoint as exc:
                bad = str(exc)
            except ValueError as exc:  # another model shape: the same verdict on every rank
                hint = _other_model_hint(c.resume, ctx.run_dir)
                raise ConfigError(f"checkpoint.resume={c.resume}: {exc}; {hint}") from exc
            bad = next((r for r in all_gather_objects(bad) if r), None)
            if bad is None:
                trainer["path"] = found
                return trainer
            if c.resume not in ("auto", ""):
                raise ConfigError(f"checkpoint.resume={c.resume}: not a usable checkpoint: {bad}")
            log(f"checkpoint: skipping {found}: {bad}; trying the previous one")
            older = None
            if ctx.dist.rank == 0:
                step = int(str(found).rstrip("/").rsplit("_", 1)[-1])
                for s, path in reversed(self.store.published()):
                    if s < step and self.store.verify(path, checksums=False).ok:
                        older = str(path)
                        break
            older = broadcast_str(older)
            if older is None:
                raise ConfigError(
                    f"checkpoint: no usable checkpoint in {self.store.root}: {bad}; "
                    f"start afresh with checkpoint.resume=never"
                )
            found = older

    def on_step_end(self, ctx: TrainContext, metrics: dict[str, Any]) -> None:
        every = self.cfg.checkpoint.every_steps
        if every and self.cfg.checkpoint.async_save and not self.staging.started:
            # the async snapshot's buffers made and touched from here on, in the background: not in
            # the first save's stall, nor in start-up's memory peak
            self.staging.prepare(self._training(ctx))
        step = ctx.state.step
        signum = ctx.stop_signal if ctx.stop_requested else 0
        stop_at = self.cfg.checkpoint.stop_at_step
        stop = ctx.stop_requested or (stop_at > 0 and step == stop_at)
        if stop:
            ctx.stop_requested = True
        if stop or (every and step % every == 0):
            reason = signal.Signals(signum).name if signum else ("checkpoint.stop_at_step" if stop else "")
            self.save(ctx, reason=reason)
        if stop:
            self.wait(ctx)

    def on_train_end(self, ctx: TrainContext) -> None:
        if ctx.state.step != self.last_saved and ctx.state.step > 0:
            self.save(ctx, reason="end")
        self.wait(ctx)

    def close(self) -> None:
        """The run ends (on an exception, the save in flight was never waited for): no writer or
        staging thread outlives the loop (see BackgroundSave.abandon)."""
        bg, self.in_flight = self.in_flight, None
        if bg is not None:
            bg.abandon()
        self.staging.ready()

    # Saving -----------------------------------------------------------------------------
    def wait(self, ctx: TrainContext) -> None:
        """Wait for the save in flight (every rank; rank 0 until it is published, and until
        the checkpoints it pruned are deleted)."""
        bg, self.in_flight = self.in_flight, None
        if bg is None:
            wait_for_deletions()
            return
        with io_phase("checkpoint save (waiting for the one in flight)"):
            bg.wait()
            barrier()
        wait_for_deletions()
        for rec in self.saves:
            if rec["step"] == bg.step:
                rec.update(bg.record())
        if bg.error is not None:
            if is_write_error(bg.error):  # a full or read-only disk: one line, `latest` untouched
                raise write_error(bg.error, self.store, bg.step) from None
            self._message(
                ctx, f"checkpoint: step {bg.step} was not saved (rank {ctx.dist.rank}): {bg.error}", every_rank=True
            )

    def save(self, ctx: TrainContext, reason: str = "") -> Path | str:
        """Save this step: synchronously, or (checkpoint.async_save) hand it to a writer thread
        after waiting for the one in flight. Returns the directory it is (or will be) published as."""
        self.wait(ctx)
        try:
            return self._save(ctx, reason)
        except Exception as exc:  # a full or read-only disk, an object store gone: one line, `latest` untouched
            if is_write_error(exc) or store_failure(exc):
                raise write_error(exc, self.store, ctx.state.step) from None
            raise

    def _save(self, ctx: TrainContext, reason: str) -> Path | str:
        with io_phase("checkpoint save"):
            t0 = time.perf_counter()
            step, rank = ctx.state.step, ctx.dist.rank
            tmp = self.store.begin(step) if rank == 0 else self.store.temp_dir(step)
            barrier()
            asynchronous = bool(self.cfg.checkpoint.async_save)
            snap = take_snapshot(
                step, self._training(ctx), copy=asynchronous, config_yaml=to_yaml(self.cfg), tokenizer=ctx.tokenizer
            )
            self.last_saved = step
            record = {"step": step, "reason": reason, "async": asynchronous}
            self.saves.append(record)

            def published(bg: BackgroundSave) -> None:
                record.update(bg.record())
                msg = (
                    f"checkpoint: step {bg.step} -> {bg.path} ({time.perf_counter() - t0:.1f} s, "
                    f"training blocked {record['blocked_s']:.2f} s)"
                )
                self._message(ctx, msg + (f" [{reason}]" if reason else ""))

            if asynchronous:
                self.in_flight = BackgroundSave(snap, self.store, tmp, on_published=published if rank == 0 else None)
                record["blocked_s"] = time.perf_counter() - t0
                self.in_flight.start()
                return self.store.final_dir(step)
            path = write_and_publish(snap, self.store, tmp)
            record["blocked_s"] = time.perf_counter() - t0
            if rank == 0:
                msg = f"checkpoint: step {step} -> {path} ({record['blocked_s']:.1f} s)"
                self._message(ctx, msg + (f" [{reason}]" if reason else ""))
        return path

    def _training(self, ctx: TrainContext) -> Training:
        return Training(
            ctx.engine,
            ctx.topology,
            zero_stage=self.cfg.parallel.zero_stage,
            stream=ctx.train_stream,
            lr_scheduler=ctx.scheduler,
            train_state=ctx.state,
            staging=self.staging,
        )

    @staticmethod
    def _message(ctx: TrainContext, msg: str, every_rank: bool = False) -> None:
        if ctx.dist.rank == 0 and ctx.metrics is not None:
            ctx.metrics.message(msg)
        elif ctx.dist.rank == 0 or every_rank:
            print(msg, flush=True)
