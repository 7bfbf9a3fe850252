"""ModelConfig: the one definition of a model's shape and variant."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .lora_config import LoraConfig

NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")
# gelu is the exact (erf) GELU; gelu_tanh its tanh approximation, which GPT-2 was trained with.
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")
ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclass
class RopeScaling:
    """How RoPE's inverse frequencies are stretched for long contexts (`model.rope_scaling`),
    computed as transformers computes them (see loomtrain.model.positions.rope_inv_freq).

    none    the plain frequencies theta^(-2i/head_dim)
    linear  every frequency divided by `factor` (position interpolation)
    llama3  Llama 3.1's: wavelengths longer than original_max_position / low_freq_factor are
            divided by `factor`, shorter than original_max_position / high_freq_factor are kept,
            and the band between is interpolated smoothly
    """

    type: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def validate(self, prefix: str = "model.rope_scaling") -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"{prefix}.{name}: {msg}")

        if self.type not in ROPE_SCALINGS:
            fail("type", f"{self.type!r} is not one of {', '.join(ROPE_SCALINGS)}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                fail(name, f"must be a positive number, got {value!r}")
        value = self.original_max_position
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            fail("original_max_position", f"must be a positive integer, got {value!r}")
        if self.type == "none" and self.factor != 1.0:
            fail("factor", f"is {self.factor!r} but {prefix}.type is none (set type to linear or llama3)")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            fail(
                "high_freq_factor",
                f"must be greater than low_freq_factor={self.low_freq_factor!r}, got {self.high_freq_factor!r}",
            )


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
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # The width of one attention head; None means d_model // n_heads. Set it when
    # n_heads * head_dim != d_model (Qwen3: hidden 1024, 16 heads of 128).
    head_dim: int | None = None
    # Biases on q, k and v only (Qwen2/2.5); `bias` is every linear's and layernorm's bias.
    qkv_bias: bool = False
    # RMSNorm (weights of head_dim, eps norm_eps) on each head of q and k before RoPE (Qwen3).
    qk_norm: bool = False
    # Each query attends to at most the last `sliding_window` keys, itself included
    # (Mistral; transformers' sliding-window causal mask). None: the whole causal context.
    sliding_window: int | None = None
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
        # A config read back from JSON/YAML (final/, checkpoints, imports) holds a plain dict here.
        if isinstance(self.rope_scaling, dict):
            known = {f.name for f in fields(RopeScaling)}
            unknown = sorted(set(self.rope_scaling) - known)
            if unknown:
                raise ValueError(
                    f"model.rope_scaling.{unknown[0]}: unknown key (expected one of {', '.join(sorted(known))})"
                )
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        self.validate()

    # Derived sizes -------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_width(self) -> int:
        """The resolved head_dim: the option when set, else d_model // n_heads."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

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
        for name in ("n_kv_heads", "ffn_hidden", "head_dim", "sliding_window"):
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
        for name in ("qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                fail(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.head_dim is None and self.d_model % self.n_heads:
            fail(
                "n_heads",
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} (or set model.head_dim)",
            )
        if self.n_heads % self.kv_heads:
            fail("n_kv_heads", f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.kv_heads}")
        if self.positions == "rope" and self.head_width % 2:
            where = "head_dim" if self.head_dim is not None else "positions"
            fail(where, f"rope needs an even head dim, got {self.head_width}")
        if not self.rope_theta > 0:
            fail("rope_theta", f"must be positive, got {self.rope_theta!r}")
        if not isinstance(self.rope_scaling, RopeScaling):
            fail("rope_scaling", f"must be a mapping of type, factor, ..., got {self.rope_scaling!r}")
        self.rope_scaling.validate(f"{prefix}.rope_scaling")
        if self.rope_scaling.type != "none" and self.positions != "rope":
            fail("rope_scaling.type", f"{self.rope_scaling.type} scales RoPE, but model.positions={self.positions}")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if not self.norm_eps > 0:
            fail("norm_eps", f"must be positive, got {self.norm_eps!r}")
        if not self.init_std > 0:
            fail("init_std", f"must be positive, got {self.init_std!r}")
        self.lora = LoraConfig.of(self.lora, f"{prefix}.lora")  # a saved config's dict, too
