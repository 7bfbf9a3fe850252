"""A Hugging Face model as a finished run (`loomtrain import --format hf SRC_DIR --output RUN_DIR`,
launcher/cli/import_hf.py).

The inverse of `loomtrain export --format hf` (launcher/checkpoints/export.py), tensor for
tensor, so import then export gives back the same tensors bitwise.

What is read and what is refused, and how each tensor is mapped: hf_source.py.

Written: RUN_DIR/final/ (what a finished run leaves: model.safetensors, model_config.json,
tokenizer/tokenizer.json, the source's tensors in their own dtype) and RUN_DIR/config.yaml
(a full run config: the model section from config.json, data.tokenizer the imported
tokenizer, model.init_from these weights), so `loomtrain generate RUN_DIR` works and
`loomtrain train RUN_DIR/config.yaml run.dir=NEW_DIR data.path=...` continues training.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from loomtrain.data_pipeline import DataError, load_tokenizer
from loomtrain.launcher.checkpoints.hf_source import HFImportError, open_hf
from loomtrain.launcher.checkpoints.safetensors_source import WeightSource, check_complete, model_tensor_names
from loomtrain.launcher.config import DataConfig, RunConfig, RunSection, TrainConfig
from loomtrain.launcher.config_loader import save_config
from loomtrain.launcher.weights import TOKENIZER_DIR, write_final

FORMATS = ("hf",)


# The command ------------------------------------------------------------------------------------
def _load_tokenizer(source: WeightSource, src: Path):
    if source.tokenizer_dir is None:
        hint = (
            " (it has a sentencepiece tokenizer.model: save it as tokenizer.json with transformers' "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
            if (src / "tokenizer.model").is_file()
            else ""
        )
        raise HFImportError(f"{src}: no tokenizer.json{hint}")
    try:
        tok = load_tokenizer(source.tokenizer_dir)
    except DataError as exc:
        raise HFImportError(str(exc)) from None
    if tok.vocab_size > source.model_cfg.vocab_size:
        raise HFImportError(
            f"{src / 'tokenizer.json'}: {tok.vocab_size} tokens, more than the model's "
            f"vocab_size {source.model_cfg.vocab_size}"
        )
    return tok


def write_run_config(out: Path, model_cfg, tokenizer_file: Path) -> Path:
    """RUN_DIR/config.yaml: a run that starts from these weights with this tokenizer."""
    run = RunConfig(
        run=RunSection(name=out.name, dir=str(out)),
        model=dataclasses.replace(model_cfg, init_from=str(out / "final")),
        data=DataConfig(tokenizer=str(tokenizer_file)),
        train=TrainConfig(seq_len=min(TrainConfig.seq_len, model_cfg.max_seq_len)),
    )
    save_config(run, out / "config.yaml")
    return out / "config.yaml"


def import_hf(src: str | Path, output: str | Path) -> Path:
    src, out = Path(src).expanduser(), Path(output).expanduser().absolute()
    if not (src / "config.json").is_file():
        raise HFImportError(f"{src}: no config.json (expected a Hugging Face model directory)")
    for existing in (out / "final", out / "config.yaml"):
        if existing.exists():
            raise HFImportError(f"{existing} already exists; choose a new --output directory")
    source = open_hf(src)
    check_complete(source)
    tok = _load_tokenizer(source, src)
    state = {name: source.read(name) for name in model_tensor_names(source.model_cfg)}
    write_final(state, source.model_cfg, tok, out / "final")
    write_run_config(out, source.model_cfg, out / "final" / TOKENIZER_DIR / "tokenizer.json")
    n = sum(t.numel() for t in state.values())
    print(f"import: {source.description} -> {out} ({n:,} parameters, tokenizer {tok.vocab_size} tokens)")
    return out
