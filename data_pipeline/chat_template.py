"""A tokenizer's chat template (Jinja, from a model's files) rendered under limits.

A template is code that came with a model: Jinja's sandbox stops it from reaching Python's
objects, not from running long or making a huge string. So every rendering here is bounded:

    RENDER_TIME_S      one conversation's rendering (nested `range(100000)` loops hung preprocess)
    RENDER_CHARS       its output, and any `str * n` / `list * n` inside it (`'x' * 200000000` was
                       OOM-killed after minutes); `**` with a large exponent is refused as well
    recursion          Python's own limit (a recursive macro): said, not a RecursionError traceback

A template past a limit is TemplateLimit (a jinja2 TemplateError): callers name the tokenizer
file in one line. The time limit is kept by one watchdog thread per process that raises
TemplateLimit inside the rendering thread once its deadline passes (a template is Python code
compiled by Jinja, so the exception lands between two of its operations).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIME_S = 10.0
RENDER_CHARS = 8 << 20
MAX_EXPONENT = 4096


class TemplateLimit(TemplateError):
    """A chat template that ran past RENDER_TIME_S, RENDER_CHARS or the recursion limit."""


class _TimedOut(BaseException):
    """Raised inside a rendering thread by the watchdog (a BaseException: no template catches it)."""


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > RENDER_CHARS:
                    raise TemplateLimit(f"a value of {len(seq) * n:,} items (more than {RENDER_CHARS:,})")
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise TemplateLimit(f"an exponent of {right} (more than {MAX_EXPONENT})")
        return super().call_binop(context, operator, left, right)


# The watchdog: {thread ident: deadline} of the renderings in progress in this process.
_deadlines: dict[int, float] = {}
_lock = threading.Lock()
_watchdog_pid: int | None = None


def _watch() -> None:
    while True:
        time.sleep(0.1)
        now = time.monotonic()
        with _lock:
            for ident, deadline in list(_deadlines.items()):
                if now > deadline:
                    del _deadlines[ident]
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(_TimedOut))


def _start_watchdog() -> None:
    global _watchdog_pid
    with _lock:
        if _watchdog_pid != os.getpid():  # none yet, or this is a forked child's first rendering
            _deadlines.clear()
            threading.Thread(target=_watch, name="loomtrain-chat-template-watchdog", daemon=True).start()
            _watchdog_pid = os.getpid()


def _environment() -> ImmutableSandboxedEnvironment:
    def raise_exception(message):
        raise TemplateError(message)

    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


def render(chat: dict, messages: list[dict], cue: bool, eos_token: str) -> str:
    """The conversation in the chat template (read_chat_format's dict), with the assistant's cue
    when `cue`; TemplateLimit past a limit, TemplateError when the template refuses it."""
    template = _environment().from_string(chat["chat_template"])
    _start_watchdog()
    ident = threading.get_ident()
    out, size = [], 0
    with _lock:
        _deadlines[ident] = time.monotonic() + RENDER_TIME_S
    try:
        try:
            for chunk in template.generate(
                messages=messages,
                add_generation_prompt=cue,
                bos_token=chat["bos_token"],
                eos_token=chat["eos_token"] or eos_token,
            ):
                size += len(chunk)
                if size > RENDER_CHARS:
                    raise TemplateLimit(f"an output of more than {RENDER_CHARS:,} characters")
                out.append(chunk)
        finally:
            with _lock:
                fired = _deadlines.pop(ident, None) is None
            if fired:  # the watchdog's exception may not be raised yet: dropped
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
    except _TimedOut:  # raised anywhere above, the cleanup included
        raise TemplateLimit(f"more than {RENDER_TIME_S:g} s for one conversation") from None
    except RecursionError:
        raise TemplateLimit("recursion deeper than Python's limit (a macro that calls itself?)") from None
    return "".join(out)


def limit_line(source: str, exc: TemplateLimit) -> str:
    """The one line for a template past a limit, naming the tokenizer file it came with."""
    return (
        f"{source or 'the tokenizer'}: its chat template exceeds loomtrain's rendering limits ({exc}); "
        "fix the template (tokenizer_config.json's chat_template or chat_template.jinja beside it)"
    )
