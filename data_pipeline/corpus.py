"""The embedded default corpus (the Python standard library's own .py sources)
and `prepare_data`, which turns a run's `data:` section into (shard_dir, tokenizer)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import uuid
from pathlib import Path

from loomtrain.data_pipeline.preprocess import preprocess_files
from loomtrain.data_pipeline.remote import load_shard_tokenizer
from loomtrain.data_pipeline.shard_set import ShardSet
from loomtrain.data_pipeline.shards import SPLITS, VERSION, DataError, check_tokenizer_hash, read_index
from loomtrain.data_pipeline.staging import partial_dir
from loomtrain.data_pipeline.tokenizer import Tokenizer, load_tokenizer
from loomtrain.durable import replace_dir
from loomtrain.storage import below

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files(max_files: int = 0) -> list[Path]:
    """The standard library's .py files, found via sysconfig, sorted by relative
    path (deterministic on one installation); the first `max_files` (0 = all)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # not descended into: site-packages is most of the tree
        rel = Path(folder).relative_to(root)
        found += [((rel / n).as_posix(), Path(folder, n)) for n in names if n.endswith(".py")]
    files = [path for _, path in sorted(found) if path.is_file()]
    if not files:
        raise DataError(f"no .py files under the standard library directory {root}")
    return files[:max_files] if max_files and max_files > 0 else files


def _corpus_key(files: list[Path], data_cfg, tokenizer_id: str) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    desc = {
        "shard_format": VERSION,
        "python": sys.version,
        "tokenizer": tokenizer_id,
        "bpe_vocab_size": data_cfg.bpe_vocab_size if data_cfg.tokenizer == "bpe" else None,
        "val_fraction": data_cfg.val_fraction,
        "split_seed": data_cfg.split_seed,
        "files": [(p.relative_to(root).as_posix(), p.stat().st_size) for p in files],
    }
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def verify_shards(shard_dir, expected_tokenizer_hash: str | None) -> None:
    """Index present, tokenizer matches, every shard file of every split complete. In object
    storage: every shard object of the size the index says (one listing); token ids are then
    checked as they are read, as scanning them all would download the dataset."""
    index = read_index(shard_dir)
    check_tokenizer_hash(index, shard_dir, expected_tokenizer_hash)
    for split in SPLITS:
        if split in index["splits"]:
            shards = ShardSet(shard_dir, split)
            shards.check_ids()
            shards.close()


def _load_tokenizer(spec, shard_dir):
    """data.tokenizer for shards in `shard_dir`: "bpe" means the directory's own tokenizer.json."""
    return load_shard_tokenizer(shard_dir) if spec == "bpe" else load_tokenizer(spec)


def prepare_data(data_cfg, cache_dir=None, *, log=None) -> tuple[Path, Tokenizer]:
    """Resolve a run's data: -> (shard_dir, tokenizer), before any training starts.

    data_cfg.path set: it must be a shard directory made by `loomtrain preprocess`;
    the run's tokenizer is data_cfg.tokenizer ("bpe" means the directory's own
    tokenizer.json) and shards made by another tokenizer are refused.
    data_cfg.path empty: the embedded corpus (stdlib .py sources, first
    data_cfg.max_files) is tokenized once into a cache directory
    (data_cfg.cache_dir if set, else the `cache_dir` argument) and reused; several
    processes may call this at once (a file lock serialises the build, which is
    written to a temporary directory and renamed into place).
    """
    if data_cfg.path:
        # A URI stays a string (object storage, read in place): never a Path, which would be ./s3:/...
        shard_dir = below(data_cfg.path)
        read_index(shard_dir)  # a clear error before the tokenizer is looked at
        tok = _load_tokenizer(data_cfg.tokenizer, shard_dir)
        verify_shards(shard_dir, tok.hash)
        return shard_dir, tok

    cache = data_cfg.cache_dir or cache_dir
    if not cache:
        raise DataError("data.cache_dir: no cache directory for the embedded corpus (set data.cache_dir)")
    cache = Path(cache).expanduser()  # data.cache_dir=~/c: the home folder, not ./~/c (as run.dir)
    files = stdlib_files(data_cfg.max_files)
    # "byte" and "bpe" (trained on the corpus) are named as they are; any other by its hash
    run_tok = None if data_cfg.tokenizer in ("byte", "bpe") else load_tokenizer(data_cfg.tokenizer)
    key = _corpus_key(files, data_cfg, data_cfg.tokenizer if run_tok is None else run_tok.hash)
    shard_dir = cache / f"stdlib-{key}"
    if not (shard_dir / "index.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / f".stdlib-{key}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until the file is closed
            if not (shard_dir / "index.json").is_file():  # another process may have built it meanwhile
                tmp = cache / f".stdlib-{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                try:
                    preprocess_files(
                        files,
                        tmp,
                        run_tok or data_cfg.tokenizer,
                        val_fraction=data_cfg.val_fraction,
                        seed=data_cfg.split_seed,
                        bpe_vocab_size=data_cfg.bpe_vocab_size,
                        progress=False,
                        # In-process: no worker pool spawned from inside a training (or Ray) worker;
                        # the whole stdlib (~32 M byte tokens) takes a few seconds this way.
                        workers=1,
                        sources=[f"stdlib:{sysconfig.get_paths()['stdlib']} ({len(files)} files)"],
                        # its summary names the cache folder the shards are renamed into, not the build's
                        log=log and (lambda line: log(line.replace(str(tmp), str(shard_dir)))),
                    )
                    replace_dir(tmp, shard_dir)  # over an incomplete leftover (no index.json)
                finally:
                    for leftover in (tmp, partial_dir(tmp)):  # a private build: nothing to resume
                        shutil.rmtree(leftover, ignore_errors=True)
    tok = run_tok or load_tokenizer(shard_dir)
    verify_shards(shard_dir, tok.hash)
    return shard_dir, tok


def prepare_sources(data_cfg, cache_dir=None, *, log=None) -> tuple[Path | list[tuple[Path, float]], Tokenizer]:
    """A run's data: -> (what TokenStream reads, tokenizer): one shard directory
    (data.path or the embedded corpus, via prepare_data), or for data.sources the
    list [(shard_dir, weight), ...], every directory checked and all made by one tokenizer."""
    if not data_cfg.sources:
        return prepare_data(data_cfg, cache_dir, log=log)
    dirs = [below(src.path) for src in data_cfg.sources]
    indexes = []
    for i, d in enumerate(dirs):
        try:
            indexes.append(read_index(d))
        except DataError as exc:
            raise DataError(f"data.sources[{i}].path: {exc}") from None
    tok = _load_tokenizer(data_cfg.tokenizer, dirs[0])
    whose = f"data.sources[0] ({dirs[0]})" if data_cfg.tokenizer == "bpe" else f"data.tokenizer={data_cfg.tokenizer}"
    for i, (d, index) in enumerate(zip(dirs, indexes)):
        found = index["tokenizer"]["hash"]
        if found != tok.hash:
            raise DataError(
                f"data.sources[{i}] ({d}) was made by tokenizer {found} ({index['tokenizer'].get('name')}), "
                f"but {whose} is tokenizer {tok.hash}; all sources must share one tokenizer"
            )
        verify_shards(d, tok.hash)
    return [(d, float(src.weight)) for d, src in zip(dirs, data_cfg.sources)], tok
