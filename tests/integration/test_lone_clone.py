"""A lone clone passes its own tests, also after the README's commands have run in it.

The project's files (tests/source_tree.py: what git tracks, with files not yet added) are copied
into an empty temporary folder, with nothing beside it (no ../shared), and made a git checkout as
a clone is. The README's outputs are then made inside it, as a user following the README makes
them: a finished tiny run with checkpoints (runs/tiny/...), a corpus with Python files in it, token
shards (data/...), a mixture config at the root, an export (hf/...). Fake files suffice: the tests
run there must not read them. In that copy the Kubernetes, docs-path and config-error tests run
with pytest in a child process, the copy's own package first on the path, and must all pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import child_env
from source_tree import ROOT, project_files

TESTS = [
    "tests/integration/test_k8s_manifests.py",
    "tests/integration/test_k8s_broken.py",
    "tests/unit/test_docs_paths.py",
    "tests/unit/test_where_things_live.py",
    "tests/unit/test_one_home.py",
    "tests/unit/test_config_loader.py",
]

# What the README's commands leave in the checkout: run output, corpus, shards, mixture config, export.
README_OUTPUTS = {
    "runs/tiny/config.yaml": "run:\n  name: tiny\n  dir: runs/tiny\n",
    "runs/tiny/metrics.jsonl": '{"step": 300, "loss": 1.5}\n',
    "runs/tiny/checkpoints/step_00000300/model.safetensors": "not really weights",
    "runs/tiny/checkpoints/latest": "step_00000300\n",
    "runs/tiny/final/model.safetensors": "not really weights",
    "runs/tiny/logs/rank0.log": "step 300/300\n",
    "corpus/docs/intro.md": "# A document\n\nSee launcher/nowhere.py and loomtrain.no_such_module.\n",
    # a corpus of Python sources: docstrings naming files that are not here, imports from anywhere
    "corpus/code/asyncio_events.py": '"""See tests/test_gone.py."""\nimport ray\nfrom loomtrain.launcher import cli\n',
    "data/docs/tokenizer.json": "{}",
    "data/docs/meta.json": "{}",
    "data/code/train/shard_00000.bin": "",
    "mix.yaml": "extends: configs/tiny.yaml\ndata:\n  sources:\n    - {path: data/docs, weight: 0.3}\n",
    "hf/tiny/config.json": "{}",
}


def make_lone_clone(dest: Path) -> Path:
    """The project's files copied to `dest`, made a git checkout holding exactly them."""
    files = project_files()
    assert files, "not a git checkout: the copy needs the list of the project's files"
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-C", str(dest)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run(
        [*git, "add", "--pathspec-from-file=-", "--pathspec-file-nul"],
        input="\0".join(files),
        text=True,
        check=True,
    )
    return dest


@pytest.mark.slow
def test_k8s_docs_and_error_tests_pass_in_a_lone_clone_after_the_readme(tmp_path):
    # named as a clone is: its folder is the `loomtrain` package the child imports first
    clone = make_lone_clone(tmp_path / "loomtrain")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loomtrain"]  # nothing beside it
    for rel, text in README_OUTPUTS.items():
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        (clone / rel).write_text(text)
    env = child_env(PYTHONPATH=str(tmp_path))
    env.pop("LOOMTRAIN_KUBERAY_CRDS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and not any(w in summary for w in ("failed", "error", "skipped")), summary
    # the child tested the copy, not this checkout
    probe = [sys.executable, "-c", "import loomtrain, os; print(os.path.dirname(loomtrain.__file__))"]
    where = subprocess.run(probe, cwd=clone, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where) == clone, where
    assert os.path.isdir(clone / "k8s" / "crds")
