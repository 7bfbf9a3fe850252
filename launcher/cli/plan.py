"""`loomtrain plan CONFIG [--world-size N] [--gpu h100|h200|a100|l40s|cpu] [key=value ...]`

Predicts one rank of a run before it is submitted: memory for parameters, gradients
and optimizer states at the configured ZeRO stage and TP, activations, FLOPs per
step, TP/DP communication per step, and step time / tokens/s / MFU on the named
GPU at an assumed MFU; then host RAM per node at start-up and during a save or resume,
the checkpoint's size and the time to save it at a stated storage bandwidth. The model is
built full-size on the meta device, so a 70 B config is counted without allocating its weights.

Exit status: 0 when the config fits, 1 when it will not fit, 2 on a bad config.
"""

from __future__ import annotations

import argparse
import json
import sys

from loomtrain.launcher.cli import RawDescriptionHelpFormatter
from loomtrain.launcher.config_loader import ConfigError
from loomtrain.launcher.planning import host_model as hm
from loomtrain.launcher.planning import memory_model as mm
from loomtrain.launcher.planning.memory_plan import format_plan, load_plan


def plan_parser(prog: str, doc: str, overrides_help: str, world_size_help: str) -> argparse.ArgumentParser:
    """The arguments `plan` and `dryrun` share: a config, its overrides and the cluster to predict for."""
    ap = argparse.ArgumentParser(
        prog=prog, description=doc.split("\n\n")[1], formatter_class=RawDescriptionHelpFormatter
    )
    ap.add_argument("config", help="the run's YAML config")
    ap.add_argument("overrides", nargs="*", help=overrides_help)
    ap.add_argument("--world-size", type=int, default=None, help=world_size_help)
    ap.add_argument("--gpu", default="h100", choices=sorted(mm.DEVICES), help="device to predict for")
    ap.add_argument(
        "--mfu", type=float, default=mm.DEFAULT_MFU, help=f"assumed model-FLOPs utilization (default {mm.DEFAULT_MFU})"
    )
    return ap


def build_parser() -> argparse.ArgumentParser:
    ap = plan_parser(
        "loomtrain plan",
        __doc__,
        "key=value config overrides",
        "number of ranks (default: the config's ray.num_workers)",
    )
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        default=hm.DEFAULT_GPUS_PER_NODE,
        help=f"ranks per node, for host RAM per node (default {hm.DEFAULT_GPUS_PER_NODE})",
    )
    ap.add_argument(
        "--node-ram-gib",
        type=float,
        default=None,
        help=f"host RAM per node in GiB (default {hm.DEFAULT_NODE_RAM_GIB:g}, a 1 TB node; with --gpu cpu, "
        "this machine's RAM)",
    )
    ap.add_argument(
        "--storage-gbps",
        type=float,
        default=hm.DEFAULT_STORAGE_GBPS,
        help=f"checkpoint storage write bandwidth in GB/s per node (default {hm.DEFAULT_STORAGE_GBPS:g})",
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def _node_ram_gib(args) -> float:
    """A CPU "cluster" is this machine: its RAM, unless --node-ram-gib says otherwise."""
    if args.node_ram_gib is not None:
        return args.node_ram_gib
    return round(mm.host_memory_gib(), 1) if args.gpu == "cpu" else hm.DEFAULT_NODE_RAM_GIB


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        _, p = load_plan(
            args.config,
            args.overrides,
            args.world_size,
            args.gpu,
            args.mfu,
            gpus_per_node=args.gpus_per_node,
            node_ram_gib=_node_ram_gib(args),
            storage_gbps=args.storage_gbps,
        )
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"loomtrain plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(p.as_dict(), indent=2, default=str))
    else:
        print(format_plan(p, args.config))
    return 0 if p.fits else 1
