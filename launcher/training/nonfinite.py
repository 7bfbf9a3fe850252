"""Non-finite losses and gradients: skip the optimizer step, count it, stop after K in a row.

Who skips (DeepSpeed 0.19.8, checked in tests/distributed/test_zero.py and tests/integration/test_zero_units.py):
* fp16: DeepSpeed's dynamic loss scaler skips overflowing steps and lowers the scale;
* bf16 (every ZeRO stage) and fp32 at ZeRO 1-3: DeepSpeed's optimizers skip a step
  whose global gradient norm is inf/NaN (bf16 `check_grad_overflow`, on by default);
* fp32 at ZeRO 0: DeepSpeed hands the step to the client torch AdamW and would apply
  NaN gradients; `SkipGuard.step` skips it, using the loop's own global gradient norm:
  - with the fused AdamW loomtrain builds (CPU and CUDA), on the device: the norm's
    "not finite" flag is the fused kernel's `found_inf` (the kernel leaves weights, moments
    and step count as they were), and the skips are counted on the device and read with the
    losses on log steps (`read`), so this path, too, reads nothing back between log steps.
    Unlike DeepSpeed's own skips the LR schedule moves on over a skipped step (the host does
    not know of it in time), and `max_consecutive_skips` stops the run at the log step that
    sees the run of skips, naming the steps it spanned;
  - with any other optimizer, on the host as DeepSpeed does (the optimizer is marked
    `overflow`, so the engine counts the skip and leaves the LR schedule where it is),
    which reads the norm back every step.

The check runs every step without reading the loss back to the host: whether a step was
skipped is the engine's own host-side count, so a NaN is caught the step it happens whatever
log.every_steps is (the loss is read only under fp16, and only on a skipped step).

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

import torch

if TYPE_CHECKING:
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
        # The skips decided on the device: [skipped so far, current run of skips, the step at
        # which a run first reached max_consecutive (0: none)]; None until the first one.
        self._on_device: torch.Tensor | None = None
        self._folded = 0  # device skips already added to the engine's count
        self._hit = 0  # that step, as of the last read

    @property
    def skipped_steps(self) -> int:
        return int(self.engine.skipped_steps)

    @contextlib.contextmanager
    def step(self, own_norm: float | torch.Tensor | None = None, step: int = 0):
        """Around engine.step() of optimizer step `step`. `own_norm`: the global gradient norm
        at the boundary on the path DeepSpeed does not guard (fp32 ZeRO 0); non-finite -> the
        step is skipped: on the device with a fused optimizer, else on the host like DeepSpeed."""
        opt = self.engine.optimizer
        if isinstance(own_norm, torch.Tensor) and getattr(opt, "defaults", {}).get("fused"):
            with self._skip_on_device(opt, own_norm, step):
                yield
            return
        if own_norm is None or math.isfinite(float(own_norm)):
            yield
            return
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

    @contextlib.contextmanager
    def _skip_on_device(self, opt, own_norm: torch.Tensor, step: int):
        """The fused AdamW skips its update where `found_inf` is 1 (GradScaler's mechanism);
        the flag and the counts stay on the device."""
        found = (~torch.isfinite(own_norm)).to(torch.float32).reshape(())
        opt.found_inf = found
        try:
            yield
        finally:
            del opt.found_inf
        if self._on_device is None:
            self._on_device = torch.zeros(3, dtype=torch.float64, device=found.device)
        skipped, run, hit = self._on_device.unbind()
        flag = found.double()
        skipped.add_(flag)
        run.add_(1).mul_(flag)  # a good step ends the run
        if self.max_consecutive:
            hit.copy_(torch.where((hit == 0) & (run >= self.max_consecutive), float(step), hit))

    def read(self) -> None:
        """On a log step (the loop reads the losses back then too): the skips made on the
        device join the engine's count (`skipped_steps`, checkpointed with the engine)."""
        if self._on_device is None:
            return
        skipped, _, hit = self._on_device.tolist()
        self.engine.skipped_steps += int(skipped) - self._folded
        self._folded, self._hit = int(skipped), int(hit)
        self._seen = self.engine.skipped_steps

    def after_step(self, step: int, loss: float | Callable[[], float]) -> bool:
        """Call after each optimizer step (1-based `step`; the DP-mean loss, or a function that
        reads it, called only on a skipped step): was it skipped? Raises NonFiniteError after
        max_consecutive skips in a row. Every rank calls it at the same step and reads the loss
        at the same steps (the engine's skip count is the same on every rank)."""
        if self._on_device is not None:  # skips decided on the device, seen at the last read
            if self._hit:
                loss = loss() if callable(loss) else loss
                raise NonFiniteError(self._stop_message(self._hit - self.max_consecutive + 1, self._hit, loss))
            return False
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
            raise NonFiniteError(self._stop_message(self.run_start, step, loss))
        return skipped

    def _stop_message(self, first: int, last: int, loss) -> str:
        return (
            f"train.max_consecutive_skips={self.max_consecutive}: optimizer steps "
            f"{first}-{last} all had a non-finite loss or gradient norm and were skipped "
            f"(last loss {loss}); stopping the run. Lower train.lr, check the data, or raise "
            f"train.max_consecutive_skips."
        )
