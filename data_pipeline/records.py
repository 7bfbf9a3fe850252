"""Instruction and chat records -> tokens and a loss mask (`loomtrain preprocess --format`).

Formats of a JSONL line:
  text             {"text": ...} (the --text-field): every token is a target
  prompt-response  {"prompt": ..., "response": ...}: a one-turn chat, user then assistant
  chat             {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}

Only the assistant's tokens (and the token that ends each of its turns) are targets; with
`--train-on-prompt` every token is. The mask is 1 where a token is a target: predicting it
from the tokens before it counts in the loss.

Templates. A tokenizer that carries a Hugging Face chat template (`HFTokenizer.chat`) renders
the conversation with it: the text between the rendering of the turns before an assistant
message (with the generation cue) and the rendering that includes it is that message's target.
Otherwise the built-in template, the same for the byte and BPE tokenizers:

    <|system|>\\n{content}\\n        (not a target)
    <|user|>\\n{content}\\n          (not a target)
    <|assistant|>\\n                 (not a target)
    {content}EOS                    (the target: the reply and the end-of-text that ends it)

Every record ends with EOS (one that is no target is added when the last turn is not the
assistant's), so records are documents as the rest of the pipeline knows them.

A conversation's turns go: an optional system message first, then user and assistant in turn;
another order is refused naming file:line. A message's content is text: a special token's
spelling inside it (`<|endoftext|>`, a fake `<|user|>` turn) is encoded as characters, never as
the token; special tokens come only from the template's own markup (see _encode).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from loomtrain.data_pipeline.shards import DataError

FORMATS = ("text", "prompt-response", "chat")
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class RecordFormat:
    """How preprocess reads JSONL records. max_tokens: the most tokens a record may hold
    (train.seq_len + 1: seq_len inputs, each predicting the next; 0 = no limit); longer ones
    are refused, or cut to max_tokens with `truncate`."""

    format: str = "text"
    train_on_prompt: bool = False
    max_tokens: int = 0
    truncate: bool = False

    @property
    def masked(self) -> bool:
        return self.format != "text"


TEXT = RecordFormat()


def detect_format(files: list[Path], text_field: str) -> str:
    """The format of the first record of the first JSONL input: chat with "messages",
    prompt-response with "prompt" and "response", else text (also for .txt and Parquet)."""
    for path in files:
        if not path.name.lower().endswith((".jsonl", ".ndjson")):
            return "text"
        try:
            with open(path, "rb") as f:
                first = next((raw for raw in f if raw.strip()), None)
        except OSError as exc:  # worded as preprocess words any input it cannot read (staging.Progress)
            raise DataError(f"input {path}: {exc.strerror or exc}") from None
        if first is None:
            continue
        try:
            obj = json.loads(first)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return "text"  # the text reader names the bad line
        if isinstance(obj, dict) and text_field not in obj:
            if "messages" in obj:
                return "chat"
            if "prompt" in obj and "response" in obj:
                return "prompt-response"
        return "text"
    return "text"


def record_messages(obj, fmt: str) -> list[dict]:
    """A record's conversation as [{"role", "content"}], checked; ValueError names what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    if fmt == "prompt-response":
        for key in ("prompt", "response"):
            if not isinstance(obj.get(key), str):
                found = "missing" if key not in obj else f"{type(obj[key]).__name__}"
                raise ValueError(f"field {key!r} is {found}, expected a string (--format prompt-response)")
        return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["response"]}]
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("field 'messages' is missing or empty, expected a list of {role, content} (--format chat)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] is a {type(m).__name__}, expected an object with role and content")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role is {m.get('role')!r}, expected system, user or assistant")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content is {type(m.get('content')).__name__}, expected a string")
    _check_turn_order([m["role"] for m in messages])
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _check_turn_order(roles: list[str]) -> None:
    """An optional system message first, then user and assistant in turn (what chat templates
    and models expect; a template may render other orders silently into something else)."""
    rule = "turns go: an optional system message first, then user and assistant in turn"
    start = 1 if roles and roles[0] == "system" else 0
    for i in range(start, len(roles)):
        want = "user" if (i - start) % 2 == 0 else "assistant"
        if roles[i] != want:
            after = f" after {roles[i - 1]!r}" if i else " first"
            raise ValueError(f"messages[{i}].role is {roles[i]!r}{after}, expected {want!r} ({rule})")


EOS = object()  # a segment that is the EOS token itself (the byte tokenizer has no text for it)


ASSISTANT_CUE = "<|assistant|>\n"  # the built-in template's start of the assistant's turn


def _builtin_segments(messages: list[dict]) -> list[tuple[object, bool]]:
    """(text or EOS, is_target) pieces of the built-in template; each message's content stands as
    its sentinel (encoded as text, never as special tokens: see _encode)."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            out += [(ASSISTANT_CUE, False), (_sentinel(i), True), (EOS, True)]
        else:
            out.append((f"<|{m['role']}|>\n{_sentinel(i)}\n", False))
    return out


# Message content is text: `<|endoftext|>` or a fake `<|user|>` turn inside it must not become the
# special token itself (a model would learn to end answers early, a user could forge turns). So
# templates render each content as a sentinel (private-use characters no text holds), and the
# pieces between sentinels (the template's own markup) are encoded with special tokens, the
# contents without (transformers' split_special_tokens). A template that transforms the content
# (its rendering with the contents differs from the sentinels' replaced) is rendered as before.
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def _sentinel(i: int) -> str:
    return f"\ue000{i}\ue001"


def _encode(tokenizer, text: str, contents: list[str]) -> list[int]:
    """A rendered piece -> ids: markup with special tokens, each sentinel's content as plain text."""
    plain = getattr(tokenizer, "encode_plain", tokenizer.encode)
    ids, pos = [], 0
    for m in _SENTINEL.finditer(text):
        if m.start() > pos:
            ids += tokenizer.encode(text[pos : m.start()])
        content = contents[int(m.group(1))]
        ids += plain(content) if content else []
        pos = m.end()
    if pos < len(text):
        ids += tokenizer.encode(text[pos:])
    return ids


def _with_sentinels(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": _sentinel(i)} for i, m in enumerate(messages)]


def _filled(text: str, contents: list[str]) -> str:
    return _SENTINEL.sub(lambda m: contents[int(m.group(1))], text)


def question_tokens(tokenizer, text: str) -> list[int]:
    """What a model fine-tuned on chat records answers: `text` as a user's message followed by the
    assistant's cue, rendered and tokenized as preprocess renders a record's prompt (the tokenizer's
    own chat template when it has one, else the built-in template). ValueError: a template that
    refuses the message."""
    messages = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat", None):
        from jinja2 import TemplateError
        from loomtrain.data_pipeline.chat_template import render

        try:
            shaped = render(tokenizer.chat, _with_sentinels(messages), True, tokenizer.eos_token)
            real = render(tokenizer.chat, messages, True, tokenizer.eos_token)
        except TemplateError as exc:
            raise ValueError(f"the tokenizer's chat template refused the message: {exc}") from None
        return _encode(tokenizer, shaped, [text]) if _filled(shaped, [text]) == real else tokenizer.encode(real)
    segments = [*_builtin_segments(messages), (ASSISTANT_CUE, False)]
    return [t for piece, _ in segments for t in _encode(tokenizer, piece, [text])]


def _template_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """(text, is_target) pieces rendered by the tokenizer's own chat template: with each content
    as its sentinel when the template keeps contents as they are, else with the contents."""
    contents = [m["content"] for m in messages]
    real = _rendered_segments(tokenizer, messages)
    try:
        shaped = _rendered_segments(tokenizer, _with_sentinels(messages))
    except ValueError:  # a template that looks into the contents: rendered with them
        return real
    same = [(_filled(text, contents), target) for text, target in shaped] == real
    return shaped if same else real


def _rendered_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    from jinja2 import TemplateError
    from loomtrain.data_pipeline.chat_template import TemplateLimit, limit_line, render

    out, done = [], ""
    try:
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            cue = render(tokenizer.chat, messages[:i], True, tokenizer.eos_token)
            full = render(tokenizer.chat, messages[: i + 1], False, tokenizer.eos_token)
            if not (cue.startswith(done) and full.startswith(cue)):
                raise ValueError(
                    "the tokenizer's chat template does not render the conversation turn by turn (an earlier "
                    "turn changes when a later one is added), so the assistant's tokens cannot be told apart"
                )
            out += [(cue[len(done) :], False), (full[len(cue) :], True)]
            done = full
        whole = render(tokenizer.chat, messages, False, tokenizer.eos_token)
    except TemplateLimit as exc:  # the template's fault, not the record's: --skip-bad-lines does not skip it
        raise DataError(limit_line(getattr(tokenizer, "source", ""), exc)) from None
    except TemplateError as exc:
        raise ValueError(f"the tokenizer's chat template refused the conversation: {exc}") from None
    if not whole.startswith(done):
        raise ValueError("the tokenizer's chat template renders the whole conversation otherwise than turn by turn")
    out.append((whole[len(done) :], False))
    return out


def record_tokens(obj, fmt: RecordFormat, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """One JSONL record -> (token ids int64, mask uint8: 1 = target). ValueError names the problem."""
    messages = record_messages(obj, fmt.format)
    eos_id = tokenizer.eos_id
    chat = getattr(tokenizer, "chat", None)
    segments = _template_segments(tokenizer, messages) if chat else _builtin_segments(messages)
    contents = [m["content"] for m in messages]
    ids: list[int] = []
    mask: list[int] = []
    for text, target in segments:
        piece = [eos_id] if text is EOS else _encode(tokenizer, text, contents) if text else []
        ids += piece
        mask += [1 if (target or fmt.train_on_prompt) else 0] * len(piece)
    if not ids or ids[-1] != eos_id:  # every document ends with EOS
        ids.append(eos_id)
        mask.append(1 if fmt.train_on_prompt else 0)
    if fmt.max_tokens and len(ids) > fmt.max_tokens:
        if not fmt.truncate:
            raise ValueError(
                f"the record is {len(ids)} tokens, more than train.seq_len + 1 = {fmt.max_tokens} "
                f"(--seq-len {fmt.max_tokens - 1}); shorten it, or pass --truncate to cut such records"
            )
        ids, mask = ids[: fmt.max_tokens], mask[: fmt.max_tokens]
    if not any(mask[1:]):  # the first token is never predicted
        why = "no assistant message" if not any(m["role"] == "assistant" for m in messages) else "empty replies"
        cut = " after --truncate" if fmt.max_tokens and fmt.truncate else ""
        raise ValueError(f"the record has no target tokens ({why}{cut}); --train-on-prompt trains on every token")
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def check_format(fmt: RecordFormat, files: list[Path]) -> None:
    """--format prompt-response and chat read JSONL only."""
    if fmt.format not in FORMATS:
        raise DataError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt.format!r}")
    if fmt.masked:
        for path in files:
            if not path.name.lower().endswith((".jsonl", ".ndjson")):
                raise DataError(f"{path}: --format {fmt.format} reads JSONL records (.jsonl), not this file")
    if fmt.max_tokens < 0:
        raise DataError(f"--seq-len: expected a positive number of tokens (train.seq_len), got {fmt.max_tokens - 1}")
