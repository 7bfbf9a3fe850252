"""A Hugging Face model id (`org/name`, `org/name@rev`) is accepted wherever a Hugging Face folder
is (`loomtrain import`, `model.init_from`), resolved in the local Hugging Face cache that
HF_HUB_CACHE points at (laid out here as huggingface_hub lays it out); nothing is downloaded, a
missing id says where it looked and how to fetch it, an existing folder of the same name wins
and a URI stays a URI."""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_fixtures import tiny_llama
from launch import one_line
from loomtrain.hf_cache import hub_cache_dir, looks_like_model_id, resolve_model
from loomtrain.launcher import cli
from loomtrain.launcher.checkpoints.weight_source import check_init_from, open_source
from loomtrain.launcher.config_loader import ConfigError, load_config
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_thread")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache, repo: str, folder, commit: str = COMMIT, ref: str = "main"):
    """`folder`'s files as the hub cache holds a download of `repo`: blobs are plain copies here."""
    org, name = repo.split("/")
    base = cache / f"models--{org}--{name}"
    shutil.copytree(folder, base / "snapshots" / commit)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / ref).write_text(commit)
    return base / "snapshots" / commit


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, bpe):
    src = tmp_path_factory.mktemp("hf") / "tiny"
    tiny_llama(src, bpe)
    return src


@pytest.fixture
def cache(tmp_path, monkeypatch, hf_folder):
    cache = tmp_path / "hub"
    lay_out_cache(cache, "org/tiny-llama", hf_folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any attempt to reach the hub fails loudly
    monkeypatch.chdir(tmp_path)
    return cache


def imported(run) -> tuple[dict, str]:
    weights = load_file(str(run / "final" / "model.safetensors"))
    return weights, (run / "final" / "model_config.json").read_text()


def test_import_by_id_equals_import_by_folder(cache, hf_folder, tmp_path, capsys):
    assert hub_cache_dir() == cache
    assert cli.main(["import", str(hf_folder), "--output", str(tmp_path / "by-folder")]) == 0
    for n, model_id in enumerate(["org/tiny-llama", f"org/tiny-llama@{COMMIT}", "org/tiny-llama@main"]):
        out = tmp_path / f"by-id-{n}"
        assert cli.main(["import", model_id, "--output", str(out)]) == 0
        (a, a_cfg), (b, b_cfg) = imported(tmp_path / "by-folder"), imported(out)
        assert a_cfg == b_cfg and sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a)
    said = capsys.readouterr().out
    assert f"models--org--tiny-llama/snapshots/{COMMIT}" in said


def test_a_missing_id_says_where_it_looked_and_how_to_fetch_it(cache, tmp_path, capsys):
    for model_id, fetch in (
        ("meta-llama/Llama-3.2-1B", "hf download meta-llama/Llama-3.2-1B"),
        ("org/tiny-llama@v2", "hf download org/tiny-llama --revision v2"),
    ):
        capsys.readouterr()
        assert cli.main(["import", model_id, "--output", str(tmp_path / "run")]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"loomtrain import: {model_id}: no such folder") and str(cache) in line, line
        assert f"`{fetch}`" in line and "nothing is downloaded" in line, line
        assert not (tmp_path / "run").exists()


def test_an_existing_folder_wins_and_a_uri_stays_a_uri(cache, hf_folder, tmp_path):
    assert resolve_model("org/tiny-llama").parent.parent.name == "models--org--tiny-llama"
    shutil.copytree(hf_folder, tmp_path / "org" / "tiny-llama")  # a relative folder of the id's name
    assert str(resolve_model("org/tiny-llama")) == "org/tiny-llama"
    assert resolve_model("s3://bucket/org/tiny-llama") == "s3://bucket/org/tiny-llama"
    for not_an_id in ("s3://b/x", "/abs/path", "./rel", "~/x", "a/b/c", "org--x/y", "", "data/tokenizer.json"):
        assert not looks_like_model_id(not_an_id), not_an_id
    for an_id in ("gpt2", "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.2-1B@main", f"org/x@{COMMIT}"):
        assert looks_like_model_id(an_id), an_id


def test_init_from_takes_a_model_id(cache, tmp_path):
    source = open_source("org/tiny-llama")
    assert source.model_cfg.n_kv_heads == 2 and "models--org--tiny-llama" in source.description
    cli.main(["import", "org/tiny-llama", "--output", str(tmp_path / "run")])
    cfg = load_config(
        tmp_path / "run" / "config.yaml", [f"run.dir={tmp_path / 'ft'}", "model.init_from=org/tiny-llama"]
    )
    check_init_from(cfg)  # the id resolves, the shapes match
    cfg = load_config(tmp_path / "run" / "config.yaml", [f"run.dir={tmp_path / 'ft'}", "model.init_from=org/absent"])
    with pytest.raises(ConfigError, match=r"^model\.init_from: org/absent: no such folder, .*`hf download org/absent`"):
        check_init_from(cfg)


def test_data_tokenizer_takes_a_model_id(cache, tmp_path):
    from loomtrain.data_pipeline import load_tokenizer

    cli.main(["import", "org/tiny-llama", "--output", str(tmp_path / "run")])
    base = [f"run.dir={tmp_path / 'ft'}"]
    cfg = load_config(tmp_path / "run" / "config.yaml", [*base, "data.tokenizer=org/tiny-llama"])
    assert (
        load_tokenizer(cfg.data.tokenizer).vocab_size
        == load_tokenizer(tmp_path / "run" / "final" / "tokenizer").vocab_size
    )
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: org/absent: no such folder, .*`hf download org/absent`"):
        load_config(tmp_path / "run" / "config.yaml", [*base, "data.tokenizer=org/absent"])


def test_the_cache_is_where_huggingface_hub_puts_it(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hub_cache_dir() == tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert hub_cache_dir() == tmp_path / "hub-cache"
