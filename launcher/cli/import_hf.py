"""`loomtrain import --format hf SRC_DIR|MODEL_ID --output RUN_DIR`.

What is imported and what is refused: launcher/checkpoints/hf_source.py.
"""

from __future__ import annotations

import argparse
import sys

from loomtrain.launcher.checkpoints.hf_import import FORMATS, import_hf
from loomtrain.launcher.checkpoints.safetensors_source import WeightSourceError
from loomtrain.launcher.cli import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="loomtrain import",
        description="Turn a Hugging Face model directory into a loomtrain run directory.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "src",
        help="a Hugging Face model directory or URI (config.json, safetensors, tokenizer.json), or a model id "
        "(ORG/NAME or ORG/NAME@REVISION) in the local Hugging Face cache ($HF_HUB_CACHE; nothing is downloaded)",
    )
    ap.add_argument("--format", default="hf", choices=FORMATS, help="the source's format")
    ap.add_argument(
        "--output",
        required=True,
        help="the run directory or URI to create (final/ and config.yaml): absent, empty, or a previous import of SRC",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import_hf(args.src, args.output)
    except WeightSourceError as exc:
        print(f"loomtrain import: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # import_hf removed what it had written
        print(f"loomtrain import: interrupted; nothing was written to {args.output}", file=sys.stderr)
        return 130
    return 0
