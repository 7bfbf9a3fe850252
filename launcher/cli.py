"""The `loomtrain` command: a thin dispatcher to one module per subcommand.

Each subcommand lives in its own module and exposes `main(argv) -> int`, so
the CLI never imports torch, DeepSpeed or Ray before it knows it needs them.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("loomtrain.launcher.train", "train a model from a YAML config (locally, under torchrun, or --ray)"),
    "preprocess": ("loomtrain.data_pipeline.preprocess", "tokenize text/JSONL/Parquet into token shards"),
    "data-stats": ("loomtrain.data_pipeline.stats", "samples and tokens per data source over a run's first N steps"),
    "generate": ("loomtrain.launcher.generate", "continue a prompt with a trained run's weights"),
    "plan": ("loomtrain.launcher.planning.plan", "predict memory, FLOPs and step time per rank for a config"),
    "dryrun": (
        "loomtrain.launcher.planning.dryrun",
        "run one cluster rank's shard on this machine, measured against plan",
    ),
    "export": ("loomtrain.launcher.checkpoints.export", "export a run's weights to Hugging Face format"),
    "import": (
        "loomtrain.launcher.checkpoints.hf_import",
        "turn a Hugging Face model directory into a run (final/ + config.yaml)",
    ),
    "submit": ("loomtrain.launcher.cluster.jobs", "submit a config as a Ray job to a cluster"),
    "status": ("loomtrain.launcher.cluster.jobs", "show a Ray job's status"),
    "logs": ("loomtrain.launcher.cluster.jobs", "print (or --follow) a Ray job's logs"),
    "stop": ("loomtrain.launcher.cluster.jobs", "stop a Ray job"),
}


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
    module = importlib.import_module(COMMANDS[command][0])
    # jobs.py serves several commands; it gets the command name first.
    if COMMANDS[command][0].endswith(".jobs"):
        return int(module.main([command, *rest]) or 0)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
