"""Checkpoint save and resume against what the machine itself allows, side by side in one run.

At world 1 (ZeRO 0) and at tp 2 x dp 2 (ZeRO 1), fp32, on the 101 M model of the issue
(d_model 1024, 8 layers, 16 heads, the tiny config's vocabulary; --tiny: a small one), every
rank measures, in rounds of each kind:

    save     save_checkpoint, synchronous: write, hash, fsync, publish (what a step waits for)
    dd       `dd if=/dev/zero bs=16M conv=fsync` of the bytes this rank wrote, to the same disk,
             every rank at once (as they save), alternating with the saves
    resume   load_checkpoint of the last checkpoint into the engine: page cache warm, and cold
             (every file of the checkpoint dropped from the page cache with
             posix_fadvise(DONTNEED) first; no root needed)
    floor    safetensors `load_file` of the files this rank's resume opened + sha256 of every
             tensor in them (the issue's floor), warm and cold the same way
    floor3   the same with the tile checksum a resume checks (XXH3-128 since format v3; warm)
    async    the step's stall for checkpoint.async_save (the snapshot copy to host memory)

and the table shows, per layout, the worst rank's median and the worst rank's ratio:
save at (dd / save) of the disk's fsynced write rate (target >= 0.7), resume at
(resume / floor) times the load-and-hash floor (target <= 2), and against floor3 too.

    python benchmarks/checkpoint_speed.py [--tiny] [--rounds 3] [--layouts 1x1,2x2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import common

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
BIG = ["model.d_model=1024", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=16"]
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4"]


def drop_from_page_cache(root: Path) -> None:
    """Every file under root out of the page cache (written and fsynced, so the pages are clean)."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_and_hash(files: list[Path], new_hash=hashlib.sha256) -> None:
    """The floor of a resume: read the same files with safetensors and hash every tensor."""
    import torch
    from safetensors.torch import load_file

    for f in files:
        for t in load_file(str(f)).values():
            new_hash(t.reshape(-1).view(torch.uint8).numpy()).digest()


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """(seconds, result) of fn(*args, **kwargs)."""
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - t0, result


def worker(args) -> None:
    from loomtrain.launcher.checkpoints.background import BackgroundSave
    from loomtrain.launcher.checkpoints.shards import TILE_CHECKSUM, TILE_CHECKSUMS
    from loomtrain.launcher.checkpoints.state import load_checkpoint, save_checkpoint, take_snapshot
    from loomtrain.launcher.checkpoints.store import CheckpointStore, wait_for_deletions
    from loomtrain.launcher.distributed import barrier

    run_dir = Path(args.run_dir)
    ctx, training = common.checkpoint_rig(list(SMALL if args.tiny else BIG), args.tp, run_dir)
    rank = ctx.dist.rank
    store = CheckpointStore(run_dir, keep_last=1, log=lambda m: None)
    out = {k: [] for k in ("save", "dd", "resume", "floor", "floor3", "resume_cold", "floor_cold", "async")}
    # Each kind of figure in its own alternating rounds, so that a save and dd both follow the
    # same thing (the previous write and its deletion) and the reads and the async copies
    # follow their own kind, not one another.
    # A pruned checkpoint is deleted in the background while training goes on; here no steps
    # run between saves, so each timed part starts once the deletions are done.
    for r in range(args.rounds):
        wait_for_deletions()
        barrier()
        seconds, path = timed(save_checkpoint, store, r + 1, training)
        out["save"].append(seconds)
        mine = [path / d / f"rank_{rank:05d}.safetensors" for d in ("model", "optim", "rng")]
        written = sum(f.stat().st_size for f in mine if f.exists())
        wait_for_deletions()
        scratch = run_dir / f"dd_rank_{rank}"
        dd = ["dd", "if=/dev/zero", f"of={scratch}", "bs=16M", f"count={written}", "iflag=count_bytes", "conv=fsync"]
        barrier()
        out["dd"].append(timed(subprocess.run, dd, check=True, capture_output=True)[0])
        scratch.unlink()

    for _ in range(args.rounds):  # the last checkpoint saved, read back
        barrier()
        seconds, trainer = timed(load_checkpoint, path, training)
        out["resume"].append(seconds)
        files = [path / rel for rel in trainer["files_read"]]
        barrier()
        out["floor"].append(timed(load_and_hash, files)[0])
        barrier()
        out["floor3"].append(timed(load_and_hash, files, TILE_CHECKSUMS[TILE_CHECKSUM])[0])
        barrier()
        drop_from_page_cache(path)
        barrier()
        out["resume_cold"].append(timed(load_checkpoint, path, training)[0])
        barrier()
        drop_from_page_cache(path)
        barrier()
        out["floor_cold"].append(timed(load_and_hash, files)[0])

    for r in range(args.rounds):
        step = 1000 + r
        wait_for_deletions()
        barrier()
        t0 = time.perf_counter()
        tmp = store.begin(step) if rank == 0 else store.temp_dir(step)
        barrier()
        snap = take_snapshot(step, training, copy=True)
        save = BackgroundSave(snap, store, tmp).start()
        out["async"].append(time.perf_counter() - t0)
        save.wait()
        barrier()
    out["written"] = written
    common.write_row(args.out, rank, out)


def summary(rows: list[dict]) -> dict:
    """Per rank the median of each figure; then the worst rank's figure and ratio."""
    med = [{k: statistics.median(v) for k, v in r.items() if isinstance(v, list)} for r in rows]
    return {
        **{k: max(m[k] for m in med) for k in med[0]},
        "disk_share": min(m["dd"] / m["save"] for m in med),
        "floor_x": max(m["resume"] / m["floor"] for m in med),
        "floor3_x": max(m["resume"] / m["floor3"] for m in med),
        "floor_x_cold": max(m["resume_cold"] / m["floor_cold"] for m in med),
        "written": max(r["written"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small model (a smoke test of the script)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per layout (medians)")
    ap.add_argument("--layouts", default="1x1,2x2", help="TPxDP list")
    ap.add_argument("--dir", default=None, help="where to write: the disk the runs use (default: the temp folder)")
    common.add_worker_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    pairs = [tuple(int(v) for v in item.split("x")) for item in args.layouts.split(",")]
    with tempfile.TemporaryDirectory(prefix="ckpt_speed_", dir=args.dir) as d:
        extra = ["--rounds", str(args.rounds), *(["--tiny"] if args.tiny else [])]
        results = {p: summary(common.run_layout(HERE, *p, Path(d), extra, {})) for p in pairs}
    print(
        f"checkpoint_speed: {'tiny' if args.tiny else '101 M'} model, fp32, CPU; worst rank's median of "
        f"{args.rounds} rounds (ratio: worst rank's)"
    )
    head = ["layout", "MB/rank", "save s", "dd s", "save/disk", "resume s", "floor s", "x floor"]
    head += ["floor3 s", "x floor3", "cold s", "floor s", "x floor", "async s"]
    print(" ".join(f"{h:>10}" for h in head))
    for (tp, dp), s in results.items():
        cells = [f"tp{tp} dp{dp}", f"{s['written'] / 1e6:.0f}", f"{s['save']:.2f}", f"{s['dd']:.2f}"]
        cells += [f"{s['disk_share']:.2f}x", f"{s['resume']:.2f}", f"{s['floor']:.2f}", f"{s['floor_x']:.2f}x"]
        cells += [
            f"{s['floor3']:.2f}",
            f"{s['floor3_x']:.2f}x",
            f"{s['resume_cold']:.2f}",
            f"{s['floor_cold']:.2f}",
            f"{s['floor_x_cold']:.2f}x",
        ]
        cells += [f"{s['async']:.2f}"]
        print(" ".join(f"{c:>10}" for c in cells))
    print("save/disk: the fsynced write rate a save reaches, as a share of dd's (target >= 0.7x);")
    print("x floor: resume time over loading the same files with safetensors and hashing them with sha256")
    print("(target <= 2x); x floor3: the same floor with XXH3-128, the checksum the resume itself checks")


if __name__ == "__main__":
    main()
