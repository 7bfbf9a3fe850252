"""A rank whose file of the final weights cannot be written (a full disk, a refused upload) fails
the run on every rank with that rank's one line, after still joining the gathers its peers are
in (no rank waits forever on one that gave up), on a disk and in an object store alike; no
final/ a reader would take is left, and the run's checkpoints stay."""

from __future__ import annotations

import pytest
from launch import QUICK, TINY, child_env, run_loomtrain
from loomtrain import storage
from loomtrain.launcher.checkpoints.store import CheckpointStore
from loomtrain.launcher.checkpoints.weight_source import weights_at

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("backend", ["disk", "s3"])
def test_a_failed_final_write_on_one_rank_is_its_one_line_on_every_rank(backend, tmp_path, data_cache, request):
    run_dir = tmp_path / "run"
    where = str(run_dir) if backend == "disk" else request.getfixturevalue("s3_bucket") + "/run"
    proc = run_loomtrain(
        "train",
        TINY,
        *QUICK,
        "train.max_steps=1",
        "train.global_batch_size=4",
        f"run.dir={run_dir}",
        f"data.cache_dir={data_cache}",
        *([] if backend == "disk" else [f"run.storage={where}"]),
        nproc=2,
        env=child_env(LOOMTRAIN_TEST_FAULTS="final_full:1"),
        rc=1,
        timeout=300,
    )
    said = [line for line in proc.stderr.splitlines() if line.startswith("loomtrain: final weights not written: ")]
    assert len(said) == 2 and said[0] == said[1], proc.stderr[-3000:]  # rank 1's line, from both ranks
    assert "model-00002-of-00002.safetensors: cannot write it" in said[0] and "No space left on device" in said[0]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr  # torchrun: its own
    assert not weights_at(storage.below(where, "final"))  # no final/ that a reader takes
    assert CheckpointStore(where).find_resumable(checksums=False) is not None  # the end-of-run checkpoint
