"""LoraConfig: `model.lora` in the run config (torch-free, so configs load without torch).

The adapters themselves are loomtrain.model.lora; this file only defines and checks the knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# model.lora.targets: the short names (peft's q_proj ... down_proj) -> this model's module names.
TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "gate", "up": "up", "down": "down"}
# Where each module lives in a block.
PARENTS = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "attn", "gate": "ffn", "up": "ffn", "down": "ffn"}


@dataclass
class LoraConfig:
    # 0: no adapters (full fine-tuning). > 0: every base weight is frozen and only the adapters train.
    rank: int = 0
    # The update is scaled by alpha / rank (peft's lora_alpha).
    alpha: float = 16.0
    # Dropout on the adapter's input (the frozen path sees x as it is).
    dropout: float = 0.0
    # Which Linears get an adapter: any of q, k, v, o, gate, up, down (or the module names
    # wq, wk, wv, wo). gate exists only with activation swiglu and is skipped elsewhere.
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self) -> list[str]:
        """The targets as this model's module names (wq, wk, ...), in the order given."""
        names = {**TARGETS, **{v: v for v in TARGETS.values()}}
        return [names[t] for t in self.targets]

    def validate(self, prefix: str = "model.lora") -> None:
        """ValueError naming `<prefix>.<field>`, one line."""

        def fail(name: str, msg: str) -> None:
            raise ValueError(f"{prefix}.{name}: {msg}")

        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            fail("rank", f"must be a non-negative integer (0 = off), got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            fail("alpha", f"must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            fail("dropout", f"must be in [0, 1), got {self.dropout!r}")
        known = [*TARGETS, *TARGETS.values()]
        targets = list(self.targets) if isinstance(self.targets, (list, tuple)) else None
        if not targets:
            fail("targets", f"must be a non-empty list of {', '.join(TARGETS)}, got {self.targets!r}")
        for t in targets:
            if t not in known:
                fail("targets", f"{t!r} is not one of {', '.join(TARGETS)} (or wq, wk, wv, wo)")
        if len(set(self.modules())) != len(targets):
            fail("targets", f"names a layer twice: {targets!r}")

    @classmethod
    def of(cls, value, prefix: str = "model.lora") -> LoraConfig:
        """`value` (a LoraConfig, or the dict a saved model_config.json / config.yaml holds) as a
        validated LoraConfig."""
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"rank", "alpha", "dropout", "targets"})
            if unknown:
                raise ValueError(f"{prefix}.{unknown[0]}: not a LoRA setting (rank, alpha, dropout, targets)")
            value = cls(**value)
        if not isinstance(value, cls):
            raise ValueError(f"{prefix}: expected a mapping of rank, alpha, dropout, targets, got {value!r}")
        value.validate(prefix)
        return value
