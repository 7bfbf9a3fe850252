"""`loomtrain dryrun CONFIG [--steps N] [--world-size W] [--gpu NAME] [key=value ...]`

Runs exactly one rank of a cluster config on this machine (its GPU, else the CPU) and
prints what it measured next to `plan`'s prediction, as a table.

How the rank is built, run and measured: launcher/planning/dryrun.py.
"""

from __future__ import annotations

import dataclasses
import sys

from loomtrain.launcher.cli.plan import plan_parser
from loomtrain.launcher.config_loader import ConfigError, resolve
from loomtrain.launcher.planning.dryrun import dry_run
from loomtrain.launcher.planning.memory_plan import load_plan


def main(argv: list[str] | None = None) -> int:
    ap = plan_parser(
        "loomtrain dryrun",
        __doc__,
        "key=value config overrides (they apply to the plan columns too)",
        "cluster ranks (default: ray.num_workers)",
    )
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps to run (default 3; the first is warm-up)")
    ap.add_argument(
        "--max-micro",
        type=int,
        default=0,
        help="GPU only: search the largest micro-batch from this size down (0 = 4 x micro)",
    )
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")

    try:
        cfg, cluster = load_plan(args.config, args.overrides, args.world_size, args.gpu, args.mfu)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"loomtrain dryrun: {exc}", file=sys.stderr)
        return 2
    try:
        changed = changed_model_fields(args.config, cfg)
    except ConfigError:  # load_plan read the same file a moment ago
        changed = []
    print(dry_run(cfg, cluster, args.steps, args.gpu, args.mfu, args.max_micro, changed=changed))
    return 0


def changed_model_fields(config: str, cfg) -> list[str]:
    """`model.KEY=VALUE (CONFIG: ITS VALUE)` for each model field the command line changed: a
    dry run is often shrunk to fit this machine, and its table then describes that model."""
    base = resolve(config).model
    return [
        f"model.{f.name}={getattr(cfg.model, f.name)} ({config}: {getattr(base, f.name)})"
        for f in dataclasses.fields(cfg.model)
        if getattr(cfg.model, f.name) != getattr(base, f.name)
    ]
