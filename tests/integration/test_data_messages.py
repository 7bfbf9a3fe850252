"""data.sources in one line: a bad item is named (`data.sources[1].weight`) with what it takes,
in a YAML file as on the command line; a mixture resumed with other weights, swapped or other
sources says what differs, saved against now, and what to do (exit 2, the checkpoints as they
were); the same mixture written otherwise (weights 3:7 as 0.3:0.7) resumes."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import launch
import numpy as np
import pytest
from launch import TINY
from loomtrain.data_pipeline import DataError, TokenStream, preprocess_files
from loomtrain.launcher.config import ConfigError
from loomtrain.launcher.config_loader import load_config
from stream_support import write_arrays

WEIGHT = "a positive number (the source's relative share of the samples)"
ITEM = "{path: ..., weight: ...}"


@pytest.mark.parametrize(
    "sources,message",
    [
        ("[{path: a}, {path: b, weight: heavy}]", f"data.sources[1].weight: expected {WEIGHT}, got 'heavy'"),
        ("[{path: a}, {path: b, weight: [1]}]", f"data.sources[1].weight: expected {WEIGHT}, got [1]"),
        (
            "[{path: a}, {path: [b]}]",
            "data.sources[1].path: expected a shard directory made by `loomtrain preprocess`, got ['b']",
        ),
        (
            "[{path: a}, {path: b, wieght: 2}]",
            f"data.sources[1].wieght: unknown key (did you mean 'weight'?); an item has {ITEM}",
        ),
        (
            "[{path:a}]",
            "data.sources[0].path:a: unknown key (YAML needs a space after the colon: {path: DIR}); "
            f"an item has {ITEM}",
        ),
        ("[{path: a}, b]", f"data.sources[1]: expected a mapping {ITEM}, got 'b'"),
        ("a", f"data.sources: expected a list of {ITEM} items, got 'a'"),
    ],
)
def test_a_bad_sources_item_is_named_with_what_it_takes(sources, message, tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(TINY, [f"data.sources={sources}"])
    assert str(exc.value) == f"{message} [command line]"
    config = tmp_path / "mix.yaml"
    config.write_text(f"extends: {TINY}\ndata:\n  sources: {sources}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(config)
    assert str(exc.value) == f"{message} [{config}]"


# --- resuming a mixture ------------------------------------------------------------
T = 8
INFO = {"hash": "synthetic0000000", "name": "synthetic", "vocab_size": 1 << 20, "eos_id": 0}
FIX = (
    "to resume, keep the data.sources the run started with; to train on the new mixture, start afresh "
    "with checkpoint.resume=never (earlier checkpoints are set aside) or another run.dir"
)


def make_source(path: Path, n_samples: int) -> str:
    tokens = np.arange(n_samples * T + 1, dtype=np.uint32)
    write_arrays(path, {"train": tokens, "val": tokens[: 3 * T + 1]}, INFO)
    return str(path)


@pytest.fixture
def sources(tmp_path) -> dict[str, str]:
    return {name: make_source(tmp_path / name, n) for name, n in (("web", 13), ("code", 7), ("more_code", 9))}


def saved_state(mixture) -> dict:
    stream = TokenStream(mixture, seq_len=T, micro_batch_size=1, seed=7, prefetch=0)
    next(iter(stream))
    state = stream.state_dict()
    stream.close()
    return state


def resume_refusal(state: dict, mixture) -> str | None:
    stream = TokenStream(mixture, seq_len=T, micro_batch_size=1, seed=7, prefetch=0)
    try:
        stream.load_state_dict(state)
    except DataError as exc:
        return str(exc)
    finally:
        stream.close()
    return None


def test_a_mixture_resumed_otherwise_says_what_differs_and_what_to_do(sources):
    web, code, more = sources["web"], sources["code"], sources["more_code"]
    state = saved_state([(web, 3.0), (code, 7.0)])
    head = "cannot resume the data stream: data.sources differs from the run's checkpoint: "
    assert resume_refusal(state, [(web, 1.0), (code, 1.0)]) == (
        head + "data.sources[0].weight was 3 (30.0% of the samples), now 1 (50.0% of the samples); "
        "data.sources[1].weight was 7 (70.0% of the samples), now 1 (50.0% of the samples); " + FIX
    )
    assert resume_refusal(state, [(code, 7.0), (web, 3.0)]) == (
        head + f"the same sources in another order: was [{web}, {code}], now [{code}, {web}]; " + FIX
    )
    assert resume_refusal(state, [(web, 3.0), (more, 7.0)]) == (
        head + f"data.sources[1].path was {code}, now {more}; " + FIX
    )
    assert resume_refusal(state, [(web, 3.0), (code, 7.0), (more, 1.0)]) == (
        head + "the run read 2 sources, data.sources now lists 3; " + FIX
    )
    assert resume_refusal(state, web) == head + "the run read 2 sources, data.sources now lists one source; " + FIX
    assert resume_refusal(state, [(web, 0.3), (code, 0.7)]) is None  # the same mixture


def test_a_state_saved_without_source_paths_is_still_resumed_and_refused_by_share(sources):
    web, code = sources["web"], sources["code"]
    state = saved_state([(web, 3.0), (code, 7.0)])
    del state["mixture"]["sources"]  # as checkpoints before the paths were kept
    assert resume_refusal(state, [(web, 3.0), (code, 7.0)]) is None
    assert resume_refusal(state, [(web, 1.0), (code, 1.0)]) == (
        "cannot resume the data stream: data.sources differs from the run's checkpoint: "
        "data.sources[0].weight was 30.0% of the samples, now 1 (50.0% of the samples); "
        "data.sources[1].weight was 70.0% of the samples, now 1 (50.0% of the samples); " + FIX
    )


def tree(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_train_resumed_with_other_weights_is_one_line_exit_2_and_changes_no_checkpoint(tmp_path):
    from loomtrain.launcher.cli import train as train_cli

    for name, word in (("web", "alpha"), ("code", "def beta():")):
        docs = tmp_path / f"{name}.jsonl"
        docs.write_text("".join(json.dumps({"text": f"{word} {i}\n" * 6}) + "\n" for i in range(80)))
        preprocess_files([docs], tmp_path / name, "byte", val_fraction=0.05, progress=False, log=None)
    run = tmp_path / "run"
    args = [
        str(TINY),
        *launch.SMALLEST,
        *launch.QUIET,
        "train.max_steps=4",
        "train.warmup_steps=1",
        "checkpoint.every_steps=2",
        f"run.dir={run}",
    ]

    def train(weights: tuple[int, int], *extra: str) -> tuple[int, str]:
        web, code = tmp_path / "web", tmp_path / "code"
        mix = f"data.sources=[{{path: {web}, weight: {weights[0]}}}, {{path: {code}, weight: {weights[1]}}}]"
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = train_cli.main([*args, mix, *extra])
        return rc, out.getvalue()

    rc, text = train((3, 7), "checkpoint.stop_at_step=2")
    assert rc == 0, text[-3000:]
    before = tree(run / "checkpoints")
    rc, text = train((1, 1))
    assert rc == 2 and "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "error" in line]
    assert errors == [
        "loomtrain: data error: cannot resume the data stream: data.sources differs from the run's checkpoint: "
        "data.sources[0].weight was 3 (30.0% of the samples), now 1 (50.0% of the samples); "
        "data.sources[1].weight was 7 (70.0% of the samples), now 1 (50.0% of the samples); " + FIX
    ], text[-3000:]
    assert tree(run / "checkpoints") == before
