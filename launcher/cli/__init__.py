"""The `loomtrain` command: a thin dispatcher to one module per subcommand.

Each subcommand's entry point lives in this package (`loomtrain.launcher.cli.<module>`)
and exposes `main(argv) -> int`: it parses the arguments, calls the library code where
that belongs (data_pipeline/, launcher/checkpoints/, launcher/planning/, launcher/cluster/,
the loop) and turns bad input into one line on stderr. The dispatcher imports a command's
module only when it runs, so `loomtrain --help` never imports torch, DeepSpeed or Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module in this package, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a model from a YAML config (locally, under torchrun, or --ray)"),
    "preprocess": ("preprocess", "tokenize text/JSONL/Parquet into token shards"),
    "data-stats": ("data_stats", "samples and tokens per data source over a run's first N steps"),
    "generate": ("generate", "continue a prompt with a trained run's weights"),
    "plan": ("plan", "predict memory, FLOPs and step time per rank for a config"),
    "dryrun": ("dryrun", "run one cluster rank's shard on this machine, measured against plan"),
    "export": ("export", "export a run's weights to Hugging Face format"),
    "import": ("import_hf", "turn a Hugging Face model directory into a run (final/ + config.yaml)"),
    "submit": ("jobs", "submit a config as a Ray job to a cluster"),
    "status": ("jobs", "show a Ray job's status"),
    "logs": ("jobs", "print (or --follow) a Ray job's logs"),
    "stop": ("jobs", "stop a Ray job"),
}


class _ShowsDefaults:
    """`--help` shows each option's default, as argparse.ArgumentDefaultsHelpFormatter does,
    except where there is none to show (None, a flag's False, an empty list) or the option's
    help already says what happens by default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
        nothing = action.default is None or action.default is False or action.default == []  # 0 is a default
        if shown and not nothing and action.default != argparse.SUPPRESS and "default" not in text:
            text += " (default: %(default)s)"
        return text


class HelpFormatter(_ShowsDefaults, argparse.HelpFormatter):
    """Every subcommand's parser: `formatter_class=HelpFormatter`."""


class RawDescriptionHelpFormatter(_ShowsDefaults, argparse.RawDescriptionHelpFormatter):
    """The same, for a description laid out by hand."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: loomtrain COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"loomtrain: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    name = COMMANDS[command][0]
    module = importlib.import_module(f"{__name__}.{name}")
    # The jobs module serves several commands; it gets the command name first.
    return int(module.main([command, *rest] if name == "jobs" else rest) or 0)
