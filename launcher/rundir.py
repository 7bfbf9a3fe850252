"""Who owns a run directory: a marker that says "loomtrain wrote this", and a lock.

    with claim(run_dir):        # one process per run: global rank 0, or the Ray driver
        ...                      # train

* Marker `RUN_DIR/.loomtrain-run` (JSON): written when a run starts in a new or
  empty folder. A folder without it is refused when it holds anything, so that
  `run.dir=~/thesis` never gets its files mixed with (or moved aside by) a run.
  Runs written before the marker existed are recognised by what loomtrain leaves
  there (checkpoints/, metrics.jsonl, a loomtrain config.yaml, final/model_config.json,
  ray_attempts.jsonl) and adopted.
* Lock `RUN_DIR/.loomtrain.lock` (JSON: pid, host, process start time, start time),
  created with O_EXCL. A second `train` on the same run is refused, naming the pid
  and host that hold it. A lock whose process is gone (same host: pid not running,
  or running but started at another time, i.e. a reused pid) is taken over; one from
  another host cannot be checked from here, so the holder touches the lock every
  HEARTBEAT_S and a lock silent for LEASE_S is taken over (a Kubernetes retry on a fresh
  cluster after the head pod died); until then the message says how to clear it.
  Only one process per run takes it: the Ray driver holds it while Ray restarts its
  worker group, so a restart never meets its own run's lock.

Outputs of an earlier attempt (metrics.jsonl, final/, tb/) are moved aside, never
deleted, when a run starts again from step 0 (`supersede`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from loomtrain.durable import create_durable, naming
from loomtrain.storage import filesystem, listing, location

if TYPE_CHECKING:
    from loomtrain.launcher.config import RunConfig

MARKER = ".loomtrain-run"
LOCK = ".loomtrain.lock"
LEASE = ".loomtrain-lease.json"  # run.storage's owner (launcher/lease.py)
# The lock holder touches the lock every HEARTBEAT_S; a lock from another host that has
# not been touched for LEASE_S (that host or its process died) is taken over.
HEARTBEAT_S = 20.0
LEASE_S = 180.0
# What a run directory of an older loomtrain holds (any one of them adopts the folder).
# (run.storage: checkpoints/, the TensorBoard mirror tb/metrics.jsonl, final/'s manifest)
LEGACY_SIGNS = (
    "checkpoints",
    "metrics.jsonl",
    "final/model_config.json",
    "ray_attempts.jsonl",
    "tb/metrics.jsonl",
    "final/manifest.json",
)
CONFIG_SECTIONS = {"run", "model", "train", "checkpoint"}
# Outputs of an attempt that a fresh start (step 0) would overwrite or mix with its own
# (TensorBoard event files: in RUN_DIR itself, or tb/ in older runs). Per-rank logs and
# ray_attempts.jsonl are histories of every attempt and stay.
OUTPUTS = ("metrics.jsonl", "final", "tb", "events.out.tfevents.*")


class RunDirError(ValueError):
    """The run directory is not ours to use (one line: the path, who holds it, what to do)."""


# ------------------------------------------------------------------ paths


def local_path(path: str | os.PathLike) -> Path:
    """A local folder as the user wrote it (run.dir, data.cache_dir): `~` expanded, a relative
    path left relative to the working directory. Every path under a run starts here, so that
    `run.dir=~/x` never makes a folder named `~` in the working directory."""
    return Path(os.path.expanduser(os.fspath(path)))


def run_dir(cfg: RunConfig) -> Path:
    """RUN_DIR: run.dir, `~` expanded (logs, heartbeats, checkpoints, final/, TensorBoard)."""
    return local_path(cfg.run.dir)


def checkpoint_location(cfg: RunConfig) -> Path | str:
    """Where a run's checkpoints live (checkpoints/ below it): run.storage when it is set (an
    object-store URI that every host reaches), else RUN_DIR."""
    return cfg.run.storage.rstrip("/") if cfg.run.storage else run_dir(cfg)


def data_cache_dir(cfg: RunConfig) -> Path:
    """Where the embedded corpus' shards are cached: data.cache_dir, else .data_cache beside
    RUN_DIR (shared by the runs in the same folder, so each tokenizes the corpus once)."""
    if cfg.data.cache_dir:
        return local_path(cfg.data.cache_dir)
    return run_dir(cfg).absolute().parent / ".data_cache"


# ------------------------------------------------------------------ marker


def _loomtrain_config(path: Path) -> bool:
    try:
        from omegaconf import OmegaConf

        keys = set(OmegaConf.load(path).keys())
    except Exception:
        return False
    return CONFIG_SECTIONS <= keys


# A run directory (a Path) and run.storage (a URI: its prefix) are checked by the same rules,
# through one storage.location each.
def is_loomtrain_run(where: Path | str) -> bool:
    """Does a run directory, or run.storage's prefix, hold a loomtrain run (its marker, or what
    an older loomtrain left there)?"""
    objs = location(where, "run.storage")
    if any(objs.exists(sign) for sign in (MARKER, *LEGACY_SIGNS)):
        return True
    return objs.local and (objs.root / "config.yaml").is_file() and _loomtrain_config(objs.root / "config.yaml")


def check_marker(where: Path | str, what: str = "run.dir") -> None:
    """Refuse a folder (run.dir) or a prefix (run.storage, `what`) that holds files but is no
    loomtrain run (writes nothing)."""
    objs = location(where, what)
    if objs.local:
        where = Path(where)
        if not where.exists():
            return
        if not where.is_dir():
            raise RunDirError(f"{what}={where}: exists and is not a directory")
    entries = sorted(n for n in objs.entries() if n not in (LOCK, LEASE))  # the lock and lease aside
    if entries and not is_loomtrain_run(where):
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        kind = "folder" if objs.local else "prefix"
        raise RunDirError(
            f"{what}={where}: not a loomtrain run {'directory' if objs.local else kind} (it holds {len(entries)} "
            f"{'entry' if len(entries) == 1 else 'entries'}: {shown}, "
            f"and no {MARKER}); pick a new or empty {kind}, e.g. {what}={str(where).rstrip('/')}/run"
        )


def write_marker(where: Path | str) -> None:
    record = json.dumps({"format": 1, "created": time.time(), "host": socket.gethostname()}) + "\n"
    objs = location(where, "run.storage")
    if not objs.exists(MARKER):
        objs.replace(MARKER, record.encode())


# ------------------------------------------------------------------ lock


def _process_start(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # gone, or not ours to inspect
        return None


def _alive(pid: int, started: float | None) -> bool:
    """Is the process that wrote a lock on this host still running?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now_started = _process_start(pid)  # another start time: the pid was reused by another process
    return started is None or now_started is None or abs(now_started - started) <= 1.0


def _read_lock(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # half-written or garbled: treated as held by an unknown process


def _describe(holder: dict) -> str:
    since = holder.get("time")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if since else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"


def _fs_now(folder: Path) -> float:
    """'Now' by the clock that stamps files in `folder` (a shared filesystem's server may
    disagree with this host's clock): the mtime of a probe file written there."""
    probe = folder / f"{LOCK}.probe-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        return probe.stat().st_mtime
    except OSError:
        return time.time()
    finally:
        probe.unlink(missing_ok=True)


class RunLock:
    def __init__(self, run_dir: Path, log=None):
        self.run_dir = run_dir
        self.path = run_dir / LOCK
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "process_start": _process_start(os.getpid()),
            "time": time.time(),
            "argv": " ".join(sys.argv)[:500],
        }
        self.held = False

    def acquire(self) -> None:
        for _ in range(5):  # O_EXCL create; on a stale lock, move it away and try again
            # A read-only or full disk fails here as an OSError naming the lock (the command's
            # one line for a disk error); a lock left half-written is removed (create_durable).
            with naming(self.path):
                created = create_durable(self.path, (json.dumps(self.record) + "\n").encode())
            if not created:
                self._handle_existing()
                continue
            self.held = True
            self._start_heartbeat()
            return
        raise RunDirError(f"run.dir={self.run_dir}: could not take {self.path} (another start is racing for it)")

    def _handle_existing(self) -> None:
        holder = _read_lock(self.path)
        if holder is None:
            return  # released meanwhile
        host = socket.gethostname()
        if holder.get("host") == host:
            pid = holder.get("pid")
            if isinstance(pid, int) and not _alive(pid, holder.get("process_start")):
                return self._take_over(holder, "that process is gone")
            raise RunDirError(
                f"run.dir={self.run_dir} is in use by another loomtrain run ({_describe(holder)}; lock "
                f"{self.path}); wait for it to finish or stop it, or pick another run.dir"
            )
        # Another host's process cannot be checked from here; its heartbeat can.
        try:
            silent = _fs_now(self.run_dir) - self.path.stat().st_mtime
        except FileNotFoundError:
            return
        if silent > LEASE_S:
            return self._take_over(holder, f"no heartbeat for {silent:.0f} s")
        raise RunDirError(
            f"run.dir={self.run_dir} is locked by {_describe(holder)}, last heartbeat {max(silent, 0):.0f} s "
            f"ago (lock {self.path}); that host cannot be checked from {host}: if no run is alive there, "
            f"delete {self.path}, or start again after {LEASE_S} s without a heartbeat"
        )

    def _take_over(self, holder: dict, why: str) -> None:
        """Move a dead holder's lock aside (only one of several racing starts wins the rename)."""
        stale = self.path.with_name(f"{LOCK}.stale-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(self.path, stale)
        except FileNotFoundError:
            return
        stale.unlink(missing_ok=True)
        self.log(f"loomtrain: took over the lock of {self.run_dir} from {_describe(holder)} ({why})")

    def _start_heartbeat(self) -> None:
        """Touch the lock every HEARTBEAT_S while held: a run on another host can then tell
        a live holder from one whose host died (no heartbeat for LEASE_S)."""
        self._stop = threading.Event()

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                holder = _read_lock(self.path)
                if not holder or holder.get("pid") != self.record["pid"] or holder.get("host") != self.record["host"]:
                    return  # no longer ours (deleted by hand, taken over): leave it alone
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        threading.Thread(target=beat, name="loomtrain-run-lock-heartbeat", daemon=True).start()

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._stop.set()
        holder = _read_lock(self.path)
        if holder and holder.get("pid") == self.record["pid"] and holder.get("host") == self.record["host"]:
            # a read-only run directory: the lock stays, and names a process that is gone once
            # this one exits, so the next start on this host takes it over
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def claim(run_dir: str | os.PathLike, log=None) -> Iterator[RunLock]:
    """Check the marker, take the lock, write the marker; release the lock on the way out."""
    run_dir = local_path(run_dir)
    check_marker(run_dir)
    # A read-only or full disk: an OSError naming the folder or file (one line in the command).
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir, log=log)
    lock.acquire()
    try:
        check_marker(run_dir)  # a folder filled between the check and the lock
        write_marker(run_dir)
        yield lock
    finally:
        lock.release()


# ------------------------------------------------------------------ fresh starts


def superseded_name() -> str:
    """The folder (or prefix) under checkpoints/ that a fresh start moves an earlier run into."""
    return time.strftime("superseded-%Y%m%d-%H%M%S")


def _outputs(where: Path | str) -> list[str]:
    """The entries directly under `where` that OUTPUTS names, sorted; an empty file is none."""
    found = []
    for name, info in listing(*filesystem(where), recursive=False).items():  # (listing strips a trailing /)
        empty = info.get("type", "file") == "file" and not int(info.get("size") or 0)
        if not empty and any(fnmatch.fnmatchcase(name, p) for p in OUTPUTS):
            found.append(name)
    return sorted(found)


def supersede(where: Path | str, name: str, log) -> Path | str | None:
    """Move an earlier attempt's outputs (OUTPUTS) in a run directory, or in run.storage (a URI:
    final/ and the tb/ mirror with its metrics.jsonl), into WHERE/checkpoints/NAME (a
    superseded-TIME name: the caller picks one for both places). Nothing is deleted: an object
    store's move copies first (the backend's move_aside)."""
    found = _outputs(where)
    if not found:
        return None
    dest = location(where).move_aside(found, f"checkpoints/{name}")
    log(f"checkpoint: fresh start: moved the earlier {', '.join(found)} to {dest}")
    return dest
