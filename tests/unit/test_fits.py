"""`train` runs the `plan` memory estimate first: a config this machine cannot hold is
refused in one line naming needed vs available, before anything is allocated or
written; `--force` overrides; the tiny config and the test configs fit comfortably."""

from __future__ import annotations

import contextlib
import io

import launch
import pytest
from launch import ROOT
from loomtrain.launcher.cli import train
from loomtrain.launcher.config_loader import load_config
from loomtrain.launcher.planning import fit

TINY = str(launch.TINY)
SMALL = [
    *launch.SMALLEST,
    "train.max_steps=1",
    "data.max_files=20",
    *launch.QUIET,
]

pytestmark = pytest.mark.usefixtures("one_thread")


def run_train(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = train.main(list(argv))
    return rc, err.getvalue()


def test_a_config_larger_than_this_machine_is_refused_before_anything(tmp_path):
    run = tmp_path / "run"
    # gpt-7b 4x wider (~100 B parameters) on one rank: ~1.6 TB, more than any one host or GPU has.
    rc, err = run_train(
        str(ROOT / "configs" / "gpt-7b.yaml"),
        "parallel.tp=1",
        "model.d_model=16384",
        "model.ffn_hidden=44032",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
        "train.device=auto",
        f"run.dir={run}",
    )
    assert rc == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith("loomtrain: will not fit: needs ") and " GiB per rank" in line, line
    assert ("available host RAM is" in line or "free memory is" in line) and "--force" in line, line
    assert not run.exists()


def test_force_starts_a_config_the_estimate_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(fit, "available_bytes", lambda device_type, local_rank: (1024.0, "available host RAM"))
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    rc, err = run_train(TINY, *SMALL, f"run.dir={tmp_path / 'a'}", cache)
    assert rc == 2 and "will not fit" in err and "available host RAM is 0.00 GiB" in err, err
    assert not (tmp_path / "a").exists()
    rc, err = run_train(TINY, *SMALL, f"run.dir={tmp_path / 'b'}", cache, "--force")
    assert rc == 0, err
    assert (tmp_path / "b" / "final" / "model.safetensors").is_file()


# The configs the test suite trains (shapes from test_checkpoint_resume, test_tp_train,
# test_zero: up to 4 ranks on one host at ZeRO 3) and configs/tiny.yaml as shipped.
TEST_SHAPE = [*launch.SMALL, "train.micro_batch_size=2", "train.global_batch_size=8"]
TEST_SHAPES = [
    ([], 1),
    ([*TEST_SHAPE, "parallel.tp=2", "parallel.zero_stage=2"], 4),
    ([*TEST_SHAPE, "parallel.zero_stage=3", "train.precision=bf16"], 4),
]


@pytest.mark.parametrize("overrides, ranks", TEST_SHAPES)
def test_tiny_and_test_configs_fit_comfortably(overrides, ranks):
    cfg = load_config(TINY, overrides, world_size=ranks)
    verdict = fit.check_fits(cfg, ranks, local_ranks=ranks)
    assert verdict.fits and verdict.needed < 0.1 * verdict.available, verdict.message
    assert verdict.needed < 2 * 1024**3, verdict.message  # < 2 GiB on any host
