"""Final weights on object storage, against the local S3 server
(tests/s3_server.py, a bucket per test): `import --output s3://...`, `generate s3://...`,
`export s3://... --output s3://...` (byte for byte the export from disk), the refusals of a
non-empty --output applied to a URI, `model.init_from=s3://...` and a run whose final/ goes
to run.storage=s3://... (each rank uploads its own file, the manifest last), and a damaged or
missing object of final/ named in one line. No URI ever becomes a local folder `./s3:/...`.
"""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from hf_fixtures import tiny_llama
from launch import QUIET, run_loomtrain
from loomtrain import storage
from loomtrain.launcher import cli
from loomtrain.launcher.checkpoints.safetensors_source import WeightSourceError
from loomtrain.launcher.checkpoints.weight_source import check_init_from, open_source
from loomtrain.launcher.config_loader import ConfigError, load_config

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "def add(a"


@pytest.fixture(scope="module")
def hf_and_disk(tmp_path_factory, bpe):
    """A tiny Llama saved by transformers, and the same imported to disk (one per module)."""
    base = tmp_path_factory.mktemp("final_s3")
    tiny_llama(base / "hf", bpe)
    assert cli.main(["import", "--format", "hf", str(base / "hf"), "--output", str(base / "disk")]) == 0
    return base / "hf", base / "disk"


@pytest.fixture
def env(s3_bucket, hf_and_disk, tmp_path, monkeypatch):
    """(bucket, HF folder, its import on disk): this host's object cache in tmp_path, the
    working directory tmp_path/cwd (where a URI taken for a path would leave `s3:`)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    yield s3_bucket, *hf_and_disk
    assert not any(p.name.startswith("s3:") for p in (tmp_path / "cwd").iterdir())


def objects(uri: str) -> dict[str, bytes]:
    return {rel: storage.read_object(storage.join(uri, rel)) for rel in storage.list_objects(uri)}


def generated(capsys, where: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(["generate", where, "--prompt", PROMPT, "--max-new-tokens", "16", "--device", "cpu"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_import_to_s3_generates_and_exports_s3_to_s3_as_from_disk(env, tmp_path, capsys, monkeypatch):
    bucket, hf, disk = env
    imp = f"{bucket}/imported"
    assert cli.main(["import", "--format", "hf", str(hf), "--output", imp]) == 0
    stored = objects(imp)
    assert {"config.yaml", "final/manifest.json", "final/model.safetensors", "final/model_config.json"} <= set(stored)
    # the same final/ as the import to disk, byte for byte
    for rel, data in stored.items():
        if rel.startswith("final/"):
            assert data == (disk / rel).read_bytes(), rel
    config = yaml.safe_load(stored["config.yaml"].decode().split("\n", 1)[1])
    assert config["run"]["storage"] == imp and config["model"]["init_from"] == f"{imp}/final"
    assert stored["config.yaml"].decode().startswith(f"# made by `loomtrain import --format hf {hf.resolve()}`")

    # generate: the run's storage and its final/ give what the disk import gives
    want = generated(capsys, str(disk))
    assert want[0] == 0 and len(want[1]) > len(PROMPT) + 4
    assert generated(capsys, imp)[:2] == want[:2]
    assert generated(capsys, f"{imp}/final")[:2] == want[:2]

    # export from S3 to S3 equals the export from disk to disk, byte for byte
    capsys.readouterr()
    assert cli.main(["export", str(disk), "--format", "hf", "--output", str(tmp_path / "exp")]) == 0
    assert cli.main(["export", imp, "--format", "hf", "--output", f"{bucket}/exp"]) == 0
    assert f"final weights {imp}/final -> {bucket}/exp (LlamaForCausalLM" in capsys.readouterr().out
    exported = objects(f"{bucket}/exp")
    local = {p.name: p.read_bytes() for p in (tmp_path / "exp").iterdir()}
    assert exported == local and "config.json" in exported
    # ... and an export over it replaces it (an earlier export is the one thing --output may hold)
    assert cli.main(["export", imp, "--format", "hf", "--output", f"{bucket}/exp", "--dtype", "bf16"]) == 0
    assert b'"bfloat16"' in storage.read_object(f"{bucket}/exp/config.json")

    # refusals as on disk, nothing touched: export into an import, import into an export
    capsys.readouterr()
    before = objects(imp)
    assert cli.main(["export", imp, "--format", "hf", "--output", imp]) == 2
    assert re.fullmatch(
        rf"loomtrain export: --output {imp}: holds config\.yaml and \d+ more objects, not an earlier export; "
        r"choose a new or empty prefix \(nothing in it was touched\)",
        one_line(capsys.readouterr().err),
    )
    assert cli.main(["import", "--format", "hf", str(hf), "--output", f"{bucket}/exp"]) == 2
    assert one_line(capsys.readouterr().err).startswith(
        f"loomtrain import: --output {bucket}/exp: holds config.json and 4 more, not a previous import of {hf}"
    )
    # importing the same source again replaces the earlier import
    assert cli.main(["import", "--format", "hf", str(hf), "--output", imp]) == 0
    assert objects(imp) == before

    # init_from naming the run's own storage is refused, as its own run.dir is
    with pytest.raises(ConfigError, match=r"^model\.init_from: expected weights outside run\.storage="):
        check_init_from(load_config(disk / "config.yaml", [f"run.storage={imp}", f"model.init_from={imp}/final"]))
    # an HF folder on S3 (sharded: an index and several files) reads as from disk
    hf_uri = f"{bucket}/hf"
    storage.upload_folder(hf, hf_uri, ("config.json",))
    remote, here = open_source(hf_uri), open_source(hf)
    assert remote.description == f"Hugging Face llama model {hf_uri}"
    assert all(torch.equal(remote.read(name), here.read(name)) for name in here.refs)

    # the pre-flight reads the safetensors headers with ranged reads, no tensor: a fresh cache
    # keeps nothing; a config that disagrees with the weights is refused naming the field
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))
    check_init_from(load_config(disk / "config.yaml", [f"run.dir={tmp_path / 'ft'}", f"model.init_from={imp}"]))
    assert [p for p in (tmp_path / "fresh").rglob("*") if p.is_file()] == []
    with pytest.raises(ConfigError) as err:
        check_init_from(load_config(disk / "config.yaml", ["model.d_model=128", f"model.init_from={hf_uri}"]))
    assert str(err.value) == f"model.d_model: the config has 128, but the weights in model.init_from={hf_uri} have 64"


def test_a_damaged_or_missing_object_of_final_is_named_in_one_line(env, capsys):
    bucket, hf, _ = env
    imp = f"{bucket}/imported"
    assert cli.main(["import", "--format", "hf", str(hf), "--output", imp]) == 0
    assert generated(capsys, imp)[0] == 0  # this host's cache now holds the good copy

    weights = f"{imp}/final/model.safetensors"
    data = bytearray(storage.read_object(weights))
    data[len(data) // 2] ^= 0x01
    storage.write_object(weights, bytes(data))  # same size: only its sha256 tells
    damaged = f"{weights}: fails its sha256 checksum"
    rc, _, err = generated(capsys, imp)
    assert rc == 2 and one_line(err).startswith(f"loomtrain generate: {damaged}"), err
    assert cli.main(["export", imp, "--output", f"{bucket}/exp"]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"loomtrain export: {damaged}")
    assert storage.list_objects(f"{bucket}/exp") == {}  # nothing uploaded
    with pytest.raises(WeightSourceError, match=f"^{damaged}"):
        open_source(imp)  # what each rank of a run with model.init_from={imp} reads first

    storage.delete_objects(f"{imp}/final", ["tokenizer/tokenizer.json"])
    rc, _, err = generated(capsys, f"{imp}/final")
    assert rc == 2 and one_line(err).startswith(f"loomtrain generate: {imp}/final/tokenizer/tokenizer.json: missing")

    storage.delete_objects(f"{imp}/final", ["manifest.json"])  # not committed: no final weights
    rc, _, err = generated(capsys, imp)
    assert rc == 2 and one_line(err).startswith(f"loomtrain generate: {imp}: no manifest.json there or under")


@pytest.mark.slow
def test_a_run_from_s3_weights_writes_its_final_to_s3_and_generate_reads_it(env, tmp_path, capsys, data_cache):
    """Two ranks start from model.init_from=s3://... (a run's storage: its final/), and each
    uploads its share of the final weights to {run.storage}/final; nothing lands in run.dir.
    generate reads them; export from the run's storage reads its checkpoint there."""
    bucket, hf, disk = env
    imp, run = f"{bucket}/imported", f"{bucket}/ft"
    assert cli.main(["import", "--format", "hf", str(hf), "--output", imp]) == 0
    proc = run_loomtrain(
        "train",
        disk / "config.yaml",
        f"run.dir={tmp_path / 'ft'}",
        f"run.storage={run}",
        f"model.init_from={imp}",
        f"data.tokenizer={hf}",
        f"data.cache_dir={data_cache}",
        "data.max_files=10",
        "train.max_steps=2",
        "train.seq_len=32",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "checkpoint.every_steps=0",
        *QUIET,
        nproc=2,
    )
    assert f"model.init_from: starting from loomtrain weights {imp}/final" in proc.stdout
    assert f"final weights: {run}/final" in proc.stdout + proc.stderr
    stored = storage.list_objects(f"{run}/final")
    assert {
        "manifest.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model_config.json",
    } <= set(stored)
    assert not (tmp_path / "ft" / "final").exists() and not (tmp_path / "ft" / ".tmp-final-upload").exists()
    rc, out, err = generated(capsys, run)
    assert rc == 0 and out.startswith(PROMPT) and len(out) > len(PROMPT) + 4, err

    # export from the run's storage takes its newest checkpoint (as from disk), whose fp32 masters
    # are the final weights: the same export as from final/
    assert cli.main(["export", run, "--output", str(tmp_path / "from_ckpt")]) == 0
    assert f"checkpoint {run}/checkpoints/step_00000002 -> " in capsys.readouterr().out
    assert cli.main(["export", f"{run}/final", "--output", str(tmp_path / "from_final")]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "from_ckpt" / name).read_bytes() == (tmp_path / "from_final" / name).read_bytes(), name
    # model.init_from gone: a run whose storage has a checkpoint resumes from it (nothing to check),
    # a fresh one is refused naming the URI
    gone = [f"run.dir={tmp_path / 'ft'}", f"model.init_from={bucket}/gone"]
    check_init_from(load_config(disk / "config.yaml", [*gone, f"run.storage={run}"]))
    with pytest.raises(ConfigError, match=f"^model.init_from: {bucket}/gone: neither a run's final/"):
        check_init_from(load_config(disk / "config.yaml", [*gone, f"run.storage={bucket}/fresh"]))

    # without final/ (its manifest gone), generate takes the checkpoint, as from disk, and says so
    storage.delete_objects(f"{run}/final", ["manifest.json"])
    assert generated(capsys, run) == (
        0,
        out,
        f"loomtrain generate: no final/ weights: using checkpoint {run}/checkpoints/step_00000002\n",
    )
