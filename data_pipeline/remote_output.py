"""`loomtrain preprocess --output s3://bucket/ds` (any URI fsspec knows): the shard set is made
in a local work folder as for a path, and each file goes up as soon as it is complete.

    RemoteOutput(uri, overwrite)    .staging: the local folder preprocess works in (its
                                    .partial sibling holds the parts, so a rerun of the same
                                    command on this machine resumes); .check(): before anything
                                    is written; .begin(), .upload(work, name) as each shard is
                                    complete (several in flight), .commit(work): index.json last

An object store has no rename: the shard set at URI exists iff URI/index.json does, and it is
uploaded last, after every shard, docs and mask file and the tokenizer are in place. Meanwhile
a marker object (URI/.loomtrain-preprocess) says the prefix is a preprocess output in the
making, so a rerun after a kill replaces it without --overwrite; it goes after the commit.
Replacing an earlier output at URI (made by preprocess, or anything with --overwrite) takes its
index.json away first (readers see no data set rather than a mix), and its objects the new one
does not name after the commit.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from concurrent.futures import Future, wait
from pathlib import Path

from loomtrain.data_pipeline.shards import FORMAT, INDEX, DataError
from loomtrain.data_pipeline.staging import check_output, output_names, publish
from loomtrain.data_pipeline.tokenizer import CHAT_CONFIG
from loomtrain.storage import (
    StorageError,
    delete_objects,
    first_line,
    join,
    listing,
    location,
    object_store,
    read_object,
    transfer_pool,
    upload_file,
    write_object,
)

MARKER = ".loomtrain-preprocess"
# The names a preprocess output holds: shard, docs and mask files, the tokenizer, the index.
_OURS = re.compile(
    r"^(\w+_\d{5}\.bin|\w+\.docs\.bin|\w+\.mask\.bin|tokenizer\.json|tokenizer_config\.json|index\.json)$"
)


def staging_dir(uri: str) -> Path:
    """The local folder a preprocess to `uri` works in: one per URI (under the temp folder, so
    TMPDIR moves it), the same on a rerun, so the rerun resumes."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", uri.rstrip("/").rsplit("/", 1)[-1]) or "root"
    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "loomtrain-preprocess" / f"{name}-{key}"


def open_output(output: str | Path, overwrite: bool) -> FolderOutput | RemoteOutput:
    """Where preprocess writes, as its backend (storage.location) is: a folder, published by a
    rename, or an object store, uploaded file by file and committed by index.json."""
    if location(output, "--output").local:
        return FolderOutput(Path(output), overwrite)
    return RemoteOutput(str(output), overwrite)


class FolderOutput:
    """--output a folder: preprocess works in its .partial sibling (`staging` is the folder), and
    the finished work folder is renamed onto it (staging.publish)."""

    def __init__(self, out: Path, overwrite: bool):
        self.staging, self.shown, self.overwrite = out, str(out), overwrite

    def check(self) -> None:
        check_output(self.staging, self.overwrite)

    def begin(self) -> None:
        """(nothing goes anywhere before the rename)"""

    def upload(self, work: Path, name: str) -> None:
        """(a file is in place once the work folder is renamed)"""

    def commit(self, work: Path) -> None:
        publish(work, self.staging)

    def close(self) -> None:
        """(nothing in flight)"""


class RemoteOutput:
    def __init__(self, uri: str, overwrite: bool):
        self.uri = self.shown = str(uri).rstrip("/")
        try:
            self.fs, path = object_store(self.uri, "--output")
        except ValueError as exc:  # a scheme fsspec does not know, or its library missing
            raise DataError(str(exc)) from None
        self.path = path.rstrip("/")
        self.overwrite = overwrite
        self.staging = staging_dir(self.uri)
        self._old: set[str] = set()  # objects there before this run (what the commit may remove)
        self._uploads: list[Future] = []  # appended on preprocess_files' own thread only (upload, commit): no lock

    def _fail(self, action: str, exc: BaseException) -> DataError:
        detail = exc.detail if isinstance(exc, StorageError) else first_line(exc)
        return DataError(f"--output {self.uri}: cannot {action} ({detail})")

    def _listing(self) -> set[str]:
        """Names of every object under the prefix (relative to it)."""
        try:
            found = listing(self.fs, self.path)
        except Exception as exc:  # no credentials, no connection: the library's own types
            raise self._fail("list it", exc) from None
        if not found and self.fs.isfile(self.path):
            raise DataError(f"--output {self.uri} is an object; expected a prefix to write a shard directory under")
        return set(found)

    def check(self) -> None:
        """Before anything is written: the bucket is there, and the prefix is empty, an earlier
        preprocess output (done, or cut short: the marker), or --overwrite is given."""
        bucket = self.path.split("/", 1)[0]  # "" for file:///...
        try:
            if bucket:
                self.fs.info(bucket)
        except FileNotFoundError:
            raise DataError(
                f"--output {self.uri}: the bucket {bucket} does not exist (or cannot be seen); create it"
            ) from None
        except Exception as exc:  # no credentials, no connection: the library's own types
            raise self._fail("reach the store", exc) from None
        present = self._listing()
        self._old = present
        if not present or self.overwrite:
            return
        foreign = sorted(n for n in present if n != MARKER and not _OURS.match(n))
        if MARKER not in present and not self._our_index():
            raise DataError(
                f"--output {self.uri} holds objects and is not a loomtrain preprocess output (no valid {INDEX}); "
                "refusing to replace it: choose another prefix, or pass --overwrite to replace everything under it"
            )
        if foreign:
            raise DataError(
                f"--output {self.uri} holds {foreign[0]!r}, which preprocess did not write; refusing to replace it: "
                "move it away, or pass --overwrite to replace everything under the prefix"
            )

    def _our_index(self) -> bool:
        try:
            index = json.loads(read_object(join(self.uri, INDEX)).decode("utf-8"))
        except Exception:
            return False
        return isinstance(index, dict) and index.get("format") == FORMAT

    def begin(self) -> None:
        """Before the first upload: the marker, and an earlier output's index (its commit point) removed."""
        try:
            write_object(join(self.uri, MARKER), json.dumps({"format": "loomtrain-preprocess-upload"}).encode())
            if INDEX in self._old:
                delete_objects(self.uri, [INDEX])
        except StorageError as exc:
            raise self._fail("start writing under it", exc) from None

    def _put(self, local: Path, name: str, remove: bool) -> None:
        try:
            upload_file(local, join(self.uri, name))
        except StorageError as exc:
            raise self._fail(f"upload {name}", exc) from None
        if remove:  # a shard is assembled again from the parts on a rerun: its local copy can go
            local.unlink(missing_ok=True)

    def upload(self, work: Path, name: str, keep: bool = False) -> None:
        """Start uploading work/name (a shard, docs or mask file just completed); its local copy
        goes once it is up, unless `keep`."""
        self._uploads.append(transfer_pool().submit(self._put, work / name, name, not keep))

    def commit(self, work: Path) -> None:
        """Wait for the uploads, then the tokenizer, then index.json (the commit point); then
        the marker and what an earlier output held that this one does not name go, and the local
        work folder (a copy of what is now in the store)."""
        for name in ("tokenizer.json", CHAT_CONFIG):
            if (work / name).is_file():
                self.upload(work, name, keep=True)
        for future in self._uploads:
            future.result()  # the first failed upload's DataError
        self._put(work / INDEX, INDEX, False)
        names = output_names(json.loads((work / INDEX).read_text(encoding="utf-8")))
        stale = sorted((self._old | {MARKER}) - names)
        try:
            delete_objects(self.uri, stale)
        except StorageError as exc:
            raise self._fail(f"remove {stale[0]} of the earlier output (the new one is complete)", exc) from None
        shutil.rmtree(work, ignore_errors=True)

    def close(self) -> None:
        """Stop: uploads not started are cancelled (a rerun does them again)."""
        uploads, self._uploads = self._uploads, []
        for future in uploads:
            future.cancel()
        wait(uploads)


__all__ = ["FolderOutput", "RemoteOutput", "open_output", "staging_dir"]
