"""loomtrain.storage: a URI is never taken for a path, and the test S3 server is a real endpoint."""

import pytest
from loomtrain import storage


def test_uris_and_paths_are_told_apart():
    assert storage.is_uri("s3://bkt/ds") and storage.is_uri("gs://b") and storage.is_uri("file:///tmp/x")
    assert not storage.is_uri("runs/x") and not storage.is_uri("/abs/s3:/x") and not storage.is_uri("~/x")
    assert storage.join("s3://bkt/ds/", "shards", "a.bin") == "s3://bkt/ds/shards/a.bin"
    assert storage.join("runs/x", "final") == "runs/x/final"


def test_an_unknown_scheme_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"run\.storage='nope://b/x': unknown storage scheme nope://"):
        storage.object_store("nope://b/x", "run.storage")


def test_the_local_server_stores_and_serves_ranged_reads(s3_bucket):
    fs, path = storage.object_store(f"{s3_bucket}/dir/obj.bin", "test")
    fs.pipe_file(path, bytes(range(256)))
    assert fs.cat_file(path, start=10, end=14) == bytes([10, 11, 12, 13])
    assert fs.ls(path.rsplit("/", 1)[0], detail=False) == [path]


def test_an_output_folder_for_a_uri_replaces_the_prefix_whole_with_its_commits_last(s3_bucket, monkeypatch):
    """An object store has no rename: output_folder stages the folder and uploads it once it is
    complete; an earlier output's commit goes first (no reader takes a mix), its other objects
    after it, and the new commits are the last objects to appear, outermost last."""
    where, sent, upload = f"{s3_bucket}/out", [], storage.upload_file
    monkeypatch.setattr(storage, "upload_file", lambda local, uri: (upload(local, uri), sent.append(uri)))
    for files in (
        {"w.bin": b"1", "final/x.bin": b"2", "final/manifest.json": b"{}", "config.yaml": b"a"},
        {"w.bin": b"3", "final/manifest.json": b"{}", "config.yaml": b"b"},
    ):
        sent.clear()
        with storage.output_folder(where, ("final/manifest.json", "config.yaml")) as out:
            for rel, data in files.items():
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                (out / rel).write_bytes(data)
        assert storage.location(where).sizes() == {rel: len(data) for rel, data in files.items()}
        assert sent[-2:] == [f"{where}/final/manifest.json", f"{where}/config.yaml"]
    assert storage.location(where).read("w.bin") == b"3"
