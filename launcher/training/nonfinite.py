"""Non-finite losses and gradients: skip the optimizer step, count it, stop after K in a row.

Who skips (DeepSpeed 0.19.8, checked in tests/test_zero.py and tests/test_zero_units.py):
* fp16: DeepSpeed's dynamic loss scaler skips overflowing steps and lowers the scale;
* bf16 (every ZeRO stage) and fp32 at ZeRO 1-3: DeepSpeed's optimizers skip a step
  whose global gradient norm is inf/NaN (bf16 `check_grad_overflow`, on by default);
* fp32 at ZeRO 0: DeepSpeed hands the step to the client torch AdamW and would apply
  NaN gradients; `SkipGuard.step` skips it the same way DeepSpeed does (the optimizer
  is marked `overflow`, so the engine counts the skip and leaves the LR schedule
  where it is), using the loop's own global gradient norm.

The check runs every step without reading the loss back to the host: whether a step was
skipped is the engine's own host-side count, so a NaN is caught the step it happens whatever
log.every_steps is (the loss is read only under fp16, and only on a skipped step). The one
device-to-host read is the fp32 ZeRO-0 guard's: it needs the gradient norm on the host to
decide, before the optimizer step, whether to skip it.

Every skipped step shows in `engine.skipped_steps` (the `skipped_steps` metric). After
`train.max_consecutive_skips` skipped steps in a row (0 = never stop) `SkipGuard`
raises `NonFiniteError`. Under fp16 only steps whose loss itself is non-finite count
towards that limit: a scaler overflow with a finite loss is loss scaling at work.

Tests force NaN losses with the test suite's fault plugin (`nan:RANK:N-M`,
tests/fault_plugin.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient norm."""


class SkipGuard:
    def __init__(self, engine: DeepSpeedEngine, max_consecutive: int, precision: str) -> None:
        self.engine = engine
        self.max_consecutive = max_consecutive
        self.fp16 = precision == "fp16"
        self.consecutive = 0
        self.run_start: int | None = None
        self._seen = engine.skipped_steps

    @property
    def skipped_steps(self) -> int:
        return int(self.engine.skipped_steps)

    @contextlib.contextmanager
    def step(self, own_norm: float | torch.Tensor | None = None):
        """Around engine.step(). `own_norm`: the global gradient norm at the boundary on the
        path DeepSpeed does not guard (fp32 ZeRO 0); non-finite -> skip like DeepSpeed.
        A tensor is read back here: the skip is decided on the host, before the step."""
        if own_norm is None or math.isfinite(float(own_norm)):
            yield
            return
        opt = self.engine.optimizer
        saved = opt.__dict__.get("step", None)
        opt.step = lambda *args, **kwargs: None  # the engine still clips, zeroes and counts
        opt.overflow = True
        try:
            yield
        finally:
            opt.overflow = False
            if saved is None:
                del opt.step
            else:
                opt.step = saved

    def after_step(self, step: int, loss: float | Callable[[], float]) -> bool:
        """Call after each optimizer step (1-based `step`; the DP-mean loss, or a function that
        reads it, called only on a skipped step): was it skipped? Raises NonFiniteError after
        max_consecutive skips in a row. Every rank calls it at the same step and reads the loss
        at the same steps (the engine's skip count is the same on every rank)."""
        now = self.skipped_steps
        skipped, self._seen = now > self._seen, now
        if skipped and callable(loss):
            loss = loss()
        counts = skipped and (not self.fp16 or not math.isfinite(loss))
        if counts:
            self.consecutive += 1
            self.run_start = step if self.consecutive == 1 else self.run_start
        else:
            self.consecutive, self.run_start = 0, None
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"train.max_consecutive_skips={self.max_consecutive}: optimizer steps "
                f"{self.run_start}-{step} all had a non-finite loss or gradient norm and were skipped "
                f"(last loss {loss}); stopping the run. Lower train.lr, check the data, or raise "
                f"train.max_consecutive_skips."
            )
        return skipped
