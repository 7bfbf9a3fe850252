"""Token shards in object storage, against the local S3 server (s3_server.py):
`preprocess --output s3://...` writes the shard set there (never a local ./s3: folder), training
streams it window by window and yields exactly what the same shards on disk yield, across a
resume at another DP size, within data.cache_bytes; a shard deleted or rewritten mid-run is
one line naming it."""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from loomtrain import storage
from loomtrain.data_pipeline import DataError, TokenStream, prepare_sources
from loomtrain.data_pipeline.preprocess import preprocess_files, tokenize_file
from loomtrain.data_pipeline.remote_output import MARKER, staging_dir
from loomtrain.launcher.cli.preprocess import main as preprocess_main
from loomtrain.launcher.config import ConfigError, DataConfig, DataSource

T = 16  # seq_len
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


@pytest.fixture(autouse=True)
def _staging_in_tmp(tmp_path, monkeypatch):
    """preprocess stages a URI output under the temp folder: this test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def text_inputs(folder: Path, files: int = 3, docs: int = 40, seed: int = 0) -> str:
    """A few JSONL files of random-word documents; -> their glob."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))}) for _ in range(docs)]
        (folder / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder / "*.jsonl")


def chat_inputs(folder: Path, records: int = 60, seed: int = 1) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "chat.jsonl"
    rows = []
    for _ in range(records):
        q, a = (" ".join(rng.choices(WORDS, k=rng.randint(1, 4))) for _ in range(2))
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def objects(uri: str) -> dict[str, bytes]:
    fs, root = storage.object_store(uri)
    fs.invalidate_cache()
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def preprocess(inputs: str, output: str, *extra: str) -> int:
    return preprocess_main(
        ["--input", inputs, "--output", output, "--val-fraction", "0.1", "--no-progress", "--shard-tokens", *extra]
    )


def run_ranks(source, m: int, d: int, rounds: int, state=None, seq_len=T, **kw):
    """d DP ranks for `rounds` rounds -> (every micro batch's tensors as lists, in global order; the state)."""
    streams = [
        TokenStream(source, seq_len=seq_len, micro_batch_size=m, dp_rank=r, dp_size=d, seed=3, **kw) for r in range(d)
    ]
    if state is not None:
        for s in streams:
            s.load_state_dict(state)
    out = []
    for _ in range(rounds):
        for s in streams:
            out.append([t.tolist() for t in next(s)])
    state = streams[0].state_dict()
    for s in streams:
        s.close()
    return out, state


def test_preprocess_to_s3_uploads_the_shard_set_and_writes_no_local_s3_folder(tmp_path, s3_bucket, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    inputs = text_inputs(tmp_path / "in")
    uri = f"{s3_bucket}/ds"
    assert preprocess(inputs, str(tmp_path / "local"), "700") == 0
    assert preprocess(inputs, uri, "700") == 0
    assert not (tmp_path / "s3:").exists() and not list(Path("/").glob("s3:*"))  # the old bug: ./s3:/bucket/ds
    local = files(tmp_path / "local")
    assert len([n for n in local if n.startswith("train_")]) >= 4  # several shards went up
    assert objects(uri) == local  # every object byte for byte, the index included; no marker left
    assert not staging_dir(uri).exists() and not Path(str(staging_dir(uri)) + ".partial").exists()

    # A rerun with fewer, larger shards replaces the earlier output and leaves none of its shards.
    assert preprocess(inputs, str(tmp_path / "local2"), "5000") == 0
    assert preprocess(inputs, uri, "5000") == 0
    assert objects(uri) == files(tmp_path / "local2")

    # A prefix holding something preprocess did not write is refused in one line, nothing touched.
    fs, root = storage.object_store(s3_bucket)
    fs.pipe_file(f"{root}/other/notes.txt", b"mine")
    capsys.readouterr()
    assert preprocess(inputs, f"{s3_bucket}/other", "700") == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--output s3://" in err and "not a loomtrain preprocess output" in err
    assert objects(f"{s3_bucket}/other") == {"notes.txt": b"mine"}
    capsys.readouterr()
    assert preprocess(inputs, "s3://no-such-bucket-here/ds", "700") == 1
    assert "the bucket no-such-bucket-here does not exist" in capsys.readouterr().err

    # An upload cut short (the marker and some shards there, no index) is ours: the rerun completes it.
    fs.pipe_file(f"{root}/cut/{MARKER}", b"{}")
    fs.pipe_file(f"{root}/cut/train_00000.bin", b"partial")
    assert preprocess(inputs, f"{s3_bucket}/cut", "700") == 0
    assert objects(f"{s3_bucket}/cut") == local


def test_a_failed_upload_is_one_line_and_a_rerun_resumes_from_the_kept_parts(tmp_path, s3_bucket, monkeypatch, capsys):
    inputs = text_inputs(tmp_path / "in")
    uri = f"{s3_bucket}/ds"
    fs = storage.object_store(uri)[0]  # fsspec's cached instance: the one preprocess gets
    put_file = fs.put_file

    def refused(local, remote, **kw):  # the store refuses one shard (a policy, a quota)
        if remote.endswith("train_00002.bin"):
            raise PermissionError("Access Denied\nmore detail")
        return put_file(local, remote, **kw)

    monkeypatch.setattr(fs, "put_file", refused)
    assert preprocess(inputs, uri, "700") == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"loomtrain preprocess: error: --output {uri}: cannot upload train_00002.bin (PermissionError: Access Denied)"
    )
    assert "index.json" not in objects(uri)  # no data set there until it is whole
    monkeypatch.setattr(fs, "put_file", put_file)
    assert preprocess(inputs, uri, "700") == 0
    assert "3 of 3 input files already done" in capsys.readouterr().out  # tokenized once, kept locally
    assert preprocess(inputs, str(tmp_path / "local"), "700") == 0
    assert objects(uri) == files(tmp_path / "local")


def test_preprocess_with_an_executor_uploads_from_the_driver(tmp_path, s3_bucket):
    """`preprocess --ray` hands the files to tasks and writes on the driver: the same path to the store."""

    class InProcessTasks:  # RayTasks' interface, without a cluster
        name = "in-process"

        def __call__(self, jobs, tokenizer, text_field, skip_bad_lines, *, max_in_flight, on_file, log=None, **kw):
            for i, path in jobs:
                on_file(i, tokenize_file(path, tokenizer, text_field, skip_bad_lines, **kw))
            return 1

    src = chat_inputs(tmp_path / "in")
    kw = {"val_fraction": 0.1, "progress": False, "log": None, "shard_tokens": 900}
    preprocess_files([src], tmp_path / "local", "byte", **kw)
    preprocess_files([src], f"{s3_bucket}/chat", "byte", executor=InProcessTasks(), **kw)
    assert objects(f"{s3_bucket}/chat") == files(tmp_path / "local")


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_streaming_from_s3_equals_disk_across_a_resume_at_another_dp_size(tmp_path, s3_bucket, kind):
    """Plain windows (text) and packed documents with loss masks (chat): the same batches,
    token for token, from S3 as from disk, straight and resumed from dp 2 at dp 4 and at dp 1."""
    uri = f"{s3_bucket}/{kind}"
    seq = T if kind == "text" else 128  # a chat record is one document and must fit a window
    if kind == "text":
        inputs = text_inputs(tmp_path / "in", files=2, docs=15)
        assert preprocess(inputs, str(tmp_path / "local"), "300") == 0
        assert preprocess(inputs, uri, "300") == 0
    else:
        src = chat_inputs(tmp_path / "in", records=40)
        for out in (tmp_path / "local", uri):
            preprocess_files([src], out, "byte", val_fraction=0.1, progress=False, log=None, shard_tokens=300)
    m = 2
    disk_first, state = run_ranks(tmp_path / "local", m, 2, 4, seq_len=seq)
    s3_first, s3_state = run_ranks(uri, m, 2, 4, seq_len=seq, cache_bytes=4096)
    assert s3_first == disk_first and s3_state == state
    for d in (4, 1):
        rounds = 24 // (m * d)
        disk_rest, _ = run_ranks(tmp_path / "local", m, d, rounds, state, seq_len=seq)
        s3_rest, _ = run_ranks(uri, m, d, rounds, s3_state, seq_len=seq, cache_bytes=0, prefetch=0)
        assert s3_rest == disk_rest
    straight, _ = run_ranks(tmp_path / "local", m, 1, 4 * 2 + 12, seq_len=seq)
    flat = [row for batch in disk_first + disk_rest for row in zip(*batch)]
    assert flat == [row for batch in straight for row in zip(*batch)][: len(flat)]
    # And the run's own entry points: data.path as a URI gives the same directory and tokenizer,
    # and the run's streams read it within data.cache_bytes.
    got, tok = prepare_sources(DataConfig(path=uri + "/"), tmp_path / "cache")
    assert got == uri and tok.hash == prepare_sources(DataConfig(path=str(tmp_path / "local")))[1].hash
    if kind == "text":
        from loomtrain.launcher.config import RunConfig
        from loomtrain.launcher.training.startup import val_stream
        from loomtrain.parallel import Topology

        cfg = RunConfig()
        cfg.data.path, cfg.data.cache_bytes, cfg.train.seq_len = uri, 12345, seq
        with val_stream(cfg, got, Topology(world_size=1, rank=0), tok) as stream:
            assert stream.cache.capacity == 12345 and stream.sources[0].dir == uri


def test_a_file_uri_is_written_and_streamed_as_the_path_is(tmp_path):
    """file:// goes through the same code as s3:// (fsspec's local filesystem): the same shards,
    the same batches over many rounds with the read-ahead threads at work."""
    inputs = text_inputs(tmp_path / "in", files=2, docs=30)
    assert preprocess(inputs, str(tmp_path / "local"), "900") == 0
    assert preprocess(inputs, f"file://{tmp_path}/uri/ds", "900") == 0
    assert files(tmp_path / "uri" / "ds") == files(tmp_path / "local")
    by_uri, _ = run_ranks(f"file://{tmp_path}/uri/ds", 4, 2, 60, cache_bytes=1 << 12, prefetch=2)
    by_path, _ = run_ranks(tmp_path / "local", 4, 2, 60)
    assert by_uri == by_path


def test_a_rank_reads_only_its_windows_within_cache_bytes_and_waits_for_none_in_the_steady_state(tmp_path, s3_bucket):
    inputs = text_inputs(tmp_path / "in", files=2, docs=60)
    uri = f"{s3_bucket}/ds"
    assert preprocess(inputs, uri, "2000") == 0
    split_bytes = sum(len(v) for k, v in objects(uri).items() if k.startswith("train_"))
    m, batches = 4, 20
    batch_bytes = m * (T + 1) * 2  # uint16 tokens
    cap = 8 * batch_bytes
    s = TokenStream(uri, seq_len=T, micro_batch_size=m, dp_rank=1, dp_size=2, seed=0, cache_bytes=cap)
    for _ in range(batches):
        next(s)
    cache = s.cache
    assert 0 < cache.peak_bytes <= cap
    # This rank's windows and those fetched ahead, nothing else: a fraction of the split.
    assert batches * batch_bytes <= cache.fetched_bytes <= (batches + 8) * batch_bytes < split_bytes / 2
    s.close()

    # Steps longer than the fetches in flight and the making of a batch (here: a step lasts until
    # no fetch is in flight and the prefetch queue is full): once the read-ahead is under way,
    # every window was fetched before its batch was made.
    s = TokenStream(uri, seq_len=T, micro_batch_size=m, seed=0, cache_bytes=cap)

    def step():
        while s._queue is not None and (s.cache.in_flight or not s._queue.full()):
            time.sleep(0.005)
        next(s)

    for _ in range(4):
        step()
    waits = s.cache.waits
    for _ in range(16):
        step()
    assert s.cache.waits == waits
    s.close()

    # 0 = the read-ahead only: the next prefetch + 1 batches, nothing kept.
    s = TokenStream(uri, seq_len=T, micro_batch_size=m, seed=0, cache_bytes=0, prefetch=2)
    for _ in range(12):
        next(s)
    assert s.cache.peak_bytes <= 3 * batch_bytes and s.cache.hits == 0
    s.close()

    # A cache that holds the split: its second epoch costs no GET.
    small = f"{s3_bucket}/small"
    assert preprocess(text_inputs(tmp_path / "small", files=1, docs=3), small, "2000") == 0
    s = TokenStream(small, seq_len=T, micro_batch_size=1, seed=0, cache_bytes=1 << 20, prefetch=0)
    for _ in range(2 * s.samples_per_epoch):
        next(s)
    assert s.epoch == 2 and s.cache.fetches == s.samples_per_epoch and s.cache.hits >= s.samples_per_epoch
    s.close()


@pytest.mark.parametrize("change", ["deleted", "overwritten", "overwritten-while-open"])
def test_a_shard_deleted_or_overwritten_mid_run_is_one_line_naming_it(tmp_path, s3_bucket, change):
    """Deleted, or rewritten with other bytes of the same size (only the ETag tells): before the
    run first reads the shard (checked against the listing when it is opened), or after
    (every ranged read carries If-Match: the listed ETag)."""
    inputs = text_inputs(tmp_path / "in", files=1, docs=30)
    uri = f"{s3_bucket}/ds"
    one_shard = change == "overwritten-while-open"
    assert preprocess(inputs, uri, "100000" if one_shard else "500") == 0
    s = TokenStream(uri, seq_len=T, micro_batch_size=2, seed=0, prefetch=0, cache_bytes=0)
    next(s)
    # The shard the next batch's first sample starts in (with one shard: the one just read).
    sample = int(s.locate(s.rank_positions(s.position))[1][0])
    shard = s.sources[0].files[int(np.searchsorted(s.sources[0].starts, sample * T, side="right")) - 1]
    fs, path = storage.object_store(shard)
    if change == "deleted":
        fs.rm_file(path)
    else:
        fs.pipe_file(path, bytes(len(fs.cat_file(path))))
    with pytest.raises(DataError) as err:
        next(s)
    line = str(err.value)
    assert "\n" not in line and shard in line
    expected = {
        "deleted": "disappeared during the run",
        "overwritten": "changed during the run (listed as",
        "overwritten-while-open": "changed during the run (its ETag is no longer",
    }
    assert expected[change] in line
    s.close()
    if change == "deleted":  # and a new run says so before it starts
        with pytest.raises(DataError, match=rf"shard {shard} is missing: index says \d+ tokens"):
            TokenStream(uri, seq_len=T, micro_batch_size=2)


def test_config_takes_shard_uris_and_cache_bytes():
    DataConfig(path="s3://bucket/ds").validate("data")
    DataConfig(sources=[DataSource("gs://bucket/a"), DataSource("runs/b")]).validate("data")
    assert DataConfig().cache_bytes == 1 << 30
    for cfg, key in (
        (DataConfig(path="nope://bucket/ds"), "data.path"),
        (DataConfig(sources=[DataSource("nope://b/a")]), r"data.sources\[0\].path"),
        (DataConfig(cache_bytes=-1), "data.cache_bytes"),
    ):
        with pytest.raises(ConfigError, match=rf"^{key}: (unknown storage scheme .*)?expected .*got"):
            cfg.validate("data")
