"""Checkpoints in object storage (run.storage=s3://...) against s3fs' own bulk transfers of the
same bytes, side by side in one run, against a local S3 server (moto's, in a process of its own
so its CPU is not in the measured processes).

Throughput (per rank, each layout in processes of its own, fp32, alternating rounds): every
rank measures

    save        save_checkpoint into a CheckpointStore on run.storage, synchronous: what a save does
                (serialize, hash every tile, stream each file up as a multipart upload with
                parts in flight, the part list, rank 0's manifest and `latest`)
    upload      storage.Upload alone (the uploader a save streams into) fed this rank's files
                from local disk in 16 MiB writes
    bulk put    s3fs `fs.put(local files, keys)` of the same files (the library's bulk upload,
                its defaults)
    resume      load_checkpoint from the checkpoint's URI into the engine (ranged GETs of the
                rank's tiles, sha256 of each)
    ranged      the resume's own ranged GETs (headers and tiles) replayed bare, one after
                another (s3fs `cat_file` of each range, no hashing, nothing put in the engine):
                what the server makes those requests cost. moto answers every GET by copying
                the whole object first (its FakeKey.value), so there a ranged GET costs the
                object's size, not the range's; resume/ranged is loomtrain's own share of a
                resume, ranged/bulk the server's
    bulk get    s3fs `fs.cat(keys)` of the files the resume opened, whole, into memory

and the table shows the worst rank's median time and the ratios bulk / loomtrain
(>= 1: loomtrain at least as fast as the bulk path; target >= 0.8).

Blocked time: the real `loomtrain train` (configs/tiny.yaml at the benchmark's model size,
checkpoint.async_save on, its default) with run.storage on the server against the same run on
disk, alternating; each save line's "training blocked X s" (rank 0's line) and the run's wall time.

    python benchmarks/object_storage.py [--tiny] [--rounds 3] [--layouts 1x1,1x2] [--d-model 768]
        [--layers 8] [--train-runs 2] [--skip-train]

Bytes each rank reads at resume against its share, for S3:
    python benchmarks/checkpoint_scale.py --storage s3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import common

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
# The local server's test credentials (moto takes any); never a real account's.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "loomtrain-bench",
    "AWS_SECRET_ACCESS_KEY": "loomtrain-bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
WRITE_BYTES = 16 << 20  # the upload-alone contender's write size (a part's)


@contextlib.contextmanager
def moto_server():
    """(bucket URI, environment for the processes that reach it): `python -m moto.server` on
    127.0.0.1 in a process of its own, a fresh bucket on it; the server ends with the block."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": url}
    try:
        import boto3
        import botocore.exceptions

        client = boto3.client("s3", endpoint_url=url, **_boto_credentials())
        bucket = f"loomtrain-bench-{uuid.uuid4().hex[:8]}"
        for _ in range(300):  # the server takes a few seconds to start on a loaded machine
            try:
                client.create_bucket(Bucket=bucket)
                break
            except botocore.exceptions.EndpointConnectionError:
                if proc.poll() is not None:
                    sys.exit(f"object_storage: moto's server ended at start (exit {proc.returncode})")
                time.sleep(0.1)
        else:
            sys.exit(f"object_storage: no S3 server at {url} after 30 s")
        yield f"s3://{bucket}", env
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _boto_credentials() -> dict:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def model_args(args) -> list[str]:
    if args.tiny:
        return ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4"]
    heads = max(1, args.d_model // 64)
    return [f"model.d_model={args.d_model}", f"model.n_layers={args.layers}"] + [
        f"model.n_heads={heads}",
        f"model.n_kv_heads={heads}",
    ]


def timed(fn, *a, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def recorded_ranges():
    """Every ranged GET s3fs makes inside the block, as (key, start, end). fsspec binds each
    instance's blocking methods when the instance is made, so both are wrapped: the class'
    coroutine (what cat_ranges and instances made inside the block call) and the blocking
    cat_file of the instances that exist already (what a header read calls)."""
    import s3fs

    cls = s3fs.S3FileSystem
    calls, real = [], cls._cat_file

    async def recording(self, path, version_id=None, start=None, end=None, **kw):
        if start is not None or end is not None:
            calls.append((path, start, end))
        return await real(self, path, version_id=version_id, start=start, end=end, **kw)

    def wrapped(blocking):
        def cat_file(path, version_id=None, start=None, end=None, **kw):
            if start is not None or end is not None:
                calls.append((path, start, end))
            return blocking(path, version_id=version_id, start=start, end=end, **kw)

        return cat_file

    existing = [(fs, vars(fs)["cat_file"]) for fs in list(cls._cache.values()) if "cat_file" in vars(fs)]
    cls._cat_file = recording
    for fs, blocking in existing:
        fs.cat_file = wrapped(blocking)
    try:
        yield calls
    finally:
        cls._cat_file = real
        for fs, blocking in existing:
            fs.cat_file = blocking


def replay(fs, calls) -> None:
    """The same ranged GETs, one after another, the bytes dropped."""
    for path, start, end in calls:
        fs.cat_file(path, start=start, end=end)


def upload_alone(objects, files: list[tuple[Path, str]]) -> None:
    """This rank's files through storage.Upload, as a save streams them (16 MiB writes)."""
    for local, rel in files:
        _, up = objects.sink(rel)
        with open(local, "rb") as f:
            while chunk := f.read(WRITE_BYTES):
                up.write(chunk)
        up.close()


# Throughput: one process per rank ---------------------------------------------------------------
def worker(args) -> None:
    from loomtrain.launcher.checkpoints.state import load_checkpoint, save_checkpoint
    from loomtrain.launcher.checkpoints.store import CheckpointStore, wait_for_deletions
    from loomtrain.launcher.distributed import barrier
    from loomtrain.storage import Objects

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx, training = common.checkpoint_rig(model_args(args), args.tp, run_dir)
    rank = ctx.dist.rank
    storage = f"{args.storage}/{run_dir.name}"
    store = CheckpointStore(storage, keep_last=1, log=lambda m: None)
    bulk = Objects(storage).child(f"bulk/rank_{rank:05d}")
    fs = bulk.fs
    mine = f"rank_{rank:05d}"
    scratch = run_dir / f"scratch_{mine}"
    out = {k: [] for k in ("save", "upload", "put", "resume", "ranged", "get")}
    for r in range(args.rounds):
        step = 10 * (r + 1)
        wait_for_deletions()  # the previous round's checkpoint goes in the background
        barrier()
        seconds, uri = timed(save_checkpoint, store, step, training)
        out["save"].append(seconds)
        step_objects = Objects(str(uri))
        files = sorted(rel for rel in step_objects.sizes() if mine in rel.rsplit("/", 1)[-1])
        written = sum(step_objects.sizes()[rel] for rel in files)
        if r == 0:  # the same bytes on local disk, for the bulk put and the upload alone
            for rel in files:
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{step_objects.path}/{rel}", str(scratch / rel))
        local = [(scratch / rel, rel) for rel in files]

        barrier()
        out["put"].append(timed(fs.put, [str(p) for p, _ in local], [f"{bulk.path}/put/{rel}" for _, rel in local])[0])
        barrier()
        out["upload"].append(timed(upload_alone, bulk.child("upload"), local)[0])
        bulk.delete_tree("")

        barrier()
        with recorded_ranges() as calls:
            seconds, trainer = timed(load_checkpoint, uri, training)
        out["resume"].append(seconds)
        barrier()
        out["ranged"].append(timed(replay, fs, calls)[0])
        gets, fetched = len(calls), sum(end - start for _, start, end in calls)
        keys = [f"{step_objects.path}/{rel}" for rel in trainer["files_read"]]
        read = sum(step_objects.sizes()[rel] for rel in trainer["files_read"])
        barrier()
        out["get"].append(timed(fs.cat, keys)[0])
    out.update(written=written, read=read, bytes_read=trainer["bytes_read"], gets=gets, fetched=fetched)
    common.write_row(args.out, rank, out)
    barrier()  # every rank done with the bucket
    if rank == 0:
        Objects(storage).delete_tree("")


def summary(rows: list[dict]) -> dict:
    """Worst rank's median time of each; worst rank's median per-round ratio bulk / loomtrain."""
    med = [{k: statistics.median(v) for k, v in r.items() if isinstance(v, list)} for r in rows]

    def ratio(bulk: str, ours: str) -> float:
        return min(statistics.median(b / o for b, o in zip(r[bulk], r[ours])) for r in rows)

    return {
        **{k: max(m[k] for m in med) for k in med[0]},
        "save_x": ratio("put", "save"),
        "upload_x": ratio("put", "upload"),
        "resume_x": ratio("get", "resume"),
        "own_x": ratio("ranged", "resume"),
        "server_x": ratio("get", "ranged"),
        "gets": max(r["gets"] for r in rows),
        "fetched": max(r["fetched"] for r in rows),
        "written": max(r["written"] for r in rows),
        "read": max(r["read"] for r in rows),
    }


def throughput(args, storage: str, env: dict, tmp: Path) -> None:
    pairs = [tuple(int(v) for v in item.split("x")) for item in args.layouts.split(",")]
    extra = ["--rounds", str(args.rounds), "--storage", storage, *model_args_cli(args)]
    results = {p: summary(common.run_layout(HERE, *p, tmp, extra, env)) for p in pairs}
    print(
        f"object_storage: checkpoint transfers against s3fs' bulk put/get, {size_name(args)}, fp32, CPU, "
        f"local moto server; worst rank's median of {args.rounds} rounds (load {common.loadavg()})"
    )
    head = ["layout", "MB/rank", "save s", "upload s", "bulk put s", "put/save", "put/upload"]
    head += ["MB opened", "MB fetched", "GETs", "resume s", "ranged s", "bulk get s"]
    head += ["get/resume", "ranged/res", "get/ranged"]
    print(" ".join(f"{h:>11}" for h in head))
    for (tp, dp), s in results.items():
        cells = [f"tp{tp} dp{dp}", f"{s['written'] / 1e6:.0f}", f"{s['save']:.2f}", f"{s['upload']:.2f}"]
        cells += [f"{s['put']:.2f}", f"{s['save_x']:.2f}x", f"{s['upload_x']:.2f}x", f"{s['read'] / 1e6:.0f}"]
        cells += [f"{s['fetched'] / 1e6:.0f}", f"{s['gets']}", f"{s['resume']:.2f}", f"{s['ranged']:.2f}"]
        cells += [f"{s['get']:.2f}"]
        cells += [f"{s['resume_x']:.2f}x", f"{s['own_x']:.2f}x", f"{s['server_x']:.2f}x"]
        print(" ".join(f"{c:>11}" for c in cells))
    print("put/save, put/upload, get/resume: bulk time over loomtrain's (>= 1: loomtrain as fast; target >= 0.8x)")
    print("MB opened: the sizes of the files the resume opened (the bulk get's bytes); MB fetched: its ranged GETs'")
    print("ranged/res: the resume's ranged GETs replayed bare over the resume (loomtrain's own share);")
    print("get/ranged: bulk whole-object GETs over those ranged GETs (the server's cost per request)")


def model_args_cli(args) -> list[str]:
    return ["--tiny"] if args.tiny else ["--d-model", str(args.d_model), "--layers", str(args.layers)]


def size_name(args) -> str:
    if args.tiny:
        return "tiny model"
    params = args.layers * 12 * args.d_model**2 + 320 * args.d_model
    return f"~{params / 1e6:.0f} M model (d_model {args.d_model}, {args.layers} layers)"


# Blocked time: the real `loomtrain train` -------------------------------------------------------
BLOCKED = re.compile(r"checkpoint: step (\d+) -> \S+ \(([\d.]+) s, training blocked ([\d.]+) s\)")


def train_run(args, run_dir: Path, cache: Path, storage: str | None, env: dict) -> dict:
    """One `loomtrain train` launch: each save's blocked seconds (rank 0's line) and the wall time."""
    steps, every = (4, 2) if args.tiny else (args.train_steps, args.train_every)
    over = [
        *model_args(args),
        "model.max_seq_len=64",
        "train.seq_len=64",
        "train.micro_batch_size=2",
        f"train.global_batch_size={2 * args.train_world}",
        "train.precision=fp32",
        f"train.max_steps={steps}",
        "train.warmup_steps=1",
        "eval.every_steps=0",
        f"checkpoint.every_steps={every}",
        "checkpoint.keep_last=2",
        "log.tensorboard=false",
        "data.max_files=40",
        f"run.dir={run_dir}",
        f"data.cache_dir={cache}",
        *([f"run.storage={storage}"] if storage else []),
    ]
    head = [sys.executable]
    if args.train_world > 1:
        head += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.train_world)]
    cmd = [*head, "-m", "loomtrain", "train", str(REPO / "configs" / "tiny.yaml"), *over]
    child = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **env}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=child, capture_output=True, text=True, timeout=3600, cwd=run_dir.parent)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        sys.exit(f"object_storage: loomtrain train failed ({storage or 'disk'}):\n{tail}")
    saves = [(int(m[1]), float(m[2]), float(m[3])) for m in BLOCKED.finditer(p.stdout + p.stderr)]
    if not saves:
        sys.exit(f"object_storage: no save line in loomtrain train's output:\n{(p.stdout + p.stderr)[-3000:]}")
    return {"blocked": [b for _, _, b in saves], "save_s": [s for _, s, _ in saves], "wall": wall}


def blocked(args, storage: str, env: dict, tmp: Path) -> None:
    cache = tmp / "data_cache"
    rows = {"disk": [], "s3": []}
    for r in range(args.train_runs):
        for where in ("disk", "s3") if r % 2 == 0 else ("s3", "disk"):
            run_dir = tmp / f"train_{where}_{r}"
            run_dir.mkdir()
            uri = f"{storage}/train_{r}" if where == "s3" else None
            rows[where].append(train_run(args, run_dir, cache, uri, env))
    print(
        f"\nobject_storage: `loomtrain train` with checkpoint.async_save (default), {size_name(args)}, fp32, "
        f"world {args.train_world}; rank 0's save lines, {args.train_runs} runs each, alternating "
        f"(load {common.loadavg()})"
    )
    print(f"{'where':>6} {'blocked per save (s)':>44} {'median':>8} {'max':>8} {'save done (s)':>14} {'wall s':>8}")
    for where, runs in rows.items():
        b = [x for run in runs for x in run["blocked"]]
        done = statistics.median(x for run in runs for x in run["save_s"])
        walls = "/".join(f"{run['wall']:.0f}" for run in runs)
        shown = " ".join(f"{x:.2f}" for x in b)
        print(f"{where:>6} {shown:>44} {statistics.median(b):>8.2f} {max(b):>8.2f} {done:>14.1f} {walls:>8}")
    print("blocked: the step's stall for the save (the snapshot copy); the upload runs behind training")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small model (a smoke test of the script)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per layout (medians)")
    ap.add_argument("--layouts", default="1x1,1x2", help="TPxDP list")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--train-runs", type=int, default=2, help="loomtrain train launches per place (disk, S3)")
    ap.add_argument("--train-world", type=int, default=2, help="ranks of each loomtrain train launch")
    ap.add_argument("--train-steps", type=int, default=12)
    ap.add_argument("--train-every", type=int, default=4, help="checkpoint.every_steps of the launches")
    ap.add_argument("--skip-train", action="store_true", help="only the throughput table")
    ap.add_argument("--skip-throughput", action="store_true", help="only the loomtrain train launches")
    ap.add_argument("--storage", default="", help=argparse.SUPPRESS)
    common.add_worker_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with moto_server() as (storage, env), tempfile.TemporaryDirectory(prefix="object_storage_") as d:
        if not args.skip_throughput:
            throughput(args, storage, env, Path(d))
        if not args.skip_train:
            blocked(args, storage, env, Path(d))


if __name__ == "__main__":
    main()
