"""Bad input is one line naming the path or value, never a library traceback:
`train.lr=inf|nan`, a malformed `--address` / `ray.address`, `generate --device cuda`
without CUDA, `generate --temperature nan`, a corrupt or incomplete `final/`.
An unknown command is named on the first line (the usage follows), and every command in the
dispatcher's table reaches its own parser."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import one_line
from loomtrain.launcher.cli import generate, train
from loomtrain.launcher.config_loader import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_learning_rate_is_a_config_error(value, capsys):
    with pytest.raises(ConfigError, match=rf"^train\.lr: expected a finite number, got {value}$"):
        load_config(TINY, [f"train.lr={value}"])
    assert train.main([TINY, f"train.lr={value}"]) == 2
    assert "train.lr: expected a finite number" in one_line(capsys.readouterr().err)


def test_any_non_finite_float_knob_is_named(capsys):
    with pytest.raises(ConfigError, match=r"^model\.rope_theta: expected a finite number"):
        load_config(TINY, ["model.rope_theta=inf"])
    with pytest.raises(ConfigError, match=r"^eval\.temperature: expected a finite number"):
        load_config(TINY, ["eval.temperature=nan"])


@pytest.mark.parametrize(
    "address, says",
    [
        ("http://head:80x", "port"),
        ("http://:8265", "no host name"),
        ("ftp://head:8265", "scheme 'ftp'"),
        ("head:99999", "port"),
        ("http://he ad:8265", "white space"),
    ],
)
@pytest.mark.parametrize("command", ["status", "logs", "stop"])
def test_malformed_jobs_address_is_one_line(command, address, says, capsys):
    from loomtrain.launcher.cli import jobs

    assert jobs.main([command, "some-job", "--address", address]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"loomtrain {command}: error: --address {address!r}") and says in line, line


def test_malformed_submit_address_and_ray_address(tmp_path, capsys, monkeypatch):
    from loomtrain.launcher.cli import jobs

    assert jobs.main(["submit", TINY, f"run.dir={tmp_path}", "--address", "http://head:port"]) == 1
    assert "--address 'http://head:port'" in one_line(capsys.readouterr().err)
    monkeypatch.setenv("RAY_ADDRESS", "http://:1")
    assert jobs.main(["status", "x"]) == 1
    assert "RAY_ADDRESS 'http://:1'" in one_line(capsys.readouterr().err)
    for bad in ("head", "head:x", "http://head:8265", "ray://:10001"):
        with pytest.raises(ConfigError, match=rf"^ray\.address {bad!r}"):
            load_config(TINY, [f"ray.address={bad}"])
    for good in ("auto", "10.0.0.1:6379", "ray://head:10001", "'[::1]:6379'"):
        load_config(TINY, [f"ray.address={good}"])
    with pytest.raises(ConfigError, match=r"^ray\.address: cannot parse the value of 'ray\.address=\[::1\]:6379'"):
        load_config(TINY, ["ray.address=[::1]:6379"])  # YAML reads [ as a list: quote it


@pytest.fixture(scope="module")
def final_dir(tmp_path_factory) -> Path:
    from final_weights import save_final
    from loomtrain.data_pipeline.tokenizer import ByteTokenizer
    from loomtrain.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    run = tmp_path_factory.mktemp("run")
    save_final(Transformer(cfg, seed=0), cfg, ByteTokenizer(), run / "final")
    return run


def test_generate_device_cuda_without_cuda_and_nan_temperature(final_dir, capsys, monkeypatch):
    import torch

    assert generate.main([str(final_dir), "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert generate.main([str(final_dir), "--device", "cuda"]) == 2
    assert "--device cuda: this machine has no usable CUDA device" in one_line(capsys.readouterr().err)
    for flag, value in (
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--temperature", "-1"),
        ("--top-p", "nan"),
        ("--device", "tpu"),
    ):
        assert generate.main([str(final_dir), flag, value]) == 2
        assert f"{flag}: expected" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "damage, name",
    [
        ("truncate", "model.safetensors"),
        ("garble", "model.safetensors"),
        ("delete", "model.safetensors"),
        ("delete", "model_config.json"),
        ("garble", "model_config.json"),
        ("garble", "tokenizer/tokenizer.json"),
        ("delete", "tokenizer"),
    ],
)
def test_corrupt_or_incomplete_final_is_one_line(final_dir, tmp_path, damage, name, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(final_dir, run)
    victim = run / "final" / name
    if damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
    elif damage == "garble":
        victim.write_bytes(b"\x00garbage{")
    elif victim.is_dir():
        shutil.rmtree(victim)
    else:
        victim.unlink()
    assert generate.main([str(run)]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(run / "final" / name.split("/")[0]) in line and "incomplete or corrupt" in line, line


def test_unknown_command_is_named_and_every_command_reaches_its_own_parser(capsys):
    from loomtrain.launcher import cli

    assert cli.main(["trian"]) == 2
    assert capsys.readouterr().err.startswith("loomtrain: unknown command 'trian'")
    for command in cli.COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0, command
        assert capsys.readouterr().out.startswith(f"usage: loomtrain {command} "), command


def test_help_shows_every_default(capsys, monkeypatch):
    """`loomtrain COMMAND --help` shows each option's default value, unless the option has none
    (None, an off flag) or its help already says what happens by default."""
    import argparse

    from loomtrain.launcher import cli

    made: list[argparse.ArgumentParser] = []
    init = argparse.ArgumentParser.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(argparse.ArgumentParser, "__init__", record)
    shown = {}
    for command in cli.COMMANDS:
        made.clear()
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        (parser,) = [p for p in made if p.prog == f"loomtrain {command}"]
        for action in parser._actions:
            default = action.default
            if default is None or default is False or default == [] or default == argparse.SUPPRESS:
                continue
            said = "default" in " ".join((action.help or "").split())
            assert said or f"(default: {default})" in out, (command, action.option_strings or action.dest, default)
            shown[(command, action.dest)] = said
        shown[command] = out
    assert (
        "vocabulary size a --tokenizer bpe is trained up to (a small corpus stops short) (default: 4096)"
        in (shown["preprocess"])
    )
    assert "validation split seed (default: 0)" in shown["preprocess"]
    assert "tokens to generate (default: 100)" in shown["generate"]
    assert "(default: None)" not in " ".join(v for v in shown.values() if isinstance(v, str))
