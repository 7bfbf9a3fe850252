"""`loomtrain preprocess --input GLOB... --output DIR|URI [--tokenizer byte|bpe|PATH] [--ray] ...`.

What is read, how it is tokenized and split, and how the output is published:
data_pipeline/preprocess.py.
"""

from __future__ import annotations

import argparse
import sys

from loomtrain.data_pipeline.documents import expand_inputs
from loomtrain.data_pipeline.preprocess import DEFAULT_SHARD_TOKENS, preprocess_files
from loomtrain.data_pipeline.records import FORMATS, RecordFormat, detect_format
from loomtrain.data_pipeline.shards import DataError
from loomtrain.data_pipeline.staging import Interrupted, OutputError
from loomtrain.launcher.cli import HelpFormatter
from loomtrain.launcher.cluster.preprocess_tasks import RayTasks
from loomtrain.launcher.config import DataConfig

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


def build_parser() -> argparse.ArgumentParser:
    d = DataConfig()  # the defaults come from the run schema
    p = argparse.ArgumentParser(
        prog="loomtrain preprocess",
        description="Tokenize text/JSONL/Parquet into token shards.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--input", nargs="+", required=True, metavar="GLOB", help=".txt/.jsonl/.parquet files (globs; ** allowed)"
    )
    p.add_argument(
        "--output",
        required=True,
        metavar="DIR|URI",
        help="shard directory to write: a path, or a URI (s3://bucket/ds: made in a local work folder under "
        "the temp directory, each file uploaded as it is complete, index.json last)",
    )
    p.add_argument("--tokenizer", default=d.tokenizer, help="byte | bpe (trained on the inputs) | PATH/tokenizer.json")
    p.add_argument(
        "--bpe-vocab-size",
        type=int,
        default=d.bpe_vocab_size,
        help="vocabulary size a --tokenizer bpe is trained up to (a small corpus stops short)",
    )
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="what a JSONL line holds: text (--text-field), prompt-response ({prompt, response}) or chat "
        "({messages: [{role, content}, ...]}); default: detected from the first record",
    )
    p.add_argument(
        "--train-on-prompt",
        action="store_true",
        help="prompt-response / chat: every token is a target (default: only the assistant's replies)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=0,
        metavar="N",
        help="prompt-response / chat: the run's train.seq_len; a record of more than N + 1 tokens is an error "
        "naming its file and line (or cut with --truncate); 0 = no limit here (train refuses such records)",
    )
    p.add_argument("--truncate", action="store_true", help="with --seq-len: cut longer records instead of failing")
    p.add_argument(
        "--val-fraction", type=float, default=d.val_fraction, help="fraction of the documents in the validation split"
    )
    p.add_argument("--seed", type=int, default=d.split_seed, help="validation split seed")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizing processes (default: all cores), "
        "or with --ray Ray tasks in flight (default: the cluster's CPUs)",
    )
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count bad JSONL lines instead of failing")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    p.add_argument(
        "--bpe-sample-bytes",
        type=int,
        default=0,
        metavar="N",
        help="train BPE on a deterministic sample of about N bytes (each file's share, from its start); 0 = all",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --output that is not an earlier preprocess output"
    )
    p.add_argument("--ray", action="store_true", help="tokenize input files as Ray tasks across a cluster")
    p.add_argument(
        "--address",
        default=None,
        help="with --ray: the cluster (HOST:PORT, 'auto', or ray://HOST:10001); "
        "default $RAY_ADDRESS, else a local instance",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.address is not None and not args.ray:
        parser.error("--address needs --ray")
    if args.truncate and not args.seq_len:
        parser.error("--truncate needs --seq-len (the run's train.seq_len)")
    if args.seq_len < 0:
        parser.error(f"--seq-len: expected the run's train.seq_len (a positive number of tokens), got {args.seq_len}")
    from loomtrain.storage import location_problem

    problem = location_problem(args.output)  # s3:/bkt/x would be written as a local folder ./s3:/bkt/x
    if problem:
        print(f"loomtrain preprocess: error: --output {args.output}: {problem}", file=sys.stderr)
        return 2
    executor = RayTasks(args.address) if args.ray else None
    try:
        if executor is not None:
            executor.check()  # up front: a dead address fails in seconds, before anything is written
        files = expand_inputs(args.input)
        records = RecordFormat(
            args.format or detect_format(files, args.text_field),
            train_on_prompt=args.train_on_prompt,
            max_tokens=args.seq_len + 1 if args.seq_len else 0,
            truncate=args.truncate,
        )
        preprocess_files(
            files,
            args.output,
            args.tokenizer,
            text_field=args.text_field,
            val_fraction=args.val_fraction,
            seed=args.seed,
            workers=args.workers,
            skip_bad_lines=args.skip_bad_lines,
            bpe_vocab_size=args.bpe_vocab_size,
            bpe_sample_bytes=args.bpe_sample_bytes,
            progress=not args.no_progress,
            shard_tokens=args.shard_tokens,
            sources=args.input,
            overwrite=args.overwrite,
            executor=executor,
            records=records,
        )
    except DataError as exc:
        print(f"loomtrain preprocess: error: {exc}", file=sys.stderr)
        return 1
    except OutputError as exc:  # full or read-only: the path, the cause, what a rerun resumes from
        print(f"loomtrain preprocess: error: {exc.line}", file=sys.stderr)
        return 1
    except Interrupted as exc:  # Ctrl-C: the line says what was kept and that a rerun resumes
        print(f"loomtrain preprocess: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before preprocess_files began (listing the inputs)
        print("loomtrain preprocess: interrupted before anything was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
