"""Hang detection: a watchdog thread per rank, heartbeats in RUN_DIR, one line that names the stuck rank.

Each rank runs `Watchdog` (a daemon thread). The loop announces what the rank is doing,
and each phase has its own allowance (`Allowances`, from the config: loomtrain.launcher.timeouts):

    phase           allowance                                              knob
    start-up        the first step of an attempt: 3 x parallel.timeout_s   parallel.startup_timeout_s
    training step   parallel.timeout_s                                     parallel.timeout_s
    evaluation      timeout_s + eval.batches x one forward pass            parallel.forward_timeout_s
    samples         timeout_s + eval.sample_tokens x one forward pass      (0: timeout_s / 3)
    checkpoint I/O  checkpoint.timeout_s (`io_phase`)                      checkpoint.timeout_s

plus, with parallel.compile, parallel.compile_timeout_s the first time a phase runs in the
process (torch.compile compiles the training step, the no-grad forward and sampling's
shapes once). Announcing is attribute writes on the loop's thread: `beat(step)` after every
step, `with phase("evaluation"):` around a phase, `io_phase(...)` around checkpoint I/O
(a slow save is not a hang, and a hang is not excused as a save). No collective, no
device sync. The time spent in announced phases (`outside_steps_s`) is what the loop
leaves out of a step's time for tok/s. Every `interval` seconds the thread writes this rank's heartbeat,
RUN_DIR/logs/heartbeats/rank_NNNNN.json: host, pid, last completed step, phase and its
allowance, the function its main thread is in, and a beat counter.

When a rank has made no progress for its phase's allowance, its watchdog

1. dumps every thread's Python stack (faulthandler) into its rank log;
2. probes the master (a TCP connect to MASTER_ADDR:MASTER_PORT, PROBE_TIMEOUT_S) and
   records in its heartbeat whether it got an answer;
3. keeps beating for two intervals (longer while a live rank has not probed yet) and
   reads every rank's heartbeat twice: a rank whose beat counter did not move is
   stopped, dead or wedged (its watchdog cannot run); the stuck ranks are those, else
   the ranks that cannot reach the master while others can (a network partition: every
   rank is alive and waits in a collective, and only the probe tells the sides apart),
   else the ranks behind the others' step, else the ranks not waiting in a collective;
4. on the lowest live rank, prints one line (console, its log and rank 0's log):
   `loomtrain: hang: rank N (host H, pid P) did not reach step S (in PHASE, allowed X s:
   KNOB); ranks ... waited in FUNCTION; stacks in RUN_DIR/logs/`, records it in
   RUN_DIR/logs/hang.json (the next Ray attempt says why the previous one ended), and
   SIGKILLs stuck ranks on its own host that no longer beat (a stopped process would
   otherwise hold the launcher's shutdown for its SIGTERM grace);
5. ends its process with exit status HANG_EXIT_CODE.

The process group's own timeout is set HANG_REPORT_MARGIN_S above the longest allowance
(loomtrain.launcher.timeouts, loomtrain.launcher.distributed), so this report comes before a library traceback, and a
rank waiting in a collective for a peer's long phase is not cut off by the library first.
Heartbeats are files (not the torch.distributed store) because the store lives in
one process, which may be the stuck one; RUN_DIR is shared by all ranks anyway.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from loomtrain.durable import atomic_write
from loomtrain.launcher.observe.ranklog import logs_dir, rank_log_path
from loomtrain.launcher.timeouts import EVALUATION, SAMPLES, START_UP, STEP, Allowances

HANG_EXIT_CODE = 3
PROBE_TIMEOUT_S = 3.0  # a host cut off never answers; one on the network answers in milliseconds

# A rank waits in a collective when the function it is in (the innermost, not its caller in
# loomtrain) has one of these among the "_"-separated words of its name: "gather" covers
# all_gather_into_tensor, "wait" is a whole word (not "await", "waiting").
COLLECTIVE_CALLS = ("all_reduce", "broadcast", "barrier", "reduce_scatter", "wait", "report", "gather", "send", "recv")

_current: Watchdog | None = None


def heartbeat_path(run_dir, rank: int) -> Path:
    return logs_dir(run_dir) / "heartbeats" / f"rank_{rank:05d}.json"


def where(thread_id: int) -> str:
    """The function a thread is in now, e.g. 'all_reduce (from dp_reduce, loop.py:62)'."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "?"
    inner, ours = frame.f_code.co_name, None
    while frame is not None:
        if "loomtrain" in frame.f_code.co_filename or "/launcher/" in frame.f_code.co_filename:
            ours = f"{frame.f_code.co_name}, {Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
            break
        frame = frame.f_back
    return inner if ours is None or ours.startswith(inner + ",") else f"{inner} (from {ours})"


def reaches(address: str | None, timeout: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether a TCP connect to `address` (host:port) gets an answer; None without an address.

    Accepted or refused, the host answered, so the network path is there; a timeout or
    "no route" is what a rank on the far side of a partition sees."""
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def io_phase(name: str):
    """Around checkpoint I/O: the limit is checkpoint.timeout_s, and finishing is progress."""
    dog = _current
    with dog.phase(name) if dog is not None else contextlib.nullcontext():
        yield


class Watchdog:
    def __init__(
        self,
        run_dir,
        rank: int,
        world_size: int,
        allow: Allowances,
        rank_log=None,
        host: str | None = None,
        master: str | None = None,
    ) -> None:
        """`host`: this rank's host as the report names it (DistEnv.host); `master`: the
        MASTER_ADDR:MASTER_PORT a hung rank probes to tell a partition from a stuck peer."""
        self.run_dir, self.rank, self.world_size = Path(run_dir), rank, world_size
        self.allow = allow
        self.interval = min(5.0, max(0.5, allow.step / 10))
        self.rank_log = rank_log
        self.host, self.pid = host or socket.gethostname(), os.getpid()
        self.master = master
        self.reaches_master: bool | None = None  # probed once a hang is suspected
        self.step = 0
        self.ran: set[str] = set()  # the phases run once in this process (compiled by now)
        self.phase_name, self.limit, self.knob = self._allowance(START_UP)
        self.progress_at = time.monotonic()
        self.outside_steps_s = 0.0  # time in announced phases other than steps (not training time)
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loomtrain-watchdog", daemon=True)
        self._main = threading.current_thread().ident  # the training thread (not main under Ray)
        self.exit = os._exit  # a seam for unit tests

    def _allowance(self, phase: str) -> tuple[str, float, str]:
        """(phase, allowance, knob), the compile allowance added the first time a phase that
        torch.compile compiles code for runs (the training step's is start-up; I/O compiles nothing)."""
        limit, knob = self.allow.limit(phase)
        if self.allow.compile and phase in (START_UP, EVALUATION, SAMPLES) and phase not in self.ran:
            self.ran.add(phase)
            limit, knob = limit + self.allow.compile, f"{knob} + parallel.compile_timeout_s"
        return phase, limit, knob

    # --- called by the loop (main thread): attribute writes only ----------------------
    def beat(self, step: int) -> None:
        """Step `step` is done; the next one is a training step (the first, start-up, compiled it)."""
        self.step = step
        self.phase_name, self.limit, self.knob = self._allowance(STEP)
        self.progress_at = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str):
        """The rank is in phase `name` until the block ends: its allowance (a name that
        timeouts.Allowances does not know is checkpoint-like I/O), and ending it is progress."""
        before = (self.phase_name, self.limit, self.knob)
        self.phase_name, self.limit, self.knob = self._allowance(name)
        start = self.progress_at = time.monotonic()
        outermost = before[0] in (STEP, START_UP)
        try:
            yield
        finally:
            self.phase_name, self.limit, self.knob = before
            self.progress_at = time.monotonic()
            if outermost:
                self.outside_steps_s += self.progress_at - start

    def start(self) -> Watchdog:
        global _current
        self._write_heartbeat()
        self._thread.start()
        _current = self
        return self

    def stop(self) -> None:
        global _current
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 1)
        if _current is self:
            _current = None

    # --- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with contextlib.suppress(OSError):  # a full or read-only run.dir: the training thread says so, once
                    self._write_heartbeat()
                if time.monotonic() - self.progress_at > self.limit:
                    self._on_hang()
            except Exception as exc:  # the watchdog must never be what kills a run
                print(f"loomtrain: watchdog error on rank {self.rank}: {exc!r}", file=sys.stderr, flush=True)

    def _record(self, hung: bool = False) -> dict:
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "step": self.step,
            "phase": self.phase_name,
            "allowed_s": self.limit,
            "knob": self.knob,
            "where": where(self._main),
            "beats": self.beats,
            "hung": hung,
            "reaches_master": self.reaches_master,
            "time": time.time(),
        }

    def _write_heartbeat(self, hung: bool = False) -> None:
        self.beats += 1
        path = heartbeat_path(self.run_dir, self.rank)
        # Atomic (a reader never sees half a record) but not fsynced: liveness, written often.
        atomic_write(path, json.dumps(self._record(hung)), fsync=False)

    def _read_all(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world_size):
            with contextlib.suppress(OSError, ValueError):
                out[r] = json.loads(heartbeat_path(self.run_dir, r).read_text())
        return out

    def _on_hang(self) -> None:
        reported_after = time.time() - self.interval  # a report of this hang, not an earlier one's
        waited = time.monotonic() - self.progress_at
        func = where(self._main)
        self._log(
            f"loomtrain: watchdog: rank {self.rank} made no progress for {waited:.0f} s "
            f"(limit {self.limit:.0f} s) after step {self.step}, in {self.phase_name}, waiting in {func}; "
            f"all threads' stacks:"
        )
        self._dump_stacks()
        self.reaches_master = reaches(self.master)
        self._write_heartbeat(hung=True)
        first = self._read_all()
        # Two intervals at least; longer (up to a probe's timeout more) while a live rank's
        # probe result is not in yet, since the others' watchdogs fire a little later.
        deadline = time.monotonic() + 2 * (self.interval + 0.2) + PROBE_TIMEOUT_S
        for rounds in itertools.count():
            time.sleep(self.interval + 0.2)
            self._write_heartbeat(hung=True)
            second = self._read_all()
            stale = {
                r
                for r in range(self.world_size)
                if r not in second or (r in first and first[r].get("beats") == second[r].get("beats"))
            }
            stale.discard(self.rank)
            live = [r for r in range(self.world_size) if r not in stale]
            probed = self.master is None or all(second[r].get("reaches_master") is not None for r in live)
            if rounds >= 1 and (probed or time.monotonic() > deadline):
                break
        cut_off = _cut_off(second, live)
        stuck = sorted(stale) or cut_off or _behind(second, live) or _not_in_collective(second, live) or live
        line = _hang_line(
            self.run_dir,
            stuck,
            [r for r in live if r not in stuck],
            second,
            master=self.master if cut_off and stuck == cut_off else None,
        )
        if live and live[0] == self.rank:
            print(line, file=sys.stderr, flush=True)
            if self.rank != 0:
                with contextlib.suppress(OSError), open(rank_log_path(self.run_dir, 0), "a") as f:
                    f.write(line + "\n")
            with contextlib.suppress(OSError):
                record = {"line": line, "time": time.time(), "stuck": stuck}
                atomic_write(logs_dir(self.run_dir) / "hang.json", json.dumps(record) + "\n", fsync=False)
            self._kill_local(stale, second)
        else:
            self._log(line)
            # Not before the reporter has written the line: this exit breaks the collectives the
            # reporter's own training thread waits in, which would then end its process first.
            self._await_report(since=reported_after, bound=2 * self.interval + PROBE_TIMEOUT_S)
        if self.rank_log is not None:
            self.rank_log.close()
        self.exit(HANG_EXIT_CODE)

    def _await_report(self, since: float, bound: float) -> None:
        """Until RUN_DIR/logs/hang.json holds a report made after `since` (at most `bound` s)."""
        path, deadline = logs_dir(self.run_dir) / "hang.json", time.monotonic() + bound
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(path.read_text()).get("time", 0) >= since:
                    return
            time.sleep(0.2)

    def _log(self, text: str) -> None:
        if self.rank_log is not None:
            self.rank_log.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def _dump_stacks(self) -> None:
        if self.rank_log is not None and not self.rank_log.file.closed:
            self.rank_log.file.flush()
            faulthandler.dump_traceback(file=self.rank_log.file, all_threads=True)
            self.rank_log.file.flush()
        else:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def _kill_local(self, stale: set[int], beats: dict[int, dict]) -> None:
        for r in stale:
            rec = beats.get(r)
            if rec and rec.get("host") == self.host and rec.get("pid") not in (None, self.pid):
                with contextlib.suppress(OSError):
                    os.kill(int(rec["pid"]), signal.SIGKILL)


def _cut_off(beats: dict[int, dict], live: list[int]) -> list[int]:
    """The live ranks that could not reach the master while other live ranks could."""
    answers = {r: beats[r].get("reaches_master") for r in live if r in beats}
    if True not in answers.values():
        return []
    return sorted(r for r, ok in answers.items() if ok is False)


def _behind(beats: dict[int, dict], live: list[int]) -> list[int]:
    steps = {r: beats[r]["step"] for r in live if r in beats}
    if not steps or len(set(steps.values())) == 1:
        return []
    low = min(steps.values())
    return sorted(r for r, s in steps.items() if s == low)


def _not_in_collective(beats: dict[int, dict], live: list[int]) -> list[int]:
    return sorted(r for r in live if r in beats and not in_collective(beats[r].get("where", "")))


def in_collective(where: str) -> bool:
    """Whether a heartbeat's `where` ('all_reduce (from dp_reduce, loop.py:62)') is in a collective call."""
    words = f"_{where.split(' ', 1)[0]}_"  # the innermost function, its words between underscores
    return any(f"_{call}_" in words for call in COLLECTIVE_CALLS)


def _hang_line(
    run_dir: Path, stuck: list[int], waiting: list[int], beats: dict[int, dict], master: str | None = None
) -> str:
    """The one line; with `master`, the stuck ranks are the ones cut off from it."""

    def who(r: int) -> str:
        rec = beats.get(r, {})
        return f"rank {r} (host {rec.get('host', '?')}, pid {rec.get('pid', '?')})"

    # The step the waiting ranks are in (a stopped rank's own heartbeat may predate its last steps).
    done = [beats[r]["step"] for r in waiting if r in beats] or [beats.get(r, {}).get("step", 0) for r in stuck]
    step = min(done, default=0) + 1
    places: dict[str, list[int]] = {}
    for r in waiting:
        places.setdefault(beats.get(r, {}).get("where", "?"), []).append(r)
    waited = (
        "; ".join(f"ranks {', '.join(map(str, rs))} waited in {f}" for f, rs in places.items())
        or "no other rank was waiting"
    )
    cut = _phases(stuck, beats, step)
    if master:
        hosts = sorted({beats.get(r, {}).get("host", "?") for r in stuck})
        cut += f", cut off: host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)} cannot reach the master {master}"
    return (
        f"loomtrain: hang: {', '.join(who(r) for r in stuck)} did not reach step {step}{cut}; {waited}; "
        f"stacks in {logs_dir(run_dir)}/"
    )


def _phases(stuck: list[int], beats: dict[int, dict], step: int) -> str:
    """' (in PHASE, allowed X s: KNOB)' for the stuck ranks' phase; per rank where they differ. A
    rank stopped between two heartbeats left one from before its last steps (a tiny step is
    shorter than the interval): a phase from before step - 1 is not named, it would be stale."""

    def phase(r: int) -> str:
        rec = beats.get(r, {})
        allowed = rec.get("allowed_s")
        limit = "" if allowed is None else f", allowed {allowed:.0f} s: {rec.get('knob', '?')}"
        return f"{rec.get('phase', '?')}{limit}"

    # A rank with no heartbeat at all (it never started its watchdog) has no phase to name.
    each = {r: phase(r) for r in stuck if "phase" in beats.get(r, {}) and beats[r].get("step", 0) >= step - 1}
    if not each:
        return ""
    if len(set(each.values())) == 1 and len(each) == len(stuck):
        return f" (in {next(iter(each.values()))})"
    return " (" + "; ".join(f"rank {r} in {p}" for r, p in each.items()) + ")"
