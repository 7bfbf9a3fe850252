"""`loomtrain preprocess` stops in one line: Ctrl-C (locally, with a worker pool, and with
--ray) says how many input files were kept and that a rerun resumes (exit 130), and the rerun
does; a read-only or full output location names the path and the cause (exit 1) and changes
nothing the user owns; `--ray --address` with no cluster there gives up in seconds naming it.

The disks are real: a folder made read-only, the command run without root's permission override
(setpriv drops CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH); a small tmpfs (the tests run as root).
Ctrl-C is a real SIGINT to the command's whole process group, as a terminal sends it, at a
known point (tests/preprocess_ctrl_c_driver.py).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launch import ROOT, child_env, loomtrain_cmd, run_child
from loomtrain.data_pipeline import preprocess as pp
from loomtrain.data_pipeline.tokenizer import train_bpe
from loomtrain.launcher.cli import preprocess as cli
from loomtrain.launcher.cluster import preprocess_tasks

DRIVER = ROOT / "tests" / "preprocess_ctrl_c_driver.py"
AS_A_USER = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
N_FILES = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, str]:
    """Six 64 KiB JSONL files (together over the size at which BPE starts a worker pool) and a
    small BPE's tokenizer.json."""
    root = tmp_path_factory.mktemp("corpus")
    docs = [" ".join(f"w{(i * 7 + j) % 97}" for j in range(60)) for i in range(300)]
    for f in range(N_FILES):
        lines = [json.dumps({"text": f"file {f}: {d}"}) + "\n" for d in docs]
        (root / f"in_{f}.jsonl").write_text("".join(lines)[: 64 << 10].rsplit("\n", 1)[0] + "\n")
    train_bpe(iter(docs), 300).save(root)
    return root, str(root / "tokenizer.json")


def preprocess_args(corpus: tuple[Path, str], out: Path, *extra: str) -> list[str]:
    root, tokenizer = corpus
    return ["preprocess", "--no-progress", "--input", str(root / "in_*.jsonl"), "--output", str(out), *extra]


def shards(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.bin"))}


def reference(corpus, tmp_path: Path, tokenizer: str) -> dict[str, str]:
    """The shards of an uninterrupted run."""
    root, _ = corpus
    ref = tmp_path / "reference"
    files = sorted(root.glob("in_*.jsonl"))
    pp.preprocess_files(files, ref, tokenizer, workers=1, progress=False, log=None)
    return shards(ref)


def listing(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def ctrl_c_after(stop_after: int, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """The command, Ctrl-C pressed once input file `stop_after` is written (in its own session,
    so the SIGINT to its process group reaches nothing else)."""
    return subprocess.run(
        [sys.executable, str(DRIVER), str(stop_after), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,
    )


def assert_kept_two(proc, out: Path) -> Path:
    """The command stopped with one line saying files 0 and 1 are kept (and they are); -> the work folder."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    work = out.with_name(out.name + ".partial")
    assert text.strip().splitlines()[-1] == (
        f"loomtrain preprocess: interrupted: 2 of {N_FILES} input files are tokenized and kept in {work}; "
        "run the same command again to resume from there"
    ), text
    assert sorted(p.name for p in (work / "parts").glob("*.json")) == ["000000.json", "000001.json"]
    assert not out.exists()
    return work


def test_ctrl_c_with_a_worker_pool_says_what_was_kept_exits_130_and_the_rerun_resumes(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    args = preprocess_args(corpus, out, "--tokenizer", corpus[1], "--workers", "2")
    proc = ctrl_c_after(1, args, child_env())
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # the pool's workers too
    work = assert_kept_two(proc, out)
    capsys.readouterr()
    assert cli.main(args[1:]) == 0  # the rerun
    assert f"resuming {work}: 2 of {N_FILES} input files already done" in capsys.readouterr().out
    assert shards(out) == reference(corpus, tmp_path, corpus[1])


@pytest.mark.slow
def test_ctrl_c_with_ray_says_what_was_kept_exits_130_and_the_rerun_resumes(corpus, tmp_path, ray_head):
    out = tmp_path / "out"
    # One task in flight: files finish in input order, so "after file 1" means files 0 and 1.
    args = preprocess_args(corpus, out, "--ray", "--address", ray_head.gcs_address, "--workers", "1")
    env = child_env(**ray_head.env)
    work = assert_kept_two(ctrl_c_after(1, args, env), out)
    rerun = run_child(loomtrain_cmd(*args), env=env, timeout=180)
    assert f"resuming {work}: 2 of {N_FILES} input files already done" in rerun.stdout + rerun.stderr
    assert shards(out) == reference(corpus, tmp_path, "byte")


def test_read_only_output_location_is_one_line_and_changes_nothing(corpus, tmp_path):
    parent = tmp_path / "shelf"
    parent.mkdir()
    (parent / "notes.txt").write_text("mine")
    parent.chmod(0o555)
    out = parent / "out"
    as_user = AS_A_USER if os.geteuid() == 0 else []
    proc = run_child([*as_user, *loomtrain_cmd(*preprocess_args(corpus, out))], rc=1, timeout=120)
    assert proc.stderr.strip().splitlines() == [
        f"loomtrain preprocess: error: --output {out}: {out}.partial: Permission denied; "
        "make it writable, or choose another --output"
    ]
    assert listing(parent) == {"notes.txt": "mine"}


@pytest.fixture
def small_disk(tmpfs):
    """A 512k tmpfs (room for three of the six files' parts)."""
    return tmpfs("512k")


def test_full_output_disk_is_one_line_keeps_the_finished_files_and_the_rerun_resumes(
    corpus, tmp_path, small_disk, capsys
):
    (small_disk / "notes.txt").write_text("mine")
    out = small_disk / "out"
    work = small_disk / "out.partial"
    args = preprocess_args(corpus, out, "--tokenizer", "byte")[1:]
    assert cli.main(args) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    kept = sorted(p.name for p in (work / "parts").glob("*.json"))
    assert 0 < len(kept) < N_FILES, kept
    assert len(lines) == 1 and lines[0].startswith(f"loomtrain preprocess: error: --output {out}: {work}/"), lines
    assert lines[0].endswith(
        f": No space left on device; free space there, or choose another --output; {len(kept)} of {N_FILES} "
        f"input files are tokenized and kept in {work}, where a rerun of the same command resumes"
    ), lines
    assert (small_disk / "notes.txt").read_text() == "mine" and not out.exists()
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)  # space freed
    assert cli.main(args) == 0
    assert f"resuming {work}: {len(kept)} of {N_FILES} input files already done" in capsys.readouterr().out
    assert shards(out) == reference(corpus, tmp_path, "byte")
    assert (small_disk / "notes.txt").read_text() == "mine"


def test_ray_address_with_no_cluster_fails_in_seconds_naming_it(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    start = time.monotonic()
    assert cli.main([*preprocess_args(corpus, out, "--ray", "--address", "127.0.0.1:1")[1:]]) == 1
    assert time.monotonic() - start < 10
    assert capsys.readouterr().err.strip().splitlines() == [
        "loomtrain preprocess: error: --address 127.0.0.1:1: cannot connect (Connection refused); check the "
        "address (HOST:6379, the head's GCS port, or ray://HEAD:10001) and that the cluster is up"
    ]
    assert list(tmp_path.iterdir()) == []  # checked before anything is written


class _Dashboard(http.server.BaseHTTPRequestHandler):
    """An HTTP/1 server, as the dashboard (8265) is: it accepts connections but is no GCS."""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("scheme,server", [("", "a Ray GCS"), ("ray://", "a Ray client server")])
def test_ray_address_of_a_port_that_is_not_ray_fails_in_seconds_naming_it(
    scheme, server, corpus, tmp_path, capsys, monkeypatch
):
    # ray.init waited here without end (HOST:PORT), or 30 s (ray://) and then went on to write.
    monkeypatch.setattr(preprocess_tasks, "REACH_TIMEOUT_S", 2.0)  # a client server's probe waits it out
    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Dashboard)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    address = f"{scheme}127.0.0.1:{http_server.server_address[1]}"
    try:
        start = time.monotonic()
        assert cli.main([*preprocess_args(corpus, tmp_path / "out", "--ray", "--address", address)[1:]]) == 1
        assert time.monotonic() - start < 10
    finally:
        http_server.shutdown()
        http_server.server_close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"loomtrain preprocess: error: --address {address}: it accepts connections but does not answer as "
        f"{server} within 2 s (is it the dashboard port, 8265?); check the address (HOST:6379, the head's GCS "
        "port, or ray://HEAD:10001) and that the cluster is up"
    ], lines
    assert list(tmp_path.iterdir()) == []
