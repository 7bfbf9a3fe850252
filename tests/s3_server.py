"""A real local S3 endpoint for the object-storage tests: moto's server mode (an HTTP S3 API)
in a thread of the test process, one per test session (each xdist process has its own), and
one fresh bucket per test.

    def test_x(s3_bucket):          # s3_bucket: "s3://loomtrain-test-<random>"
        ...                         # os.environ holds AWS_ENDPOINT_URL and test credentials,
                                    # so child processes (tests/launch.child_env) reach it too

The server listens on `S3_HOST` (default 127.0.0.1). Tests that run processes inside network
namespaces (tests/hosts.py) must start their own server on an address the namespaces reach:

    proc, url = start_server_on(host)                # moto's server on host.addr, as a process there
    bucket = make_bucket_on(host, url)                # "s3://loomtrain-test-<random>", made from that host
    keys = list_on(host, url, bucket)                 # every key, from that host
    fetch_on(host, url, f"{bucket}/run/tb", dest)     # a prefix's objects into dest (a folder the test reads)

(the test process, in the machine's own namespace, has no route to the hosts' addresses, so
everything that touches the bucket runs on a host).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


@pytest.fixture(params=["disk", "s3"])
def backend_root(request, tmp_path) -> str:
    """A location on each storage backend in turn (a test taking it runs twice): the test's own
    folder, then a new bucket of the local server (storage.location picks Folder, then Objects)."""
    return str(tmp_path) if request.param == "disk" else request.getfixturevalue("s3_bucket")


def _forget_cached_filesystems() -> None:
    """fsspec caches filesystem instances by their arguments; one made under another test's
    environment (endpoint, credentials) must not be reused."""
    import fsspec

    for cls in (fsspec.get_filesystem_class("s3"),):
        cls.clear_instance_cache()


HOST_PORT = 9000  # of a server on a test host: its namespace has nothing else on it but Ray's ports

# Run on a test host with the test credentials: one operation on the server at argv[1].
_ON_HOST = """
import json, os, sys, time
import boto3, botocore.exceptions
url, op, *args = sys.argv[1:]
s3 = boto3.client("s3", endpoint_url=url)
if op == "mkbucket":
    for _ in range(150):  # the server may still be starting
        try:
            s3.create_bucket(Bucket=args[0])
            break
        except botocore.exceptions.EndpointConnectionError:
            time.sleep(0.1)
    else:
        sys.exit("no S3 server at " + url)
elif op == "list":
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=args[0])
    print(json.dumps(sorted(o["Key"] for page in pages for o in page.get("Contents", []))))
elif op == "fetch":
    bucket, prefix, dest = args
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            if o["Key"].endswith("/"):  # a folder marker (s3fs makes some): no file
                continue
            path = os.path.join(dest, o["Key"][len(prefix) + 1:])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            s3.download_file(bucket, o["Key"], path)
"""


def host_env(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the server at `endpoint` (credentials included)."""
    return {**TEST_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def start_server_on(host, port: int = HOST_PORT) -> tuple[subprocess.Popen, str]:
    """(process, endpoint URL): moto's server on `host` (tests/hosts.py), at its address;
    it ends with the host (or proc.kill())."""
    argv = [sys.executable, "-m", "moto.server", "-H", host.addr, "-p", port]
    proc = host.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://{host.addr}:{port}"


def _on_host(host, endpoint: str, *args: str) -> str:
    env = {**os.environ, **host_env(endpoint)}
    out = host.run([sys.executable, "-c", _ON_HOST, endpoint, *args], env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def make_bucket_on(host, endpoint: str) -> str:
    """A new empty bucket on the server at `endpoint`, made from `host` (waits for the server)."""
    name = f"loomtrain-test-{uuid.uuid4().hex[:12]}"
    _on_host(host, endpoint, "mkbucket", name)
    return f"s3://{name}"


def _split(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.rstrip("/")


def list_on(host, endpoint: str, bucket: str) -> list[str]:
    """Every key of `bucket` (s3://NAME), sorted, listed from `host`."""
    return json.loads(_on_host(host, endpoint, "list", _split(bucket)[0]))


def fetch_on(host, endpoint: str, uri: str, dest) -> None:
    """The objects under `uri` (s3://NAME/PREFIX) into the folder `dest`, as `host` sees it."""
    _on_host(host, endpoint, "fetch", *_split(uri), str(dest))


__all__ = [
    "HOST_PORT",
    "S3_HOST",
    "TEST_CREDENTIALS",
    "backend_root",
    "fetch_on",
    "free_port",
    "host_env",
    "list_on",
    "make_bucket_on",
    "s3_bucket",
    "s3_endpoint",
    "start_server",
    "start_server_on",
]
