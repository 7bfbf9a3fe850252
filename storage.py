"""Where durable bytes live: a local path, or an object-store URI (`s3://bucket/prefix`, and
whatever else fsspec knows: `gs://`, `az://`, `file://`).

    is_uri(location)            does it name a scheme (`s3://...`)? Such a string is never a path:
                                treating `s3://b/x` as one writes a local folder `./s3:/b/x`
    known_scheme(location)      a URI whose scheme fsspec knows (no library imported)
    object_store(uri, what)     (fsspec filesystem, path inside it) for a URI, or one line naming
                                `what` (the config key or option) and the value when its scheme
                                is unknown or its library is missing
    join(base, *parts)          a child location of a path or a URI (`/` for URIs)

Credentials and the endpoint come from the storage library's standard chain (for S3:
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL, profiles, instance roles); nothing
here takes, logs or writes them.

This module sits at the package root beside durable.py: data_pipeline/ and launcher/ both use it.
"""

from __future__ import annotations

import os
import re

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_uri(location: str | os.PathLike) -> bool:
    return isinstance(location, str) and _SCHEME.match(location) is not None


def scheme(location: str | os.PathLike) -> str:
    m = _SCHEME.match(location) if isinstance(location, str) else None
    return m.group(1).lower() if m else ""


def known_scheme(location: str | os.PathLike) -> bool:
    """A URI whose scheme fsspec knows (without importing its library: config checks stay pure)."""
    from fsspec.registry import known_implementations, registry

    proto = scheme(location)
    return bool(proto) and (proto in known_implementations or proto in registry)


def object_store(uri: str, what: str = "location"):
    """The fsspec filesystem for `uri` and the path inside it. ValueError in one line, naming
    `what` and `uri`, for a scheme fsspec does not know or whose library is not installed."""
    import fsspec

    proto = scheme(uri)
    if not proto:
        raise ValueError(f"{what}={uri!r}: expected a URI such as s3://bucket/prefix")
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except ImportError as e:
        raise ValueError(f"{what}={uri!r}: the library for {proto}:// is not installed ({e})") from None
    except ValueError as e:
        raise ValueError(f"{what}={uri!r}: unknown storage scheme {proto}:// ({e})") from None
    return fs, path


def join(base: str | os.PathLike, *parts: str) -> str:
    if is_uri(base):
        out = str(base).rstrip("/")
        for p in parts:
            out += "/" + str(p).strip("/")
        return out
    return os.path.join(os.fspath(base), *parts)
