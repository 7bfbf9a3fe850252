"""`loomtrain train CONFIG [key=value ...] [--ray]`: resolve the config, run the loop.

Locally (one process, the loop in launcher/training/loop.py), under torchrun (`torchrun
--nproc_per_node N -m loomtrain train CONFIG`), or with --ray on a Ray cluster
(launcher/cluster/ray_train.py).
A bad config stops here with `loomtrain: config error: <dotted key>: ...` and
exit status 2, before any process group, model or data exists. A full or read-only disk
is one line naming the file, the cause and the checkpoint that stays `latest` (exit 1);
a signal before the loop's own handlers are in place is one line too (exit 128 + signal).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import shutil
import sys
from pathlib import Path

from loomtrain.data_pipeline import DataError
from loomtrain.launcher.checkpoints.store import CheckpointWriteError
from loomtrain.launcher.cli import HelpFormatter
from loomtrain.launcher.config import check_location
from loomtrain.launcher.config_loader import ConfigError, env_world_size, resolve, validate
from loomtrain.launcher.lease import StorageInUse, claim_storage
from loomtrain.launcher.rundir import RunDirError, claim, run_dir
from loomtrain.launcher.training.stopping import StoppedDuringStartUp, exit_code, stop_during_start_up

# Disk trouble a user fixes (space, quota, permissions, a read-only mount, a name too long):
# one line, no traceback; errno -> what to do about it.
DISK_FIXES = {
    errno.ENOSPC: "free space on that disk (or pick another run.dir)",
    errno.EDQUOT: "free space within your quota (or pick another run.dir)",
    errno.EFBIG: "pick a run.dir on a filesystem that takes larger files",
    errno.EROFS: "make that location writable (or pick another run.dir)",
    errno.EACCES: "make that location writable (or pick another run.dir)",
    errno.EPERM: "make that location writable (or pick another run.dir)",
    errno.ENAMETOOLONG: "pick a shorter run.dir",
    errno.EIO: "check that disk",
}


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
    # A signal before the loop's own handlers are in place: one line, the run lock released.
    try:
        with stop_during_start_up():
            return _main(args)
    except StoppedDuringStartUp as exc:
        if os.environ.get("RANK", "0") == "0":
            print(exc.line(), file=sys.stderr, flush=True)
        return 128 + exc.signum  # nothing was saved: not the 0 of a stop that saved a checkpoint


def _main(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args.config, args.overrides)
        # With --ray the world size is ray.num_workers; else what the launcher set (or 1).
        validate(cfg, cfg.ray.num_workers if args.ray else env_world_size())
        check_location("model.init_from", cfg.model.init_from)  # model/ knows no storage: checked here
        misfit = _preflight(cfg, args)
    except ConfigError as exc:
        print(f"loomtrain: config error: {exc}", file=sys.stderr)
        return 2
    if misfit is not None:  # the run does not fit here: rank 0 says why, every rank stops
        if os.environ.get("RANK", "0") == "0":
            print(f"loomtrain: {misfit}", file=sys.stderr)
        return 2

    # One process per run owns RUN_DIR (see launcher/rundir.py): the Ray driver (it
    # outlives its worker groups' restarts), else global rank 0; the other ranks follow it.
    owner = args.ray or os.environ.get("RANK", "0") == "0"
    made = _first_missing(run_dir(cfg))  # what this start creates, if anything
    rc, stopped = 1, False
    try:
        # ... and run.storage's lease (launcher/lease.py), taken once RUN_DIR is ours
        with (
            claim(cfg.run.dir) if owner else contextlib.nullcontext(),
            claim_storage(cfg) if owner else contextlib.nullcontext(),
        ):
            _refuse_another_models_checkpoint(cfg, args.ray)
            rc = _run_on_ray(cfg) if args.ray else _run_here(cfg)
            return rc
    except ConfigError as exc:  # the checkpoint to resume holds another model
        print(f"loomtrain: config error: {exc}", file=sys.stderr)
        rc = 2
        return rc
    except RunDirError as exc:
        what = "run storage" if isinstance(exc, StorageInUse) else "run directory"
        print(f"loomtrain: {what} error: {exc}", file=sys.stderr)
        rc = 2
        return rc
    except OSError as exc:  # a full or read-only disk, wherever it struck (the lock, a log, a checkpoint)
        if not isinstance(exc, CheckpointWriteError) and exc.errno not in DISK_FIXES:
            raise
        print(disk_error_line(exc, run_dir(cfg), cfg.run.storage), file=sys.stderr, flush=True)
        rc = 1
        return rc
    except StoppedDuringStartUp:
        stopped = True
        raise
    finally:
        # exit 2: a config, data or run-directory error, whose one console line is the whole
        # story (a hang or a crash keeps its folder: the stacks and rank logs are in it); a
        # start stopped before its first step has nothing to keep either
        if (rc == 2 or stopped) and owner and not args.ray and made is not None:
            _remove_if_no_step(run_dir(cfg), made)


def _preflight(cfg, args: argparse.Namespace) -> str | None:
    """The checks that read files and size the machine, after the config's own rules: model.init_from's
    weights (their headers), and whether the run fits here, before anything is allocated or written.
    Raises ConfigError; -> why the run does not fit here, or None. Their modules bring torch (2 s),
    which a config error and a Ray driver (without init_from) do not wait for: imported when they run."""
    if cfg.model.init_from:
        from loomtrain.launcher.checkpoints.weight_source import check_init_from

        check_init_from(cfg)
    if args.ray:  # a cluster that does not answer: one line in seconds, not Ray's endless retries
        _probe_ray(
            cfg.ray.address or os.environ.get("RAY_ADDRESS", ""), "ray.address" if cfg.ray.address else "RAY_ADDRESS"
        )
    if args.ray or args.force:
        return None
    from loomtrain.launcher.planning.fit import check_fits, local_ranks_from_env

    try:
        verdict = check_fits(cfg, env_world_size(), *local_ranks_from_env())
    except ValueError as exc:  # a config the estimate cannot size
        raise ConfigError(str(exc)) from None
    return None if verdict.fits else verdict.message


def _refuse_another_models_checkpoint(cfg, on_ray: bool) -> None:
    """Another model's checkpoint to resume, refused before the process group, the model or a Ray
    worker group exist (their start-up takes minutes for a large model); after the run's claims,
    so that a store that cannot be reached is said once, by run.storage's lease, not waited on twice."""
    if on_ray and not cfg.run.storage:  # a Ray driver's disk is not its workers' (run.storage is theirs)
        return
    from loomtrain.launcher.checkpoints.hook import refuse_another_models_checkpoint

    refuse_another_models_checkpoint(cfg)


def _probe_ray(address: str, what: str) -> None:
    """The probe `preprocess --ray` makes of its address (a TCP connect, then one GCS or Ray Client
    request, each bounded by a few seconds); ConfigError naming the key otherwise. No address: a
    local instance, nothing to probe."""
    if not address:
        return
    from loomtrain.launcher.cluster.preprocess_tasks import probe_ray_address

    try:
        probe_ray_address(address, what)
    except DataError as exc:
        raise ConfigError(str(exc)) from None


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
    from loomtrain.launcher.checkpoints.final import FinalWeightsError
    from loomtrain.launcher.distributed import RendezvousError
    from loomtrain.launcher.training.loop import run_training
    from loomtrain.launcher.training.nonfinite import NonFiniteError

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
    except FinalWeightsError as exc:  # every rank says it: the failing rank's one line
        print(f"loomtrain: final weights not written: {exc}; the run's checkpoints are kept", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # a peer gone mid-collective (gloo): one line naming its host
        line = lost_peer_line(exc, run_dir(cfg))
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return 1
    return exit_code(result.stopped_by)  # SIGTERM: 0; Ctrl-C: 130; SIGHUP: 129


# gloo's words for a peer that went away: "Read error [198.18.0.2]:59535: Connection reset by peer",
# "Connection closed by peer [198.18.0.2]:59535"
_PEER_GONE = (
    re.compile(r"(?:Read|Write) error \[([^\]]+)\]:\d+: (Connection reset by peer|Connection refused|Broken pipe)"),
    re.compile(r"(Connection closed by peer) \[([^\]]+)\]:\d+"),
)


def lost_peer_line(exc: BaseException, run_dir: Path) -> str | None:
    """The one line for a collective that failed because a peer's connection went (its host was
    killed, lost power or left the network), naming that host's address; None for anything else."""
    text = str(exc)
    for i, pattern in enumerate(_PEER_GONE):
        m = pattern.search(text)
        if m:
            addr, cause = (m.group(1), m.group(2)) if i == 0 else (m.group(2), m.group(1))
            return (
                f"loomtrain: lost a host: {addr} ({cause} in a collective): that host or its ranks are gone; "
                f"the ranks' logs are in {run_dir / 'logs'}; run the same command on every host to resume from "
                "the newest checkpoint"
            )
    return None


def disk_error_line(exc: OSError, run_dir: Path, storage: str = "") -> str:
    """A run ended by its disk (or, with `storage` = run.storage, a save to its object store),
    in one line: the file, the cause, the checkpoint that stays `latest` (the newest one saved
    before the failure), and what to do."""
    # an object store that failed mid-save is not asked again (its failure named `latest` already)
    latest = exc.latest if hasattr(exc, "latest") else _latest(storage or run_dir)
    if isinstance(exc, CheckpointWriteError):  # names the checkpoint it was writing and `latest`
        what = str(exc)
    else:
        kept = f"{latest[0]} stays latest" if latest else "no checkpoint was saved yet"
        what = f"{os.fsdecode(exc.filename or run_dir)}: {exc.strerror or exc}; {kept}"  # TensorBoard's are bytes
    # a CheckpointWriteError carries its cause as text ("No space left on device"), not an errno
    code = exc.errno or next((e for e in DISK_FIXES if os.strerror(e) in str(exc)), None)
    if code in DISK_FIXES:
        fix = DISK_FIXES[code]
    elif storage and isinstance(exc, CheckpointWriteError):
        fix = f"check that run.storage={storage} is reachable and writable (endpoint, credentials, bucket)"
    else:
        fix = "check that disk"
    then = f"run the same command to resume from {latest[1]}" if latest else "run the same command to start"
    return f"loomtrain: write error: {what}: {fix}, then {then}"


def _latest(location: Path | str) -> tuple[str, str] | None:
    """(where, name) of the checkpoint the `latest` pointer of a run's checkpoints names
    (RUN_DIR/checkpoints/latest, or the one in run.storage), if any."""
    from loomtrain.launcher.checkpoints.store import CheckpointStore
    from loomtrain.storage import below

    try:
        store = CheckpointStore(location)
        name = store.latest_pointer()
    except (OSError, ValueError):  # the store itself is what failed
        return None
    return (str(below(store.root, name)), name) if name else None
