"""What checkpoints cost a real training run, end to end: no interval saves vs synchronous vs async.

The command a user runs: `loomtrain train configs/tiny.yaml` with the 101 M model
(d_model 1024, 8 layers, 16 heads, seq_len 128, micro and global batch 4, fp32, no eval), 9
steps, world 1, OMP_NUM_THREADS=1, each launch its own process, in alternating rounds:

    none     checkpoint.every_steps=0: the one save every run makes, at the end
    sync     a save every 3 steps, checkpoint.async_save=false (steps 3, 6, 9)
    async    the same, checkpoint.async_save=true

and it prints per mode the median wall time of the whole command, the extra time of sync and of
async over `none` (all three end with the same last save, which training waits for), async's
extra as a share of sync's (target <= 0.4), and the time each save blocked training ("training
blocked X s" for async, the save itself for sync), the first one shown on its own, and the CPU
time (user + system) of the whole command: on a shared machine the wall times drift with the
load, the CPU time far less.

    python benchmarks/async_checkpoint.py [--rounds 3] [--steps 9] [--every 3] [--dir DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

REPO = Path(__file__).resolve().parents[1]
BIG = ["model.d_model=1024", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=16"]
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4"]
MODES = ("none", "sync", "async")
BLOCKED = re.compile(r"checkpoint: step (\d+) -> \S+ \(([\d.]+) s(?:, training blocked ([\d.]+) s)?\)")


def launch(mode: str, run_dir: Path, args, steps: int | None = None) -> dict:
    """One `loomtrain train` of `mode`: its wall time and each save's (step, blocked seconds)."""
    ckpt = ["checkpoint.every_steps=0"] if mode == "none" else [f"checkpoint.every_steps={args.every}"]
    ckpt += [f"checkpoint.async_save={'false' if mode == 'sync' else 'true'}", "checkpoint.keep_last=2"]
    cmd = [sys.executable, "-m", "loomtrain", "train", str(REPO / "configs" / "tiny.yaml")]
    cmd += SMALL if args.tiny else BIG
    cmd += ["train.seq_len=128", "train.micro_batch_size=4", "train.global_batch_size=4", "train.precision=fp32"]
    cmd += ["eval.every_steps=0", "eval.num_samples=0", f"train.max_steps={steps or args.steps}"]
    cmd += [f"run.dir={run_dir}", f"data.cache_dir={run_dir.parent / 'data'}", "log.progress=plain"]
    cmd += ["log.tensorboard=false", "checkpoint.resume=never", *ckpt]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=3600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode != 0:
        sys.exit(f"async_checkpoint: the {mode} run failed:\n{(p.stdout + p.stderr)[-3000:]}")
    saves = []
    for m in BLOCKED.finditer(p.stdout + p.stderr):
        step, took, blocked = int(m[1]), float(m[2]), m[3]
        saves.append((step, float(blocked) if blocked is not None else took))
    return {"wall": wall, "cpu": cpu, "saves": sorted(saves)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small model, 3 steps (a smoke test of the script)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians)")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--every", type=int, default=3, help="checkpoint.every_steps of the sync and async runs")
    ap.add_argument("--dir", default=None, help="where the runs write (default: the temp folder)")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.every = min(args.steps, 4), min(args.every, 2)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="async_ckpt_", dir=args.dir) as d:
        launch("none", Path(d) / "warm-up", args, steps=1)  # the data cache, and the files' first reads
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]  # none, sync, async; then async, sync, none
            for mode in order:
                runs[mode].append(launch(mode, Path(d) / f"{mode}-{r}", args))
                last = runs[mode][-1]
                blocked = " ".join(f"{b:.2f}" for _, b in last["saves"])
                print(
                    f"round {r + 1} {mode:>5}: {last['wall']:.1f} s, CPU {last['cpu']:.1f} s, saves blocked "
                    f"[{blocked}] s (load {common.loadavg()})",
                    flush=True,
                )
    wall = {m: statistics.median(x["wall"] for x in runs[m]) for m in MODES}
    cpu = {m: statistics.median(x["cpu"] for x in runs[m]) for m in MODES}
    extra = {m: wall[m] - wall["none"] for m in ("sync", "async")}
    # per round too: each mode against the `none` run of the same round (less of the machine's drift)
    share = [
        (a["wall"] - n["wall"]) / (s["wall"] - n["wall"])
        for n, s, a in zip(runs["none"], runs["sync"], runs["async"])
        if s["wall"] > n["wall"]
    ]
    model = "tiny" if args.tiny else "101 M"
    print(
        f"async_checkpoint: {model} model, fp32, world 1, OMP_NUM_THREADS=1, {args.steps} steps, a save every "
        f"{args.every} steps; median of {args.rounds} alternating rounds (load now {common.loadavg()})"
    )
    head = f"{'mode':>6} {'wall s':>8} {'extra s':>8} {'CPU s':>8}"
    print(f"{head} {'first save blocked s':>21} {'later saves blocked s':>22}")
    for m in MODES:
        firsts = [x["saves"][0][1] for x in runs[m] if x["saves"]]
        laters = [b for x in runs[m] for _, b in x["saves"][1:]]
        cells = [f"{m:>6}", f"{wall[m]:>8.1f}", f"{extra.get(m, 0.0):>8.1f}", f"{cpu[m]:>8.1f}"]
        cells.append(f"{'max ' + format(max(firsts), '.2f') if firsts else '-':>21}")
        cells.append(f"{'max ' + format(max(laters), '.2f') if laters else '-':>22}")
        print(" ".join(cells))
    ratio = extra["async"] / extra["sync"] if extra["sync"] > 0 else float("nan")
    print(f"async extra / sync extra: {ratio:.2f}x of the medians (target <= 0.4x)", end="")
    print(f"; per round {', '.join(f'{x:.2f}x' for x in share)}" if share else "")
    every_blocked = [b for x in runs["async"] for _, b in x["saves"]]
    if every_blocked:
        print(f"async: every save's blocked time <= {max(every_blocked):.2f} s (target <= 0.5 s for the 101 M model)")


if __name__ == "__main__":
    main()
