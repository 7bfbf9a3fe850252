"""Run-directory ownership and resume rules, through `loomtrain train` where it matters:

* a second `train` on a run directory in use is refused, naming pid and host; the
  lock of a dead process is taken over; one from another host says how to clear it;
* a folder that is not a loomtrain run is refused (nothing written); runs from
  before the marker existed still resume;
* a refused resume (another model shape) changes no file;
* checkpoint.resume=never moves the earlier checkpoints, metrics and final weights aside;
* checkpoint.resume=PATH seeds only the first start; later starts use the run's own;
* checkpoints that all fail verification stop the run (one line naming each), no
  silent restart at step 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import launch
import pytest
from launch import Run, loomtrain_cmd, records
from loomtrain.launcher import rundir
from loomtrain.launcher.rundir import LOCK, MARKER, RunDirError, claim

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = str(launch.TINY)
SMALL = [
    *launch.SMALLEST,
    "train.warmup_steps=1",
    "data.max_files=20",
    "data.val_fraction=0.1",
    *launch.QUIET,
]


def train(run: Path, data_cache: Path, *extra: str, rc: int = 0) -> str:
    """`loomtrain train` in this process (the CLI's main: run-dir claim, config, loop)."""
    import contextlib
    import io

    from loomtrain.launcher.cli import train as train_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        got = train_cli.main([TINY, *SMALL, f"run.dir={run}", f"data.cache_dir={data_cache}", *extra])
    text = out.getvalue() + err.getvalue()
    assert got == rc, text[-4000:]
    return text


def error_lines(out: str) -> list[str]:
    assert "Traceback" not in out, out[-3000:]
    return [line for line in out.splitlines() if line.startswith("loomtrain: ") and "error" in line]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root -> sha256 (directories as names), for 'changes no file'.
    logs/ is left out: the per-rank logs record every attempt, a refused one included."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel == "logs" or rel.startswith("logs/"):
            continue
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def steps_of(run: Path) -> list[int]:
    return [r["step"] for r in records(run) if "loss" in r]


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_cache) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 and final weights."""
    run = tmp_path_factory.mktemp("base") / "run"
    train(run, data_cache, "train.max_steps=4", "checkpoint.every_steps=2")
    assert (run / MARKER).is_file() and not (run / LOCK).exists()
    return run


# ---------------------------------------------------------------- lock


@pytest.mark.slow
def test_second_train_on_a_run_in_use_is_refused_and_a_dead_holder_is_taken_over(tmp_path, data_cache, base):
    run = tmp_path / "run"  # (base: the data cache is ready, the holder starts training at once)
    argv = ["train", TINY, *SMALL, f"run.dir={run}", f"data.cache_dir={data_cache}"]
    extra = ["train.max_steps=1000000", "log.every_steps=1", "checkpoint.every_steps=0"]
    with Run(loomtrain_cmd(*argv, *extra), cwd=tmp_path) as first:
        first.wait_for(lambda line: line.startswith("step 1/"), timeout=240)  # running: it holds the lock
        out = train(run, data_cache, "train.max_steps=2", rc=2)
        (line,) = error_lines(out)
        pid = first.proc.pid
        assert "is in use by another loomtrain run" in line and f"pid {pid} on host {socket.gethostname()}" in line
        first.proc.send_signal(signal.SIGKILL)  # dies holding the lock
        first.proc.wait(timeout=60)
    assert json.loads((run / LOCK).read_text())["pid"] == pid
    killed_metrics = (run / "metrics.jsonl").read_text()
    out = train(run, data_cache, "train.max_steps=2")
    assert f"took over the lock of {run} from pid {pid}" in out
    assert not (run / LOCK).exists() and steps_of(run) == [1, 2]
    # no checkpoint to resume: a fresh start, and the killed attempt's metrics are kept aside
    (aside,) = (run / "checkpoints").glob("superseded-*")
    assert (aside / "metrics.jsonl").read_text() == killed_metrics and killed_metrics


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_rules_in_process(tmp_path):
    run = tmp_path / "run"
    logs: list[str] = []
    with claim(run, log=logs.append):
        held = json.loads((run / LOCK).read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        with pytest.raises(RunDirError, match=rf"in use by another loomtrain run \(pid {os.getpid()} on host"):
            with claim(run):
                pass
    assert not (run / LOCK).exists() and (run / MARKER).is_file()
    # a dead process on this host; a live pid that now belongs to another process
    for record in (
        {"pid": _dead_pid(), "host": socket.gethostname()},
        {"pid": os.getpid(), "host": socket.gethostname(), "process_start": 1.0},
    ):
        (run / LOCK).write_text(json.dumps(record))
        with claim(run, log=logs.append):
            assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
        assert "that process is gone" in logs[-1]
    # another host cannot be checked from here: say how to clear it, while it has a heartbeat
    (run / LOCK).write_text(json.dumps({"pid": 1, "host": "node-elsewhere-7"}))
    with pytest.raises(RunDirError, match=rf"pid 1 on host node-elsewhere-7, last heartbeat .*delete {run / LOCK}"):
        with claim(run):
            pass
    assert (run / LOCK).exists()  # not ours: left alone
    # ... and take it over once its heartbeat is older than the lease (that host died)
    old = time.time() - rundir.LEASE_S - 60
    os.utime(run / LOCK, (old, old))
    with claim(run, log=logs.append):
        pass
    assert "from pid 1 on host node-elsewhere-7" in logs[-1] and "no heartbeat for" in logs[-1]


def test_the_holder_keeps_its_lock_alive(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.05)
    run = tmp_path / "run"
    with claim(run):
        old = time.time() - 1000
        os.utime(run / LOCK, (old, old))
        deadline = time.time() + 10
        while (run / LOCK).stat().st_mtime < time.time() - 100 and time.time() < deadline:
            time.sleep(0.05)
        assert (run / LOCK).stat().st_mtime > time.time() - 100


def test_worker_processes_never_meet_their_own_runs_lock(tmp_path, data_cache):
    """Ray's workers (and their restarted groups) call run_training while the driver holds
    the lock: the loop itself takes no lock, so a restart is never refused by its own run."""
    from loomtrain.launcher.config_loader import load_config
    from loomtrain.launcher.training.loop import run_training

    run = tmp_path / "run"
    cfg = load_config(TINY, [*SMALL, f"run.dir={run}", f"data.cache_dir={data_cache}", "train.max_steps=2"])
    with claim(run):  # the driver
        for _ in range(2):  # the first worker group, then its restart
            result = run_training(cfg)
        assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    assert result.state.step == 2 and not (run / LOCK).exists()


# ---------------------------------------------------------------- marker


def test_a_user_folder_is_refused_and_left_untouched(tmp_path, data_cache):
    user = tmp_path / "thesis"
    user.mkdir()
    (user / "chapter1.tex").write_text("my work\n")
    (user / "config.yaml").write_text("font: serif\n")  # a config.yaml, but not loomtrain's
    before = snapshot(user)
    out = train(user, data_cache, "train.max_steps=1", rc=2)
    (line,) = error_lines(out)
    assert f"run.dir={user}: not a loomtrain run directory" in line and "chapter1.tex" in line
    assert snapshot(user) == before
    for ok in (tmp_path / "new" / "run", tmp_path / "empty"):  # new or empty: fine
        ok.mkdir(parents=True, exist_ok=ok.name == "empty")
        with claim(ok):
            pass
        assert (ok / MARKER).is_file()


def test_runs_from_before_the_marker_are_adopted(tmp_path, base):
    for keep in ("checkpoints", "metrics.jsonl", "config.yaml"):
        old = tmp_path / f"old-{keep}"
        old.mkdir()
        src = base / keep
        shutil.copytree(src, old / keep) if src.is_dir() else shutil.copy(src, old / keep)
        assert not (old / MARKER).exists()
        with claim(old):
            pass
        assert (old / MARKER).is_file()


def test_old_run_without_marker_resumes(tmp_path, data_cache, base):
    run = tmp_path / "legacy"
    shutil.copytree(base, run)
    (run / MARKER).unlink()
    out = train(run, data_cache, "train.max_steps=5", "checkpoint.every_steps=2")
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'}" in out
    assert steps_of(run) == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- resume


def test_refused_resume_changes_no_file(tmp_path, data_cache, base):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    (run / "checkpoints" / ".tmp-step_00000006").mkdir()  # leftover of an interrupted write
    before = snapshot(run)
    out = train(run, data_cache, "train.max_steps=6", "model.d_model=64", rc=2)
    (line,) = error_lines(out)
    assert "checkpoint.resume=auto" in line and "tok_emb.weight" in line
    assert snapshot(run) == before


def test_resume_never_moves_metrics_final_and_checkpoints_aside(tmp_path, data_cache, base):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    old_metrics = (run / "metrics.jsonl").read_text()
    old_final = snapshot(run / "final")
    train(run, data_cache, "train.max_steps=2", "checkpoint.resume=never")
    (aside,) = (run / "checkpoints").glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == [
        "final",
        "latest",
        "metrics.jsonl",
        "step_00000002",
        "step_00000004",
    ]
    assert (aside / "metrics.jsonl").read_text() == old_metrics and snapshot(aside / "final") == old_final
    assert steps_of(run) == [1, 2] and (run / "final" / "model.safetensors").is_file()


def test_resume_path_seeds_only_the_first_start(tmp_path, data_cache, base):
    run = tmp_path / "seeded"
    seed = base / "checkpoints" / "step_00000002"
    out = train(
        run,
        data_cache,
        "train.max_steps=6",
        "checkpoint.every_steps=0",
        "checkpoint.stop_at_step=3",
        f"checkpoint.resume={seed}",
    )
    assert f"resumed from {seed}" in out and steps_of(run) == [3]
    out = train(run, data_cache, "train.max_steps=6", "checkpoint.every_steps=0", f"checkpoint.resume={seed}")
    own = run / "checkpoints" / "step_00000003"
    assert f"resumed from {own}" in out and "only seeds a run's first start" in out
    assert steps_of(run) == [3, 4, 5, 6]
    gone = tmp_path / "seed-gone"  # the seed may be deleted once the run has its own checkpoints
    shutil.copytree(base / "checkpoints" / "step_00000002", gone)
    other = tmp_path / "seeded-2"
    train(other, data_cache, "train.max_steps=3", "checkpoint.stop_at_step=3", f"checkpoint.resume={gone}")
    shutil.rmtree(gone)
    out = train(other, data_cache, "train.max_steps=4", f"checkpoint.resume={gone}")
    assert f"resumed from {other / 'checkpoints' / 'step_00000003'}" in out and steps_of(other) == [3, 4]


def test_checkpoints_that_all_fail_verification_stop_the_run(tmp_path, data_cache, base):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    for step in (2, 4):
        victim = run / "checkpoints" / f"step_{step:08d}" / "trainer.json"
        victim.write_text(victim.read_text() + " ")
    before = snapshot(run)
    out = train(run, data_cache, "train.max_steps=6", rc=2)
    (line,) = error_lines(out)
    assert "no usable checkpoint" in line and "step_00000004: trainer.json" in line
    assert "step_00000002: trainer.json" in line and "checkpoint.resume=never" in line
    assert snapshot(run) == before


def test_supersede_keeps_everything(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "w").write_text("w")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    dest = rundir.supersede(run, rundir.superseded_name(), log=lambda m: None)
    assert (dest / "final" / "w").read_text() == "w" and (dest / "metrics.jsonl").is_file()
    assert not (run / "final").exists() and not (run / "metrics.jsonl").exists()


# ---------------------------------------------------------------- a save that cannot be written


@pytest.fixture
def file_size_limit():
    """Writes past 32 KB fail with EFBIG, as on a full disk (SIGXFSZ ignored so the write
    returns the error): the checkpoint's weight files cannot be written, metrics lines can."""
    import resource

    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, old_limit[1]))

    try:
        yield apply
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_save_on_a_full_disk_is_one_line_and_keeps_latest(tmp_path, data_cache, base, file_size_limit):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    train(run, data_cache, "train.max_steps=4")  # resumes at 4: nothing to write but final/
    file_size_limit()
    out = train(run, data_cache, "train.max_steps=6", "checkpoint.every_steps=2", rc=1)
    (line,) = error_lines(out)
    assert (
        line.startswith("loomtrain: write error: checkpoint: cannot save step 6: File too large: ")
        and str(run / "checkpoints") in line
    ), line
    assert f"{run / 'checkpoints' / 'step_00000004'} stays the newest checkpoint" in line, line
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


@pytest.mark.slow  # three launches, ~16 s
def test_a_run_that_fails_before_its_first_step_leaves_no_new_folder(tmp_path):
    """A missing data path (found once DeepSpeed and the process group are up) used to leave
    runs/NAME/ behind (marker, lock, a rank log): the folders this start made go, the parents
    that were already there and an earlier run's folder stay."""
    bad = ["data.path=data/nope", *launch.QUIET]
    proc = launch.run_loomtrain("train", TINY, *bad, "run.dir=runs/x", cwd=tmp_path, rc=2)
    assert "data directory not found: data/nope" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # not even runs/
    earlier = tmp_path / "runs" / "earlier"
    earlier.mkdir(parents=True)
    (earlier / "notes.txt").write_text("mine")
    launch.run_loomtrain("train", TINY, *bad, "run.dir=runs/x", cwd=tmp_path, rc=2)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["earlier"]
    (tmp_path / "runs" / "made-by-hand").mkdir()  # an empty folder the user made for the run
    proc = launch.run_loomtrain("train", TINY, *bad, "run.dir=runs/made-by-hand", cwd=tmp_path, rc=2)
    assert "data directory not found" in proc.stderr
    assert (tmp_path / "runs" / "made-by-hand" / MARKER).exists()  # there before: it stays
    assert (earlier / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- paths


def test_a_run_dir_under_home_puts_everything_under_it(tmp_path, monkeypatch):
    """run.dir=~/x: the rank logs, checkpoints, final weights, TensorBoard events and the data
    cache beside it all land under $HOME; no folder named `~` appears in the working directory
    (the data cache once went to ./~/.data_cache)."""
    import contextlib
    import io

    from loomtrain.launcher.cli import train as train_cli
    from loomtrain.launcher.config_loader import resolve
    from loomtrain.launcher.rundir import data_cache_dir

    # DeepSpeed's compiled ops are cached under ~/.cache: keep them (a rebuild takes minutes)
    monkeypatch.setenv("XDG_CACHE_HOME", os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"))
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    args = [TINY, *SMALL, "run.dir=~/runs/x", "train.max_steps=1", "checkpoint.every_steps=1", "log.tensorboard=true"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert train_cli.main(args) == 0, out.getvalue()[-4000:]
    run = home / "runs" / "x"
    assert (run / "checkpoints" / "step_00000001").is_dir() and (run / "final").is_dir()
    assert list((run / "logs").glob("rank_*.log")) and list(run.glob("events.out.tfevents.*"))
    assert list((home / "runs" / ".data_cache").glob("stdlib-*/index.json"))
    assert list(cwd.iterdir()) == []
    cfg = resolve(TINY, ["data.cache_dir=~/cache"])
    assert data_cache_dir(cfg) == home / "cache"
