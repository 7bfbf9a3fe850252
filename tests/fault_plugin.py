"""The test suite's fault injection: a LOOMTRAIN_PLUGIN (loomtrain.launcher.training.plugins), so that
the product itself holds no test seam.

    child_env(LOOMTRAIN_TEST_FAULTS="sigstop:1:5")   # a launched run (tests/launch.py)
    with planned("raise:0:3"):                        # an in-process one
        run_training(cfg)

The plan is LOOMTRAIN_PLUGIN_FAULTS (a Ray driver hands LOOMTRAIN_PLUGIN_* to its workers),
read when a run starts (`hooks`): a comma-separated list of `KIND:ARG[:ARG...]` entries.
Steps are 1-based optimizer steps; RANK is the global rank. Each kind strikes from outside
the product:

    kind:args                  what happens, and where it is hooked in
    nan:RANK:N[-M]             the loss of steps N..M is NaN on rank RANK (a forward hook on
                               ctx.model: the training forward, given targets, returns the loss)
    raise:RANK:STEP            rank RANK raises FaultInjected in the middle of step STEP (after
                               its first forward; the same forward hook)
    delay:RANK:SECONDS         rank RANK spends SECONDS more in every step, after its share of the
                               step's compute and collectives (engine.step wrapped: after the
                               optimizer step), and says so once on its own output
    signal:RANK:STEP:SIGNAME   rank RANK sends itself SIGNAME while step STEP runs (after its
                               optimizer step; Ctrl-C = SIGINT, a closed terminal = SIGHUP)
    sigstop:RANK:STEP          rank RANK stops itself (SIGSTOP) after step STEP (this plugin's
                               on_step_end: after the checkpoint hook and the watchdog's beat)
    exit:RANK:STEP             rank RANK hard-exits (os._exit(1)) after step STEP's checkpoint is
                               published (watched for on disk), before Ray's report hook hears of it
    gate:RANK:STEP:PATH        rank RANK waits at the end of every step from STEP on until the file
                               PATH exists (this plugin's on_step_end; the test opens the gate)
    ckpt_slow:STEP:SECONDS     every rank's writer sleeps before writing step STEP (write_snapshot
                               wrapped where checkpoints/hook.py and background.py call it)
    ckpt_pause:STEP:SECONDS    rank 0 sleeps after step STEP's files are written and fsynced,
                               before the manifest (CheckpointStore._write_manifest wrapped)
    final_full:RANK            rank RANK's file of the final weights fails at its first tensor
                               with ENOSPC, a full disk or store (final.SafetensorsWriter wrapped)

sigstop and exit strike once per run directory (a marker RUN_DIR/.test_fault_KIND_RANK_STEP
keeps a restarted worker group from striking again).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loomtrain.launcher.hooks import Hooks

ENV = "LOOMTRAIN_PLUGIN_FAULTS"
PLUGIN = Path(__file__).resolve()

# kind -> (where it strikes, its arguments)
KINDS = {
    "nan": ("loss", ("rank", "steps")),
    "raise": ("loss", ("rank", "step")),
    "delay": ("step", ("rank", "seconds")),
    "signal": ("step", ("rank", "step", "signum")),
    "sigstop": ("step_end", ("rank", "step")),
    "exit": ("step_end", ("rank", "step")),
    "gate": ("step_end", ("rank", "from", "path")),
    "ckpt_slow": ("checkpoint_write", ("step", "seconds")),
    "ckpt_pause": ("checkpoint_publish", ("step", "seconds")),
    "final_full": ("final_write", ("rank",)),
}


class FaultInjected(RuntimeError):
    """The `raise` fault: an error in the middle of a step."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None  # None: whichever rank gets there
    steps: range | None = None  # None: every step
    seconds: float = 0.0
    signum: int = 0
    path: str = ""

    def applies(self, step: int | None, rank: int | None) -> bool:
        return (self.rank is None or self.rank == rank) and (self.steps is None or step in self.steps)


def _argument(name: str, text: str):
    if name == "rank":
        return "rank", int(text)
    if name == "step":
        return "steps", range(int(text), int(text) + 1)
    if name == "steps":
        lo, _, hi = text.partition("-")
        return "steps", range(int(lo), int(hi or lo) + 1)
    if name == "from":
        return "steps", range(int(text), sys.maxsize)
    if name == "seconds":
        return "seconds", float(text)
    if name == "path":
        return "path", text
    return "signum", int(getattr(signal, text))


def parse(spec: str) -> dict[str, tuple[Fault, ...]]:
    """where -> the faults planned there; a clear error for an entry it cannot read."""
    plan: dict[str, list[Fault]] = {}
    for entry in filter(None, (p.strip() for p in spec.split(","))):
        kind, *args = entry.split(":")
        try:
            where, names = KINDS[kind]
            if len(args) != len(names):
                raise ValueError(kind)
            fault = Fault(kind, **dict(_argument(n, a) for n, a in zip(names, args)))
        except (KeyError, ValueError, AttributeError):
            raise ValueError(f"{ENV}: cannot read {entry!r} (see tests/fault_plugin.py)") from None
        plan.setdefault(where, []).append(fault)
    return {where: tuple(faults) for where, faults in plan.items()}


def env(spec: str) -> dict[str, str]:
    """The variables that plan `spec` for a run: this plugin, and its plan."""
    return {"LOOMTRAIN_PLUGIN": str(PLUGIN), ENV: spec}


_SPEC = ""
_PLAN: dict[str, tuple[Fault, ...]] = {}


def configure(spec: str) -> None:
    """Replace the plan; the checkpoint functions are wrapped only while it has checkpoint faults."""
    global _SPEC, _PLAN
    _SPEC, _PLAN = spec, parse(spec)
    _wrap_checkpoints("checkpoint_write" in _PLAN, "checkpoint_publish" in _PLAN)
    _wrap_final("final_write" in _PLAN)


def hooks(cfg) -> list[Hooks]:
    """LOOMTRAIN_PLUGIN's entry point, once per run: the plan as the environment has it now."""
    configure(os.environ.get(ENV, ""))
    return [FaultHook()] if _PLAN else []


@contextlib.contextmanager
def planned(spec: str) -> Iterator[None]:
    """`spec` for the duration of the block (in-process tests: a run started in it loads this
    plugin, and a Ray driver hands it to its workers), then the plan and environment before it."""
    before_spec = _SPEC
    before_env = {k: os.environ.get(k) for k in env(spec)}
    os.environ.update(env(spec))
    configure(spec)
    try:
        yield
    finally:
        for k, v in before_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        configure(before_spec)


def striking(where: str, step: int | None, rank: int | None) -> list[Fault]:
    return [f for f in _PLAN.get(where, ()) if f.applies(step, rank)]


def _say(kind: str, step: int, rank: int | None) -> None:
    at = "" if rank is None else f" on rank {rank}"
    print(f"loomtrain: TEST FAULT {kind} at step {step}{at}", file=sys.stderr, flush=True)


def loss_at(loss, step: int, rank: int):
    """The `nan` and `raise` faults on one micro step's loss."""
    for fault in striking("loss", step, rank):
        if fault.kind == "raise":
            raise FaultInjected(f"test fault: rank {rank} raises in the middle of step {step}")
        loss = loss * float("nan")
    return loss


_announced: set[Fault] = set()


def after_step(step: int, rank: int) -> None:
    """The `delay` and `signal` faults, once a step's optimizer step is done."""
    for fault in striking("step", step, rank):
        if fault.kind == "signal":
            os.kill(os.getpid(), fault.signum)
            continue
        if fault not in _announced:  # once per process: the rank's own output says it is slowed
            _announced.add(fault)
            line = f"loomtrain: TEST FAULT delay {fault.seconds:g} s per step on rank {rank}"
            print(line, file=sys.stderr, flush=True)
        time.sleep(fault.seconds)


def _first_time(run_dir: Path, fault: Fault, step: int, rank: int) -> bool:
    """Once per run directory (a restarted worker group does not strike again)."""
    marker = Path(run_dir) / f".test_fault_{fault.kind}_{rank}_{step}"
    if marker.exists():
        return False
    marker.write_text(f"{time.time()}\n")
    return True


def wait_until_published(run_dir: Path, step: int, timeout_s: float = 300.0) -> None:
    """Until the checkpoint of `step` is published, if one is being saved (an async save's
    writer publishes after the step ended), or a rank's writer failed; no collective."""
    from loomtrain.launcher.checkpoints.store import PARTS_DIR, CheckpointStore

    store = CheckpointStore(run_dir)
    final, tmp = store.final_dir(step), store.temp_dir(step)
    deadline = time.monotonic() + timeout_s
    while not final.exists() and time.monotonic() < deadline:
        if not tmp.exists() or any((tmp / PARTS_DIR).glob("rank_*.failed")):
            return  # no save of this step (or it was published between the two looks), or it failed
        time.sleep(0.05)


class FaultHook(Hooks):
    """The faults of a run: hooked into the model and engine at the start, and at each step's end."""

    def on_train_start(self, ctx) -> None:
        rank = ctx.dist.rank
        if "loss" in _PLAN:

            def strike_on_loss(module, args, kwargs, output):
                if module.training and kwargs.get("targets") is not None:  # a training forward: the loss
                    return loss_at(output, ctx.state.step + 1, rank)
                return None

            ctx.model.register_forward_hook(strike_on_loss, with_kwargs=True)
        if "step" in _PLAN:
            engine, optimizer_step = ctx.engine, ctx.engine.step

            def step_then_strike(*args, **kwargs):
                last_micro_step = engine.is_gradient_accumulation_boundary()
                out = optimizer_step(*args, **kwargs)
                if last_micro_step:
                    after_step(ctx.state.step + 1, rank)
                return out

            engine.step = step_then_strike

    def on_step_end(self, ctx, metrics) -> None:
        step, rank = ctx.state.step, ctx.dist.rank
        for fault in striking("step_end", step, rank):
            if fault.kind == "gate":
                if not Path(fault.path).exists():
                    _say("gate (waiting for the test)", step, rank)
                while not Path(fault.path).exists():
                    time.sleep(0.1)
                continue
            if fault.kind == "exit":
                wait_until_published(ctx.run_dir, step)
            if not _first_time(ctx.run_dir, fault, step, rank):
                continue
            _say(fault.kind, step, rank)
            if fault.kind == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os._exit(1)


_wrapped: dict[str, object] = {}  # the checkpoint functions as the product has them


def _wrap_checkpoints(write: bool, publish: bool) -> None:
    """ckpt_slow and ckpt_pause: the writer and the publisher, wrapped where they are looked up
    while planned (the writer's modules are imported only then: they bring in torch)."""
    from loomtrain.launcher.checkpoints import store

    if publish and "write_manifest" not in _wrapped:
        original_manifest = _wrapped["write_manifest"] = store.CheckpointStore._write_manifest

        def write_manifest(self, at, manifest):  # publish: every file is written and durable
            _pause("checkpoint_publish", manifest["step"])
            return original_manifest(self, at, manifest)

        store.CheckpointStore._write_manifest = write_manifest
    elif not publish and "write_manifest" in _wrapped:
        store.CheckpointStore._write_manifest = _wrapped.pop("write_manifest")
    if write == ("write_snapshot" in _wrapped):
        return
    from loomtrain.launcher.checkpoints import background, state

    if write:  # state's own (a synchronous save) and the one background.py imported (an async one)
        original = _wrapped["write_snapshot"] = state.write_snapshot

        def write_snapshot(snap, *args, **kwargs):
            _pause("checkpoint_write", snap.step)
            return original(snap, *args, **kwargs)

        state.write_snapshot = background.write_snapshot = write_snapshot
    else:
        state.write_snapshot = background.write_snapshot = _wrapped.pop("write_snapshot")


def _wrap_final(on: bool) -> None:
    """final_full: the final weights' writer, as final.py looks it up, replaced while planned."""
    if on == ("final_writer" in _wrapped):
        return
    from loomtrain.launcher.checkpoints import final

    if not on:
        final.SafetensorsWriter = _wrapped.pop("final_writer")
        return
    original = _wrapped["final_writer"] = final.SafetensorsWriter

    class FullWriter(original):
        def write(self, name, tensor):
            from loomtrain.launcher.distributed import current_rank

            for fault in striking("final_write", None, current_rank()):
                _say(fault.kind, 0, current_rank())
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(name, tensor)

    final.SafetensorsWriter = FullWriter


def _pause(where: str, step: int) -> None:
    for fault in striking(where, step, None):
        _say(fault.kind, step, None)
        time.sleep(fault.seconds)
