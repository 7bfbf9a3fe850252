"""`loomtrain train CONFIG [key=value ...] [--ray]`: resolve the config, run the loop.

Locally (one process, the loop in launcher/loop.py), under torchrun (`torchrun
--nproc_per_node N -m loomtrain train CONFIG`), or with --ray on a Ray cluster
(launcher/cluster/ray_train.py).
A bad config stops here with `loomtrain: config error: <dotted key>: ...` and
exit status 2, before any process group, model or data exists.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import sys
from pathlib import Path

from loomtrain.data_pipeline import DataError
from loomtrain.launcher.checkpoints.store import CheckpointWriteError
from loomtrain.launcher.cli import HelpFormatter
from loomtrain.launcher.config_loader import ConfigError, env_world_size, resolve, validate
from loomtrain.launcher.nonfinite import NonFiniteError
from loomtrain.launcher.planning.fit import check_fits, local_ranks_from_env
from loomtrain.launcher.rundir import RunDirError, claim, run_dir
from loomtrain.launcher.stopping import exit_code

# Disk trouble a user fixes (space, quota, permissions, a read-only mount): one line, no traceback.
DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EIO}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loomtrain train",
        description="Train a model from a YAML config. Overrides are dotted keys: train.lr=1e-3 model.n_layers=2",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("config", help="YAML config (may `extends:` another)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.max_steps=50")
    parser.add_argument("--ray", action="store_true", help="run the ranks as Ray Train workers (ray.* keys)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="start even when the `plan` memory estimate says the config will not fit this machine",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    try:
        cfg = resolve(args.config, args.overrides)
        # With --ray the world size is ray.num_workers; else what the launcher set (or 1).
        validate(cfg, cfg.ray.num_workers if args.ray else env_world_size())
    except ConfigError as exc:
        print(f"loomtrain: config error: {exc}", file=sys.stderr)
        return 2

    if not args.ray and not args.force:  # before anything is allocated or written
        try:
            verdict = check_fits(cfg, env_world_size(), *local_ranks_from_env())
        except ValueError as exc:  # a config the estimate cannot size
            print(f"loomtrain: config error: {exc}", file=sys.stderr)
            return 2
        if not verdict.fits:
            if os.environ.get("RANK", "0") == "0":
                print(f"loomtrain: {verdict.message}", file=sys.stderr)
            return 2

    # One process per run owns RUN_DIR (see launcher/rundir.py): the Ray driver (it
    # outlives its worker groups' restarts), else global rank 0; the other ranks follow it.
    owner = args.ray or os.environ.get("RANK", "0") == "0"
    made = _first_missing(run_dir(cfg))  # what this start creates, if anything
    rc = 1
    try:
        with claim(cfg.run.dir) if owner else contextlib.nullcontext():
            rc = _run(cfg, args)
            return rc
    except RunDirError as exc:
        print(f"loomtrain: run directory error: {exc}", file=sys.stderr)
        rc = 2
        return rc
    finally:
        # exit 2: a config, data or run-directory error, whose one console line is the whole
        # story (a hang or a crash keeps its folder: the stacks and rank logs are in it)
        if rc == 2 and owner and not args.ray and made is not None:
            _remove_if_no_step(run_dir(cfg), made)


def _first_missing(run_dir: Path) -> Path | None:
    """The outermost folder of run_dir that does not exist yet (run_dir itself, or a parent
    such as runs/), or None when run_dir exists."""
    missing = None
    for p in [run_dir.absolute(), *run_dir.absolute().parents]:
        if p.exists():
            return missing
        missing = p
    return missing


def _remove_if_no_step(run_dir: Path, made: Path) -> None:
    """A local run refused before its first step (no metrics.jsonl, no checkpoint) leaves no
    folder it created: its run directory goes (marker, lock, a rank log that repeats what the
    console showed), then each folder up to `made` that is left empty (runs/ keeps a data cache)."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for p in run_dir.absolute().parents:
        if not p.is_relative_to(made):
            break
        try:
            p.rmdir()  # only an empty folder
        except OSError:
            break


def _run(cfg, args) -> int:
    return _run_on_ray(cfg) if args.ray else _run_here(cfg)


# Each path imports only its own runtime, when it runs: the Ray driver never loads the loop
# (DeepSpeed and the model), and a local or torchrun run never loads Ray.
def _run_on_ray(cfg) -> int:
    from loomtrain.launcher.cluster.ray_train import RayRunError, train_on_ray

    try:
        return train_on_ray(cfg)
    except RayRunError as exc:  # the workers could not be placed, or the run failed for good
        print(f"loomtrain: error: {exc}", file=sys.stderr)
        return 1


def _run_here(cfg) -> int:
    from loomtrain.launcher.distributed import RendezvousError
    from loomtrain.launcher.loop import run_training

    try:
        result = run_training(cfg)
    except RendezvousError as exc:  # the hosts could not form the process group
        print(f"loomtrain: rendezvous error: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # rules that need the real world size or the tokenizer
        print(f"loomtrain: config error: {exc}", file=sys.stderr)
        return 2
    except DataError as exc:
        print(f"loomtrain: data error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteError as exc:
        print(f"loomtrain: training stopped: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full or read-only disk (checkpoints: CheckpointWriteError)
        if not isinstance(exc, CheckpointWriteError) and exc.errno not in DISK_ERRNOS:
            raise
        print(f"loomtrain: write error: {exc}", file=sys.stderr)
        return 1
    return exit_code(result.stopped_by)  # SIGTERM: 0; Ctrl-C: 130; SIGHUP: 129
