"""Preprocess at scale: a rerun after a kill resumes from OUTPUT.partial/ and gives
the same bytes as a clean run; `--ray` gives the same bytes as the local command;
`--bpe-sample-bytes` trains BPE on a deterministic sample."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch import child_env, run_child, run_loomtrain
from loomtrain.data_pipeline import DataError, train_bpe
from loomtrain.data_pipeline import preprocess as pp

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def corpus(tmp_path: Path, n_files: int = 8) -> list[Path]:
    """JSONL files of many documents, one .txt and a Parquet-free mix, different sizes."""
    files = []
    for f in range(n_files):
        path = tmp_path / "in" / f"part{f:02d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        docs = [
            " ".join(WORDS[(f * 7 + d * 3 + k) % len(WORDS)] for k in range(20 + d % 13)) + f" {f}.{d}\n"
            for d in range(30 + 5 * f)
        ]
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        files.append(path)
    text = tmp_path / "in" / "zz_notes.txt"
    text.write_text("".join(f"line {i}: {' '.join(WORDS[i % 5 :])}\n" for i in range(300)))
    return [*files, text]


@pytest.fixture
def bpe_json(tmp_path) -> Path:
    tok = train_bpe(iter([" ".join(WORDS)] * 20 + [f"line {i}" for i in range(50)]), 300)
    tok.save(tmp_path / "tok")
    return tmp_path / "tok" / "tokenizer.json"


def tree(path: Path) -> dict[str, str]:
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return run_loomtrain("preprocess", "--no-progress", *args, env=env, timeout=300, rc=None)


# Killed with SIGKILL inside the 5th input file (tokens half written, no completion marker),
# or after the shards are assembled, just before the publishing rename.
KILLER = """
import os, signal, sys
from pathlib import Path
from loomtrain.data_pipeline import documents, preprocess as pp, remote_output, staging
calls = {"n": 0}
original = staging.PartWriter.add
def add(self, *a, **k):
    original(self, *a, **k)
    calls["n"] += 1
    if calls["n"] == 5:
        self._tok.file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
def publish(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[4] == "tokenizing":
    staging.PartWriter.add = add
else:  # shards assembled, not yet published (the folder output's rename)
    remote_output.publish = publish
files = documents.expand_inputs([sys.argv[1]])
pp.preprocess_files(files, sys.argv[2], sys.argv[3], workers=1, val_fraction=0.1, shard_tokens=500,
                    sources=[sys.argv[1]], progress=False)
"""


@pytest.mark.parametrize("when", ["tokenizing", "assembled"])
def test_killed_preprocess_rerun_resumes_and_equals_a_clean_run(tmp_path, bpe_json, when):
    corpus(tmp_path)
    pattern = str(tmp_path / "in" / "*")
    args = [
        "--input",
        pattern,
        "--tokenizer",
        bpe_json,
        "--val-fraction",
        "0.1",
        "--shard-tokens",
        "500",
        "--workers",
        "1",
    ]
    clean = cli(*args, "--output", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr

    out = tmp_path / "resumed"
    run_child([sys.executable, "-c", KILLER, pattern, str(out), str(bpe_json), when], timeout=300, rc=-9)
    work = tmp_path / "resumed.partial"
    assert not out.exists() and work.is_dir()
    done = 4 if when == "tokenizing" else 9
    assert len(list((work / "parts").glob("*.json"))) == done
    if when == "tokenizing":
        assert (work / "parts" / "000004.tokens.tmp").stat().st_size > 0  # the 5th file, half done
    else:
        assert (work / "index.json").is_file()

    rerun = cli(*args, "--output", out)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{done} of 9 input files already done" in rerun.stdout + rerun.stderr
    assert not work.exists()
    assert tree(out) == tree(tmp_path / "clean")


def test_rerun_with_other_inputs_starts_afresh(tmp_path):
    files = corpus(tmp_path, 3)
    out = tmp_path / "o"
    with pytest.raises(DataError, match="missing.jsonl: No such file"):
        pp.preprocess_files([*files, tmp_path / "missing.jsonl"], out, progress=False, log=None)
    bad = tmp_path / "in" / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        pp.preprocess_files([*files, bad], out, progress=False, log=None)
    assert len(list((tmp_path / "o.partial" / "parts").glob("*.json"))) == 3
    index = pp.preprocess_files(files[:2], out, progress=False, log=None)  # another job: the parts are not reused
    assert index["run"]["resumed_files"] == 0 and index["stats"]["files"] == 2
    assert not (tmp_path / "o.partial").exists()


def test_bpe_sample_bytes_is_deterministic_and_bounded(tmp_path):
    files = corpus(tmp_path)
    sample = list(pp.bpe_sample(files, "text", 4000))
    assert sample == list(pp.bpe_sample(files, "text", 4000))
    size = sum(len(t.encode()) for t in sample)
    assert 4000 <= size <= 4000 + len(files) * 200
    assert all(any(t.startswith(w) for w in WORDS + ["line"]) for t in sample)
    a = pp.preprocess_files(
        files, tmp_path / "a", "bpe", bpe_vocab_size=300, bpe_sample_bytes=4000, progress=False, log=None
    )
    b = pp.preprocess_files(
        files, tmp_path / "b", "bpe", bpe_vocab_size=300, bpe_sample_bytes=4000, progress=False, log=None
    )
    assert a["tokenizer"]["hash"] == b["tokenizer"]["hash"]
    assert tree(tmp_path / "a") == tree(tmp_path / "b")


@pytest.mark.slow
def test_preprocess_on_ray_equals_the_local_command(tmp_path, bpe_json, ray_head):
    corpus(tmp_path)
    pattern = str(tmp_path / "in" / "*")
    args = ["--input", pattern, "--tokenizer", bpe_json, "--val-fraction", "0.1", "--shard-tokens", "700"]
    local = cli(*args, "--output", tmp_path / "local", "--workers", "2")
    assert local.returncode == 0, local.stderr
    env = child_env(**ray_head.env)
    on_ray = cli(
        *args, "--output", tmp_path / "ray", "--ray", "--address", ray_head.gcs_address, "--workers", "2", env=env
    )
    assert on_ray.returncode == 0, on_ray.stderr
    assert "9 input files as Ray tasks, 2 at a time" in on_ray.stdout + on_ray.stderr
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")

    (tmp_path / "in" / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    bad = cli(*args, "--output", tmp_path / "ray2", "--ray", "--address", ray_head.gcs_address, env=env)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("loomtrain preprocess: error: ")
    assert "bad.jsonl:2: not valid JSON" in bad.stderr.strip().splitlines()[-1]


def test_malformed_ray_address_is_one_line(tmp_path):
    files = corpus(tmp_path, 1)
    proc = cli("--input", files[0], "--output", tmp_path / "o", "--ray", "--address", "http://head:8265")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--address 'http://head:8265'" in lines[0] and "scheme 'http' is not ray" in lines[0]


def test_a_file_given_twice_is_tokenized_twice(tmp_path):
    files = corpus(tmp_path, 2)
    once = pp.preprocess_files(files[:2], tmp_path / "once", val_fraction=0, workers=2, progress=False, log=None)
    twice = pp.preprocess_files(
        [files[0], files[1], files[0]], tmp_path / "twice", val_fraction=0, workers=2, progress=False, log=None
    )
    docs0 = pp.preprocess_files(files[:1], tmp_path / "one", val_fraction=0, progress=False, log=None)["stats"][
        "documents"
    ]
    assert twice["stats"]["documents"] == once["stats"]["documents"] + docs0
