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
