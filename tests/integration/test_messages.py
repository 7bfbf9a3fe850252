"""Messages that say what is wrong and what to do, in one line: a key left empty on the
command line (`run.dir=`, `model.init_from=`), a run.dir over the filesystem's name limit,
SIGTERM during start-up (nothing saved, the run lock released), `generate --max-new-tokens`
beyond the model's context, and the line a full or read-only disk ends a run with."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
from launch import one_line
from loomtrain.launcher.cli import generate, train
from loomtrain.launcher.config_loader import ConfigError, load_config
from loomtrain.launcher.rundir import LOCK

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.parametrize("key", ["run.dir", "model.init_from", "train.lr", "log.profile_steps"])
def test_a_key_left_empty_on_the_command_line_is_named_with_what_to_write(key, tmp_path, capsys):
    others = [] if key == "run.dir" else [f"run.dir={tmp_path / 'run'}"]
    assert train.main([TINY, f"{key}=", *others]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"loomtrain: config error: {key}: no value after '=' on the command line"), line
    assert f"give one ({key}=VALUE)" in line and "leave the override out to keep the config's value" in line
    assert "Incompatible value" not in line and "not Optional" not in line
    assert not (tmp_path / "run").exists()


def test_an_empty_string_field_says_how_to_write_none():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["model.init_from="])
    assert """or "model.init_from=''" for none""" in str(err.value)
    assert load_config(TINY, ["model.init_from=''"]).model.init_from == ""  # what the message offers works


def test_an_empty_value_in_a_yaml_file_names_the_file(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text(f"extends: {TINY}\nrun:\n  dir:\n")
    with pytest.raises(ConfigError, match=rf"^run\.dir: empty in {config}; give it a value, or remove the line"):
        load_config(config)


def test_a_run_dir_name_over_the_filesystem_limit_is_one_line(tmp_path, capsys):
    run_dir = tmp_path / ("x" * 300)
    assert train.main([TINY, f"run.dir={run_dir}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (
        f"loomtrain: config error: run.dir: a folder name in it is 300 bytes long ({'x' * 24}...); "
        f"the filesystem allows at most {os.pathconf(tmp_path, 'PC_NAME_MAX')} bytes per name: pick a shorter run.dir"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_run_dir_path_over_the_filesystem_limit_is_one_line(tmp_path):
    deep = "/".join(["d" * 200] * 20)  # each name fits, the whole path does not
    with pytest.raises(ConfigError, match=r"^run\.dir: the path is \d+ bytes long; the filesystem allows 4096"):
        load_config(TINY, [f"run.dir={tmp_path / deep}"])


def test_sigterm_during_start_up_is_one_line_and_releases_the_lock(tmp_path, capsys, monkeypatch):
    """The signal lands after the run lock is taken, while the process group is being set up
    (before the loop's own handlers): one line, exit 143, no lock and no new folder left."""
    from loomtrain.launcher.training import loop

    run_dir = tmp_path / "runs" / "run"
    seen = {}

    def signalled_while_starting(cfg):
        seen["locked"] = (run_dir / LOCK).exists()
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (the main) thread at once
        raise AssertionError("the start-up went on after SIGTERM")

    def no_handler(signum, frame):  # what Python's default would do: end the process, say nothing
        raise AssertionError("SIGTERM during start-up met no handler of loomtrain's")

    monkeypatch.setattr(loop, "init_distributed", signalled_while_starting)
    before = signal.signal(signal.SIGTERM, no_handler)
    try:
        assert train.main([TINY, f"run.dir={run_dir}", "log.progress=plain"]) == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is no_handler  # the handlers are put back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == {"locked": True}
    assert one_line(capsys.readouterr().err) == (
        "loomtrain: SIGTERM: stopped during start-up, before the first step: nothing saved; "
        "run the same command to start again"
    )
    assert not (tmp_path / "runs").exists()  # the folders this start made are gone, the lock with them


def test_sigterm_during_start_up_keeps_an_existing_run(tmp_path, capsys, monkeypatch):
    from loomtrain.launcher.rundir import MARKER
    from loomtrain.launcher.training import loop

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / MARKER).write_text("{}\n")
    (run_dir / "notes.txt").write_text("mine\n")
    monkeypatch.setattr(loop, "init_distributed", lambda cfg: os.kill(os.getpid(), signal.SIGINT))
    assert train.main([TINY, f"run.dir={run_dir}"]) == 128 + signal.SIGINT
    assert one_line(capsys.readouterr().err).startswith("loomtrain: SIGINT: stopped during start-up")
    assert sorted(p.name for p in run_dir.iterdir()) == [MARKER, "notes.txt"]  # no lock, nothing else touched


@pytest.fixture(scope="module")
def tiny_final(tmp_path_factory):
    """A final/ of a tiny untrained model (max_seq_len 32), written as a run writes it."""
    from final_weights import save_final
    from loomtrain.data_pipeline import ByteTokenizer
    from loomtrain.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32)
    final = tmp_path_factory.mktemp("gen") / "final"
    save_final(Transformer(cfg, seed=0), cfg, ByteTokenizer(), final)
    return final


def test_generate_beyond_the_context_says_where_it_stops(tiny_final, capsys):
    assert generate.main([str(tiny_final), "--prompt", "def f", "--max-new-tokens", "100000"]) == 0
    out, err = capsys.readouterr()
    assert one_line(err) == (
        "loomtrain generate: --max-new-tokens 100000 is more than the context leaves: generation stops "
        "at model.max_seq_len 32 (the prompt's 5 tokens + at most 27 new)"
    )
    assert out.startswith("def f")


def test_generate_with_a_prompt_that_fills_the_context_names_the_command(tiny_final, capsys):
    assert generate.main([str(tiny_final), "--prompt", "x" * 40]) == 2
    assert one_line(capsys.readouterr().err) == "loomtrain generate: the prompt is 40 tokens; the model's context is 32"


def test_generate_refused_by_the_sampler_names_the_command(tiny_final, capsys, monkeypatch):
    from loomtrain.model import Transformer

    def refuse(*args, **kwargs):
        raise ValueError("top_k must be >= 1, got 0")

    monkeypatch.setattr(Transformer, "generate", refuse)
    assert generate.main([str(tiny_final), "--prompt", "def f", "--max-new-tokens", "5"]) == 2
    assert one_line(capsys.readouterr().err) == "loomtrain generate: top_k must be >= 1, got 0"


def test_generate_within_the_context_says_nothing(tiny_final, capsys):
    assert generate.main([str(tiny_final), "--prompt", "def f", "--max-new-tokens", "27"]) == 0
    assert capsys.readouterr().err == ""


def test_disk_error_line_names_the_file_the_cause_and_latest(tmp_path):
    from loomtrain.launcher.cli.train import disk_error_line

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000008\n")
    line = disk_error_line(OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "metrics.jsonl")), tmp_path)
    assert line == (
        f"loomtrain: write error: {tmp_path}/metrics.jsonl: Read-only file system; "
        f"{tmp_path}/checkpoints/step_00000008 stays latest: make that location writable (or pick another "
        f"run.dir), then run the same command to resume from step_00000008"
    )
    # an error without a file name (a write to an open file) names the run directory
    line = disk_error_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), tmp_path / "fresh")
    assert line.startswith(f"loomtrain: write error: {tmp_path}/fresh: No space left on device; no checkpoint")
    assert line.endswith("free space on that disk (or pick another run.dir), then run the same command to start")
    # a failed checkpoint names the one it was writing and the one that stays latest; the fix
    # comes from its cause's text (it carries no errno)
    from loomtrain.launcher.checkpoints.store import CheckpointWriteError

    failed = CheckpointWriteError(
        f"checkpoint: cannot save step 10: Disk quota exceeded: {tmp_path}/checkpoints/.tmp-step_00000010; "
        f"{tmp_path}/checkpoints/step_00000008 stays the newest checkpoint"
    )
    assert disk_error_line(failed, tmp_path) == (
        f"loomtrain: write error: {failed}: free space within your quota (or pick another run.dir), "
        f"then run the same command to resume from step_00000008"
    )


def test_a_failed_save_to_run_storage_names_the_store_and_its_latest(tmp_path, s3_bucket):
    from loomtrain import storage
    from loomtrain.launcher.checkpoints.store import CheckpointWriteError
    from loomtrain.launcher.cli.train import disk_error_line

    run_storage = f"{s3_bucket}/runs/x"
    fs, root = storage.object_store(run_storage, "run.storage")
    fs.pipe_file(f"{root}/checkpoints/latest", b"step_00000008\n")
    failed = CheckpointWriteError(
        f"checkpoint: cannot save step 10: Access Denied: {run_storage}/checkpoints/step_00000010; "
        f"{run_storage}/checkpoints/step_00000008 stays the newest checkpoint"
    )
    assert disk_error_line(failed, tmp_path, run_storage) == (
        f"loomtrain: write error: {failed}: check that run.storage={run_storage} is reachable and writable "
        "(endpoint, credentials, bucket), then run the same command to resume from step_00000008"
    )
