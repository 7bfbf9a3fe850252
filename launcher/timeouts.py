"""How long each phase of a rank may go without progress before it is a hang, from the config.

The watchdog (loomtrain.launcher.observe.watchdog) holds each rank to these allowances; the
process group's timeout (loomtrain.launcher.distributed) is HANG_REPORT_MARGIN_S above the
longest of them, so the watchdog's report comes before a library's timeout. Both need the same
numbers, so they live here, below both: plain arithmetic on the config, nothing imported but it.
The table of phases, knobs and defaults is in the watchdog's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loomtrain.launcher.config import RunConfig

HANG_REPORT_MARGIN_S = 60  # process-group timeout above parallel.timeout_s
FIRST_STEP_FACTOR = 3  # parallel.startup_timeout_s = 0: the first step gets this x timeout_s
FORWARD_SHARE = 3  # parallel.forward_timeout_s = 0: one forward pass gets timeout_s / this

# The phases the loop announces (heartbeats and hang lines name them).
START_UP = "start-up"
STEP = "training step"
EVALUATION = "evaluation"
SAMPLES = "samples"


@dataclass(frozen=True)
class Allowances:
    """Seconds without progress each phase may take before it is a hang, and the knob that sets each."""

    step: float
    start_up: float
    evaluation: float
    samples: float
    io: float
    compile: float = 0.0  # added the first time a phase runs in this process (0: no compile)

    def limit(self, phase: str) -> tuple[float, str]:
        """(allowance, knob) of `phase`; a phase not named here is checkpoint-like I/O."""
        return {
            START_UP: (self.start_up, "parallel.startup_timeout_s"),
            STEP: (self.step, "parallel.timeout_s"),
            EVALUATION: (self.evaluation, "parallel.forward_timeout_s"),
            SAMPLES: (self.samples, "parallel.forward_timeout_s"),
        }.get(phase, (self.io, "checkpoint.timeout_s"))

    @property
    def longest(self) -> float:
        return max(self.step, self.start_up, self.evaluation, self.samples, self.io) + self.compile


def allowances(cfg: RunConfig) -> Allowances:
    """Each phase's allowance from the config (see the table in this module's docstring)."""
    p, e = cfg.parallel, cfg.eval
    step = float(p.timeout_s)
    forward = p.forward_timeout_s or step / FORWARD_SHARE
    return Allowances(
        step=step,
        start_up=float(p.startup_timeout_s or FIRST_STEP_FACTOR * step),
        evaluation=step + e.batches * forward,
        samples=step + e.sample_tokens * forward,
        io=float(cfg.checkpoint.timeout_s),
        compile=float(p.compile_timeout_s) if p.compile else 0.0,
    )
