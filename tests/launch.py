"""Launching `loomtrain` as a user does, in a child process, and the shrunk configs those runs use.

    proc = run_loomtrain("train", TINY, *SMALL, *QUIET, f"run.dir={run}", cwd=tmp_path)
    with Run(loomtrain_cmd("train", ..., nproc=2), cwd=tmp_path, run_dir=run) as run:
        run.wait_for(lambda line: line.startswith("step 3/"), timeout=300)

Every child gets `child_env()`: this process's environment without what an in-process run
or another test left in it (a torch.distributed rendezvous would make the child join a group
that is gone, RAY_ADDRESS a cluster it was not given, a LOOMTRAIN_PLUGIN or LOOMTRAIN_TEST_*
fault would strike a run that did not ask for it), plus the CPU settings every test run wants: DeepSpeed's CPU
accelerator, one OpenMP thread per rank (2 shared cores), no tokenizers thread pool.
More than one rank runs under torchrun `--standalone`, which binds a free port itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fault_plugin
from small_configs import QUICK, QUIET, ROOT, SMALL, SMALL_MODEL, SMALLEST, TINY  # noqa: F401 (the tests' names for them)

# The TensorBoard scalars every training run writes (metrics.jsonl has the same under plain
# keys, memory in bytes where TensorBoard has GiB).
TB_SCALARS = {
    "loss/train",
    "train/lr",
    "train/grad_norm",
    "perf/tokens_per_s",
    "perf/mfu",
    "perf/step_time_s",
    "memory/mem_gib",
}
# ... and the job-wide rank figures, which TensorBoard gets only from a run of several ranks.
TB_RANK_SCALARS = {
    "perf/step_time_max_s",
    "perf/step_time_min_s",
    "perf/step_time_median_s",
    "perf/slowest_rank",
    "perf/data_wait_max_s",
    "memory/mem_gib_max",
    "memory/mem_rank_max",
}

NOT_INHERITED = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RAY_ADDRESS",
}


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a launched run (see the module docstring); `extra` is added last.
    LOOMTRAIN_TEST_FAULTS=SPEC plans test faults: the fault plugin and its plan (tests/fault_plugin.py)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in NOT_INHERITED and not k.startswith(("LOOMTRAIN_TEST_", "LOOMTRAIN_PLUGIN"))
    }
    if "LOOMTRAIN_TEST_FAULTS" in extra:
        extra.update(fault_plugin.env(extra.pop("LOOMTRAIN_TEST_FAULTS")))
    return {**base, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def python_cmd(*argv, nproc: int = 1) -> list[str]:
    """`python ARGV` (a script and its arguments, or `-m MODULE ...`), or the same under
    torchrun with `nproc` ranks on this host."""
    if nproc == 1:
        head = [sys.executable]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [*head, *map(str, argv)]


def loomtrain_cmd(*args, nproc: int = 1) -> list[str]:
    """`python -m loomtrain ARGS`, or under torchrun with `nproc` ranks."""
    return python_cmd("-m", "loomtrain", *args, nproc=nproc)


def run_child(
    argv: list[str],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    rc: int | None = 0,
) -> subprocess.CompletedProcess:
    """Run `argv` to its end with `child_env()` (or `env`), output captured, in `cwd` (default:
    this process's, which is each test's own empty folder, see tests/conftest.py); with `rc`
    (default 0), assert the exit status, showing the output's tail when it differs."""
    proc = subprocess.run(
        argv, cwd=cwd, env=child_env() if env is None else env, capture_output=True, text=True, timeout=timeout
    )
    if rc is not None:
        assert proc.returncode == rc, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    return proc


def run_loomtrain(*args, nproc: int = 1, **how) -> subprocess.CompletedProcess:
    """`loomtrain ARGS` (under torchrun with `nproc` > 1) through `run_child(..., **how)`."""
    return run_child(loomtrain_cmd(*args, nproc=nproc), **how)


def run_variants(driver: str, out: Path, common: list[str], by_ranks: dict[int, dict], timeout: float = 900) -> Path:
    """tests/DRIVER (zero_driver.py, lora_driver.py) launched once per rank count of `by_ranks`
    (one process, or torchrun of N): each of its variants (name -> overrides on TINY and `common`)
    trained in turn into out/NAME, all sharing one data cache; -> out."""
    for nproc, variants in by_ranks.items():
        argv = [ROOT / "tests" / driver, out, TINY, "--common", *common, f"data.cache_dir={out / 'cache'}"]
        for name, overrides in variants.items():
            argv += ["--variant", name, *overrides]
        run_child(python_cmd(*argv, nproc=nproc), timeout=timeout)
    return out


def train_here(run: Path, data_cache: Path, *extra: str, rc: int = 0) -> str:
    """`loomtrain train` on TINY with QUICK in this process (the CLI's main: run-dir claim, storage
    lease, loop), its console output, after checking its exit status."""
    import contextlib
    import io

    from loomtrain.launcher.cli import train as train_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        got = train_cli.main([str(TINY), *QUICK, f"run.dir={run}", f"data.cache_dir={data_cache}", *extra])
    assert got == rc, out.getvalue()[-4000:]
    return out.getvalue()


def poll(get, done=bool, timeout_s: float = 10.0, every_s: float = 0.1):
    """get() once done(get()) holds, or its last value after timeout_s: for what a background
    thread or another process does in its own time (the assertion after it says what is wrong)."""
    deadline = time.monotonic() + timeout_s
    while not done(value := get()) and time.monotonic() < deadline:
        time.sleep(every_s)
    return value


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def one_line(err: str) -> str:
    """The one line an error printed (asserting it is one, and no traceback)."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


class Run:
    """A run in a child process whose output (stdout + stderr) is read line by line; use it as a
    context manager so that the child, and the ranks torchrun started, never outlive the test."""

    def __init__(
        self, argv: list[str], cwd: Path, env: dict[str, str] | None = None, run_dir: Path | None = None
    ) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            argv,
            env=child_env() if env is None else env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def wait_for(self, predicate, timeout: float) -> str:
        """Read lines until one satisfies `predicate` (a str: that text in the line); return it."""
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            if predicate in line if isinstance(predicate, str) else predicate(line):
                return line
            assert time.monotonic() < deadline, "".join(self.lines[-60:])
        raise AssertionError("ended before the awaited line:\n" + "".join(self.lines[-60:]))

    def finish(self, timeout: float) -> int:
        """Read the rest of the output and wait for the exit status."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
            self.lines += out.splitlines(keepends=True)
        finally:
            self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # this run's own process group only
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        for pid in self.rank_pids():  # torchrun starts each rank in a session of its own
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def rank_pids(self) -> list[int]:
        """The pids of this run's ranks, from their heartbeat files."""
        beats = self.run_dir / "logs" / "heartbeats" if self.run_dir else None
        if beats is None or not beats.is_dir():
            return []
        return [json.loads(p.read_text())["pid"] for p in sorted(beats.glob("rank_*.json"))]

    @property
    def text(self) -> str:
        return "".join(self.lines)


def checkpoint_saved_on_signal(lines: list[str], run_dir: Path) -> int:
    """The step of the one checkpoint a run saved on SIGTERM (its `[SIGTERM]` line), which is
    the run's latest."""
    saved = [line for line in lines if "[SIGTERM]" in line]
    assert len(saved) == 1, "".join(lines)[-3000:]
    step = int(saved[0].split("checkpoint: step ")[1].split()[0])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
    return step


def records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one dict per line."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> training loss, from the run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}
