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

RUN_DIR must be absent, an empty directory, or a previous import of the same source (config.yaml's
first line names it; the import replaces it); never a file, the source itself or a folder holding
anything else. Everything is checked and read (headers, dtypes, shapes, every value finite)
before anything is written, and a failure while writing leaves nothing behind.

Object storage: RUN_DIR may be a URI (s3://bucket/prefix): the same refusals apply to what is
under it; the import is written into a local staging folder and uploaded, final/ as a run's
final/ goes (its manifest last) and config.yaml after it (run.storage the URI, model.init_from
URI/final, data.tokenizer URI/final/tokenizer/tokenizer.json). SRC_DIR may be a URI of a Hugging
Face folder: its files are fetched into this host's cache first (weight_source.fetch_weights).
SRC_DIR may be a model id (`Qwen/Qwen2.5-0.5B`, `ORG/NAME@REV`): its folder in the local Hugging
Face cache (hf_cache.resolve_model; an existing folder of that name wins; nothing is downloaded).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from loomtrain.data_pipeline import DataError, load_tokenizer
from loomtrain.durable import atomic_write
from loomtrain.hf_cache import resolve_model
from loomtrain.launcher.checkpoints.final import (
    FINAL_MANIFEST,
    TOKENIZER_DIR,
    naming_objects,
    objects_named,
    staging_folder,
    write_final,
)
from loomtrain.launcher.checkpoints.hf_source import HFImportError, open_hf
from loomtrain.launcher.checkpoints.safetensors_source import (
    WeightSource,
    WeightSourceError,
    check_complete,
    model_tensor_names,
)
from loomtrain.launcher.config import DataConfig, RunConfig, RunSection, TrainConfig
from loomtrain.launcher.config_loader import to_yaml
from loomtrain.storage import (
    StorageError,
    canonical,
    join,
    location,
    output_folder,
)

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


# config.yaml's first line: the source this folder was imported from, so that running the same
# import again replaces it while any other use of a non-empty folder is refused.
IMPORTED_FROM = "# made by `loomtrain import --format hf {}`\n"
IMPORT_ENTRIES = {"final", "config.yaml"}


def write_run_config(out: Path, model_cfg, src_name: str, uri: str | None = None) -> None:
    """RUN_DIR/config.yaml: a run that starts from these weights with their tokenizer. `uri`:
    where RUN_DIR will be uploaded (the config names the objects, run.storage that URI)."""
    where = uri or str(out)
    section = RunSection(name=where.rstrip("/").rsplit("/", 1)[-1], storage=uri) if uri else RunSection(out.name, where)
    run = RunConfig(
        run=section,
        model=dataclasses.replace(model_cfg, init_from=join(where, "final")),
        data=DataConfig(tokenizer=join(where, "final", TOKENIZER_DIR, "tokenizer.json")),
        train=TrainConfig(seq_len=min(TrainConfig.seq_len, model_cfg.max_seq_len)),
    )
    atomic_write(out / "config.yaml", IMPORTED_FROM.format(src_name) + to_yaml(run))


def _source_in(first: str) -> str | None:
    """The source config.yaml's first line names, or None when it is not an import's."""
    head, tail = IMPORTED_FROM.split("{}")
    return first[len(head) : -len(tail)] if first.startswith(head) and first.endswith(tail) else None


def check_output(output, src: Path, src_name: str) -> None:
    """--output (a folder or a prefix) is absent, empty, or a previous import of the same source
    (which the import replaces); never a file, the source itself or a place holding anything
    else. Refused in one line, with nothing there changed."""
    objs = location(output, "--output")
    untouched = f"choose a new or empty {'directory' if objs.local else 'prefix'} (nothing in it was touched)"
    if objs.local:
        out = objs.root  # `~` expanded: the folder output_folder writes
        if out.exists() and not out.is_dir():
            raise HFImportError(f"--output {out}: is a file; expected a new or empty directory")
        if out.is_dir() and out.resolve() == src.resolve():
            raise HFImportError(f"--output {out}: is the source directory itself; {untouched}")
    entries = sorted(objs.entries())
    if not entries:
        return
    try:
        first = objs.read("config.yaml").decode("utf-8", "replace").split("\n")[0] + "\n"
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        first = ""
    previous = _source_in(first)
    if set(entries) <= IMPORT_ENTRIES and previous == src_name:
        return
    if set(entries) <= IMPORT_ENTRIES and previous is not None:
        raise HFImportError(f"--output {output}: holds an import of {previous}, not of {src_name}; {untouched}")
    others = [e for e in entries if e not in IMPORT_ENTRIES] or entries
    more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
    raise HFImportError(f"--output {output}: holds {others[0]}{more}, not a previous import of {src_name}; {untouched}")


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what an import creates), or None."""
    missing = None
    for p in [path, *path.parents]:
        if p.exists():
            return missing
        missing = p
    return missing


def write_import(out: Path, state: dict, source: WeightSource, tok, src_name: str, uri: str | None = None) -> None:
    """OUTPUT/final and OUTPUT/config.yaml; on any failure nothing is left behind (no final.tmp,
    no folder the import created) and an OS error is one line naming the path."""
    made = _first_missing(out)
    try:
        write_final(state, source.model_cfg, tok, out / "final")
        write_run_config(out, source.model_cfg, src_name, uri)
    except BaseException as exc:
        shutil.rmtree(made if made is not None else out / "final.tmp", ignore_errors=True)
        if isinstance(exc, OSError):
            raise HFImportError(
                f"--output {out}: cannot write {exc.filename or out}: {exc.strerror or exc} (nothing was left there)"
            ) from None
        raise


def import_hf(src: str | Path, output: str | Path) -> Path | str:
    try:
        with naming_objects():
            return _import_hf(src, output)
    except StorageError as exc:
        raise HFImportError(str(exc)) from None


def _import_hf(src: str | Path, output: str | Path) -> Path | str:
    from loomtrain.launcher.checkpoints.weight_source import weights_folder

    try:
        folder = weights_folder(src)  # a URI's objects fetched, a model id's snapshot in the local cache
    except WeightSourceError as exc:
        raise HFImportError(str(exc)) from None
    src_name = canonical(resolve_model(src))  # what the import names its source: the URI, or the folder
    src = folder
    try:
        check_output(output, src, src_name)
    except OSError as exc:  # a folder on the way that cannot be read
        raise HFImportError(
            f"--output {output}: cannot look into {exc.filename or output}: {exc.strerror or exc}"
        ) from None
    if not (src / "config.json").is_file():
        raise HFImportError(f"{src}: no config.json (expected a Hugging Face model directory)")
    source = open_hf(src)
    check_complete(source)  # dtypes and shapes, from the files' headers
    tok = _load_tokenizer(source, src)
    # all read (each tensor checked to be finite) before anything is written
    state = {name: source.read(name) for name in model_tensor_names(source.model_cfg)}
    uri = None if location(output, "--output").local else str(output).rstrip("/")  # what the run config names
    # On object storage a reader takes the import by its config.yaml, and its final/ by the manifest.
    with output_folder(output, (f"final/{FINAL_MANIFEST}", "config.yaml"), staging_folder()) as out:
        write_import(out.absolute(), state, source, tok, src_name, uri)
    n = sum(t.numel() for t in state.values())
    description = objects_named(source.description)
    print(f"import: {description} -> {uri or out.absolute()} ({n:,} parameters, tokenizer {tok.vocab_size} tokens)")
    return uri or out.absolute()
