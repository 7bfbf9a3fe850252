"""Hugging Face model ids (`meta-llama/Llama-3.2-1B`, `Qwen/Qwen2.5-0.5B@main`) found in the local
Hugging Face cache, wherever a Hugging Face model folder is accepted (`loomtrain import`,
`model.init_from`, `data.tokenizer`).

    resolve_model(location)   a cached model id's snapshot folder; anything else (a path, a URI)
                              as it was given. Nothing is downloaded: a missing id is one line
                              saying where it looked and how to fetch it.
    looks_like_model_id(s)    ORG/NAME or NAME, with an optional @REVISION

Which string is what, in this order: a URI (`s3://...`) is a URI, never an id (an id holds no
`:`); a path that
exists (a folder `org/name` under the working directory included) is that path; a string shaped
like an id (no leading `/`, `./`, `~`, at most one `/`) is looked up in the cache; anything else
is a path that does not exist, and its reader says so.

The cache is where huggingface_hub puts it, read at call time so a test or a user can point it
elsewhere: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub (`models--ORG--NAME/snapshots/COMMIT/`, `refs/main` naming COMMIT).

This module sits at the package root beside storage.py: data_pipeline/ and launcher/ both use it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The hub's repo id rules: ORG/NAME (or a bare NAME), letters, digits, -, _, . ; no `--` or `..`.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_MODEL_ID = re.compile(rf"^(?P<repo>(?:{_PART}/)?{_PART})(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]*))?$")
# A name ending so is a file's path, not a model id (ids may hold dots: Qwen2.5-0.5B).
_FILE_SUFFIXES = (".json", ".yaml", ".yml", ".safetensors", ".txt", ".model", ".bin", ".pt")


class ModelIdError(ValueError):
    """A model id not in the local cache; one line naming the cache folder and the fetch command."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder huggingface_hub would use now (environment read now)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def looks_like_model_id(location: str | os.PathLike) -> bool:
    if not isinstance(location, str) or location.startswith(("/", ".", "~")):
        return False
    m = _MODEL_ID.match(location)
    if m is None or "--" in m.group("repo") or ".." in m.group("repo"):
        return False
    return not location.lower().endswith(_FILE_SUFFIXES)  # `data/tokenizer.json` is a file's path


def cached_snapshot(model_id: str) -> Path:
    """The snapshot folder of `model_id` (one that looks_like_model_id; no @REVISION: the cache's
    refs/main) in the local cache; ModelIdError when it is not there. huggingface_hub's own
    lookup (snapshot_download with local_files_only): nothing is fetched."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo, rev = _MODEL_ID.match(model_id).group("repo", "rev")
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        at = f" at revision {rev}" if rev else ""
        fetch = f"hf download {repo}" + (f" --revision {rev}" if rev else "")
        raise ModelIdError(
            f"{model_id}: no such folder, and no model {repo}{at} in the Hugging Face cache {cache} "
            f"(HF_HUB_CACHE / HF_HOME); nothing is downloaded: fetch it with `{fetch}` "
            f"(or `huggingface-cli download {repo}`)"
        ) from None


def resolve_model(location: str | os.PathLike) -> str | Path:
    """`location` as a reader takes it: a model id as its cached snapshot folder (ModelIdError
    when not cached), anything else (an existing folder of that name, a path, a URI) as given,
    `~` expanded (a URI has none to expand)."""
    given = os.path.expanduser(os.fspath(location))
    if not looks_like_model_id(location) or Path(given).exists():
        return given
    return cached_snapshot(str(location))
