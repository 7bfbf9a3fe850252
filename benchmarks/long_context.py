"""Long sequences: training tokens/s and peak memory per rank against context length and parallel.cp.

For each T (default 2k..32k) and cp (default 1, 2, 4), one `torchrun --nproc_per_node cp` launch
(its own processes: nothing allocated for one size is reused by the next) runs forward + backward
of a small model on one window of T tokens of packed documents (data.document_masking's layout:
documents of --doc-len tokens), split over the CP group exactly as training splits it
(loomtrain.parallel.context: chunks i and 2cp-1-i, K/V all-gathered over gloo, masks described by
document ids). Each rank reports its step time and its peak RSS growth over the process after the
model was built (ru_maxrss); the table shows the slowest rank's tokens/s and the largest rank's peak,
and per T the ratio of cp N's peak to cp 1's. The dense [T, T] mask the model used before is
printed beside it: what masking alone would cost.

    python benchmarks/long_context.py                           # T 2k..32k x cp 1, 2, 4: long on 2 cores
    python benchmarks/long_context.py --seq 16384 --cp 1 2      # the acceptance figure (cp 2 <= 0.6x cp 1)
    python benchmarks/long_context.py --tiny                    # seconds: T 256, cp 1 and 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from loomtrain.model import ModelConfig, Transformer
    from loomtrain.parallel.context import apply_context_parallel
    from loomtrain.parallel.topology import Topology

    torch.set_num_threads(1)
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if cp > 1:
        dist.init_process_group("gloo")
    topo = Topology(cp, rank, 1, cp=cp)
    t = args.seq
    cfg = ModelConfig(
        vocab_size=256,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq_len=t,
        positions="rope",
    )
    model = apply_context_parallel(Transformer(cfg, seed=0), topo)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, t + 1), generator=gen)
    docs = (torch.arange(t) // args.doc_len)[None]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = model(tokens[:, :-1], targets=tokens[:, 1:], document_ids=docs)
        loss.backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    out = {"rank": rank, "step_s": min(times), "peak_bytes": peak, "loss": float(loss.detach())}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    if cp > 1:
        dist.destroy_process_group()


def launch(seq: int, cp: int, args, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--seq", str(seq), "--out", str(out)]
    cmd += ["--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads)]
    cmd += ["--kv-heads", str(args.kv_heads)]
    cmd += ["--doc-len", str(args.doc_len), "--steps", str(args.steps)]
    if cp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}", *cmd[1:]]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    step = max(r["step_s"] for r in ranks)
    loss = sum(r["loss"] for r in ranks) / len(ranks)  # every rank as many targets: their mean is the window's
    return {"tokens_per_s": seq / step, "peak": max(r["peak_bytes"] for r in ranks), "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1, help="GQA, as long-context models use (4 = MHA)")
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.seq = args.seq[0]
        return worker(args)
    if args.tiny:
        args.seq, args.cp, args.d_model, args.layers, args.heads, args.doc_len = [256], [1, 2], 64, 1, 2, 64
        args.kv_heads = 1
    import tempfile

    mib = 2**20
    print(
        f"model d {args.d_model}, {args.layers} layers, {args.heads} heads over {args.kv_heads} KV heads; "
        f"documents of {args.doc_len} tokens"
    )
    print(
        f"{'T':>7} {'cp':>3} {'tokens/s':>10} {'peak MiB/rank':>14} {'x cp 1':>7} {'dense mask MiB':>15} {'loss':>10}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.seq:
            first = None
            for cp in args.cp:
                r = launch(seq, cp, args, Path(tmp, f"{seq}_{cp}"))
                first = first or r
                ratio = r["peak"] / first["peak"] if first["peak"] else float("nan")
                print(
                    f"{seq:>7} {cp:>3} {r['tokens_per_s']:>10,.0f} {r['peak'] / mib:>14.1f} {ratio:>7.2f} "
                    f"{seq * seq / mib:>15.1f} {r['loss']:>10.6f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
