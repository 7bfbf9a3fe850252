"""The seams of the training loop: its state, its context, and the hooks that plug in.

The loop (`loomtrain.launcher.training.loop.run_training`) calls, on every rank:

    hooks.on_train_start(ctx)          after the engine and the data stream exist and
                                       before the first step: a checkpoint hook resumes
                                       here (engine state, ctx.train_stream.load_state_dict,
                                       ctx.state.load_state_dict, RNG states)
    hooks.on_step_end(ctx, metrics)    after every optimizer step (metrics: this step's
                                       lr, tokens_per_s, ... on every rank; on a log step
                                       also its loss, averaged over DP, and grad_norm: the
                                       steps between read nothing back): checkpoint every
                                       N steps, report to Ray, ...
    hooks.on_eval_end(ctx, metrics)    after each evaluation (eval/loss, eval/ppl)
    hooks.on_train_end(ctx)            after the last step (a final checkpoint), before
                                       the final weights are written

A hook may set `ctx.stop_requested = True` (e.g. on SIGTERM, after saving); the loop then
stops after the current step as if max_steps had been reached, without writing final
weights unless `ctx.state.step == cfg.train.max_steps`.

Checkpointing and Ray reporting are hooks, so the loop's body calls neither: every run gets
the checkpoint hook (loomtrain.launcher.checkpoints.hook), then the hooks of the plugin
LOOMTRAIN_PLUGIN names, if any (a .py file or a module whose `hooks(cfg)` returns them, read
once when the run starts; loomtrain.launcher.training.plugins), then a launcher's own (Ray's report
hook, loomtrain.launcher.cluster.ray_train).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from loomtrain.data_pipeline.stream import TokenStream
    from loomtrain.data_pipeline.tokenizer import Tokenizer
    from loomtrain.launcher.config import RunConfig
    from loomtrain.launcher.distributed import DistEnv
    from loomtrain.launcher.observe.metrics import MetricsLogger
    from loomtrain.parallel.topology import Topology
    from torch import nn
    from torch.optim.lr_scheduler import LRScheduler


@dataclass
class TrainState:
    """Counters that survive a resume (put `state_dict()` in the checkpoint)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # tokens consumed across all DP ranks
    elapsed: float = 0.0  # training wall time in seconds, summed across resumes

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.elapsed = float(state["elapsed"])


@dataclass
class TrainContext:
    """Everything a hook may need; built by the loop, the same on every rank."""

    cfg: RunConfig
    dist: DistEnv
    topology: Topology
    run_dir: Path
    engine: DeepSpeedEngine
    model: nn.Module  # engine.module: this rank's (possibly TP-sharded) model
    scheduler: LRScheduler | None  # the LR schedule DeepSpeed steps (its state is checkpointed)
    tokenizer: Tokenizer
    shard_dir: Path | list[tuple[Path, float]]  # one shard directory, or data.sources' (dir, weight)s
    train_stream: TokenStream  # this DP rank's (state_dict / load_state_dict)
    metrics: MetricsLogger | None = None  # writes on the logging rank; None until the resume is done
    state: TrainState = field(default_factory=TrainState)
    stop_requested: bool = False
    stop_signal: int = 0  # the signal every rank agreed to stop for (0: none; see training/stopping.py)
    last_metrics: dict[str, Any] = field(default_factory=dict)  # the last step's, for an end-of-run report
    # Set by the checkpoint hook:
    resumed_from: Path | None = None  # the checkpoint this run resumed from
    checkpoint_saves: list[dict[str, Any]] = field(default_factory=list)  # per save: step, blocked_s, times


class Hooks:
    """Base class: override what you need; every method is a no-op."""

    def on_train_start(self, ctx: TrainContext) -> None:
        pass

    def on_step_end(self, ctx: TrainContext, metrics: dict[str, Any]) -> None:
        pass

    def on_eval_end(self, ctx: TrainContext, metrics: dict[str, Any]) -> None:
        pass

    def on_train_end(self, ctx: TrainContext) -> None:
        pass

    def close(self) -> None:
        """However the run ends (after on_train_end, or on an exception): stop what runs in the background."""


class HookList(Hooks):
    def __init__(self, hooks: Iterable[Hooks] = ()) -> None:
        self.hooks = list(hooks)

    def on_train_start(self, ctx: TrainContext) -> None:
        for hook in self.hooks:
            hook.on_train_start(ctx)

    def on_step_end(self, ctx: TrainContext, metrics: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.on_step_end(ctx, metrics)

    def on_eval_end(self, ctx: TrainContext, metrics: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.on_eval_end(ctx, metrics)

    def on_train_end(self, ctx: TrainContext) -> None:
        for hook in self.hooks:
            hook.on_train_end(ctx)

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()
