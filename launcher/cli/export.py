"""`loomtrain export RUN_DIR --format hf --output DIR [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]`.

What is exported, from where, and how: launcher/checkpoints/export.py.
"""

from __future__ import annotations

import argparse
import sys

from loomtrain.launcher.checkpoints.export import DEFAULT_MAX_SHARD, DTYPES, FORMATS, ExportError, export_hf
from loomtrain.launcher.checkpoints.lora_export import export_peft
from loomtrain.launcher.cli import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="loomtrain export",
        description="Export a run's weights to Hugging Face format.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "run_dir",
        help="a run directory (newest complete checkpoint, else final/), a checkpoint directory, "
        "or a URI of a run's storage or its final/ (s3://bucket/run: its final/)",
    )
    ap.add_argument("--format", default="hf", choices=FORMATS, help="the export's format")
    ap.add_argument(
        "--output",
        required=True,
        help="output directory or URI (created; an earlier export there is replaced)",
    )
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="weights' dtype in the export (default fp32)")
    ap.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD,
        help="largest weights file, Hugging Face style: 500MB, 5GB, 2GiB (default 5GB)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from loomtrain.storage import location_problem

    for what, location in (("RUN_DIR", args.run_dir), ("--output", args.output)):
        problem = location_problem(location)  # s3:/bkt/x would be written as a local folder ./s3:/bkt/x
        if problem:
            print(f"loomtrain export: {what}={location}: {problem}", file=sys.stderr)
            return 2
    try:
        export = export_peft if args.format == "peft" else export_hf  # peft: a LoRA run's adapters
        export(args.run_dir, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except ExportError as exc:
        print(f"loomtrain export: {exc}", file=sys.stderr)
        return 2
    return 0
