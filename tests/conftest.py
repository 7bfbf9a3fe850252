"""Shared test set-up: CPU DeepSpeed without its accelerator warning, quiet threads, the
fixtures several modules use. Runs launched in a child process (`python -m loomtrain`,
torchrun) go through tests/launch.py, which also holds the shrunk configs they train."""

import os
import subprocess
import sys
from pathlib import Path

# The tests sit in three tiers (unit/, integration/, distributed/); the helpers here in tests/.
# A few modules take a fixture-maker or a shrunk config from a module of another tier (test_tp's
# COMMON, test_hf_model_ids' cache layout): every tier's folder is importable.
sys.path[1:1] = [str(Path(__file__).parent / tier) for tier in ("unit", "integration", "distributed")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import pytest  # noqa: E402
from s3_server import backend_root, s3_bucket, s3_endpoint  # noqa: E402, F401 (a local S3 server, a bucket per test)

# The modules that take two minutes or more of a 2-core machine, longest first. The suite runs
# in three processes that each take whole modules (README: -n 3 --dist loadscope
# --no-loadscope-reorder, in collection order): these start first, so that no process is left
# alone at the end with one of them (the last order on 2 cores cost ~3 minutes of one idle core).
# Three on 2 cores, not two: two sat idle together ~9% of the time (both waiting on a hang limit,
# a retry or Ray), and a third fills that (the whole suite 1503 -> 1227 s on this 2-core machine).
LONG_MODULES_FIRST = (
    "test_hangs_and_signals",
    "test_multihost_torchrun",
    "test_checkpoint_resume",
    "test_checkpoint_engine",
    "test_multihost_elastic",
    "test_multihost_ray",
    "test_ray_train",
    "test_startup",
    "test_zero",
    "test_benchmark_scripts",
    "test_readme_in_order",
    "test_checkpoint_s3",
    "test_pip_resolves",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES_FIRST)}
    # Then the others by module name across the tiers (the order the suite has always run in);
    # stable: each module's own order stays. Which worker runs a module is xdist's choice, so a
    # test must not depend on what ran before it in its process: torch.profiler's with_stack start
    # spun for 20+ minutes in a worker that had run test_one_line_errors..test_run_dir (hence
    # tests/error_mid_step_driver.py), most likely what made CI's run of 2026-12-06 time out.
    items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), item.path.stem))


@pytest.fixture(autouse=True)
def own_working_dir(tmp_path_factory, monkeypatch):
    """Every test runs in an empty folder of its own (not its tmp_path, which stays the test's):
    what a relative path reads or writes (a config's default run.dir runs/NAME, a child process
    started without a cwd) never meets what a user made in the checkout (runs/, data/, corpus/,
    a mixture config). A test that wants the repository root (the README's relative paths) says so
    with monkeypatch.chdir(ROOT) or cwd=ROOT."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module (use via pytestmark): tiny models gain nothing
    from a second thread, and on a shared 2-core machine OpenMP threads only spin."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """A data cache directory shared by the runs of one test module: the corpus is
    tokenized once per module, and no module sees another's cache."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def bpe():
    """A small byte-level BPE trained here with `tokenizers` (<|endoftext|> as EOS), for the
    Hugging Face import tests (tests/hf_fixtures.py builds the models around it)."""
    from hf_fixtures import TEXT
    from loomtrain.data_pipeline.tokenizer import train_bpe

    return train_bpe(iter(TEXT), vocab_size=300)._tok


from hosts import hosts  # noqa: E402,F401  (network-namespace test hosts, tests/hosts.py)
from ray_fixtures import ray_head  # noqa: E402,F401  (a module-scoped private Ray head)
from ray_hosts import ray_cluster  # noqa: E402,F401  (a module-scoped Ray cluster across test hosts)


@pytest.fixture
def tmpfs(tmp_path):
    """mount_tmpfs(size) -> a fresh folder on a tmpfs of that size ("16M", "512k"), unmounted
    after the test: a disk that fills (the tests run as root)."""
    mounts = []

    def mount_tmpfs(size: str) -> Path:
        mount = tmp_path / f"disk{len(mounts)}"
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
        mounts.append(mount)
        return mount

    yield mount_tmpfs
    for mount in mounts:
        subprocess.run(["umount", "-l", str(mount)], check=False)
