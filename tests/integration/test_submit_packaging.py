"""`loomtrain submit` ships the package's Python files and the configs named, never a secret.

A copy of this checkout is salted with fake secrets (keys, .env files, credentials,
kubeconfig, Ray token), run outputs, exports, data and symbolic links; then
`submit --dry-run` (the real CLI, importing the copy) lists what would ship, and
`stage_project` (the function `submit` uploads from) stages it. No fake secret and
no byte of one may be in either; the staged package must still import.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from launch import child_env, run_child, run_loomtrain
from loomtrain.launcher.cluster import jobs
from loomtrain.launcher.cluster.packaging import plan_shipment

ROOT = Path(__file__).resolve().parents[2]
MARK = "FAKE-SECRET-7f3a"
SECRETS = [
    ".env",
    ".env.production",
    "id_rsa",
    "id_rsa.pub",
    "server.pem",
    "tls.key",
    ".netrc",
    "kubeconfig",
    "kubeconfig.yaml",
    "gcp-credentials.json",
    "secrets.yaml",
    ".aws/credentials",
    ".aws/config",
    ".ray/auth_token",
    ".ssh/id_ed25519",
    "configs/secrets.yaml",
    "launcher/.env",
    "launcher/cluster/credentials.py",
    "model/secrets_local.py",
    "runs/tiny/checkpoints/step_00000001/x.py",
    "runs/tiny/metrics.jsonl",
    "exports/hf/model.safetensors",
    "data/corpus.jsonl",
    "data_pipeline/data/notes.py",
    "notes.txt",
]


@pytest.fixture(scope="module")
def salted(tmp_path_factory) -> Path:
    """A copy of the checkout (no .git) with fake secrets, outputs and links planted in it."""
    base = tmp_path_factory.mktemp("checkout")
    tree = base / "loomtrain"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "runs", "tests"))
    for rel in SECRETS:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(f"{MARK} {rel}\n")
    outside = base / "home-aws-credentials"
    outside.write_text(f"{MARK} outside\n")
    os.symlink(outside, tree / "model" / "linked_secret.py")  # a link inside the package
    os.symlink(tree / "runs", tree / "parallel" / "runs_link")  # a linked folder
    (tree / "runs" / "__init__.py").write_text(f"# {MARK}\n")
    return tree


def _shipped_names(listing: str) -> list[str]:
    rows = [line.split() for line in listing.splitlines() if line[:1] == " " or line[:1].isdigit()]
    return [r[1] for r in rows if len(r) == 2]


def test_dry_run_lists_package_and_named_configs_with_sizes_and_no_secret(salted):
    pkg_path = salted.parent / "pkgpath"
    pkg_path.mkdir(exist_ok=True)
    env = child_env(PYTHONPATH=str(salted.parent))  # imports the salted copy itself
    proc = run_loomtrain(
        "submit", "configs/tiny.yaml", "train.max_steps=5", "--dry-run", cwd=salted, env=env, timeout=120
    )
    names = _shipped_names(proc.stdout)
    assert "loomtrain/launcher/training/loop.py" in names and "loomtrain/configs/tiny.yaml" in names, proc.stdout
    assert "loomtrain/__main__.py" in names
    for name in names:
        assert name.endswith(".py") or name == "loomtrain/configs/tiny.yaml", name
        assert MARK not in (salted.parent / name).read_text(), name
    for rel in SECRETS:
        assert f"loomtrain/{rel}" not in names
    assert not any("linked" in n or "runs" in n for n in names)
    size = {
        line.split()[1]: int(line.split()[0].replace(",", ""))
        for line in proc.stdout.splitlines()
        if len(line.split()) == 2 and line.split()[0].replace(",", "").isdigit()
    }
    assert size["loomtrain/launcher/training/loop.py"] == (salted / "launcher" / "training" / "loop.py").stat().st_size
    assert "total: " in proc.stdout and "symbolic link" in proc.stdout
    assert "--ray" in proc.stderr and "nothing submitted" in proc.stderr


def test_staged_working_dir_holds_no_secret_and_imports(salted, tmp_path):
    stage = tmp_path / "stage"
    config_in_job = jobs.stage_project(stage, str(salted / "configs" / "tiny.yaml"), root=salted)
    assert config_in_job == "loomtrain/configs/tiny.yaml"
    files = [p for p in stage.rglob("*") if not p.is_dir()]
    assert files and not any(p.is_symlink() for p in files)
    for p in files:
        assert MARK.encode() not in p.read_bytes(), p
    rel = {str(p.relative_to(stage)) for p in files}
    entries, _, _ = plan_shipment(salted / "configs" / "tiny.yaml", salted)
    assert rel == {e.dest for e in entries}
    run_child(
        [sys.executable, "-c", "import loomtrain.launcher.cluster.ray_train, loomtrain.launcher.training.loop"],
        cwd=stage,
        env=child_env(PYTHONPATH=str(stage)),
        timeout=120,
    )


def test_extends_chain_ships_and_a_secret_named_config_is_refused(salted, tmp_path):
    (salted / "configs" / "mine.yaml").write_text("extends: tiny.yaml\ntrain:\n  max_steps: 3\n")
    entries, _, cfg = plan_shipment(salted / "configs" / "mine.yaml", salted)
    dests = {e.dest for e in entries}
    assert cfg == "loomtrain/configs/mine.yaml" and "loomtrain/configs/tiny.yaml" in dests
    secret_cfg = tmp_path / "prod.env"
    secret_cfg.write_text("train:\n  max_steps: 3\n")
    with pytest.raises(Exception, match=r"refusing to ship config .*prod\.env"):
        jobs.stage_project(tmp_path / "stage", str(secret_cfg), root=salted)
    assert not (tmp_path / "stage").exists()


def test_every_subpackage_pyproject_lists_is_shipped(salted):
    """A subpackage named like an output folder (launcher/checkpoints) is code, and ships."""
    import tomllib
    from loomtrain.launcher.cluster.packaging import package_files

    shipped, _ = package_files(salted)
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for name in dirs:
        rel = "/".join(name.split(".")[1:] + ["__init__.py"])
        assert rel in shipped, (name, rel)
    assert "launcher/checkpoints/hook.py" in shipped


def test_dry_run_warns_about_each_relative_path_the_cluster_will_not_have(tmp_path, capsys):
    """The job runs in a temporary working directory holding only the package and the config:
    a relative run.dir is gone with the job, and relative data or weights are not there."""
    from loomtrain.launcher import cli

    config = str(ROOT / "configs" / "tiny.yaml")
    relative = ["data.path=data/code", "model.init_from=hf/llama", "ray.storage=ray-state"]
    assert cli.main(["submit", config, *relative, "--dry-run"]) == 0
    err = capsys.readouterr().err.splitlines()
    warned = [line for line in err if line.startswith("loomtrain: warning: ")]
    assert [w.split(" ")[2] for w in warned] == [
        "run.dir=runs/tiny",  # the config's own default
        "data.path=data/code",
        "model.init_from=hf/llama",
        "ray.storage=ray-state",
    ], err
    assert "gone when the job ends" in warned[0] and "(run.dir=/mnt/shared/...)" in warned[0]
    assert "holds only the package and the config" in warned[1]
    absolute = [f"run.dir={tmp_path / 'run'}", "data.path=s3://bucket/code", f"data.cache_dir={tmp_path}"]
    assert cli.main(["submit", config, *absolute, "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_submission_waits_for_a_just_started_clusters_job_agent_and_other_refusals_are_one_line(monkeypatch):
    from loomtrain.launcher.cluster import jobs

    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)

    class Cluster:  # Ray's client as a head answers in the seconds after it started
        def __init__(self, refusals: list[str]):
            self.refusals, self.calls = refusals, 0

        def submit_job(self, **job):
            self.calls += 1
            if self.refusals:
                raise RuntimeError(self.refusals.pop(0))
            return "raysubmit_1"

    starting = Cluster(
        ["Request failed with status code 500: No available agent to submit job, please try again later."] * 2
    )
    assert jobs.submit_when_ready(starting, entrypoint="true") == "raysubmit_1" and starting.calls == 3
    refused = Cluster(["Request failed with status code 400: bad runtime_env"])
    with pytest.raises(jobs.JobsError, match="^submission refused: .*bad runtime_env$"):
        jobs.submit_when_ready(refused, entrypoint="true")
    assert refused.calls == 1
    never = Cluster(["No available agent to submit job, please try again later."] * 10)
    with pytest.raises(jobs.JobsError, match="No available agent"):
        jobs.submit_when_ready(never, wait_s=0, entrypoint="true")
