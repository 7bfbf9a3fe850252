"""Data mixtures (data.sources): the blend's shares, each source read at most once per
its own epoch, resume at another DP size, one tokenizer for all sources; and
`loomtrain data-stats`, which reports what a run will read."""

from __future__ import annotations

import json

import launch
import numpy as np
import pytest
import stream_support
from launch import TINY, run_loomtrain
from loomtrain.data_pipeline import ByteTokenizer, DataError, TokenStream, prepare_sources, preprocess_files
from loomtrain.data_pipeline.stream import Blend
from loomtrain.launcher.config import DataConfig, DataSource
from loomtrain.launcher.config_loader import ConfigError, load_config
from stream_support import write_arrays

T = 8
INFO = {"hash": "synthetic0000000", "name": "synthetic", "vocab_size": 1 << 20, "eos_id": 0}


def make_source(path, n_samples, base):
    """Tokens base, base+1, ... so a sample's first token names its source and index."""
    write_arrays(
        path,
        {
            "train": np.arange(base, base + n_samples * T + 1, dtype=np.uint32),
            "val": np.arange(base, base + 3 * T + 1, dtype=np.uint32),
        },
        INFO,
        shard_tokens=29,
    )
    return path


@pytest.fixture
def two_sources(tmp_path):
    # 13 and 7 samples: the sources' epochs end at unrelated positions.
    return [(make_source(tmp_path / "a", 13, 0), 3.0), (make_source(tmp_path / "b", 7, 1_000_000), 1.0)]


def decode_ids(inputs):
    """(source, sample index) of each row."""
    first = inputs[:, 0].numpy()
    return [(int(f >= 1_000_000), int(f % 1_000_000) // T) for f in first]


def global_order(sources, m, d, rounds, start_state=None):
    return stream_support.global_order(
        sources, m, d, rounds, decode_ids, seq_len=T, seed=7, prefetch=1, start_state=start_state
    )


def test_blend_shares_follow_the_normalised_weights():
    blend = Blend([3.0, 1.0])
    assert blend.counts(4000).tolist() == [3000, 1000]
    # Spread evenly: every window of 40 positions is within one sample of 3:1.
    src, _ = blend(np.arange(4000))
    window = np.convolve(src == 0, np.ones(40, int), mode="valid")
    assert window.min() >= 29 and window.max() <= 31
    odd = Blend([1.0, 1.0, 1.0])
    assert abs(odd.counts(3 * Blend.PERIOD).tolist()[0] - Blend.PERIOD) <= 3
    with pytest.raises(DataError, match="weight"):
        Blend([1.0, 0.0])


def test_each_source_read_at_most_once_per_its_own_epoch(two_sources):
    order, _ = global_order(two_sources, 2, 2, 40)  # 160 samples: ~9 epochs of a, ~6 of b
    for k, n in ((0, 13), (1, 7)):
        ids = [i for s, i in order if s == k]
        epochs = [ids[j : j + n] for j in range(0, len(ids), n)]
        for e in epochs:
            assert len(set(e)) == len(e)  # at most once per epoch
        for e in epochs[:-1]:
            assert sorted(e) == list(range(n))  # complete epochs read everything
        assert epochs[0] != epochs[1]  # reshuffled each epoch
    share = sum(1 for s, _ in order if s == 0) / len(order)
    assert share == pytest.approx(0.75, abs=0.01)


@pytest.mark.parametrize("m,d_before,d_after,rounds_before", [(2, 2, 3, 6), (1, 4, 2, 7), (3, 1, 2, 4)])
def test_mixture_resume_at_another_dp_size_equals_the_straight_run(two_sources, m, d_before, d_after, rounds_before):
    total = 72
    full, _ = global_order(two_sources, 1, 1, total)
    first, states = global_order(two_sources, m, d_before, rounds_before)
    assert len({json.dumps(s, sort_keys=True) for s in states}) == 1
    pos = states[0]["global_position"]
    second, _ = global_order(two_sources, m, d_after, (total - pos) // (m * d_after), start_state=states[0])
    assert first + second == full[: len(first) + len(second)]


def test_resume_with_other_weights_is_refused(two_sources):
    _, states = global_order(two_sources, 1, 1, 3)
    other = [(two_sources[0][0], 1.0), (two_sources[1][0], 1.0)]
    s = TokenStream(other, seq_len=T, micro_batch_size=1, seed=7, prefetch=0)
    with pytest.raises(DataError, match="mixture"):
        s.load_state_dict(states[0])
    s.close()


def test_one_source_mixture_is_the_plain_stream(two_sources):
    plain, _ = global_order(two_sources[0][0], 2, 1, 10)
    mixed, _ = global_order([two_sources[0]], 2, 1, 10)
    assert plain == mixed


def test_sources_must_share_one_tokenizer(tmp_path):
    byte = ByteTokenizer()
    info = {"hash": byte.hash, "name": "byte", "vocab_size": 257, "eos_id": 256}
    tokens = np.arange(200, dtype=np.uint16) % 256
    write_arrays(tmp_path / "a", {"train": tokens, "val": tokens}, info)
    write_arrays(tmp_path / "b", {"train": tokens, "val": tokens}, {**info, "hash": "another000000000"})
    cfg = DataConfig(sources=[DataSource(str(tmp_path / "a"), 1.0), DataSource(str(tmp_path / "b"), 1.0)])
    with pytest.raises(DataError, match=r"data.sources\[1\].*share one tokenizer"):
        prepare_sources(cfg)
    data, tok = prepare_sources(DataConfig(sources=cfg.sources[:1]))
    assert data == [(tmp_path / "a", 1.0)] and tok.hash == byte.hash


def test_config_refuses_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight"):
        load_config(TINY, ["data.sources=[{path: x, weight: 0}]"])
    with pytest.raises(ConfigError, match="data.sources"):
        load_config(TINY, ["data.path=y", "data.sources=[{path: x, weight: 1}]"])


def test_data_stats_reports_shares_and_shows_decoded_samples(tmp_path):
    for name, word in (("web", "alpha"), ("code", "beta")):
        text = tmp_path / f"{name}.txt"
        text.write_text("".join(f"{word} {i} " * 8 + "\n" for i in range(60)))
        preprocess_files([text], tmp_path / name, "byte", val_fraction=0.0, progress=False, log=None)
    config = tmp_path / "mix.yaml"
    config.write_text(
        "extends: " + str(TINY) + "\n"
        "data:\n  sources:\n"
        f"    - {{path: {tmp_path / 'web'}, weight: 0.75}}\n"
        f"    - {{path: {tmp_path / 'code'}, weight: 0.25}}\n"
    )
    proc = run_loomtrain(
        "data-stats",
        config,
        "train.seq_len=32",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "--steps",
        "400",
        "--show",
        "3",
        timeout=120,
        cwd=tmp_path,
    )
    report = json.loads(proc.stdout)  # one JSON object, nothing else on stdout
    assert report["samples"] == 400 * 8 and report["tokens"] == 400 * 8 * 32
    web, code = report["sources"]
    assert web["path"] == str(tmp_path / "web")
    assert web["samples"] / report["samples"] == pytest.approx(0.75, abs=0.02)
    assert web["samples"] + code["samples"] == report["samples"]
    assert web["tokens"] == web["samples"] * 32
    shown = report["shown"]
    assert len(shown) == 3
    for item in shown:
        word = "alpha" if item["source"] == str(tmp_path / "web") else "beta"
        assert word in item["text"]

    bad = run_loomtrain(
        "data-stats",
        config,
        f"data.sources=[{{path: {tmp_path / 'nope'}, weight: 1}}]",
        "--steps",
        "1",
        timeout=120,
        cwd=tmp_path,
        rc=1,
    )
    assert len(bad.stderr.strip().splitlines()) == 1 and "data.sources[0].path" in bad.stderr


def test_data_stats_takes_a_context_parallel_config(tmp_path, capsys):
    """One data rank is a whole tp x cp group: a config with parallel.cp=2 is checked as one."""
    from loomtrain.launcher.cli import data_stats

    text = tmp_path / "web.txt"
    text.write_text("".join(f"alpha {i} " * 8 + "\n" for i in range(60)))
    preprocess_files([text], tmp_path / "web", "byte", val_fraction=0.0, progress=False, log=None)
    overrides = [f"data.path={tmp_path / 'web'}", "parallel.cp=2", "train.seq_len=32", "train.global_batch_size=8"]
    assert data_stats.main([str(TINY), *overrides, "train.micro_batch_size=4", "--steps", "2"]) == 0, (
        capsys.readouterr()
    )
    assert json.loads(capsys.readouterr().out)["samples"] == 2 * 8


@pytest.mark.usefixtures("one_thread")
def test_training_on_a_mixture_resumes_exactly(tmp_path):
    """The run reads data.sources (train and val), saves the mixture position, and
    4 steps straight == 2 steps, stop, resume, 2 steps (bitwise, CPU fp32)."""
    from loomtrain.launcher.training.loop import run_training

    for name, word in (("web", "alpha"), ("code", "def beta():")):
        docs = tmp_path / f"{name}.jsonl"
        docs.write_text("".join(json.dumps({"text": f"{word} {i}\n" * 6}) + "\n" for i in range(80)))
        preprocess_files([docs], tmp_path / name, "byte", val_fraction=0.05, progress=False, log=None)
    common = [
        *launch.SMALLEST,
        "train.global_batch_size=4",
        "train.max_steps=4",
        "train.warmup_steps=1",
        "eval.every_steps=2",
        "eval.batches=1",
        "eval.num_samples=0",
        "log.progress=plain",
        "log.tensorboard=false",
        "checkpoint.every_steps=2",
        f"data.sources=[{{path: {tmp_path / 'web'}, weight: 2}}, {{path: {tmp_path / 'code'}, weight: 1}}]",
    ]
    straight = run_training(load_config(TINY, [*common, f"run.dir={tmp_path / 'straight'}"]))
    split_dir = tmp_path / "split"
    first = run_training(load_config(TINY, [*common, f"run.dir={split_dir}", "checkpoint.stop_at_step=2"]))
    second = run_training(load_config(TINY, [*common, f"run.dir={split_dir}"]))
    assert len(straight.losses) == 4
    assert first.losses + second.losses == straight.losses
    state = json.loads((split_dir / "checkpoints" / "step_00000004" / "data" / "dp_00000.json").read_text())
    assert state["global_position"] == 16 and len(state["mixture"]["quotas"]) == 2
