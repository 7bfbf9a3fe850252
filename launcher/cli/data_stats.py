"""`loomtrain data-stats CONFIG [key=value ...] --steps N [--show K]`: what a run will read, as JSON.

What the report holds: data_pipeline/stats.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from loomtrain.data_pipeline import DataError
from loomtrain.data_pipeline.stats import data_stats
from loomtrain.launcher.cli import HelpFormatter
from loomtrain.launcher.config_loader import ConfigError, resolve, validate
from loomtrain.launcher.rundir import data_cache_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loomtrain data-stats",
        description="Samples and tokens per data source over a run's first N steps.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("config", help="the run's YAML config")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for `loomtrain train`")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to count from the start of the run")
    p.add_argument("--show", type=int, default=0, metavar="K", help="also print the first K samples, decoded")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.steps < 0 or args.show < 0:
        print(
            f"loomtrain data-stats: error: --steps and --show must be >= 0, got {args.steps} and {args.show}",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = resolve(args.config, args.overrides)
        # The global order does not depend on the DP size: check the config as one data rank.
        validate(cfg, cfg.parallel.tp * cfg.parallel.cp)
        report = data_stats(cfg, data_cache_dir(cfg), args.steps, args.show)
    except (ConfigError, DataError) as exc:
        print(f"loomtrain data-stats: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1, ensure_ascii=False))
    return 0
