"""Test-only faults for the loop's failure paths (hangs, stragglers, interrupts).

LOOMTRAIN_TEST_FAULTS is read here and nowhere else: a comma-separated list of

    sigstop:RANK:STEP          rank RANK stops itself (SIGSTOP) right after step STEP, once
                               per run directory (a marker RUN_DIR/.test_sigstop_RANK_STEP
                               keeps a restarted worker group from stopping again)
    delay:RANK:SECONDS         rank RANK spends SECONDS more of its own work in every step
    signal:RANK:STEP:SIGNAME   rank RANK sends itself SIGNAME while step STEP runs
                               (Ctrl-C = SIGINT, a closed terminal = SIGHUP, ...)

Unset (every real run) the loop holds `NO_FAULTS`, whose `active` is False, and
each call site is one attribute test.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

FAULTS_ENV = "LOOMTRAIN_TEST_FAULTS"


@dataclass(frozen=True)
class Faults:
    sigstop: frozenset[tuple[int, int]] = frozenset()  # (rank, step)
    delays: tuple[tuple[int, float], ...] = ()  # (rank, seconds)
    signals: tuple[tuple[int, int, int], ...] = ()  # (rank, step, signum)
    active: bool = field(default=False)

    @classmethod
    def parse(cls, spec: str) -> Faults:
        stops, delays, signals = set(), [], []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, *args = part.split(":")
            try:
                if kind == "sigstop":
                    stops.add((int(args[0]), int(args[1])))
                elif kind == "delay":
                    delays.append((int(args[0]), float(args[1])))
                elif kind == "signal":
                    signals.append((int(args[0]), int(args[1]), int(getattr(signal, args[2]))))
                else:
                    raise ValueError(kind)
            except (IndexError, ValueError, AttributeError):
                raise ValueError(f"{FAULTS_ENV}: cannot read {part!r} (see loomtrain.launcher.faults)") from None
        return cls(frozenset(stops), tuple(delays), tuple(signals), active=bool(stops or delays or signals))

    @classmethod
    def from_env(cls) -> Faults:
        spec = spec_from_env()
        return cls.parse(spec) if spec else NO_FAULTS

    def during_step(self, rank: int, step: int) -> None:
        """Inside step `step` (1-based), after its compute: the delay and the signals."""
        for r, seconds in self.delays:
            if r == rank:
                time.sleep(seconds)
        for r, s, signum in self.signals:
            if r == rank and s == step:
                os.kill(os.getpid(), signum)

    def after_step(self, rank: int, step: int, run_dir) -> None:
        if (rank, step) in self.sigstop:
            marker = os.path.join(run_dir, f".test_sigstop_{rank}_{step}")
            if os.path.exists(marker):
                return
            with open(marker, "w") as f:
                f.write(f"{time.time()}\n")
            print(f"loomtrain: TEST FAULT: rank {rank} stops itself (SIGSTOP) after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


NO_FAULTS = Faults()


def spec_from_env() -> str:
    """The raw spec (a Ray driver hands it to its workers, whose environment is not its own)."""
    return os.environ.get(FAULTS_ENV, "")
