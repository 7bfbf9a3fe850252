"""ModelConfig: the one definition of a model's shape and variant."""

from __future__ import annotations

from dataclasses import dataclass, field

from .lora_config import LoraConfig

NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")
# gelu is the exact (erf) GELU; gelu_tanh its tanh approximation, which GPT-2 was trained with.
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")


@dataclass
class ModelConfig:
    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    # None means "same as n_heads" (plain multi-head attention); 1 is MQA.
    n_kv_heads: int | None = None
    # None means the usual width: 4 * d_model, or 2/3 of that for SwiGLU
    # (rounded up to a multiple of 8) so the parameter count stays comparable.
    ffn_hidden: int | None = None
    max_seq_len: int = 256
    norm: str = "layernorm"
    norm_placement: str = "pre"
    activation: str = "gelu"
    positions: str = "learned"
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bias: bool = False
    dropout: float = 0.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Initial weights instead of a random init: a run's final/ (or the run directory), a
    # `loomtrain import` output, or a Hugging Face model directory. Read only when a run
    # starts at step 0 (a resume reads its checkpoint); the optimizer starts fresh.
    init_from: str = ""
    # LoRA adapters (off by default: rank 0); see loomtrain.model.lora.
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        self.validate()

    # Derived sizes -------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.activation == "swiglu":
            hidden = int(2 * 4 * self.d_model / 3)
            return 8 * ((hidden + 7) // 8)
        return 4 * self.d_model

    # Validation: every error names the field ----------------------------
    def validate(self, prefix: str = "model") -> None:
        """ValueError naming `<prefix>.<field>` (the model knows nothing of the launcher's ConfigError)."""

        def fail(field: str, msg: str) -> None:
            raise ValueError(f"{prefix}.{field}: {msg}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(name, f"must be a positive integer, got {value!r}")
        for name in ("n_kv_heads", "ffn_hidden"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                fail(name, f"must be a positive integer or null, got {value!r}")
        for name, choices in (
            ("norm", NORMS),
            ("norm_placement", NORM_PLACEMENTS),
            ("activation", ACTIVATIONS),
            ("positions", POSITIONS),
        ):
            value = getattr(self, name)
            if value not in choices:
                fail(name, f"{value!r} is not one of {', '.join(choices)}")
        if self.d_model % self.n_heads:
            fail("n_heads", f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            fail("n_kv_heads", f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.kv_heads}")
        if self.positions == "rope" and self.head_dim % 2:
            fail("positions", f"rope needs an even head dim, got d_model/n_heads={self.head_dim}")
        if not self.rope_theta > 0:
            fail("rope_theta", f"must be positive, got {self.rope_theta!r}")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if not self.norm_eps > 0:
            fail("norm_eps", f"must be positive, got {self.norm_eps!r}")
        if not self.init_std > 0:
            fail("init_std", f"must be positive, got {self.init_std!r}")
        self.lora = LoraConfig.of(self.lora, f"{prefix}.lora")  # a saved config's dict, too
