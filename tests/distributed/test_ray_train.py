"""Ray Train orchestration: the same losses as torchrun, and restarts after a worker dies.

4 Ray workers at TP2 x DP2, ZeRO 2, fp32 run the tiny config shrunk by overrides
against the session's private Ray head (tests/ray_fixtures.py). The reference is
torchrun with the same config and 4 processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import launch
import pytest
from launch import losses, run_loomtrain

pytestmark = pytest.mark.slow

CONFIG = str(launch.TINY)
STEPS, EVERY = 6, 2

SHRUNK = [
    *launch.SMALL_MODEL,
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.warmup_steps=1",
    f"train.max_steps={STEPS}",
    "parallel.tp=2",
    "parallel.zero_stage=2",
    "train.precision=fp32",
    "data.max_files=20",
    "data.val_fraction=0.1",
    "data.prefetch=0",
    "eval.every_steps=0",
    "log.progress=plain",
    "log.tensorboard=false",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep_last=2",
]


@pytest.fixture(scope="module")
def torchrun_losses(tmp_path_factory, data_cache) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    run_loomtrain("train", CONFIG, *SHRUNK, f"run.dir={run_dir}", f"data.cache_dir={data_cache}", nproc=4)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


def ray_cfg(ray_head, run_dir: Path, data_cache: Path, *extra: str):
    from loomtrain.launcher.config_loader import resolve, validate

    cfg = resolve(
        CONFIG,
        [
            *SHRUNK,
            f"run.dir={run_dir}",
            f"data.cache_dir={data_cache}",
            "ray.num_workers=4",
            "ray.cpus_per_worker=1",
            "ray.max_failures=2",
            f"ray.address={ray_head.gcs_address}",
            *extra,
        ],
    )
    validate(cfg, cfg.ray.num_workers)
    return cfg


@pytest.fixture
def fast_ray_reports(monkeypatch):
    # ray.train.report waits on the controller's poll interval (2 s by default).
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def test_ray_tp2_dp2_zero2_matches_torchrun_through_a_hard_exit_restarted_from_the_newest_checkpoint(
    ray_head, tmp_path, data_cache, torchrun_losses, fast_ray_reports, monkeypatch
):
    """4 Ray workers at TP2 x DP2, ZeRO 2 give torchrun's losses, also across a restart: a hard
    exit of rank 0 right after step 4's checkpoint was published but before it was reported to
    Ray resumes from step 4, which only loomtrain's scan knows. (An exit between checkpoints,
    resumed from the one before: test_multihost_ray.py's node loss.) One Ray run shows both: a
    restart that changed any number would fail the comparison with torchrun."""
    import fault_plugin
    from loomtrain.launcher.cluster import ray_train

    run_dir = tmp_path / "run"
    cfg = ray_cfg(ray_head, run_dir, data_cache, "checkpoint.resume=never")
    with fault_plugin.planned("exit:0:4"):  # the driver hands LOOMTRAIN_PLUGIN* to the workers
        result = ray_train.run(cfg)

    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, ref in torchrun_losses.items():
        assert got[step] == pytest.approx(ref, rel=1e-5, abs=1e-6), (step, got, torchrun_losses)

    attempts = [json.loads(x) for x in (run_dir / ray_train.ATTEMPTS_FILE).read_text().splitlines()]
    assert [a["start_step"] for a in attempts] == [0, 4], attempts
    # Died at 4 before reporting: Ray knew step 2 at most (or nothing, when the controller had not
    # yet taken step 2's report); our scan found step 4.
    assert attempts[1]["ray_checkpoint_step"] in (None, 2), attempts
    # The last checkpoint was handed to Ray as a pointer to our own directory.
    pointer = ray_train.read_pointer(result.checkpoint)
    assert pointer is not None and pointer["step"] == STEPS
    assert Path(pointer["path"]) == run_dir / "checkpoints" / f"step_{STEPS:08d}"
    assert (Path(pointer["path"]) / "manifest.json").is_file()
    # Our retention owns the files (keep_last=2); Ray keeps one small pointer dir.
    published = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert published == [f"step_{s:08d}" for s in (STEPS - EVERY, STEPS)]
    # Ray's storage holds exactly one pointer (the final one): unregistered ones
    # left by the killed workers were removed at the restarts.
    ray_ckpts = sorted(p for p in (run_dir / "ray" / ray_train.RAY_RUN_NAME).glob("checkpoint_*") if p.is_dir())
    assert len(ray_ckpts) == 1, ray_ckpts
    assert json.loads((ray_ckpts[0] / ray_train.POINTER_FILE).read_text())["step"] == STEPS
    # No leftovers: no temp checkpoint dirs, no pointer staging dirs.
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert not (run_dir / "ray" / ".pointers").exists() or not any((run_dir / "ray" / ".pointers").iterdir())


def test_the_workers_config_names_every_local_path_absolutely(tmp_path, monkeypatch):
    """Ray's workers run in a directory of Ray's: every path the driver was given relative to its
    own is made absolute, a data source's and model.init_from's included; a model id stays one,
    as model.init_from and as data.tokenizer."""
    from loomtrain.launcher.cluster import ray_train
    from loomtrain.launcher.config_loader import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    sources = "data.sources=[{path: ds/a, weight: 1.0}, {path: s3://bkt/b, weight: 1.0}]"
    for init_from, want in (("hf", str(tmp_path / "hf")), ("Org/model", "Org/model"), ("''", "")):
        overrides = ["run.dir=run", sources, f"model.init_from={init_from}", "data.tokenizer=Org/tok"]
        cfg = ray_train.absolutize(resolve(CONFIG, overrides))
        assert cfg.run.dir == str(tmp_path / "run") and cfg.model.init_from == want
        assert cfg.data.tokenizer == "Org/tok"
        assert [s.path for s in cfg.data.sources] == [str(tmp_path / "ds" / "a"), "s3://bkt/b"]


def test_unregistered_pointer_dirs_are_removed_and_ours_are_kept(tmp_path):
    """No cluster needed: what a restart does to Ray's storage directory."""
    from types import SimpleNamespace

    from loomtrain.launcher.cluster import ray_train
    from loomtrain.launcher.config_loader import resolve

    cfg = ray_train.absolutize(resolve(CONFIG, [f"run.dir={tmp_path / 'run'}"]))
    root = Path(ray_train.storage_path(cfg)) / ray_train.RAY_RUN_NAME
    for name in ("checkpoint_2026-01-01_00-00-01.000001", "checkpoint_2026-01-01_00-00-02.000002"):
        (root / name).mkdir(parents=True)
        (root / name / ray_train.POINTER_FILE).write_text("{}")
    (root / "checkpoint_manager_snapshot.json").write_text("{}")
    (root / "checkpoint_2026-01-01_00-00-03.000003").mkdir()  # a partial upload
    keep = SimpleNamespace(path=str(root / "checkpoint_2026-01-01_00-00-01.000001"))

    removed = ray_train.clean_orphan_pointers(cfg, keep)
    assert sorted(Path(p).name for p in removed) == [
        "checkpoint_2026-01-01_00-00-02.000002",
        "checkpoint_2026-01-01_00-00-03.000003",
    ]
    assert sorted(p.name for p in root.iterdir()) == [
        "checkpoint_2026-01-01_00-00-01.000001",
        "checkpoint_manager_snapshot.json",
    ]
    assert ray_train.clean_orphan_pointers(cfg, None) and not any(p.is_dir() for p in root.iterdir())


def test_the_report_hook_adds_no_collective_between_log_checkpoint_and_stop_steps(tmp_path, monkeypatch):
    """No cluster needed: a step that logs nothing, saves nothing and stops nothing does not
    broadcast (rank 0's look at the store); the others do, on every rank alike."""
    from types import SimpleNamespace

    from loomtrain.launcher import distributed
    from loomtrain.launcher.cluster import ray_train
    from loomtrain.launcher.config_loader import resolve

    looked = []
    monkeypatch.setattr(distributed, "broadcast_str", lambda found: looked.append(found))
    cfg = resolve(CONFIG, [f"run.dir={tmp_path}", "log.every_steps=5", "checkpoint.every_steps=4"])
    hook = ray_train.RayReportHook(cfg)
    for step, metrics, stop in (
        (3, {"lr": 1.0}, False),  # nothing happens at step 3: no broadcast
        (4, {"lr": 1.0}, False),  # a checkpoint step
        (5, {"lr": 1.0, "loss": 2.0}, False),  # a log step
        (6, {"lr": 1.0}, True),  # a stop
    ):
        ctx = SimpleNamespace(state=SimpleNamespace(step=step), stop_requested=stop, dist=SimpleNamespace(rank=1))
        hook.on_step_end(ctx, metrics)
        assert len(looked) == step - 3, (step, looked)


def test_the_staged_pointer_is_complete_or_absent_when_a_report_is_cut_short(tmp_path, monkeypatch):
    """A host killed inside rank 0's report leaves its staged pointer behind: it must be whole
    (a JSON naming the checkpoint) or not under step_* at all, never an empty file."""
    from types import SimpleNamespace

    import ray.train
    from loomtrain.launcher.cluster import ray_train
    from loomtrain.launcher.config_loader import resolve

    cfg = resolve(CONFIG, [f"run.dir={tmp_path}"])
    hook = ray_train.RayReportHook(cfg)
    ctx = SimpleNamespace(state=SimpleNamespace(step=8), dist=SimpleNamespace(rank=0))
    seen = []

    def report(metrics, checkpoint=None):
        with checkpoint.as_directory() as d:
            seen.append(json.loads((Path(d) / ray_train.POINTER_FILE).read_text()))

    monkeypatch.setattr(ray.train, "report", report)
    hook._report(ctx, {"loss": 1.0}, "s3://bucket/run/checkpoints/step_00000008")
    assert seen == [{"path": "s3://bucket/run/checkpoints/step_00000008", "step": 8}]
    assert not list(hook.pointer_root.iterdir())  # cleaned after the report

    def killed(self, text):  # the kill lands while the JSON is written
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        hook._report(ctx, {"loss": 1.0}, "s3://bucket/run/checkpoints/step_00000012")
    assert not list(hook.pointer_root.glob("step_*")), list(hook.pointer_root.iterdir())
