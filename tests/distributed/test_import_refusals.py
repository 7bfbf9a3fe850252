"""`loomtrain import --format hf` refuses a malformed or non-finite source, and an --output it
must not write into, in one line naming the file and the field or tensor, with nothing the user
owns changed and nothing left behind; `model.init_from` finds a NaN in its
weights before step 1, naming the tensor."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from hf_fixtures import tiny_llama
from launch import QUIET, child_env, loomtrain_cmd
from loomtrain.launcher import cli
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("one_thread")

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, bpe) -> Path:
    """A tiny Llama saved by transformers in shards (tests/hf_fixtures.py); each test copies it."""
    directory = tmp_path_factory.mktemp("hf") / "llama"
    tiny_llama(directory, bpe)
    return directory


@pytest.fixture
def src(hf_model, tmp_path) -> Path:
    return Path(shutil.copytree(hf_model, tmp_path / "hf"))


# What the user owns, byte for byte --------------------------------------------------------------
def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under root, by relative path."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def import_cmd(src: Path, out: Path) -> list[str]:
    return ["import", "--format", "hf", str(src), "--output", str(out)]


def refused(capsys, tmp_path: Path, src: Path, out: Path) -> str:
    """Run the import in this process: exit 2, one line on stderr and no traceback, and nothing
    under tmp_path (the source, --output and what is around them) created or changed."""
    capsys.readouterr()  # the set-up's progress bars
    before = snapshot(tmp_path)
    assert cli.main(import_cmd(src, out)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("loomtrain import: "), err
    assert captured.out == ""
    assert snapshot(tmp_path) == before
    return err


# Editing a saved model --------------------------------------------------------------------------
def fine_tune_args(run: Path, src: Path, tmp_path: Path, data_cache: Path, *extra: str) -> list:
    """`loomtrain train`'s arguments for two short steps of the imported run's config from `src`."""
    return [
        run / "config.yaml",
        f"run.dir={tmp_path / 'ft'}",
        f"model.init_from={src}",
        f"data.tokenizer={src}",
        f"data.cache_dir={data_cache}",
        "data.max_files=10",
        "train.max_steps=2",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "checkpoint.every_steps=0",
        *QUIET,
        *extra,
    ]


def index_of(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def shard_of(src: Path, key: str) -> Path:
    return src / index_of(src)["weight_map"][key]


def edit_tensor(src: Path, key: str, edit) -> Path:
    """Rewrite the shard holding `key` with edit(its tensor) in its place; -> that shard."""
    path = shard_of(src, key)
    tensors = load_file(str(path))
    tensors[key] = edit(tensors[key].clone())
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def with_value(value: float):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t[3, 5] = value
        return t

    return edit


def read_raw(path: Path) -> tuple[dict, bytes]:
    """(a safetensors file's header, its data bytes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def last_tensor(path: Path) -> str:
    header, _ = read_raw(path)
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def edit_config(src: Path, edit) -> None:
    path = src / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


# Malformed sources -----------------------------------------------------------------------
def truncated_file(src: Path) -> str:
    """One model.safetensors (as most small models are saved) cut short by 100 bytes."""
    tensors = {}
    for f in sorted(src.glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    (src / "model.safetensors.index.json").unlink()
    path = src / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    cut = last_tensor(path)
    path.write_bytes(path.read_bytes()[:-100])
    return f"{path}: truncated: tensor {cut!r} ends at byte"


def truncated_header(src: Path) -> str:
    path = shard_of(src, Q_PROJ)
    path.write_bytes(path.read_bytes()[:40])
    return f"{path}: truncated: 40 bytes, too short for the safetensors header"


def index_points_elsewhere(src: Path) -> str:
    index = index_of(src)
    right = index["weight_map"][Q_PROJ]
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != right)
    index["weight_map"][Q_PROJ] = wrong
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return (
        f"{src / 'model.safetensors.index.json'}: weight_map puts tensor {Q_PROJ!r} in {wrong}, "
        f"which does not hold it (it is in {right})"
    )


def header_size_mismatch(src: Path) -> str:
    path = shard_of(src, Q_PROJ)
    header, data = read_raw(path)
    header[Q_PROJ]["shape"] = [64, 65]  # the bytes hold [64, 64]
    write_raw(path, header, data)
    return f"{path}: tensor {Q_PROJ!r}: data_offsets"


def hidden_size_a_string(src: Path) -> str:
    edit_config(src, lambda c: {**c, "hidden_size": "64"})
    return f"{src / 'config.json'}: hidden_size='64': expected a positive integer"


def config_a_list(src: Path) -> str:
    edit_config(src, lambda c: [c])
    return f"{src / 'config.json'}: a JSON list, expected an object of model settings"


def int8_tensor(src: Path) -> str:
    path = edit_tensor(src, Q_PROJ, lambda t: t.mul(50).to(torch.int8))
    return f"{path}: tensor {Q_PROJ!r} is I8; loomtrain reads F32, BF16, F16, F64 weights"


MALFORMED = [
    truncated_file,
    truncated_header,
    index_points_elsewhere,
    header_size_mismatch,
    hidden_size_a_string,
    config_a_list,
    int8_tensor,
]


@pytest.mark.parametrize("malform", MALFORMED, ids=lambda f: f.__name__)
def test_a_malformed_source_is_refused_in_one_line_naming_the_file_and_field(tmp_path, capsys, src, malform):
    """each of these was a SafetensorError, TypeError, AttributeError or KeyError
    traceback (the int8 one leaving OUTPUT/final.tmp/ behind)."""
    expected = malform(src)
    err = refused(capsys, tmp_path, src, tmp_path / "run")
    assert err.startswith(f"loomtrain import: {expected}"), err


def test_an_output_that_is_a_file_is_refused(tmp_path, capsys, src):
    """--output an existing file was a NotADirectoryError traceback."""
    out = tmp_path / "notes.txt"
    out.write_text("my notes\n")
    err = refused(capsys, tmp_path, src, out)
    assert err == f"loomtrain import: --output {out}: is a file; expected a new or empty directory"


def test_an_output_under_a_read_only_folder_is_refused_without_capabilities(tmp_path, src):
    """--output under a folder the user may not write was a PermissionError traceback.
    As root the import runs without the capabilities that ignore file permissions."""
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    out = parent / "run"
    before = snapshot(tmp_path)
    caps = "-dac_override,-dac_read_search"
    as_user = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"] if os.geteuid() == 0 else []
    argv = [*as_user, *loomtrain_cmd(*import_cmd(src, out))]
    proc = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "\n" not in err and "Traceback" not in err, err
    assert err == f"loomtrain import: --output {out}: cannot write {out}: Permission denied (nothing was left there)"
    assert snapshot(tmp_path) == before


# Non-finite weights ----------------------------------------------------------------------
@pytest.mark.parametrize("value, what", [(float("nan"), "1 NaN"), (float("-inf"), "1 inf")])
def test_a_non_finite_weight_in_the_source_is_refused_naming_the_tensor(tmp_path, capsys, src, value, what):
    """one NaN in a q_proj imported silently, and `generate` printed garbage."""
    path = edit_tensor(src, Q_PROJ, with_value(value))
    err = refused(capsys, tmp_path, src, tmp_path / "run")
    assert err.startswith(f"loomtrain import: {path}: tensor {Q_PROJ!r} holds {what} of 4,096 values read;"), err


def test_init_from_weights_holding_an_inf_is_refused_before_step_1(tmp_path, capsys, src, data_cache):
    """`train` with model.init_from on such weights ran `loss nan -> nan`, exited 0 and
    wrote final/ (with more steps the stop message blamed the learning rate). The tensor is
    named while the weights are loaded, before the first step; the run leaves no folder."""
    run = tmp_path / "run"
    assert cli.main(import_cmd(src, run)) == 0  # the config the run uses, from the clean model
    path = edit_tensor(src, Q_PROJ, with_value(float("inf")))
    capsys.readouterr()
    before = snapshot(tmp_path)
    rc = cli.main(["train", *map(str, fine_tune_args(run, src, tmp_path, data_cache))])
    captured = capsys.readouterr()
    assert rc == 2, captured.out + captured.err
    assert captured.err == (
        f"loomtrain: config error: model.init_from: {path}: tensor {Q_PROJ!r} holds 1 inf of 4,096 values read; "
        "the weights must be finite numbers (a diverged run or a corrupt copy? take the weights from before it "
        "went wrong)\n"
    )
    assert "step 1" not in captured.out
    assert snapshot(tmp_path) == before  # no tmp_path/ft, the source and the import as they were


# Folders import must not write into ---------------------------------------------------------
def test_an_output_holding_user_files_or_the_source_itself_is_refused(tmp_path, capsys, src):
    """a folder holding thesis.txt got final/ and config.yaml beside it, and SRC == OUTPUT
    wrote into the model's own folder."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.txt").write_text("chapter 1\n")
    err = refused(capsys, tmp_path, src, out)
    assert err == (
        f"loomtrain import: --output {out}: holds thesis.txt, not a previous import of {src}; "
        "choose a new or empty directory (nothing in it was touched)"
    )
    err = refused(capsys, tmp_path, src, src)
    assert err == (
        f"loomtrain import: --output {src}: is the source directory itself; "
        "choose a new or empty directory (nothing in it was touched)"
    )


def test_an_import_replaces_a_previous_import_of_the_same_source_only(tmp_path, capsys, src, hf_model):
    """an empty folder, or a previous import of the same source, is what --output may be;
    an import of another source is refused like any other full folder."""
    out = tmp_path / "run"
    out.mkdir()
    assert cli.main(import_cmd(src, out)) == 0  # an empty folder
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "final"]
    assert cli.main(import_cmd(src, out)) == 0  # the same import again
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "final"]
    err = refused(capsys, tmp_path, hf_model, out)
    assert err == (
        f"loomtrain import: --output {out}: holds an import of {src.resolve()}, not of {hf_model.resolve()}; "
        "choose a new or empty directory (nothing in it was touched)"
    )


@pytest.mark.slow
def test_init_from_a_nan_in_one_tp_ranks_half_ends_every_rank_in_the_same_line(tmp_path, src, data_cache):
    """At tp 2 each rank reads only its own rows of q_proj: a NaN in the last row stopped rank 1
    with the right line while rank 0 went on into DeepSpeed's first collective and ended in a
    gloo traceback (exit 1). Every rank now prints rank 1's line and exits 2."""
    run = tmp_path / "run"
    assert cli.main(import_cmd(src, run)) == 0
    path = edit_tensor(src, Q_PROJ, lambda t: t.index_fill_(0, torch.tensor([t.shape[0] - 1]), float("nan")))
    argv = loomtrain_cmd("train", *fine_tune_args(run, src, tmp_path, data_cache, "parallel.tp=2"), nproc=2)
    proc = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # each rank's line (two processes on one pipe: they may interleave), then torchrun's summary
    expected = f"loomtrain: config error: model.init_from: {path}: tensor {Q_PROJ!r} holds 64 NaN of 2,048 values read"
    assert proc.stderr.count(expected) == 2, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1 and "ChildFailedError" in proc.stderr, proc.stderr[-3000:]
    assert "gloo" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]  # not 1: a config error
    assert not (tmp_path / "ft" / "checkpoints").exists()
