"""storage.location's two backends keep one contract: a local folder (Folder) and a prefix in an
object store (Objects, on the local S3 server of tests/s3_server.py) answer every call the
checkpoint store, the shard reader, final weights and preprocess make of them the same way. Only
what a disk alone can do differs, and it is named by the backend (`local`, `renames`)."""

import hashlib
from pathlib import Path

import pytest
from loomtrain import storage


@pytest.fixture
def where(backend_root) -> str:
    return f"{backend_root}/store"


def test_location_picks_the_backend_and_names_it(where):
    at = storage.location(where)
    assert isinstance(at, storage.Folder if at.local else storage.Objects)
    assert at.renames == at.local  # only a disk publishes a folder by a rename
    assert storage.same_location(at.name(), where)
    assert storage.same_location(at.name("a/b"), storage.below(where, "a/b"))
    assert storage.canonical(storage.below(where, "x/")) == storage.canonical(where) + "/x"
    assert storage.inside(storage.below(where, "a/b"), where) and storage.inside(where, where)
    assert not storage.inside(where, storage.below(where, "a")) and not storage.inside(where + "x", where)
    assert not storage.inside(where, "s3://other" if at.local else "/") and storage.inside("/tmp/x", "/")


def test_writes_reads_listings_and_deletes_answer_alike(where):
    at = storage.location(where)
    at.make_folder("d")
    at.write("d/a.bin", b"alpha")
    at.write("d/sub/b.bin", b"bravo!")
    at.replace("pointer", b"d\n")
    assert at.read("d/a.bin") == b"alpha" and at.read("pointer") == b"d\n"
    assert at.exists("d/a.bin") and not at.exists("d/none.bin")
    assert at.sizes("d") == {"a.bin": 5, "sub/b.bin": 6}
    assert at.entries() == {"d": "directory", "pointer": "file"}
    assert at.entries("d") == {"a.bin": "file", "sub": "directory"}
    assert at.describe("d/a.bin") == {"size": 5, "sha256": hashlib.sha256(b"alpha").hexdigest()}
    assert at.child("d").read("sub/b.bin") == b"bravo!"
    with pytest.raises(FileNotFoundError):
        at.read("d/none.bin")
    at.delete("d/a.bin")
    at.delete("d/a.bin")  # a second delete of nothing is no error
    assert at.sizes("d") == {"sub/b.bin": 6}
    at.delete_tree("d")
    assert at.sizes("d") == {} and at.entries() == {"pointer": "file"}
    at.delete_tree("never-there")


def test_a_streamed_file_and_a_library_written_folder_land_alike(where):
    at = storage.location(where)
    at.make_folder("s")
    path, stream = at.sink("s/big.bin")
    data = bytes(range(256)) * 4096
    if stream is None:  # a disk: the writer writes the file itself
        with open(path, "wb") as f:
            f.write(data)
    else:  # a store: a streamed (multipart) upload that appears whole on close
        for i in range(0, len(data), 100_000):
            stream.write(data[i : i + 100_000])
        stream.close()
    assert at.read("s/big.bin") == data

    def fill(folder):
        with open(f"{folder}/tokenizer.json", "w") as f:
            f.write("{}")

    entries = at.write_folder("s/tok", fill)
    assert entries == {"s/tok/tokenizer.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}}
    assert at.read("s/tok/tokenizer.json") == b"{}"
    at.write("tok.json", b"{}")
    with at.local_copy(["tok.json", "missing.json"]) as folder:  # for a library that reads only files
        assert Path(folder, "tok.json").read_bytes() == b"{}" and not Path(folder, "missing.json").exists()


def test_a_local_folder_is_the_folder_itself_and_a_uri_is_fetched(where, tmp_path):
    at = storage.location(where)
    at.write("w/config.json", b"{}")
    fetched = []

    def fetch(uri):
        fetched.append(uri)
        copy = tmp_path / "copy"
        copy.mkdir(exist_ok=True)
        (copy / "config.json").write_bytes(storage.read_object(storage.join(uri, "config.json")))
        return copy

    folder = storage.local_folder(storage.below(where, "w"), fetch)
    assert (folder / "config.json").read_bytes() == b"{}"
    assert bool(fetched) != at.local  # only a URI is fetched


def test_a_write_that_cannot_finish_leaves_the_object_as_it_was_on_a_disk_too(tmpfs):
    """An object store's failed PUT leaves the old object; so does a failed write on a disk (a
    full one here): not a truncated object (fsspec's local write opens the object itself first),
    and no temp file beside it. The same goes for a reader while a write is under way: the bytes
    go to a temp file, renamed over the object once whole."""
    disk = tmpfs("256k")
    uri = f"file://{disk}/store/progress.json"
    storage.write_object(uri, b'{"step": 4}')
    with pytest.raises(storage.StorageError, match=f"^{uri}: cannot write it .*No space left on device"):
        storage.write_object(uri, bytes(1 << 20))
    assert storage.read_object(uri) == b'{"step": 4}'
    assert sorted(storage.list_objects(f"file://{disk}/store")) == ["progress.json"]
