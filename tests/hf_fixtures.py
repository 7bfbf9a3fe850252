"""Tiny Hugging Face models saved as transformers saves them, with a BPE tokenizer trained
here with `tokenizers` (for the import and init_from tests)."""

from __future__ import annotations

import torch
import transformers
from small_configs import HF_TINY

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
] * 4


def save_tokenizer(tok, directory):
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.save_pretrained(str(directory))
    assert (directory / "tokenizer.json").is_file()


def spread(model, seed: int):
    """Weights well away from the init (norms, biases included) so greedy choices are clear-cut
    and a swapped or transposed tensor changes the text."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p + (0.3 if p.ndim == 1 else 0.15) * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_llama(directory, tok, vocab_size=None, **extra):
    """GQA 4/2, rope_theta 500000, untied, saved in shards; `extra` overrides LlamaConfig fields."""
    eos = tok.token_to_id("<|endoftext|>")
    fields = dict(
        **HF_TINY,
        vocab_size=vocab_size or tok.get_vocab_size(),
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    cfg = transformers.LlamaConfig(**{**fields, **extra})
    torch.manual_seed(0)
    model = spread(transformers.LlamaForCausalLM(cfg), 1)
    model.save_pretrained(str(directory), max_shard_size="100KB")  # sharded: an index and several files
    save_tokenizer(tok, directory)
    return model


def tiny_gpt2(directory, tok):
    eos = tok.token_to_id("<|endoftext|>")
    cfg = transformers.GPT2Config(  # activation gelu_new, dropout 0.1, tied: GPT-2's own defaults
        vocab_size=tok.get_vocab_size(),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = spread(transformers.GPT2LMHeadModel(cfg), 2)
    model.save_pretrained(str(directory))
    save_tokenizer(tok, directory)
    return model


# The four Llama-shaped families, each with what sets it apart switched on: Llama 3.x's llama3
# RoPE scaling (an original context of 16, so the 64-token sequences reach the scaled band),
# Qwen2's q/k/v biases and tied embeddings, Qwen3's q/k norms with a head_dim wider than
# hidden_size / heads, and a sliding window of 8 (shorter than the sequences) on every layer of
# Qwen2, Qwen3 and Mistral.
FAMILY_CONFIGS = {
    "LlamaForCausalLM": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500000.0,
        ),
    ),
    "Qwen2ForCausalLM": (
        "Qwen2Config",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=0),
    ),
    "Qwen3ForCausalLM": (
        "Qwen3Config",
        dict(tie_word_embeddings=False, head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=0),
    ),
    "MistralForCausalLM": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=8)),
}


def tiny_family(directory, tok, arch: str, vocab_size=None, **extra):
    """A tiny random model of `arch` (FAMILY_CONFIGS) built with transformers' own config class,
    saved with save_pretrained (one file) with the tokenizer; `extra` overrides config fields."""
    eos = tok.token_to_id("<|endoftext|>")
    name, special = FAMILY_CONFIGS[arch]
    fields = dict(
        **HF_TINY,
        vocab_size=vocab_size or tok.get_vocab_size(),
        rms_norm_eps=1e-5,
        bos_token_id=eos,
        eos_token_id=eos,
        **special,
    )
    cfg = getattr(transformers, name)(**{**fields, **extra})
    torch.manual_seed(0)
    model = spread(getattr(transformers, arch)(cfg), 3)
    model.save_pretrained(str(directory))
    save_tokenizer(tok, directory)
    return model
