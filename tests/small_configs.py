"""The small configs the tests build again and again, in one place: the tiny run config and the
overrides that shrink it further, a Llama-style model config, and the sizes of the tiny Hugging
Face models the import and export tests make. A test states only what it changes."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

# The tiny config shrunk for launched runs; a test appends what it changes (the later
# key=value wins). A 2-layer model, d_model 64, 4 heads over 2 KV heads:
SMALL_MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]
# ... on 32-token sequences, micro and global batch 4, 2 warmup steps, 40 corpus files:
SMALL = [
    *SMALL_MODEL,
    "model.max_seq_len=64",
    "train.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.warmup_steps=2",
    "data.max_files=40",
]
# One layer, d_model 32, on 16-token sequences in batches of 2: runs whose numbers no test reads.
SMALLEST_MODEL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1"]
SMALLEST = [
    *SMALLEST_MODEL,
    "model.max_seq_len=32",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]
# No evaluation, no samples, plain progress lines, no TensorBoard.
QUIET = ["eval.every_steps=0", "eval.num_samples=0", "log.progress=plain", "log.tensorboard=false"]
# SMALLEST for runs in this process (the storage tests): a few steps on 20 corpus files.
QUICK = [*SMALLEST, "train.warmup_steps=1", "data.max_files=20", "data.val_fraction=0.1", *QUIET]
# SMALLEST's model on 96-token windows of chat records (about three records a window).
SFT = [*SMALLEST_MODEL, "model.max_seq_len=128", "train.seq_len=96", "train.global_batch_size=4"]

# Llama's choices (RMSNorm, SwiGLU, RoPE, untied embeddings), which most model tests start from.
LLAMA_STYLE = dict(norm="rmsnorm", activation="swiglu", positions="rope", tie_embeddings=False)


def llama_style(**fields):
    """A Llama-style ModelConfig of the sizes (and other fields) given."""
    from loomtrain.model import ModelConfig  # here: launch.py imports this module, and needs no torch

    return ModelConfig(**{**LLAMA_STYLE, **fields})


# The tiny Hugging Face models (hf_fixtures.py, the families' tests): GQA 4/2, 2 layers, width 64.
HF_TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
