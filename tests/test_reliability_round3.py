"""The third round of hostile cases, each reproduced as it was found, each asserting its one line,
the exit status and that nothing the user owns changed (two runs sharing a storage prefix are
tests/test_storage_lease.py):

* checkpoint.resume=never moves everything of the earlier run aside, on disk and on S3
  alike (checkpoints, final/, tb/ and metrics), nothing overwritten, the console saying what went
  where;
* a run with checkpoints in run.dir that now names run.storage is stopped in one line
  naming both and how to carry them over (no silent start at step 0).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import launch
import pytest
from loomtrain import storage

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = str(launch.TINY)
SMALL = [*launch.SMALLEST, "train.warmup_steps=1", "data.max_files=20", "data.val_fraction=0.1", *launch.QUIET]


def train(run: Path, data_cache: Path, *extra: str, rc: int = 0) -> str:
    """`loomtrain train` in this process (the CLI's main), its console output."""
    import contextlib
    import io

    from loomtrain.launcher.cli import train as train_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        got = train_cli.main([TINY, *SMALL, f"run.dir={run}", f"data.cache_dir={data_cache}", *extra])
    assert got == rc, out.getvalue()[-4000:]
    return out.getvalue()


def tree(location: str) -> dict[str, str]:
    """Every object (or file) under a URI -> sha256 of its bytes."""
    return {
        rel: hashlib.sha256(storage.read_object(storage.join(location, rel))).hexdigest()
        for rel in storage.list_objects(location)
    }


def under(files: dict[str, str], prefix: str) -> dict[str, str]:
    return {rel[len(prefix) :]: h for rel, h in files.items() if rel.startswith(prefix)}


# ------------------------------------------------------------------ Why 2


@pytest.mark.slow  # two runs per backend, ~20 s
@pytest.mark.parametrize("backend", ["disk", "s3"])
def test_resume_never_moves_everything_of_the_earlier_run_aside(backend, tmp_path, data_cache, request):
    run = tmp_path / "run"
    if backend == "s3":
        where = f"{request.getfixturevalue('s3_bucket')}/twin"
        extra = [f"run.storage={where}"]
        outputs = ("checkpoints/step_", "checkpoints/latest", "final/", "tb/")
    else:
        where, extra = f"file://{run}", []
        outputs = ("checkpoints/step_", "checkpoints/latest", "final/", "metrics.jsonl")
    train(run, data_cache, *extra, "train.max_steps=4", "checkpoint.every_steps=2")
    first = {rel: h for rel, h in tree(where).items() if rel.startswith(outputs)}
    assert any(rel.startswith("final/") for rel in first) and "checkpoints/step_00000004/trainer.json" in first
    assert any(rel.startswith(outputs[-1]) for rel in first)

    out = train(run, data_cache, *extra, "train.max_steps=2", "checkpoint.resume=never")
    moved = [line for line in out.splitlines() if line.startswith("checkpoint:") and "moved" in line]
    assert len(moved) == (3 if backend == "s3" else 2), out[-3000:]  # S3: run.dir's own metrics.jsonl too
    m = re.search(r"moved 2 earlier checkpoint\(s\) to (\S+)$", moved[0])
    assert m, moved
    aside = m.group(1)
    rel_aside = aside[len(where) + 1 :] if backend == "s3" else str(Path(aside).relative_to(run))
    assert rel_aside.startswith("checkpoints/superseded-")
    named = "final, tb" if backend == "s3" else "final, metrics.jsonl"
    assert moved[-1] == f"checkpoint: fresh start: moved the earlier {named} to {aside}"
    if backend == "s3":
        assert moved[1] == f"checkpoint: fresh start: moved the earlier metrics.jsonl to {run / rel_aside}"
    now = tree(where)
    # everything of the earlier run is under the superseded prefix, byte for byte, nothing lost
    assert under(now, rel_aside + "/") == {rel.removeprefix("checkpoints/"): h for rel, h in first.items()}
    # ... and the new run's outputs are its own: steps 1-2, a new final/, no step_4
    assert "checkpoints/step_00000002/manifest.json" in now and "checkpoints/step_00000004/manifest.json" not in now
    assert any(rel.startswith("final/") for rel in now)
    assert now["checkpoints/step_00000002/trainer.json"] != first["checkpoints/step_00000002/trainer.json"]


# ------------------------------------------------------------------ Why 3


def test_local_checkpoints_and_a_new_run_storage_stop_in_one_line(tmp_path, data_cache, s3_bucket):
    run, where = tmp_path / "run", f"{s3_bucket}/new"
    train(run, data_cache, "train.max_steps=2", "checkpoint.every_steps=2")
    local = tree(f"file://{run}")
    out = train(run, data_cache, f"run.storage={where}", "train.max_steps=4", rc=2)
    assert "Traceback" not in out
    (line,) = [line for line in out.splitlines() if line.startswith("loomtrain:") and "error" in line]
    assert line == (
        f"loomtrain: config error: checkpoint.resume=auto: {run / 'checkpoints'} holds 1 checkpoint(s) (newest "
        f"step_00000002) and run.storage={where} none; to continue from them set checkpoint.resume={run} (they "
        "seed this run's first start in run.storage), or to start at step 0 in run.storage set "
        "checkpoint.resume=never (they stay where they are)"
    )
    after = tree(f"file://{run}")
    assert {k: v for k, v in after.items() if not k.startswith("logs/")} == {
        k: v for k, v in local.items() if not k.startswith("logs/")
    }
    assert not any(rel.startswith("checkpoints/") for rel in storage.list_objects(where))
    # the way on that the line names: carried over, step 3 onwards, saved in run.storage
    out = train(run, data_cache, f"run.storage={where}", "train.max_steps=4", f"checkpoint.resume={run}")
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'}" in out
    assert "checkpoints/step_00000004/manifest.json" in storage.list_objects(where)
