"""The checkpoint hook: resume at start, save every N steps, at the end and on SIGTERM.

    checkpoint.every_steps   save after every N-th step (0: only at the end / on SIGTERM)
    checkpoint.keep_last     keep the newest N published checkpoints (0: all)
    checkpoint.keep_every    also keep every M-th step's checkpoint (0: none)
    checkpoint.resume        auto (newest complete one in RUN_DIR/checkpoints, if any; when
                             there are checkpoints but none verifies, the run stops) |
                             never (earlier checkpoints, metrics.jsonl, final/ and tb/ in
                             RUN_DIR are moved aside to checkpoints/superseded-TIME/) |
                             PATH (a checkpoint directory, or a run directory): seeds the
                             first start only; once RUN_DIR has checkpoints, those win
    checkpoint.stop_at_step  save and exit cleanly after this step (0: never)

A stop request (SIGTERM, SIGINT, SIGHUP, `loomtrain stop`; see
loomtrain.launcher.stopping) reaches this hook as `ctx.stop_requested` with the signal
in `ctx.extras["stop_signal"]`, the same on every rank at the same step: the hook
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

from loomtrain.launcher.checkpoints.state import barrier, broadcast_str, load_checkpoint, save_checkpoint
from loomtrain.launcher.checkpoints.store import CheckpointStore, is_write_error, write_error
from loomtrain.launcher.hooks import Hooks, TrainContext
from loomtrain.launcher.rundir import supersede
from loomtrain.launcher.watchdog import io_phase


class CheckpointHook(Hooks):
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.store: CheckpointStore | None = None
        self.last_saved = -1
        self.resumed_from: Path | None = None

    # Hooks -----------------------------------------------------------------------------
    def on_train_start(self, ctx: TrainContext) -> None:
        c = self.cfg.checkpoint
        say = ctx.metrics.message if ctx.metrics is not None else (lambda m: print(m, file=sys.stderr, flush=True))
        log = say if ctx.dist.rank == 0 else (lambda m: None)
        self.store = CheckpointStore(ctx.run_dir, keep_last=c.keep_last, keep_every=c.keep_every, log=log)
        found, error = None, None
        if ctx.dist.rank == 0:
            if c.resume == "never":  # earlier checkpoints and outputs go aside, nothing is deleted
                supersede(Path(ctx.run_dir), self.store.set_aside(), log=log)
            try:
                path = self.store.resolve_resume(c.resume)
                found = None if path is None else str(path)
            except ValueError as exc:
                error = str(exc)
        error = broadcast_str(error)
        if error:
            from loomtrain.launcher.config_loader import ConfigError

            raise ConfigError(error)
        found = broadcast_str(found)
        barrier()
        if found is None:
            self._tidy(ctx, fresh=True, log=log)
            return
        t0 = time.perf_counter()
        try:
            trainer = load_checkpoint(found, ctx.engine, ctx.topology, stream=ctx.train_stream,
                                      lr_scheduler=ctx.scheduler, zero_stage=self.cfg.parallel.zero_stage)
        except ValueError as exc:  # another model shape: the same verdict on every rank
            from loomtrain.launcher.config_loader import ConfigError

            raise ConfigError(f"checkpoint.resume={c.resume}: {exc}") from exc
        self._tidy(ctx, fresh=False, log=log)
        state = trainer.get("counters", {}).get("state")
        if state:
            ctx.state.load_state_dict(state)
        else:
            ctx.state.step = int(trainer["step"])
        self.last_saved = ctx.state.step
        self.resumed_from = Path(found)
        ctx.extras["resumed_from"] = str(found)
        lay = trainer["layout"]
        log(f"resumed from {found} (step {ctx.state.step}, saved at tp {lay['tp']} x dp {lay['dp']} "
            f"zero {lay['zero_stage']}) in {time.perf_counter() - t0:.1f} s")

    def _tidy(self, ctx: TrainContext, fresh: bool, log) -> None:
        """Rank 0, once the start is decided (a refused resume changes no file): drop
        leftovers of interrupted writes; a start at step 0 moves an earlier attempt's
        metrics, final weights and TensorBoard events aside instead of mixing with them."""
        if ctx.dist.rank == 0:
            self.store.clean_temp()
            if fresh:
                supersede(Path(ctx.run_dir), None, log=log)

    def on_step_end(self, ctx: TrainContext, metrics: dict[str, Any]) -> None:
        every = self.cfg.checkpoint.every_steps
        step = ctx.state.step
        signum = ctx.extras.get("stop_signal", 0) if ctx.stop_requested else 0
        stop_at = self.cfg.checkpoint.stop_at_step
        stop = ctx.stop_requested or (stop_at > 0 and step == stop_at)
        if stop:
            ctx.stop_requested = True
        if stop or (every and step % every == 0):
            reason = signal.Signals(signum).name if signum else ("checkpoint.stop_at_step" if stop else "")
            self.save(ctx, reason=reason)

    def on_train_end(self, ctx: TrainContext) -> None:
        if ctx.state.step != self.last_saved and ctx.state.step > 0:
            self.save(ctx, reason="end")

    # Saving -----------------------------------------------------------------------------
    def save(self, ctx: TrainContext, reason: str = "") -> Path:
        from loomtrain.launcher.config_loader import to_yaml

        t0 = time.perf_counter()
        try:
            with io_phase("checkpoint save"):
                path = save_checkpoint(
                    self.store, ctx.state.step, ctx.engine, ctx.topology, stream=ctx.train_stream,
                    counters={"state": ctx.state.state_dict()}, lr_scheduler=ctx.scheduler,
                    config_yaml=to_yaml(self.cfg), tokenizer=ctx.tokenizer, zero_stage=self.cfg.parallel.zero_stage,
                )
        except Exception as exc:  # a full or read-only disk: one line, `latest` untouched
            if is_write_error(exc):
                raise write_error(exc, self.store, ctx.state.step) from None
            raise
        self.last_saved = ctx.state.step
        if ctx.dist.rank == 0:
            msg = f"checkpoint: step {ctx.state.step} -> {path} ({time.perf_counter() - t0:.1f} s)"
            if reason:
                msg += f" [{reason}]"
            (ctx.metrics.message if ctx.metrics is not None else print)(msg)
        return path
