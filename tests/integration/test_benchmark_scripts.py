"""The benchmark scripts run (their --tiny shapes) and print the figures they promise."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import child_env

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    # launch.child_env: without the rendezvous variables an in-process test of this pytest process
    # may have set (a script handed its MASTER_PORT tried to listen where this process listens).
    env = child_env(CUDA_VISIBLE_DEVICES="")
    return subprocess.run([*args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# Each script run is a training launch of its own (10-30 s on 2 cores), output_layer.py's aside:
# slow, out of the quick loop.
@pytest.mark.parametrize(
    "script, args, expected",
    [
        pytest.param(
            "cpu_vs_hf.py",
            ["--rounds", "1", "--threads", "1"],
            ["ratio loomtrain/HF", "of matmul FLOP/s"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "engine_overhead.py", ["--rounds", "1", "--threads", "1"], ["ratio engine/plain"], marks=pytest.mark.slow
        ),
        ("output_layer.py", ["--threads", "1"], ["same results", "speed vs plain"]),
        pytest.param(
            "gpu_bench.py",
            ["--steps", "2", "--warmup", "1"],
            ["tokens/s", "MFU", "process RSS"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "checkpoint_scale.py",
            ["--layouts", "1x1,1x2"],
            ["read at resume", "async blocked", "ratio to world 1"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "async_checkpoint.py",
            ["--rounds", "1"],
            ["async extra / sync extra", "first save blocked"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "checkpoint_speed.py",
            ["--layouts", "1x2", "--rounds", "1"],
            ["save/disk", "x floor", "async s"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_script_runs_tiny_and_prints_its_figures(script, args, expected):
    proc = _run(sys.executable, f"benchmarks/{script}", "--tiny", *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for text in expected:
        assert text in proc.stdout, f"{script}: {text!r} missing from\n{proc.stdout[-2000:]}"


def test_gpu_sh_without_a_gpu_says_so_and_exits_2():
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        pytest.skip("this machine has a GPU: gpu.sh would run the real benchmark")
    proc = _run("bash", "benchmarks/gpu.sh", timeout=60)
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-1000:]
    assert "no CUDA device" in proc.stderr


# benchmarks/object_storage.py's full runs take minutes (a moto server, training launches); in CI
# its own measuring pieces, in-process against the tests' server: the replayed "ranged"
# contender is only honest if the recorder sees every ranged GET s3fs makes. ~11 s on the loaded
# 2-core machine (torch's import, a 16 MiB upload to moto): slow.
@pytest.mark.slow
def test_object_storage_records_the_ranged_gets_and_uploads_whole_files(s3_bucket, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import object_storage
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from loomtrain.storage import Objects

    objects = Objects(f"{s3_bucket}/bench")
    data = os.urandom(object_storage.WRITE_BYTES + 12345)  # a multipart upload of two parts
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "rank_00000.safetensors").write_bytes(data)
    object_storage.upload_alone(objects, [(tmp_path / "model" / "rank_00000.safetensors", "model/f")])
    key = f"{objects.path}/model/f"
    assert objects.fs.cat_file(key) == data
    with object_storage.recorded_ranges() as calls:
        got = objects.fs.cat_ranges([key] * 2, [0, 100], [10, 1 << 20])
        objects.fs.cat_file(key, start=5, end=9)
        objects.fs.cat_file(key)  # a whole GET: not a ranged one
    assert got == [data[:10], data[100 : 1 << 20]]
    assert sorted((s, e) for _, s, e in calls) == [(0, 10), (5, 9), (100, 1 << 20)]
    assert {p for p, _, _ in calls} == {key}
    object_storage.replay(objects.fs, calls)  # the same GETs again, without error
