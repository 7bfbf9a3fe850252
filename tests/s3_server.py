"""A real local S3 endpoint for the object-storage tests: moto's server mode (an HTTP S3 API)
in a thread of the test process, one per test session (each xdist process has its own), and
one fresh bucket per test.

    def test_x(s3_bucket):          # s3_bucket: "s3://loomtrain-test-<random>"
        ...                         # os.environ holds AWS_ENDPOINT_URL and test credentials,
                                    # so child processes (tests/launch.child_env) reach it too

The server listens on `S3_HOST` (default 127.0.0.1). Tests that run processes inside network
namespaces (tests/hosts.py) must start their own server on an address the namespaces reach.
"""

from __future__ import annotations

import socket
import uuid

import pytest

S3_HOST = "127.0.0.1"
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "loomtrain-test",
    "AWS_SECRET_ACCESS_KEY": "loomtrain-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port(host: str = S3_HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(host: str = S3_HOST, port: int = 0):
    """(server, endpoint URL): a started ThreadedMotoServer; stop it with server.stop()."""
    from moto.server import ThreadedMotoServer

    port = port or free_port(host)
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    return server, f"http://{host}:{port}"


@pytest.fixture(scope="session")
def s3_endpoint():
    server, url = start_server()
    yield url
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> str:
    """A new empty bucket on the session's server, with the environment pointing at it."""
    import boto3

    for key, value in TEST_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    name = f"loomtrain-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    _forget_cached_filesystems()
    yield f"s3://{name}"
    _forget_cached_filesystems()


def _forget_cached_filesystems() -> None:
    """fsspec caches filesystem instances by their arguments; one made under another test's
    environment (endpoint, credentials) must not be reused."""
    import fsspec

    for cls in (fsspec.get_filesystem_class("s3"),):
        cls.clear_instance_cache()


__all__ = ["S3_HOST", "TEST_CREDENTIALS", "free_port", "s3_bucket", "s3_endpoint", "start_server"]
