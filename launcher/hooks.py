"""The seams of the training loop: its state, its context, and the hooks that plug in.

The loop (`loomtrain.launcher.loop.run_training`) calls, on every rank:

    hooks.on_train_start(ctx)          after the engine and the data stream exist and
                                       before the first step: a checkpoint hook resumes
                                       here (engine state, ctx.train_stream.load_state_dict,
                                       ctx.state.load_state_dict, RNG states)
    hooks.on_step_end(ctx, metrics)    after every optimizer step (metrics: this step's
                                       loss, lr, grad_norm, ... on every rank, the loss
                                       already averaged over DP): checkpoint every N steps,
                                       report to Ray, ...
    hooks.on_eval_end(ctx, metrics)    after each evaluation (eval/loss, eval/ppl)
    hooks.on_train_end(ctx)            after the last step (a final checkpoint), before
                                       the final weights are written

A hook may set `ctx.stop_requested = True` (e.g. on SIGTERM, after saving); the loop then
stops after the current step as if max_steps had been reached, without writing final
weights unless `ctx.state.step == cfg.train.max_steps`.

Checkpointing and Ray reporting are hooks; the loop knows neither.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


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

    cfg: Any  # RunConfig
    dist: Any  # DistEnv
    topology: Any  # loomtrain.parallel.Topology
    run_dir: Path
    model: Any = None  # the (possibly TP-sharded) nn.Module inside the engine
    engine: Any = None  # deepspeed.DeepSpeedEngine
    optimizer: Any = None
    scheduler: Any = None
    tokenizer: Any = None
    shard_dir: Any = None  # one shard directory, or [(dir, weight), ...] for data.sources
    train_stream: Any = None  # TokenStream for this DP rank (state_dict / load_state_dict)
    metrics: Any = None  # MetricsLogger (writes on the logging rank only)
    state: TrainState = field(default_factory=TrainState)
    stop_requested: bool = False
    # Filled by the loop for hooks that want them.
    last_metrics: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)


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


def default_hooks(cfg) -> list[Hooks]:
    """Hooks every run gets, whatever launched it (torchrun, Ray, tests).

    The checkpoint hook saves every checkpoint.every_steps, at the end and on SIGTERM,
    and resumes per checkpoint.resume. Launcher-specific hooks (Ray's report hook) are
    passed to run_training by that launcher instead.
    """
    from loomtrain.launcher.checkpoints.hook import CheckpointHook

    return [CheckpointHook(cfg)]
