"""`torchrun ... -m loomtrain train CONFIG parallel.cp=N` follows the single-process run.

Through the real loop (DeepSpeed engine, the data stream split over the data ranks, grad
clipping, fp32), 6 steps each, losses within 1e-5 of one process on the same global batch:

* cp 2 on plain text (whole windows, SDPA's causal path at cp 1);
* with packed documents (data.document_masking) and a sliding window (model.sliding_window=12
  of 32 tokens): cp 4 with activation checkpointing at ZeRO 3 (the backward's recompute repeats
  the K/V all-gather); tp 2 x cp 2 with sequence parallelism at ZeRO 1; cp 2 x dp 2 at ZeRO 2;
* cp 2 on chat records (loss masks: the CP halves of a window hold unequal numbers of targets);
* the cp 2 x dp 2 run's step-3 checkpoint resumed mid-run at cp 2 x dp 2 and at cp 4 x dp 1
  (another cp, another ZeRO partition count): steps 4-6 as the straight run's.

Ten launched runs, variants combined so that each is covered once (~3 min on 2 idle cores; 5 min
measured while four other engineers ran tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import QUIET, TINY, losses, run_loomtrain

pytestmark = pytest.mark.slow

COMMON = [
    "train.max_steps=6",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.n_layers=2",
    "model.max_seq_len=64",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "data.max_files=40",
    "checkpoint.every_steps=0",
    *QUIET,
]
DOCS_WINDOW = ["data.document_masking=true", "model.sliding_window=12"]


def _train(run: Path, cache: Path, *overrides: str, nproc: int = 1) -> dict[int, float]:
    run.parent.mkdir(parents=True, exist_ok=True)
    run_loomtrain("train", TINY, f"run.dir={run}", f"data.cache_dir={cache}", *COMMON, *overrides, nproc=nproc)
    return losses(run)


def _close(got: dict[int, float], want: dict[int, float], steps) -> float:
    assert sorted(got) == list(steps), sorted(got)
    diff = max(abs(got[s] - want[s]) for s in steps)
    assert diff <= 1e-5, [(s, got[s], want[s]) for s in steps]
    return diff


@pytest.fixture(scope="module")
def refs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("cp_ref")
    return {
        "plain": _train(root / "plain", data_cache),
        "docs": _train(root / "docs", data_cache, *DOCS_WINDOW),
    }


def test_cp2_on_plain_text_follows_one_process(tmp_path, data_cache, refs):
    got = _train(tmp_path / "cp2", data_cache, "parallel.cp=2", nproc=2)
    print(f"\ncp 2 vs 1 process (plain text): max |loss diff| = {_close(got, refs['plain'], range(1, 7)):.2e}")


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("cp4", ["parallel.cp=4", "parallel.activation_checkpointing=true", "parallel.zero_stage=3"]),
        ("tp2cp2", ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=1"]),
    ],
)
def test_cp_with_documents_and_a_window_follows_one_process(tmp_path, data_cache, refs, name, overrides):
    got = _train(tmp_path / name, data_cache, *DOCS_WINDOW, *overrides, nproc=4)
    print(
        f"\n{name} vs 1 process (documents, window 12): max |loss diff| = {_close(got, refs['docs'], range(1, 7)):.2e}"
    )


@pytest.fixture(scope="module")
def cp2dp2(tmp_path_factory, data_cache) -> Path:
    run = tmp_path_factory.mktemp("cp2dp2") / "run"
    _train(run, data_cache, *DOCS_WINDOW, "parallel.cp=2", "parallel.zero_stage=2", "checkpoint.every_steps=3", nproc=4)
    return run


def test_cp2_dp2_zero2_follows_one_process(cp2dp2, refs):
    got = losses(cp2dp2)
    print(f"\ncp2 x dp2 ZeRO 2 vs 1 process: max |loss diff| = {_close(got, refs['docs'], range(1, 7)):.2e}")
    layout = json.loads((cp2dp2 / "checkpoints" / "step_00000003" / "trainer.json").read_text())["layout"]
    assert layout["dp"] == 4 and layout["world_size"] == 4  # ZeRO's group: data x cp


@pytest.mark.parametrize("cp", [2, 4])
def test_a_mid_run_checkpoint_resumes_exactly_at_the_same_or_another_cp(tmp_path, data_cache, refs, cp2dp2, cp):
    src = cp2dp2 / "checkpoints" / "step_00000003"
    got = _train(
        tmp_path / f"resumed_cp{cp}",
        data_cache,
        *DOCS_WINDOW,
        f"parallel.cp={cp}",
        "parallel.zero_stage=2",
        f"checkpoint.resume={src}",
        nproc=4,
    )
    print(f"\ncp2 x dp2 step 3 resumed at cp {cp}: max |loss diff| = {_close(got, refs['docs'], range(4, 7)):.2e}")
    data = json.loads(
        next((tmp_path / f"resumed_cp{cp}" / "checkpoints").glob("step_*/data/dp_00000.json")).read_text()
    )
    assert data["global_position"] == 6 * 4  # 6 steps of 4 samples: nothing repeated or skipped


def test_cp2_on_chat_records_weights_each_rank_by_its_own_targets(tmp_path, data_cache):
    """Chat records (only the answers are targets; packed, document-masked): a window's two CP
    halves hold unequal numbers of targets, so each rank's mean must be weighted by its own count
    for the step to be the mean over the global batch's targets, as in one process."""
    from loomtrain.data_pipeline.preprocess import preprocess_files
    from loomtrain.data_pipeline.stream import TokenStream
    from loomtrain.parallel.context import chunk_index
    from test_packed_documents import chat_jsonl

    preprocess_files([chat_jsonl(tmp_path / "chat.jsonl")], tmp_path / "shards", "byte", progress=False, log=None)
    with TokenStream(tmp_path / "shards", seq_len=96, micro_batch_size=1, prefetch=0) as s:
        y = next(s)[1]
    halves = [int((y[:, chunk_index(96, 2, r)] != -100).sum()) for r in range(2)]
    assert halves[0] != halves[1], halves
    sft = [f"data.path={tmp_path / 'shards'}", "model.max_seq_len=128", "train.seq_len=96", "model.positions=rope"]
    want = _train(tmp_path / "one", data_cache, *sft)
    got = _train(tmp_path / "cp2", data_cache, *sft, "parallel.cp=2", nproc=2)
    print(f"\ncp 2 vs 1 process (chat records): max |loss diff| = {_close(got, want, range(1, 7)):.2e}")
