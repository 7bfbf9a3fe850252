"""Checkpoint cost per rank as the world grows: each rank should touch only its share.

For world 1, 2 and 4, split by tensor parallelism and by data parallelism (ZeRO 1, fp32), on a
~100 M model (--tiny: a small one, worlds 1 and 2), every rank reports:

    start-up peak RSS      ru_maxrss once the engine is built (before any checkpoint work)
    bytes written / save   the sizes of the files this rank wrote into one checkpoint
    bytes read at resume   the tensor bytes this rank read (ShardedReader's count) when the
                           checkpoint is loaded back at the same layout
    save blocked, sync     seconds the step waits for a synchronous save (write + publish)
    save blocked, async    seconds the step waits for checkpoint.async_save (the snapshot)

and the table shows the largest rank's figure and its ratio to world 1 (ideal: 1/world for
bytes; the sync save shrinks with the bytes, the async one stays near the snapshot copy).

    python benchmarks/checkpoint_scale.py [--tiny] [--layouts 1x1,2x1,1x2,4x1,1x4] [--storage s3]

--storage s3: the checkpoints go to run.storage on a local S3 server (moto's, in a process of
its own: benchmarks/object_storage.py's moto_server); "written" is then the size of the objects
this rank uploaded and "read at resume" the tensor bytes its ranged GETs fetched.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import common

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
BIG = [
    "model.vocab_size=8192",
    "model.d_model=768",
    "model.n_layers=14",
    "model.n_heads=12",
    "model.n_kv_heads=12",
    "model.max_seq_len=64",
    "train.seq_len=64",
]
SMALL = [
    "model.vocab_size=512",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.max_seq_len=32",
    "train.seq_len=32",
]


def checkpoint_store(args):
    """The run's checkpoint store: its run directory, or (--storage s3) a prefix of its own in the bucket."""
    from loomtrain.launcher.checkpoints.store import CheckpointStore

    where = f"{args.storage}/{Path(args.run_dir).name}" if args.storage else args.run_dir
    return CheckpointStore(where, keep_last=10, log=lambda m: None)


def bytes_written(path, rank: int) -> int:
    """The sizes of this rank's tensor files in one checkpoint (files on disk, or objects)."""
    names = [f"{d}/rank_{rank:05d}.safetensors" for d in ("model", "optim", "rng")]
    if isinstance(path, str):
        from loomtrain.storage import Objects

        sizes = Objects(path).sizes()
        return sum(sizes.get(n, 0) for n in names)
    return sum((path / n).stat().st_size for n in names if (path / n).exists())


def worker(args) -> None:
    from loomtrain.launcher.checkpoints.background import BackgroundSave
    from loomtrain.launcher.checkpoints.parts import Training
    from loomtrain.launcher.checkpoints.state import load_checkpoint, save_checkpoint, take_snapshot
    from loomtrain.launcher.config_loader import load_config
    from loomtrain.launcher.distributed import barrier

    world = int(os.environ.get("WORLD_SIZE", "1"))
    shape = SMALL if args.tiny else BIG
    cfg = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            *shape,
            "model.norm=rmsnorm",
            "model.activation=swiglu",
            "model.positions=rope",
            "model.tie_embeddings=false",
            f"parallel.tp={args.tp}",
            "parallel.zero_stage=1",
            "train.precision=fp32",
            "train.device=cpu",
            "train.micro_batch_size=1",
            f"train.global_batch_size={world // args.tp}",
            "log.tensorboard=false",
        ],
        world_size=world,
    )
    ctx = common.engine_context(cfg, run_dir=args.run_dir)
    training = Training(ctx.engine, ctx.topology, zero_stage=1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = ctx.dist.rank
    store = checkpoint_store(args)

    barrier()
    t0 = time.perf_counter()
    path = save_checkpoint(store, 1, training)
    sync_s = time.perf_counter() - t0
    written = bytes_written(path, rank)

    barrier()
    t0 = time.perf_counter()
    tmp = store.begin(2) if rank == 0 else store.temp_dir(2)
    barrier()
    snap = take_snapshot(2, training, copy=True)
    bg = BackgroundSave(snap, store, tmp).start()
    async_s = time.perf_counter() - t0
    bg.wait()
    barrier()

    if args.storage:  # what travelled: the bytes of the ranged GETs (tiles, and the gaps merged between them)
        from object_storage import recorded_ranges

        with recorded_ranges() as calls:
            trainer = load_checkpoint(path, training)
        trainer["bytes_read"] = sum(end - start for _, start, end in calls)
    else:
        trainer = load_checkpoint(path, training)
    if args.storage:
        barrier()
        if rank == 0:
            from loomtrain.storage import Objects

            Objects(str(store.base)).delete_tree("")
    out = {
        "rank": rank,
        "rss": rss,
        "written": written,
        "read": trainer["bytes_read"],
        "sync_s": sync_s,
        "async_s": async_s,
    }
    common.write_row(args.out, rank, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small model, worlds 1 and 2 (smoke test)")
    ap.add_argument("--layouts", default="", help="TPxDP list, e.g. 1x1,2x1,1x2,4x1,1x4")
    ap.add_argument("--storage", default="", help="s3: checkpoints on a local S3 server (run.storage)")
    common.add_worker_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.storage == "s3":
        from object_storage import moto_server

        with moto_server() as (bucket, env):
            report(args, {**env, "OMP_NUM_THREADS": "1"}, ["--storage", bucket])
    elif args.storage:
        ap.error(f"--storage {args.storage}: expected s3 (or nothing: the run directory)")
    else:
        report(args, {"OMP_NUM_THREADS": "1"}, [])


def report(args, env: dict[str, str], extra: list[str]) -> None:
    layouts = args.layouts or ("1x1,2x1,1x2" if args.tiny else "1x1,2x1,1x2,4x1,1x4")
    pairs = [tuple(int(v) for v in item.split("x")) for item in layouts.split(",")]
    if pairs[0] != (1, 1):
        pairs.insert(0, (1, 1))
    with tempfile.TemporaryDirectory(prefix="ckpt_scale_") as d:
        results = {
            p: common.run_layout(HERE, *p, Path(d), [*(["--tiny"] if args.tiny else []), *extra], env, 1800)
            for p in pairs
        }
    base = {k: max(r[k] for r in results[(1, 1)]) for k in ("rss", "written", "read", "sync_s", "async_s")}
    print(
        f"checkpoint_scale: {'tiny' if args.tiny else '~112 M'} model, fp32, ZeRO 1, CPU/gloo, "
        f"{'run.storage on a local S3 server' if extra else 'run directory on disk'}; "
        f"largest rank's figure (ratio to world 1)"
    )
    print(
        f"{'layout':>10} {'start-up RSS':>20} {'written/save':>20} {'read at resume':>20} "
        f"{'sync blocked':>18} {'async blocked':>18}"
    )
    for (tp, dp), rows in results.items():
        cells = []
        for k, unit, scale in (
            ("rss", "MiB", 2**20),
            ("written", "MiB", 2**20),
            ("read", "MiB", 2**20),
            ("sync_s", "s", 1),
            ("async_s", "s", 1),
        ):
            v = max(r[k] for r in rows)
            cells.append(f"{v / scale:8.2f} {unit} ({v / base[k]:.2f})")
        print(f"{f'tp{tp} dp{dp}':>10} " + " ".join(f"{c:>20}" for c in cells))
    print("ratio to world 1 in parentheses; ideal for bytes: 1/world")


if __name__ == "__main__":
    main()
