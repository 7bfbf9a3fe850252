"""Ray Jobs glue behind `loomtrain submit | status | logs | stop` (launcher/cli/jobs.py).

`stop` has Ray send SIGTERM to the job's driver, which asks every worker to save a
checkpoint at the end of its step and stop (launcher/training/stopping.py); `submit` sets
RAY_JOB_STOP_WAIT_TIME_S so that Ray waits that long (launcher/planning/grace.py)
before it SIGKILLs the job.

The address is the cluster's dashboard (`http://HEAD:8265`), from --address or
else the RAY_ADDRESS environment variable.

What `submit` ships (launcher/cluster/packaging.py): the package's own `*.py`
files and the config named (with the files it `extends:`), nothing else: no
`.env`, keys, credentials, kubeconfigs, runs/, exports or data, and no symbolic
link is followed. `--dry-run` prints that list with sizes and contacts no
cluster. The files are copied into a staging directory as the package folder
`loomtrain/`, which becomes the job's `working_dir`. Ray unpacks it on every node and puts
it first on every job process' PYTHONPATH, so the driver and each Ray Train
worker import exactly the code that was submitted, even where an older
loomtrain is installed in the image. The entrypoint is
`python -m loomtrain train loomtrain/<CONFIG> key=value ... --ray`
(a config outside the project is copied next to the package).

Token authentication: when RAY_AUTH_MODE is unset but a token is available
(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), the client turns
token mode on so that Ray's SDK sends it; a cluster without authentication
ignores the header.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from loomtrain.launcher.addresses import AddressError, dashboard_url
from loomtrain.launcher.checkpoints.weight_source import check_init_from
from loomtrain.launcher.cluster.packaging import PackagingError, format_listing, plan_shipment, stage
from loomtrain.launcher.config_loader import ConfigError, resolve, validate
from loomtrain.launcher.planning.grace import FALLBACK_S, grace_period_s

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # launcher/cluster/jobs.py -> repo root
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
CONNECT_TIMEOUT_S = 5.0


class JobsError(Exception):
    """A user-facing error: printed as one message, exit status 1."""


# ----------------------------------------------------------------- client


def _enable_token_auth_if_available() -> None:
    if os.environ.get("RAY_AUTH_MODE"):
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or Path(token_file).is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray" in sys.modules:  # Ray read its config when it was imported: make it re-read the mode
            from ray._raylet import Config

            Config.initialize("")


def resolve_address(address: str | None) -> str:
    what = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS", "")
    if not address:
        raise JobsError("no cluster address: pass --address http://HEAD:8265 or set RAY_ADDRESS")
    try:
        return dashboard_url(address, what)
    except AddressError as e:
        raise JobsError(str(e)) from None


def _check_reachable(address: str) -> None:
    """Fail fast (bounded) where Ray's client would wait on a dead address."""
    parts = urlsplit(address)
    if parts.scheme not in ("http", "https"):
        return  # e.g. a module address Ray resolves by itself
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise JobsError(
            f"cannot reach the Ray dashboard at {address} ({e.strerror or e}); "
            "check --address / RAY_ADDRESS (the dashboard port, 8265 by default) "
            "and that the cluster is up"
        ) from None


def make_client(address: str | None):
    address = resolve_address(address)
    _check_reachable(address)
    _enable_token_auth_if_available()
    # Imported here, after the line above: Ray reads RAY_AUTH_MODE when it is first imported.
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except AuthenticationError as e:
        raise JobsError(f"the cluster at {address} refused our credentials: {e}") from None
    except (ConnectionError, RuntimeError) as e:
        raise JobsError(f"cannot talk to Ray Jobs at {address}: {e}") from None


def _call(what: str, job: str, fn):
    """fn(job), a client call; an unknown job becomes one clear message."""
    try:
        return fn(job)
    except RuntimeError as e:
        text = str(e)
        if "404" in text or "does not exist" in text:
            raise JobsError(f"no job {job!r} on this cluster (see `ray job list`)") from None
        raise JobsError(f"{what} {job!r} failed: {text}") from None


def _state(client, job: str) -> str:
    """The job's status by name (RUNNING, STOPPED, ...); an unknown job is one JobsError line."""
    s = _call("status of", job, client.get_job_status)
    return str(getattr(s, "value", s))


# ----------------------------------------------------------------- submit


def stage_project(dest_root: Path, config: str, root: Path = PROJECT_ROOT) -> str:
    """Copy what ships (see packaging.py) under dest_root; return CONFIG's path inside it."""
    entries, _, config_in_job = _plan(config, root)
    stage(entries, dest_root)
    return config_in_job


def _plan(config: str, root: Path = PROJECT_ROOT):
    try:
        return plan_shipment(config, root)
    except PackagingError as e:
        raise JobsError(str(e)) from None


# Keys naming files that may exist only on the cluster: not checked here.
CLUSTER_PATH_KEYS = ("data.tokenizer", "data.path", "checkpoint.resume", "model.init_from")


def check_config(config: str, overrides: list[str]):
    """A bad config stops here, before anything is uploaded or started; returns the config."""
    if not Path(config).is_file():
        raise JobsError(f"config file not found: {config}")
    try:
        cfg = resolve(config, overrides)
    except ConfigError as e:
        raise JobsError(f"config error: {e}") from None
    try:
        validate(cfg, cfg.ray.num_workers)
        check_init_from(cfg)  # reads the weights' headers: a path only the cluster has is noted below
    except ConfigError as e:
        if not str(e).startswith(CLUSTER_PATH_KEYS):
            raise JobsError(f"config error: {e}") from None
        print(f"loomtrain: note: not checked here (a cluster path?): {e}", file=sys.stderr)
    return cfg


def build_entrypoint(config_in_job: str, overrides: list[str]) -> str:
    args = ["python", "-m", "loomtrain", "train", config_in_job, *overrides, "--ray"]
    return " ".join(shlex.quote(a) for a in args)


def warn_relative_paths(cfg) -> None:
    """One line per relative path of the config: the job resolves it in its temporary working
    directory on the cluster, not this machine's folder (nothing but the package and the config
    ships), and a run directory there is gone with the job."""
    for section, name, key in cfg.local_paths():
        value = getattr(section, name)
        if os.path.isabs(os.path.expanduser(value)):
            continue
        if key == "run.dir":
            where = "inside the job's temporary working directory, gone when the job ends"
        else:
            where = "resolved in the job's working directory, which holds only the package and the config"
        print(
            f"loomtrain: warning: {key}={value} is a relative path: on the cluster it is {where}; "
            f"give a path every node shares ({key}=/mnt/shared/...) or a URI",
            file=sys.stderr,
        )


AGENT_WAIT_S = 60.0  # a just-started head's job agent registers seconds after its dashboard answers


def submit_when_ready(client, wait_s: float = AGENT_WAIT_S, **job) -> str:
    """client.submit_job(**job), tried again for up to `wait_s` while the cluster has no job agent
    yet (Ray: "No available agent to submit job, please try again later": a head started seconds
    ago); any other refusal, or that one after `wait_s`, is one JobsError line."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() >= deadline:
                raise JobsError(f"submission refused: {e}") from None
        time.sleep(1.0)


def submit(
    config: str,
    overrides: list[str],
    *,
    address: str | None = None,
    submission_id: str | None = None,
    env: Iterable[str] = (),
    follow: bool = False,
    dry_run: bool = False,
) -> int:
    """Check `config`, ship it with the package (see packaging.py) and start it as a Ray job;
    prints the job id. `env`: KEY=VALUE strings for the job; `dry_run` lists what would ship
    and contacts no cluster; `follow` streams the logs until the job ends (its exit status)."""
    for o in overrides:
        if "=" not in o:
            raise JobsError(f"override {o!r} is not key=value")
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    for kv in env:
        if "=" not in kv:
            raise JobsError(f"--env {kv!r} is not KEY=VALUE")
        k, v = kv.split("=", 1)
        env_vars[k] = v
    cfg = check_config(config, overrides)
    # `loomtrain stop` makes Ray SIGTERM the driver, which has the workers save; Ray's job
    # supervisor (it runs with these env_vars) SIGKILLs after this many seconds, 3 by default.
    try:
        wait_s = grace_period_s(cfg)
    except ValueError:  # a shape the plan cannot size here: still far more than Ray's 3 s
        wait_s = FALLBACK_S
    env_vars.setdefault("RAY_JOB_STOP_WAIT_TIME_S", str(wait_s))
    warn_relative_paths(cfg)
    if dry_run:
        entries, left_out, config_in_job = _plan(config)
        print(format_listing(entries, left_out))
        print(
            f"loomtrain: dry run: nothing submitted; the entrypoint would be "
            f"{build_entrypoint(config_in_job, overrides)}",
            file=sys.stderr,
        )
        return 0
    client = make_client(address)
    with tempfile.TemporaryDirectory(prefix="loomtrain-submit-") as tmp:
        config_in_job = stage_project(Path(tmp), config)
        entrypoint = build_entrypoint(config_in_job, overrides)
        runtime_env = {"working_dir": tmp, "env_vars": env_vars}
        job_id = submit_when_ready(
            client,
            entrypoint=entrypoint,
            runtime_env=runtime_env,
            submission_id=submission_id,
            metadata={"loomtrain_config": config},
        )
    print(job_id)
    print(f"loomtrain: submitted {job_id}: {entrypoint}", file=sys.stderr)
    print(f"loomtrain: follow with `loomtrain logs {job_id} --follow`", file=sys.stderr)
    if follow:
        return _follow(client, job_id)
    return 0


# ----------------------------------------------------------------- status/logs/stop


def status(job: str, *, address: str | None = None) -> int:
    """Print the job's state, message, entrypoint, running time and exit code."""
    client = make_client(address)
    info = _call("status of", job, client.get_job_info)
    st = str(getattr(info.status, "value", info.status))
    print(f"{job}: {st}")
    if info.message:
        print(f"  message: {info.message}")
    if info.entrypoint:
        print(f"  entrypoint: {info.entrypoint}")
    if info.start_time:
        # A finished job ran for a while; only one still going is "running for".
        ended = st in TERMINAL and info.end_time
        end = info.end_time if ended else time.time() * 1000
        print(f"  {'ran for' if ended else 'running for'}: {(end - info.start_time) / 1000:.1f} s")
    if getattr(info, "driver_exit_code", None) is not None:
        print(f"  exit code: {info.driver_exit_code}")
    return 0


def _follow(client, job: str) -> int:
    async def tail() -> None:
        async for chunk in client.tail_job_logs(job):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        # A job that is gone, or a stream closed early: tell which.
        _call("logs of", job, client.get_job_status)
        print(f"loomtrain: log stream ended: {e}", file=sys.stderr)
    st = _state(client, job)
    print(f"loomtrain: job {job} {st}", file=sys.stderr)
    return 0 if st == "SUCCEEDED" else 1


def logs(job: str, *, address: str | None = None, follow: bool = False) -> int:
    """Print the job's logs so far, or with `follow` stream them until it ends (its exit status)."""
    client = make_client(address)
    if follow:
        _call("logs of", job, client.get_job_status)  # unknown job -> clear error
        return _follow(client, job)
    sys.stdout.write(_call("logs of", job, client.get_job_logs))
    return 0


def stop(job: str, *, address: str | None = None, wait: bool = False, wait_timeout: float = 60.0) -> int:
    """Ask Ray to stop the job (SIGTERM to its driver); with `wait`, until it has ended or `wait_timeout` s."""
    client = make_client(address)
    stopped = _call("stop of", job, client.stop_job)
    st = _state(client, job)
    if not stopped and st in TERMINAL:
        print(f"{job}: already {st}")
        return 0
    print(f"{job}: stop requested")
    if wait:
        deadline = time.monotonic() + wait_timeout
        while st not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
            st = _state(client, job)
        if st in TERMINAL:
            print(f"{job}: {st}")
            return 0
        print(
            f"loomtrain stop: {job} did not stop within {wait_timeout:g} s (--wait-timeout); it is {st}: "
            f"the driver may still be saving a checkpoint; check with `loomtrain status {job}`",
            file=sys.stderr,
        )
        return 1
    return 0
