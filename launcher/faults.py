"""Test-only fault injection: the one seam, consulted at named points; off in every real run.

LOOMTRAIN_TEST_FAULTS, read once when this module is imported, is a comma-separated list of
`KIND:ARG[:ARG...]` entries. Each kind strikes at one point (steps are 1-based optimizer
steps; RANK is the global rank):

    kind:args                  point               what happens
    nan:RANK:N[-M]             loss                the loss of steps N..M is NaN on rank RANK
    raise:RANK:STEP            loss                rank RANK raises FaultInjected in the middle of
                                                   step STEP (after its first forward)
    delay:RANK:SECONDS         step                rank RANK spends SECONDS more in every step (and says
                                                   so once, on its own output)
    signal:RANK:STEP:SIGNAME   step                rank RANK sends itself SIGNAME while step STEP
                                                   runs (Ctrl-C = SIGINT, a closed terminal = SIGHUP)
    sigstop:RANK:STEP          step_end            rank RANK stops itself (SIGSTOP) after step STEP
    exit:RANK:STEP             report              Ray worker RANK hard-exits (os._exit(1)) after
                                                   step STEP's checkpoint is published, before Ray
                                                   hears of it
    ckpt_slow:STEP:SECONDS     checkpoint_write    every rank's writer sleeps before writing step STEP
    ckpt_pause:STEP:SECONDS    checkpoint_publish  rank 0 sleeps after step STEP's files are written
                                                   and fsynced, before the manifest and the rename

sigstop and exit strike once per run directory (a marker RUN_DIR/.test_fault_KIND_RANK_STEP
keeps a restarted worker group from striking again).

The points: `loss` in every micro step of the loop, `step` after a step's compute, `step_end`
after its hooks, `report` in Ray's report hook, and the two checkpoint points in
loomtrain.launcher.checkpoints. Each call site tests `faults.ACTIVE` (False unless the
variable is set) before calling `at`: one module attribute read, no parsing, no environment
read on the hot path. `configure` replaces the plan: a Ray worker takes its driver's spec
(`SPEC`), and in-process tests use `planned`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

ENV = "LOOMTRAIN_TEST_FAULTS"

# kind -> (the point it strikes at, its arguments)
KINDS = {
    "nan": ("loss", ("rank", "steps")),
    "raise": ("loss", ("rank", "step")),
    "delay": ("step", ("rank", "seconds")),
    "signal": ("step", ("rank", "step", "signum")),
    "sigstop": ("step_end", ("rank", "step")),
    "exit": ("report", ("rank", "step")),
    "ckpt_slow": ("checkpoint_write", ("step", "seconds")),
    "ckpt_pause": ("checkpoint_publish", ("step", "seconds")),
}


class FaultInjected(RuntimeError):
    """The `raise` fault: an error in the middle of a step."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None  # None: whichever rank reaches the point
    steps: range | None = None  # None: every step
    seconds: float = 0.0
    signum: int = 0

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
    if name == "seconds":
        return "seconds", float(text)
    return "signum", int(getattr(signal, text))


def parse(spec: str) -> dict[str, tuple[Fault, ...]]:
    """point -> the faults planned there; a clear error for an entry it cannot read."""
    plan: dict[str, list[Fault]] = {}
    for entry in filter(None, (p.strip() for p in spec.split(","))):
        kind, *args = entry.split(":")
        try:
            point, names = KINDS[kind]
            if len(args) != len(names):
                raise ValueError(kind)
            fault = Fault(kind, **dict(_argument(n, a) for n, a in zip(names, args)))
        except (KeyError, ValueError, AttributeError):
            raise ValueError(f"{ENV}: cannot read {entry!r} (see loomtrain.launcher.faults)") from None
        plan.setdefault(point, []).append(fault)
    return {point: tuple(faults) for point, faults in plan.items()}


SPEC = ""
ACTIVE = False
_PLAN: dict[str, tuple[Fault, ...]] = {}


def configure(spec: str) -> None:
    """Replace the plan (an empty spec turns the seam off)."""
    global SPEC, ACTIVE, _PLAN
    _PLAN = parse(spec)
    SPEC, ACTIVE = spec, bool(_PLAN)


@contextlib.contextmanager
def planned(spec: str) -> Iterator[None]:
    """`spec` for the duration of the block (in-process tests), then the plan before it."""
    before = SPEC
    configure(spec)
    try:
        yield
    finally:
        configure(before)


def at(point: str, value=None, *, step: int | None = None, rank: int | None = None, run_dir=None, flush=None):
    """Strike every fault planned at `point` for this step and rank; returns `value` (the
    loss at the `loss` point), NaN where a `nan` fault strikes. `flush` (report point): waits
    for a checkpoint in flight, so that `exit` strikes after it is published."""
    for fault in _PLAN.get(point, ()):
        if fault.applies(step, rank):
            value = _strike(fault, value, step, rank, run_dir, flush)
    return value


_announced: set[int] = set()


def _strike(fault: Fault, value, step, rank, run_dir, flush):
    kind = fault.kind
    if kind == "nan":
        return value * float("nan")
    if kind == "raise":
        raise FaultInjected(f"test fault: rank {rank} raises in the middle of step {step}")
    if kind == "delay":
        if id(fault) not in _announced:  # once per process: the rank's own output says it is slowed
            _announced.add(id(fault))
            line = f"loomtrain: TEST FAULT delay {fault.seconds:g} s per step on rank {rank}"
            print(line, file=sys.stderr, flush=True)
        time.sleep(fault.seconds)
        return value
    if kind == "signal":
        os.kill(os.getpid(), fault.signum)
        return value
    if kind in ("sigstop", "exit"):
        if flush is not None:
            flush()
        marker = os.path.join(run_dir, f".test_fault_{kind}_{rank}_{step}")
        if os.path.exists(marker):
            return value
        with open(marker, "w") as f:
            f.write(f"{time.time()}\n")
    where = "" if rank is None else f" on rank {rank}"
    print(f"loomtrain: TEST FAULT {kind} at step {step}{where}", file=sys.stderr, flush=True)
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "exit":
        os._exit(1)
    else:  # ckpt_slow, ckpt_pause
        time.sleep(fault.seconds)
    return value


configure(os.environ.get(ENV, ""))
