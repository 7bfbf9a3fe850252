"""`loomtrain generate RUN_DIR --prompt "..." | --chat "..." [--max-new-tokens N] [--temperature T] [--top-k K]`.

Loads RUN_DIR/final (safetensors + JSON + tokenizer; nothing unpickled), or where a run has
no final/ (stopped early, e.g. by checkpoint.stop_at_step) its newest complete checkpoint, or
a checkpoint directory given directly (read as `export` reads it), and prints the prompt
followed by its continuation; with --chat, a user's message in the model's chat template and the
assistant's reply alone. Temperature 0 is greedy. RUN_DIR may be a URI (a run's
run.storage, its final/ or a checkpoint, e.g. s3://bucket/run): its final/ is fetched into this
host's cache, each file checked against the manifest; without one, its newest checkpoint is read.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

from loomtrain.launcher.cli import HelpFormatter
from loomtrain.launcher.config import DEVICES  # train.device's choices; --device also takes cuda:N


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loomtrain generate",
        description="Continue a prompt with a trained run's weights.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "run_dir",
        help="a run directory (its final/, else its newest complete checkpoint), its final/, a checkpoint directory, "
        "or a URI of a run's storage or its final/ (s3://bucket/run)",
    )
    p.add_argument("--prompt", default="", help="text to continue (default: start from end-of-text)")
    p.add_argument(
        "--chat",
        default=None,
        metavar="MESSAGE",
        help="a user's message, in the chat template the model was fine-tuned with (the tokenizer's own, "
        "else loomtrain's built-in one); prints the assistant's reply",
    )
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest tokens only (default: all)")
    p.add_argument(
        "--top-p", type=float, default=None, help="sample among the likeliest tokens up to probability P (default: all)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """The first bad sampling argument as one line, or None (before any file is read)."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return f"--temperature: expected a finite number >= 0 (0 = greedy), got {args.temperature}"
    if args.top_p is not None and not (0.0 < args.top_p <= 1.0):  # also refuses nan
        return f"--top-p: expected a number in (0, 1], got {args.top_p}"
    if args.top_k is not None and args.top_k < 1:
        return f"--top-k: expected at least 1, got {args.top_k}"
    if args.max_new_tokens < 0:
        return f"--max-new-tokens: expected at least 0, got {args.max_new_tokens}"
    if args.chat is not None and args.prompt:
        return "--chat and --prompt: give one (--chat is a user's message, --prompt raw text to continue)"
    if args.device not in DEVICES and not re.fullmatch(r"cuda:\d+", args.device):
        return f"--device: expected one of {', '.join(DEVICES)} (or cuda:N), got {args.device!r}"
    from loomtrain.storage import location_problem

    problem = location_problem(args.run_dir)  # S3://, s4://, s3:/b: one line, not a traceback or a folder
    if problem:
        return f"RUN_DIR={args.run_dir}: {problem}"
    return None


def pick_device(requested: str) -> str:
    """auto -> cuda when there is one; an explicit cuda without CUDA is a ValueError."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {requested}: this machine has no usable CUDA device "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device cpu"
        )
    return requested


def load_model(path: str, device: str):
    """-> (model, tokenizer, what was loaded): final weights where there are some, else the
    newest complete checkpoint of a run, or the checkpoint directory `path` names."""

    from loomtrain.data_pipeline import load_tokenizer
    from loomtrain.launcher.checkpoints.export import ExportError, open_source
    from loomtrain.launcher.checkpoints.final import FINAL_MANIFEST, FinalWeightsError
    from loomtrain.launcher.checkpoints.lora_weights import BaseMismatch
    from loomtrain.launcher.checkpoints.store import MANIFEST
    from loomtrain.launcher.checkpoints.weight_source import load_final
    from loomtrain.model import Transformer
    from loomtrain.storage import below, location

    # A folder or a URI alike (never a path for a URI: s3://b/x would read a folder ./s3:/b/x).
    # A checkpoint (its manifest beside trainer.json) is read as export reads it; a run's final/
    # (committed: renamed into place on a disk, where one from before manifests has none; its
    # manifest written in an object store), final weights themselves or a file, as final weights;
    # a run with checkpoints and no committed final/, its newest checkpoint (else export's line).
    objs = location(path, "RUN_DIR")
    entries = objs.entries()
    is_checkpoint = entries.get(MANIFEST) == "file" and entries.get("trainer.json") == "file"
    has_final = (objs.renames and entries.get("final") == "directory") or objs.exists(f"final/{FINAL_MANIFEST}")
    if not is_checkpoint and (entries.get("checkpoints") != "directory" or has_final):
        model, tok = load_final(path, device=device)
        return model, tok, "final weights"
    src = below(path)
    try:
        source = open_source(src)  # a LoRA checkpoint: its base + adapters, merged
    except (ExportError, BaseMismatch) as exc:
        raise FinalWeightsError(str(exc)) from None
    if source.tok_dir is None:
        raise FinalWeightsError(f"{source.what}: no tokenizer/ in it")
    model = Transformer(source.cfg)
    state = {name: source.get(name) for name in source.shapes}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = ["lm_head.weight"] if source.cfg.tie_embeddings else []
    if unexpected or sorted(missing) != tied:
        raise FinalWeightsError(f"{source.what}: tensors do not match its model config")
    model.reset_buffers()
    model = model.to(device).eval()  # Module.to moves the parameters under no_grad itself
    return model, load_tokenizer(str(source.tok_dir)), source.what


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    bad = check_args(args)
    if bad:
        print(f"loomtrain generate: {bad}", file=sys.stderr)
        return 2
    # torch loads only now, so that a bad argument is reported at once.
    import torch
    from loomtrain.launcher.checkpoints.final import FinalWeightsError

    try:
        device = pick_device(args.device)
        model, tok, what = load_model(args.run_dir, device)
    except (FileNotFoundError, FinalWeightsError, ValueError) as exc:
        print(f"loomtrain generate: {exc}", file=sys.stderr)
        return 2
    try:
        ids = prompt_tokens(tok, args)
    except ValueError as exc:  # a chat template that refuses the message
        print(f"loomtrain generate: --chat: {exc}", file=sys.stderr)
        return 2
    room = model.cfg.max_seq_len - len(ids)
    if room <= 0:
        print(
            f"loomtrain generate: the prompt is {len(ids)} tokens; the model's context is {model.cfg.max_seq_len}",
            file=sys.stderr,
        )
        return 2
    if args.max_new_tokens > room:  # said before the wait, not left for the user to count
        print(
            f"loomtrain generate: --max-new-tokens {args.max_new_tokens} is more than the context leaves: "
            f"generation stops at model.max_seq_len {model.cfg.max_seq_len} (the prompt's {len(ids)} tokens "
            f"+ at most {room} new)",
            file=sys.stderr,
        )
    gen = torch.Generator(device=device).manual_seed(args.seed)
    try:
        out = model.generate(
            torch.tensor([ids], dtype=torch.long, device=device),
            min(args.max_new_tokens, room),
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_id=tok.eos_id,
            generator=gen,
        )
    except ValueError as exc:  # bad temperature / top-k / top-p
        print(f"loomtrain generate: {exc}", file=sys.stderr)
        return 2
    if what != "final weights":
        print(f"loomtrain generate: no final/ weights: using {what}", file=sys.stderr)
    new = [t for t in out[0, len(ids) :].tolist() if t != tok.eos_id]
    print(tok.decode(new) if args.chat is not None else args.prompt + tok.decode(new))
    return 0


def prompt_tokens(tok, args: argparse.Namespace) -> list[int]:
    """The ids generation starts from: --chat as a user's turn and the assistant's cue, or --prompt."""
    if args.chat is not None:
        from loomtrain.data_pipeline.records import question_tokens

        return question_tokens(tok, args.chat)
    return tok.encode(args.prompt) or [tok.eos_id]
