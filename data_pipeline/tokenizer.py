"""Tokenizers: a byte tokenizer that needs no training, a byte-level BPE trained
with the `tokenizers` library, and any Hugging Face `tokenizer.json`.

Common interface: `encode(str) -> list[int]`, `decode(ids) -> str`,
`vocab_size`, `eos_id`, `save(dir)` (writes `dir/tokenizer.json`), and `hash`,
a short stable string that changes whenever the id <-> text mapping changes;
token shards record it so a run never reads shards made by another tokenizer.

A chat model's tokenizer also carries its prompt format: Hugging Face's `chat_template` (a
Jinja template, from `tokenizer_config.json` or `chat_template.jinja` beside tokenizer.json),
kept by `save` in `tokenizer_config.json`, so shards, imports and checkpoints pass it on
(records.question_tokens renders a user's message and the assistant's cue with it).

Byte tokenizer ids: 0..255 are the raw UTF-8 bytes, 256 is EOS
(`<|endoftext|>`), so vocab_size = 257 (models pad it, e.g. to 320).
Documents are separated by EOS in every tokenizer.

No torch import here: preprocessing workers load this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import tokenizers
from loomtrain.data_pipeline.shards import DataError, token_dtype
from loomtrain.durable import atomic_write
from loomtrain.hf_cache import ModelIdError, resolve_model
from loomtrain.storage import message_line
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# Names an existing tokenizer.json may use for its end-of-document token.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
_BYTE_FORMAT = "loomtrain-byte-tokenizer"


CHAT_CONFIG = "tokenizer_config.json"


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else value if isinstance(value, str) else ""


def read_chat_format(directory: Path) -> dict[str, str] | None:
    """{"chat_template", "bos_token", "eos_token"} from a Hugging Face tokenizer directory, or
    None when it has no chat template (named templates: the one named "default")."""
    config = {}
    with contextlib.suppress(OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = json.loads((directory / CHAT_CONFIG).read_text(encoding="utf-8"))
    config = config if isinstance(config, dict) else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    with contextlib.suppress(OSError, UnicodeDecodeError):
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(template, str) or not template.strip():
        return None
    return {
        "chat_template": template,
        "bos_token": _token_text(config.get("bos_token")),
        "eos_token": _token_text(config.get("eos_token")),
    }


def _short_hash(payload: str) -> str:
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS = 256."""

    name = "byte"
    eos_id = 256
    vocab_size = 257
    hash = _short_hash(json.dumps({"type": _BYTE_FORMAT, "eos_id": 256, "vocab_size": 257}))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def encode_batch_np(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif i == self.eos_id:
                out += EOS_TOKEN.encode()
        return out.decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> Path:
        spec = {
            "type": _BYTE_FORMAT,
            "version": 1,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
            "note": "ids 0..255 are UTF-8 bytes, 256 is <|endoftext|>; "
            "load with loomtrain.data_pipeline.load_tokenizer",
        }
        return atomic_write(Path(directory) / "tokenizer.json", json.dumps(spec, indent=1))

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, hash={self.hash})"


class HFTokenizer:
    """Any `tokenizers` tokenizer.json (our trained BPE included)."""

    name = "bpe"

    def __init__(self, tok, source: str = "", chat: dict[str, str] | None = None):
        self._tok = tok
        self.source = source
        self.chat = chat  # read_chat_format's dict for a chat model's tokenizer, else None
        eos = next((t for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(
                f"tokenizer {source or '(in memory)'} has no end-of-document token (looked for "
                f"{', '.join(_EOS_CANDIDATES)})"
            )
        self.eos_token = eos
        self.eos_id = int(tok.token_to_id(eos))
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        # Canonical JSON so key order in the file does not change the hash.
        self.hash = _short_hash(json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":")))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> HFTokenizer:
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
            return cls(tok, source=str(path), chat=read_chat_format(Path(path).parent))
        except DataError:
            raise
        except Exception as exc:  # the Rust error text is long; keep its first line
            raise DataError(f"cannot load tokenizer {path}: {message_line(exc)}") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """`text` as text: a special token's spelling inside it (`<|endoftext|>`) is encoded as its
        characters, not as the token (a chat message's content; transformers' split_special_tokens)."""
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False

    def encode_batch_np(self, texts: list[str]) -> list[np.ndarray]:
        dtype = token_dtype(self.vocab_size)
        return [np.asarray(e.ids, dtype=dtype) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> Path:
        if self.chat is not None:
            atomic_write(Path(directory) / CHAT_CONFIG, json.dumps(self.chat, indent=2) + "\n")
        return atomic_write(Path(directory) / "tokenizer.json", self._tok.to_str(pretty=True))

    def __getstate__(self):
        return {"json": self._tok.to_str(), "source": self.source, "chat": self.chat}

    def __setstate__(self, state):
        self.__init__(tokenizers.Tokenizer.from_str(state["json"]), state["source"], state.get("chat"))

    def __repr__(self) -> str:
        return (
            f"HFTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, hash={self.hash}, source={self.source!r})"
        )


Tokenizer = ByteTokenizer | HFTokenizer


def train_bpe(texts: Iterator[str], vocab_size: int, show_progress: bool = False) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization, 256-byte base alphabet,
    `<|endoftext|>` as the only special token) on a stream of documents."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(
            f"data.bpe_vocab_size: must be at least {len(alphabet) + 1} (256 bytes + EOS), got {vocab_size}"
        )
    if vocab_size > 2**32:
        raise DataError(f"data.bpe_vocab_size: {vocab_size} is too large")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, source="bpe")


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """ "byte" -> ByteTokenizer; a tokenizer.json (or a directory holding one, e.g. a shard
    directory, or a model id naming one in the local Hugging Face cache) -> the tokenizer it describes."""
    if str(spec) == "byte":
        return ByteTokenizer()
    if str(spec) == "bpe":
        raise DataError(
            'tokenizer "bpe" must be trained on a corpus first (loomtrain preprocess --tokenizer bpe); '
            "pass the resulting tokenizer.json"
        )
    try:
        path = Path(resolve_model(spec))  # a Hugging Face model id: its folder in the local cache
    except ModelIdError as exc:
        raise DataError(f"tokenizer {exc}") from None
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer not found: {path} (expected 'byte' or a path to tokenizer.json)")
    try:
        head = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"tokenizer {path} is not valid JSON: {exc}") from None
    if isinstance(head, dict) and head.get("type") == _BYTE_FORMAT:
        return ByteTokenizer()
    return HFTokenizer.from_file(path)
