"""`model.init_from`: training starts from a Hugging Face directory or an imported run's weights.

At tp 2 (torchrun, each rank reading only its slices, the vocabulary padded) the run follows
the tp 1 run within 1e-5 for 5 steps, and the first step's loss is transformers' loss on the
same batch. A model.* that disagrees with the weights is refused naming the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_fixtures import tiny_llama
from launch import losses, run_loomtrain
from loomtrain.launcher import cli
from loomtrain.launcher.checkpoints.weight_source import check_init_from
from loomtrain.launcher.config_loader import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def imported(tmp_path_factory, bpe):
    """(HF dir, its model, the imported run dir). An odd vocabulary, so tp 2 pads it."""
    base = tmp_path_factory.mktemp("init_from")
    vocab = bpe.get_vocab_size() | 1
    model = tiny_llama(base / "hf", bpe, vocab_size=vocab)
    assert cli.main(["import", "--format", "hf", str(base / "hf"), "--output", str(base / "run")]) == 0
    return base / "hf", model, base / "run"


def test_config_disagreeing_with_the_weights_is_refused(imported, tmp_path):
    hf, _, run = imported
    for override, field, ours, theirs in (
        ("model.n_kv_heads=4", "model.n_kv_heads", 4, 2),
        ("model.d_model=128", "model.d_model", 128, 64),
    ):
        for source in (hf, run):
            with pytest.raises(ConfigError) as err:
                check_init_from(
                    load_config(run / "config.yaml", [f"run.dir={tmp_path}", override, f"model.init_from={source}"])
                )
            msg = str(err.value)
            assert msg.startswith(f"{field}: the config has {ours}, ") and msg.endswith(f"have {theirs}"), msg


def test_every_field_disagreeing_with_the_weights_is_in_the_one_line(imported, tmp_path):
    """Starting a config from other weights reported one mismatching field per attempt: all of
    them are in the one line, the first as the key."""
    hf, _, run = imported
    overrides = [f"run.dir={tmp_path}", "model.n_kv_heads=4", "model.d_model=128", "model.n_layers=3"]
    for source in (hf, run):
        with pytest.raises(ConfigError) as err:
            check_init_from(load_config(run / "config.yaml", [*overrides, f"model.init_from={source}"]))
        msg = str(err.value)
        assert "\n" not in msg
        assert msg == (
            f"model.d_model: the config has 128, but the weights in model.init_from={source} have 64; "
            "also model.n_layers: the config has 3, the weights 2; "
            "also model.n_kv_heads: the config has 4, the weights 2"
        )


def test_imported_config_needs_its_own_run_dir_and_takes_an_hf_tokenizer_dir(imported, tmp_path):
    hf, _, run = imported
    with pytest.raises(ConfigError, match=r"^model\.init_from: expected weights outside run\.dir"):
        # its run.dir is the import itself: the end would replace final/
        check_init_from(load_config(run / "config.yaml"))
    cfg = load_config(run / "config.yaml", [f"run.dir={tmp_path}", f"data.tokenizer={hf}"])
    assert cfg.model.init_from == str(run / "final") and cfg.model.n_kv_heads == 2


def test_init_from_a_file_or_nothing_is_refused_in_one_line(imported, tmp_path):
    _, _, run = imported
    (tmp_path / "model.safetensors").write_bytes(b"x")
    for where in (tmp_path / "model.safetensors", tmp_path / "nothing"):
        cfg = load_config(run / "config.yaml", [f"run.dir={tmp_path / 'run'}", f"model.init_from={where}"])
        with pytest.raises(ConfigError) as err:
            check_init_from(cfg)
        assert str(err.value) == (
            "model.init_from: expected a run's final/ directory, a run directory or a Hugging Face model "
            f"directory, got '{where}'"
        )


def test_submit_leaves_a_cluster_only_init_from_to_the_cluster(imported, capsys):
    from loomtrain.launcher.cluster.jobs import check_config

    _, _, run = imported
    check_config(str(run / "config.yaml"), ["run.dir=/mnt/shared/runs/ft", "model.init_from=/mnt/shared/hf/llama"])
    assert "not checked here (a cluster path?): model.init_from" in capsys.readouterr().err


def _train(*args, nproc: int = 1) -> None:
    proc = run_loomtrain("train", *args, nproc=nproc)
    assert "model.init_from: starting from" in proc.stdout


def _losses(run_dir: Path) -> list[float]:
    return list(losses(run_dir).values())


@pytest.mark.slow
def test_init_from_at_tp2_follows_tp1_and_starts_at_transformers_loss(imported, tmp_path):
    hf, model, run = imported
    common = [
        "train.max_steps=5",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "train.lr=1e-3",
        "train.warmup_steps=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "data.max_files=20",
        f"data.cache_dir={tmp_path / 'cache'}",
        "log.tensorboard=false",
        "log.progress=plain",
    ]
    one = [f"run.dir={tmp_path / 'tp1'}", f"model.init_from={hf}", f"data.tokenizer={hf}", *common]
    _train(run / "config.yaml", *one)
    # tp 2 starts from the imported run (its final/), tp 1 from the Hugging Face directory
    _train(
        run / "config.yaml", f"run.dir={tmp_path / 'tp2'}", f"model.init_from={run}", "parallel.tp=2", *common, nproc=2
    )
    ref, tp = _losses(tmp_path / "tp1"), _losses(tmp_path / "tp2")
    assert len(ref) == len(tp) == 5
    diff = max(abs(a - b) for a, b in zip(ref, tp))
    print(f"\ninit_from tp2 vs tp1: max |loss diff| over 5 steps = {diff:.2e}")
    assert diff <= 1e-5, list(zip(ref, tp))
    assert ref[-1] < ref[0]

    # transformers' loss on the batch the first step trained on
    from loomtrain.data_pipeline import TokenStream, prepare_data

    cfg = load_config(run / "config.yaml", one)
    shard_dir, tok = prepare_data(cfg.data, tmp_path / "cache")
    stream = TokenStream(
        shard_dir,
        "train",
        seq_len=32,
        micro_batch_size=4,
        seed=cfg.train.seed,
        prefetch=0,
        expected_tokenizer_hash=tok.hash,
    )
    x, y = next(stream)
    stream.close()
    with torch.no_grad():
        logits = model(x).logits.float()
    theirs = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    print(f"first step: loomtrain {ref[0]:.7f}, transformers {theirs:.7f}")
    assert abs(ref[0] - theirs) <= 1e-5

    # the weights only seed the first start: with them gone, a restart resumes from its checkpoint
    from loomtrain.launcher.checkpoints.weight_source import init_from
    from loomtrain.model import Transformer

    hf.rename(hf.with_name("hf-gone"))
    try:
        cfg = load_config(run / "config.yaml", [o for o in one if not o.startswith("data.tokenizer=")])
        said = []
        init_from(Transformer(cfg.model), cfg.model, log=said.append, run_dir=tmp_path / "tp1")
        assert "is gone; the run resumes from" in said[0] and "step_00000005" in said[0]
    finally:
        hf.with_name("hf-gone").rename(hf)
