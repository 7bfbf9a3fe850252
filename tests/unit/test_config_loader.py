"""Config loading: extends chains, overrides, and one-line errors naming the dotted key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from launch import run_loomtrain
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.config_loader import ConfigError, load_config, resolve, save_config, valid_keys, validate

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_every_shipped_config_loads_at_its_world_size():
    assert load_config(CONFIGS / "tiny.yaml").model.d_model > 0
    assert load_config(CONFIGS / "dryrun-1gpu.yaml").train.precision == "bf16"
    big = load_config(CONFIGS / "gpt-1b.yaml", world_size=8)
    assert (big.parallel.tp, big.ray.num_workers) == (2, 8)
    huge = load_config(CONFIGS / "gpt-7b.yaml", world_size=32)
    assert (huge.parallel.tp, huge.model.d_model, huge.ray.num_workers) == (8, 4096, 32)
    # gpt-7b extends gpt-1b extends tiny: keys it does not set come from the chain.
    assert huge.model.vocab_size == big.model.vocab_size == 32768


def test_extends_chain_relative_paths_and_overrides(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "base.yaml", "train:\n  lr: 0.01\n  max_steps: 7\nrun:\n  name: base\n")
    write(tmp_path / "sub" / "mid.yaml", "extends: ../base.yaml\ntrain:\n  lr: 0.02\n")
    leaf = write(tmp_path / "sub" / "leaf.yaml", "extends: mid.yaml\nrun:\n  name: leaf\n")
    cfg = load_config(leaf, ["train.max_steps=9", "model.n_kv_heads=2"])
    assert cfg.train.lr == 0.02  # mid wins over base
    assert cfg.train.max_steps == 9  # command line wins over all
    assert cfg.run.name == "leaf" and cfg.run.dir == "runs/leaf"  # interpolation resolved
    assert cfg.model.n_kv_heads == 2


def test_extends_cycle_is_refused(tmp_path):
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="extends: cycle"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lrr=1", "train.lrr: unknown key (did you mean 'train.lr'?)"),
        ("lr=1", "lr: unknown key (did you mean 'train.lr'?)"),
        ("trian.lr=1", "trian.lr: unknown key (did you mean 'train.lr'?)"),
        ("model.d_modle=64", "did you mean 'model.d_model'?"),
        ("train.lr=abc", "train.lr: wrong type"),
        ("train.max_steps=1.5", "train.max_steps: wrong type"),
        ("log.tensorboard=maybe", "log.tensorboard: wrong type"),
        ("train.precision=fp8", "train.precision: expected one of fp32, bf16, fp16, got 'fp8'"),
        ("train.lr_schedule=step", "train.lr_schedule: expected one of cosine, linear, constant"),
        ("log.progress=fancy", "log.progress: expected one of auto, bar, plain"),
        ("checkpoint.resume=/no/such/ckpt", "checkpoint.resume: expected auto, never or the path"),
        ("train.global_batch_size=20", "train.global_batch_size: expected a multiple of"),
        ("parallel.zero_stage=4", "parallel.zero_stage: expected 0, 1, 2 or 3"),
        ("model.n_heads=5", "model.n_heads: d_model=192 must be divisible"),
        ("train.seq_len=4096", "train.seq_len: expected at most model.max_seq_len"),
        ("parallel.tp=2", "parallel.tp: expected a divisor of the world size 1"),
        ("model.vocab_size=256", "model.vocab_size: expected at least the tokenizer's vocabulary 257"),
    ],
)
def test_errors_name_the_dotted_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "tiny.yaml", [override])
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_a_vocabulary_smaller_than_the_tokenizers_is_refused_before_any_work(tmp_path, bpe):
    """Token ids must fit the embedding: refused when the config loads (it was refused only once
    the data was prepared and the run folder made), for a tokenizer.json and for `bpe` over
    shards whose index names their vocabulary; a bpe still to be trained is checked by build_data."""
    import json

    from loomtrain.data_pipeline.tokenizer import HFTokenizer

    tok = HFTokenizer(bpe)
    tok.save(tmp_path / "tok")
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.yaml", [f"data.tokenizer={tmp_path / 'tok'}", "model.vocab_size=256"])
    assert str(err.value) == (
        f"model.vocab_size: expected at least the tokenizer's vocabulary {tok.vocab_size} "
        f"(data.tokenizer={tmp_path / 'tok'}), got 256"
    )
    assert load_config(CONFIGS / "tiny.yaml", [f"data.tokenizer={tmp_path / 'tok'}"]).model.vocab_size == 320
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "index.json").write_text(json.dumps({"tokenizer": {"vocab_size": 514}}))
    with pytest.raises(
        ConfigError, match=rf"^model\.vocab_size: .* vocabulary 514 \(the tokenizer of {shards}\), got 320$"
    ):
        load_config(CONFIGS / "tiny.yaml", [f"data.path={shards}", "data.tokenizer=bpe"])
    assert load_config(CONFIGS / "tiny.yaml", ["data.tokenizer=bpe"]).model.vocab_size == 320  # trained later


def test_loader_runs_every_sections_own_validate_with_its_dotted_prefix(monkeypatch):
    cfg = resolve(CONFIGS / "tiny.yaml")
    seen: list[tuple[str, str]] = []
    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory  # the section's dataclass
        original = cls.validate

        def record(self, prefix, _original=original, _name=cls.__name__):
            seen.append((_name, prefix))
            _original(self, prefix)

        monkeypatch.setattr(cls, "validate", record)
    validate(cfg)
    assert seen == [(f.default_factory.__name__, f.name) for f in dataclasses.fields(RunConfig)]


# One bad field per section, set after loading (a ModelConfig refuses a bad field when built):
# the section's own validate refuses it, named with the section's dotted key.
@pytest.mark.parametrize(
    "section, name, value, message",
    [
        ("run", "dir", "", "run.dir: expected a directory path, got ''"),
        (
            "run",
            "dir",
            "s3://b/runs",
            "run.dir: expected a local directory path, not a URI (checkpoints and final weights go to object "
            "storage with run.storage), got 's3://b/runs'",
        ),
        (
            "data",
            "path",
            "S3://b/ds",
            "data.path: a URI's scheme is written in lower case (s3://b/ds), got 'S3://b/ds'",
        ),
        (
            "data",
            "path",
            "s4://b/ds",
            "data.path: unknown storage scheme s4:// (expected s3://, gs://, az://, file://, or a local path), got "
            "'s4://b/ds'",
        ),
        ("model", "dropout", 1.0, "model.dropout: must be in [0, 1), got 1.0"),
        ("data", "val_fraction", 1.5, "data.val_fraction: expected a number in [0, 1), got 1.5"),
        ("parallel", "timeout_s", 0, "parallel.timeout_s: expected a positive number, got 0"),
        ("train", "min_lr", 1.0, "train.min_lr: expected at most train.lr=0.002, got 1.0"),
        ("eval", "batches", 0, "eval.batches: expected a positive number, got 0"),
        ("log", "every_steps", 0, "log.every_steps: expected a positive number, got 0"),
        ("checkpoint", "keep_last", 0, "checkpoint.keep_last: expected a positive number, got 0"),
        ("ray", "num_workers", 0, "ray.num_workers: expected a positive number, got 0"),
    ],
)
def test_each_section_refuses_its_own_bad_field(section, name, value, message):
    cfg = resolve(CONFIGS / "tiny.yaml")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value) == message


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    bad = write(tmp_path / "bad.yaml", "extends: %s\ntrain:\n  warmup: 5\n" % (CONFIGS / "tiny.yaml"))
    with pytest.raises(
        ConfigError, match=r"train.warmup: unknown key \(did you mean 'train.warmup_steps'\?\) \[.*bad.yaml\]"
    ):
        load_config(bad)


def test_batch_rule_uses_the_world_size():
    # 16 = micro 8 * dp 2: fine at world 2, not at world 4 (dp 4 needs a multiple of 32).
    load_config(CONFIGS / "tiny.yaml", ["train.micro_batch_size=8", "train.global_batch_size=16"], world_size=2)
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        load_config(CONFIGS / "tiny.yaml", ["train.micro_batch_size=8", "train.global_batch_size=16"], world_size=4)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "tiny.yaml", ["train.lr=0.005", "model.n_layers=3"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_valid_keys_cover_every_section():
    keys = valid_keys()
    for key in (
        "model.d_model",
        "parallel.tp",
        "parallel.zero_stage",
        "train.precision",
        "train.max_steps",
        "train.seed",
        "train.micro_batch_size",
        "train.global_batch_size",
        "run.dir",
    ):
        assert key in keys


def test_cli_config_error_exits_2_before_any_work(tmp_path):
    proc = run_loomtrain(
        "train", CONFIGS / "tiny.yaml", f"run.dir={tmp_path / 'run'}", "train.precison=bf16", cwd=tmp_path, rc=2
    )
    assert proc.stderr.strip().splitlines()[-1] == (
        "loomtrain: config error: train.precison: unknown key (did you mean 'train.precision'?) [command line]"
    )
    assert not (tmp_path / "run").exists()
