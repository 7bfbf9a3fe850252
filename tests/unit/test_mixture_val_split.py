"""A mixture source whose validation split cannot fill one sample is refused before the first
step (not at the first evaluation), in one line naming the source and what to do; with
evaluation off the same mixture trains."""

from __future__ import annotations

import pytest
from launch import one_line, output, run_loomtrain
from loomtrain.data_pipeline import preprocess as pp
from source_tree import ROOT

pytestmark = pytest.mark.slow


def test_a_source_with_too_short_a_val_split_is_refused_up_front(tmp_path):
    big, small = tmp_path / "big", tmp_path / "small"
    (tmp_path / "in").mkdir()
    for name, n, words in (("big", 40, 120), ("small", 12, 3)):
        files = []
        for i in range(n):
            f = tmp_path / "in" / f"{name}{i:02d}.txt"
            f.write_text(f"document {i} of {name}: " + "the run goes on as planned. " * words)
            files.append(f)
        pp.preprocess_files(files, tmp_path / name, "byte", val_fraction=0.1, progress=False, log=None)
    config = tmp_path / "mix.yaml"
    config.write_text(
        f"extends: {ROOT / 'configs' / 'tiny.yaml'}\n"
        "data:\n  tokenizer: byte\n  sources:\n"
        f"    - {{path: {big}, weight: 0.5}}\n    - {{path: {small}, weight: 0.5}}\n"
    )
    common = [f"run.dir={tmp_path / 'run'}", "train.max_steps=2", "log.progress=plain", "eval.num_samples=0"]
    proc = run_loomtrain("train", str(config), *common, timeout=600, rc=2)
    out = output(proc)
    assert one_line(proc.stderr).startswith(f"loomtrain: data error: {small}: split 'val' has "), out[-3000:]
    assert f"{small}: split 'val' has " in out and "re-run `loomtrain preprocess` with a larger --val-fraction" in out
    assert "step 1/" not in out, out[-3000:]
    run_loomtrain("train", str(config), *common, "eval.every_steps=0", timeout=600)
