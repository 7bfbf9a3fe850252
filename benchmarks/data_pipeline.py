"""Data pipeline benchmark: preprocessing throughput, stream throughput next to what a
tiny-config training step consumes, and peak memory as the corpus grows 10x.

    python benchmarks/data_pipeline.py [--max-files 0] [--workers 2] [--keep DIR]

Prints one block of figures. Each preprocessing run happens in a fresh child process
so its peak RSS (ru_maxrss of the child and of its pool workers) is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from loomtrain.data_pipeline.corpus import stdlib_files
from loomtrain.data_pipeline.preprocess import preprocess_files
max_files, copies, out, workers = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
files = stdlib_files(max_files) * copies
t = time.perf_counter()
index = preprocess_files(files, out, "byte", workers=workers, progress=False, log=None, val_fraction=0.01)
secs = time.perf_counter() - t
tokens = sum(s["num_tokens"] for s in index["splits"].values())
print(json.dumps({"tokens": tokens, "bytes": index["stats"]["bytes"], "seconds": secs,
                  "workers": index["run"]["workers"],
                  "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""

STREAM_CHILD = r"""
import json, resource, sys, time
from loomtrain.data_pipeline import TokenStream
shard_dir, seq, mb, n, prefetch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
s = TokenStream(shard_dir, "train", seq_len=seq, micro_batch_size=mb, seed=0, prefetch=prefetch)
next(s)
t = time.perf_counter()
for _ in range(n):
    x, y = next(s)
secs = time.perf_counter() - t
status = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith(("RssAnon", "RssFile")))
s.close()
print(json.dumps({"tokens_per_s": n * seq * mb / secs, "samples_per_epoch": s.samples_per_epoch,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "anon_mb": int(status["RssAnon"].split()[0]) / 1024,
                  "file_mb": int(status["RssFile"].split()[0]) / 1024}))
"""


def run_child(code: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tiny_step_consumption(seq_len: int, micro_batch: int, steps: int = 3) -> list[tuple[float, str]]:
    """Tokens/s a tiny-config training step eats on this CPU: estimated from the model's
    FLOPs at the measured fp32 matmul rate of the 2-core CI CPU, and measured on loomtrain.model.Transformer
    (fwd + bwd + AdamW) when it imports."""
    from loomtrain.model.config import ModelConfig
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")["model"])
    cfg = ModelConfig(**raw)
    tokens = seq_len * micro_batch
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_width
    n = L * (2 * d * d + 2 * d * kv + 3 * d * cfg.ffn_dim) + V * d  # tied head: counted once, in the matmul
    flops_per_token = 6 * n + 12 * L * d * seq_len
    gflops = 180.0  # fp32 matmul, measured on the 2-core CI CPU
    out = [
        (gflops * 1e9 / flops_per_token, f"estimated: {flops_per_token / 1e6:.1f} MFLOP/token at {gflops:.0f} GFLOP/s")
    ]
    try:
        import torch
        from loomtrain.model import Transformer

        torch.manual_seed(0)
        model = Transformer(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))

        def step():
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        secs = (time.perf_counter() - t) / steps
        out.append((tokens / secs, f"measured: Transformer fwd+bwd+AdamW, {secs * 1e3:.0f} ms/step of {tokens} tokens"))
    except Exception as exc:  # the model package may not be importable
        out.append((float("nan"), f"not measured ({type(exc).__name__}: {exc})"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-files", type=int, default=0, help="stdlib files in the 1x corpus (0 = all)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--keep", default="", help="write shards here instead of a temporary directory")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="loomtrain-bench-"))
    print(f"data pipeline benchmark  (cpus={os.cpu_count()}, load={os.getloadavg()[0]:.1f}, shards in {root})")

    runs = {}
    for copies in (1, 10):
        r = run_child(CHILD, args.max_files, copies, root / f"x{copies}", args.workers)
        runs[copies] = r
        print(
            f"preprocess {copies:>2}x stdlib: {r['tokens'] / 1e6:8.1f} M tokens in {r['seconds']:6.2f} s = "
            f"{r['tokens'] / r['seconds'] / 1e6:6.2f} M tokens/s ({r['workers']} workers); "
            f"peak RSS main {r['rss_main_mb']:.0f} MB, worker {r['rss_worker_mb']:.0f} MB"
        )
    ratio = runs[10]["rss_main_mb"] / runs[1]["rss_main_mb"]
    print(f"peak RSS 10x / 1x corpus (main process): {ratio:.2f}  ({'flat' if ratio < 1.3 else 'NOT flat'})")

    streams = {}
    for copies in (1, 10):
        for prefetch in (0, 2) if copies == 1 else (2,):
            s = run_child(STREAM_CHILD, root / f"x{copies}", args.seq_len, args.micro_batch, args.batches, prefetch)
            streams[(copies, prefetch)] = s
            print(
                f"stream {copies:>2}x corpus, prefetch={prefetch}: {s['tokens_per_s'] / 1e6:6.2f} M tokens/s "
                f"(seq {args.seq_len} x micro batch {args.micro_batch}, {s['samples_per_epoch']} samples/epoch); "
                f"RSS anonymous {s['anon_mb']:.0f} MB + file-backed (libraries, mapped shard pages) "
                f"{s['file_mb']:.0f} MB"
            )
    have = streams[(1, 2)]["tokens_per_s"]
    for need, how in tiny_step_consumption(args.seq_len, args.micro_batch):
        print(f"tiny-config training consumes {need:10,.0f} tokens/s ({how}); stream headroom {have / need:,.0f}x")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
