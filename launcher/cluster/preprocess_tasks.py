"""`loomtrain preprocess --ray`: input files tokenized as Ray tasks across a cluster.

Each task reads one input file where it runs (so the inputs must be on storage
every node sees: a shared filesystem, or one machine) and returns its unit
results; the driver writes each file's part as it arrives and assembles the
shards in input order (data_pipeline/staging.py), so the output is the same
bytes as a local run; an --output URI is uploaded from the driver as for a local
run (data_pipeline/remote_output.py), so the tasks need no access to the store.
Tasks are retried on a lost node: a file's result does not depend on where or
how often it is computed.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from loomtrain.data_pipeline.preprocess import tokenize_file
from loomtrain.data_pipeline.shards import DataError
from loomtrain.launcher.addresses import AddressError, check_ray_address
from loomtrain.storage import message_line

REACH_TIMEOUT_S = 5.0  # a cluster's head answers a TCP connect at once; this bounds a dead or filtered address
RAY_CLIENT_PORT = 10001  # ray://HOST without a port


def _check_reachable(address: str, what: str) -> None:
    """The cluster at `address` answers within REACH_TIMEOUT_S, else one line naming it: ray.init
    retries a dead GCS for minutes, and waits without end on a port that accepts a connection but
    speaks something else (the dashboard's 8265 given as HOST:PORT is the usual mix-up)."""
    if address in ("auto", "local"):  # found (or refused at once) by Ray from this machine's own files
        return
    netloc = urlsplit(address).netloc if "://" in address else address
    parts = urlsplit(f"//{netloc}")
    host, port = parts.hostname, parts.port or RAY_CLIENT_PORT
    fix = "check the address (HOST:6379, the head's GCS port, or ray://HEAD:10001) and that the cluster is up"
    where = "" if f"{host}:{port}" in address else f" to {host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=REACH_TIMEOUT_S):
            pass
    except OSError as exc:
        cause = f"no answer within {REACH_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else exc.strerror or exc
        raise DataError(f"{what} {address}: cannot connect{where} ({cause}); {fix}") from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return  # the probes below speak plain gRPC; with TLS, Ray's own client is the judge
    client = "://" in address
    if not (_answers_grpc(f"{host}:{port}") if client else _answers_as_gcs(address)):
        server = "a Ray client server" if client else "a Ray GCS"
        raise DataError(
            f"{what} {address}: it accepts connections but does not answer as {server} within "
            f"{REACH_TIMEOUT_S:g} s (is it the dashboard port, 8265?); {fix}"
        )


def probe_ray_address(address: str, what: str = "ray.address") -> None:
    """A driver's Ray address checked before it connects (`preprocess --ray`, `train --ray`):
    well formed, and a cluster answers there within REACH_TIMEOUT_S; DataError naming it otherwise."""
    try:
        check_ray_address(address, what)
    except AddressError as exc:
        raise DataError(str(exc)) from None
    if address:
        _check_reachable(address, what)


def _answers_grpc(target: str) -> bool:
    """A gRPC channel to HOST:PORT gets ready (an HTTP/2 server answered) within the deadline."""
    import grpc

    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=REACH_TIMEOUT_S)
        except grpc.FutureTimeoutError:
            return False
    return True


def _answers_as_gcs(address: str) -> bool:
    """One GCS request (its cluster id) to HOST:PORT with a deadline."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=REACH_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            # A GCS that wants a token refuses us but is there; ray.init sends the token.
            return exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    return True


def _connect(address: str | None, max_in_flight: int | None) -> bool:
    """Connect (or start a local instance); -> whether we started the connection."""
    import ray

    if ray.is_initialized():
        return False
    RayTasks(address).check()
    address = address or os.environ.get("RAY_ADDRESS") or None
    num_cpus = None if address else max_in_flight or os.cpu_count() or 1  # a local instance's size
    try:
        ray.init(address=address, num_cpus=num_cpus, log_to_driver=False)
    except Exception as exc:  # a bad or unreachable address: Ray's own text, first line
        raise DataError(
            f"--address {address or '(local instance)'}: cannot connect to Ray: {message_line(exc)}"
        ) from None
    return True


@dataclass(frozen=True)
class RayTasks:
    """preprocess_files' executor for `preprocess --ray`: each input file a Ray task on the
    cluster at `address` (None: $RAY_ADDRESS, else a local instance)."""

    address: str | None = None
    name = "Ray"  # in preprocess' summary line: "N worker(s) on Ray"

    def check(self) -> None:
        """Before anything is written: the address is well formed and a cluster answers there
        within a few seconds (DataError naming it otherwise); no address: a local instance."""
        what = "--address" if self.address else "RAY_ADDRESS"
        probe_ray_address(self.address or os.environ.get("RAY_ADDRESS") or "", what)

    def __call__(
        self, jobs, tokenizer, text_field, skip_bad_lines, *, max_in_flight, on_file, log=None, records=None
    ) -> int:
        """Run tokenize_file for each (i, path) of `jobs` as a Ray task, at most
        max_in_flight at once (default: the cluster's CPUs); call on_file(i, results)
        on the driver as each finishes. -> the number of tasks kept in flight."""
        import ray
        from ray.exceptions import RayTaskError

        started = _connect(self.address, max_in_flight)
        try:
            in_flight = max(1, int(max_in_flight or ray.cluster_resources().get("CPU", 1)))
            if log:
                log(f"preprocess: {len(jobs)} input files as Ray tasks, {in_flight} at a time")
            task = ray.remote(num_cpus=1, max_retries=3)(tokenize_file)
            tok_ref = ray.put(tokenizer)
            queue, running, path_of = list(jobs), {}, dict(jobs)
            while queue or running:
                while queue and len(running) < in_flight:
                    i, path = queue.pop(0)
                    extra = () if records is None else (records,)  # instruction or chat records (records.py)
                    running[task.remote(path, tok_ref, text_field, skip_bad_lines, *extra)] = i
                done, _ = ray.wait(list(running), num_returns=1)
                i = running.pop(done[0])
                try:
                    results = ray.get(done[0])
                except RayTaskError as exc:
                    if isinstance(exc.cause, DataError):  # bad input: its own one-line message
                        raise DataError(str(exc.cause)) from None
                    if isinstance(exc.cause, OSError):  # an input the task could not read where it ran
                        raise DataError(f"input {path_of[i]}: {exc.cause.strerror or exc.cause}") from None
                    raise
                on_file(i, results)
            return in_flight
        finally:
            if started:
                ray.shutdown()
