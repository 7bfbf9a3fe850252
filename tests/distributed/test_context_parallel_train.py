"""Training at `parallel.cp=N` under torchrun follows the single-process run.

Through the real loop (run_training: DeepSpeed engine, the data stream split over the data ranks, grad
clipping, fp32), 6 steps each, losses within 1e-5 of one process on the same global batch:

* cp 2 on plain text (whole windows, SDPA's causal path at cp 1);
* with packed documents (data.document_masking) and a sliding window (model.sliding_window=12
  of 32 tokens): cp 4 with activation checkpointing at ZeRO 3 (the backward's recompute repeats
  the K/V all-gather); tp 2 x cp 2 with sequence parallelism at ZeRO 1; cp 2 x dp 2 at ZeRO 2;
* cp 2 on chat records (loss masks: the CP halves of a window hold unequal numbers of targets);
* the cp 2 x dp 2 run's step-3 checkpoint resumed mid-run at cp 2 x dp 2 and at cp 4 x dp 1
  (another cp, another ZeRO partition count): steps 4-6 as the straight run's.

Ten runs, variants combined so that each is covered once, in three launches of
tests/zero_driver.py (one process: the three references; torchrun of 2: the two cp 2 runs;
torchrun of 4: the other five, the resumes after the run whose checkpoint they read, in the
same process group; test_checkpoint_resume.py resumes in a new process), so each rank pays for
process start-up and the DeepSpeed import once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import QUIET, losses, run_variants

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
# The 4-rank variants of the documents-and-window tests, by name.
DOCS_4 = {
    "cp4": ["parallel.cp=4", "parallel.activation_checkpointing=true", "parallel.zero_stage=3"],
    "tp2cp2": ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=1"],
}
CP2DP2 = ["parallel.cp=2", "parallel.zero_stage=2", "checkpoint.every_steps=3"]


def _close(got: dict[int, float], want: dict[int, float], steps) -> float:
    assert sorted(got) == list(steps), sorted(got)
    diff = max(abs(got[s] - want[s]) for s in steps)
    assert diff <= 1e-5, [(s, got[s], want[s]) for s in steps]
    return diff


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """The module's runs, each in out/NAME, all sharing the data cache out/cache."""
    return tmp_path_factory.mktemp("cp")


@pytest.fixture(scope="module")
def chat(out) -> list[str]:
    """Chat records preprocessed into shards (only the answers are targets; packed,
    document-masked): the overrides that train on them."""
    from loomtrain.data_pipeline.preprocess import preprocess_files
    from test_packed_documents import chat_jsonl

    preprocess_files([chat_jsonl(out / "chat.jsonl")], out / "chat_shards", "byte", progress=False, log=None)
    return [f"data.path={out / 'chat_shards'}", "model.max_seq_len=128", "train.seq_len=96", "model.positions=rope"]


@pytest.fixture(scope="module")
def refs(out, chat) -> dict[str, dict[int, float]]:
    """One process: plain text, documents with the window, chat records."""
    variants = {"plain": [], "docs": DOCS_WINDOW, "chat_one": chat}
    run_variants("zero_driver.py", out, COMMON, {1: variants})
    return {name: losses(out / name) for name in variants}


@pytest.fixture(scope="module")
def cp2_runs(out, chat) -> Path:
    """One torchrun of 2: cp 2 on plain text and on chat records."""
    return run_variants(
        "zero_driver.py", out, COMMON, {2: {"cp2": ["parallel.cp=2"], "chat_cp2": [*chat, "parallel.cp=2"]}}
    )


@pytest.fixture(scope="module")
def runs4(out) -> Path:
    """One torchrun of 4, documents with the window throughout: tp 2 x cp 2; cp 2 x dp 2 (a
    checkpoint every 3 steps); its step-3 checkpoint resumed at cp 2 and at cp 4; last, cp 4
    with activation checkpointing at ZeRO 3."""
    src = out / "cp2dp2" / "checkpoints" / "step_00000003"
    variants = {
        "tp2cp2": [*DOCS_WINDOW, *DOCS_4["tp2cp2"]],
        "cp2dp2": [*DOCS_WINDOW, *CP2DP2],
        **{
            f"resumed_cp{cp}": [*DOCS_WINDOW, f"parallel.cp={cp}", "parallel.zero_stage=2", f"checkpoint.resume={src}"]
            for cp in (2, 4)
        },
        "cp4": [*DOCS_WINDOW, *DOCS_4["cp4"]],
    }
    return run_variants("zero_driver.py", out, COMMON, {4: variants})


def test_cp2_on_plain_text_follows_one_process(cp2_runs, refs):
    got = losses(cp2_runs / "cp2")
    print(f"\ncp 2 vs 1 process (plain text): max |loss diff| = {_close(got, refs['plain'], range(1, 7)):.2e}")


@pytest.mark.parametrize("name", ["cp4", "tp2cp2"])
def test_cp_with_documents_and_a_window_follows_one_process(runs4, refs, name):
    got = losses(runs4 / name)
    print(
        f"\n{name} vs 1 process (documents, window 12): max |loss diff| = {_close(got, refs['docs'], range(1, 7)):.2e}"
    )


def test_cp2_dp2_zero2_follows_one_process(runs4, refs):
    cp2dp2 = runs4 / "cp2dp2"
    got = losses(cp2dp2)
    print(f"\ncp2 x dp2 ZeRO 2 vs 1 process: max |loss diff| = {_close(got, refs['docs'], range(1, 7)):.2e}")
    layout = json.loads((cp2dp2 / "checkpoints" / "step_00000003" / "trainer.json").read_text())["layout"]
    assert layout["dp"] == 4 and layout["world_size"] == 4  # ZeRO's group: data x cp


@pytest.mark.parametrize("cp", [2, 4])
def test_a_mid_run_checkpoint_resumes_exactly_at_the_same_or_another_cp(runs4, refs, cp):
    run = runs4 / f"resumed_cp{cp}"
    got = losses(run)
    print(f"\ncp2 x dp2 step 3 resumed at cp {cp}: max |loss diff| = {_close(got, refs['docs'], range(4, 7)):.2e}")
    data = json.loads(next((run / "checkpoints").glob("step_*/data/dp_00000.json")).read_text())
    assert data["global_position"] == 6 * 4  # 6 steps of 4 samples: nothing repeated or skipped


def test_cp2_on_chat_records_weights_each_rank_by_its_own_targets(out, chat, refs, cp2_runs):
    """Chat records (only the answers are targets; packed, document-masked): a window's two CP
    halves hold unequal numbers of targets, so each rank's mean must be weighted by its own count
    for the step to be the mean over the global batch's targets, as in one process."""
    from loomtrain.data_pipeline.stream import TokenStream
    from loomtrain.parallel.context import chunk_index

    with TokenStream(out / "chat_shards", seq_len=96, micro_batch_size=1, prefetch=0) as s:
        y = next(s)[1]
    halves = [int((y[:, chunk_index(96, 2, r)] != -100).sum()) for r in range(2)]
    assert halves[0] != halves[1], halves
    want, got = refs["chat_one"], losses(cp2_runs / "chat_cp2")
    print(f"\ncp 2 vs 1 process (chat records): max |loss diff| = {_close(got, want, range(1, 7)):.2e}")
