"""What document masking costs: training tokens/s with packed documents that never see each
other (data.document_masking=true) against the same data without it, at 4 and 16 documents per
sequence; and the fraction of padding tokens the packing leaves.

Data: text documents of byte tokens whose lengths are uniform in [0.5, 1.5] x (seq_len + 1) / N
for N documents per sequence, so that N of them fill a window on average (text rather than chat
records: the chat template's 25 tokens would set a floor on a document's length; masking is
the same for both, `data.document_masking=true` turns it on for text). Each run is the real
`loomtrain train` command (configs/tiny.yaml's 1.64 M model at seq_len 512, micro and global
batch 4) in a process of its own; masked and unmasked runs alternate, round after round, and a
run's figure is the median tokens/s of its steps after the first few (metrics.jsonl). Reported
per N: each median, the median of the per-round ratios masked / unmasked (target >= 0.9 on a
CPU), and the padding: the share of the packed windows' tokens that are padding (target <= 1%),
also for the recipe's own data (README "Fine-tune a model": 'complete this function' chats).

    python benchmarks/sft_masking.py [--rounds 2] [--steps 20] [--docs 4 16] [--threads 1] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]

SHAPE = {"seq_len": 512, "batch": 4}
TINY_SHAPE = {"seq_len": 64, "batch": 2}
WARMUP_STEPS = 5  # steps left out of a run's median (allocator and DeepSpeed warm-up)


def documents(n_docs: int, span: int, count: int, seed: int = 0):
    """`count` text records whose byte tokens (with the end-of-text) average span / n_docs."""
    rng = random.Random(seed)
    mean = span / n_docs
    for _ in range(count):
        length = max(2, round(rng.uniform(0.5, 1.5) * mean)) - 1  # the end-of-text is one more
        yield {"text": "".join(rng.choice("abcdefgh ") for _ in range(length))}


def make_shards(work: Path, n_docs: int, seq_len: int, tokens: int) -> Path:
    from loomtrain.data_pipeline.preprocess import preprocess_files

    src = work / f"docs{n_docs}.jsonl"
    count = tokens * n_docs // (seq_len + 1)
    src.write_text("".join(json.dumps(r) + "\n" for r in documents(n_docs, seq_len + 1, count)))
    out = work / f"docs{n_docs}"
    preprocess_files([src], out, "byte", val_fraction=0.0, progress=False, log=None)
    return out


def padding(shards, seq_len: int) -> tuple[float, float]:
    """(padding share of the packed windows' tokens, documents per window) of the train split."""
    from loomtrain.data_pipeline import TokenStream

    with TokenStream(shards, seq_len=seq_len, micro_batch_size=1, prefetch=0, document_masking=True) as s:
        windows = s.windows[0]
    return windows.padding(seq_len + 1), len(windows.start) / len(windows)


def train(shards: Path, run_dir: Path, masking: bool, shape: dict, steps: int, threads: int) -> float:
    """Median tokens/s of one `loomtrain train` launch after its warm-up steps."""
    cmd = [
        sys.executable,
        "-m",
        "loomtrain",
        "train",
        str(REPO / "configs" / "tiny.yaml"),
        f"run.dir={run_dir}",
        f"data.path={shards}",
        f"data.document_masking={str(masking).lower()}",
        f"model.max_seq_len={shape['seq_len']}",
        f"train.seq_len={shape['seq_len']}",
        f"train.micro_batch_size={shape['batch']}",
        f"train.global_batch_size={shape['batch']}",
        f"train.max_steps={steps}",
        "train.warmup_steps=2",
        "eval.every_steps=0",
        "eval.num_samples=0",
        "checkpoint.every_steps=0",
        "log.tensorboard=false",
        "log.progress=plain",
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if p.returncode != 0:
        why = f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        sys.exit(f"sft_masking: the run with document_masking={masking} failed:\n{why}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r.get("step", 0) > WARMUP_STEPS]
    return statistics.median(tps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="masked/unmasked pairs per density, alternating")
    ap.add_argument("--steps", type=int, default=20, help="steps per run (the first 5 are not timed)")
    ap.add_argument("--docs", type=int, nargs="+", default=[4, 16], help="documents per sequence")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape, one round, 8 steps: checks that it runs")
    args = ap.parse_args()
    shape = TINY_SHAPE if args.tiny else SHAPE
    rounds, steps = (1, WARMUP_STEPS + 3) if args.tiny else (args.rounds, args.steps)
    span = shape["seq_len"] + 1
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    print(
        f"sft_masking: configs/tiny.yaml's model, seq_len {shape['seq_len']}, batch {shape['batch']}, "
        f"{steps} steps a run ({WARMUP_STEPS} untimed), {rounds} round(s), OMP threads {args.threads}; load {load}"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="sft_masking_") as tmp:
        work = Path(tmp)
        for n_docs in args.docs:
            tokens = span * shape["batch"] * (steps + 2) * 2  # more than the runs read: no epoch repeats
            shards = make_shards(work, n_docs, shape["seq_len"], tokens)
            pad, per_window = padding(shards, shape["seq_len"])
            runs = {True: [], False: []}
            for r in range(rounds):
                for masking in (True, False) if r % 2 == 0 else (False, True):
                    run_dir = work / f"run_{n_docs}_{masking}_{r}"
                    runs[masking].append(train(shards, run_dir, masking, shape, steps, args.threads))
                print(
                    f"  {n_docs:2d} docs/seq, round {r + 1}/{rounds}: masked {runs[True][-1]:,.0f} tok/s, "
                    f"unmasked {runs[False][-1]:,.0f} tok/s",
                    flush=True,
                )
            ratio = statistics.median(m / u for m, u in zip(runs[True], runs[False]))
            masked, unmasked = statistics.median(runs[True]), statistics.median(runs[False])
            results.append((n_docs, per_window, masked, unmasked, ratio, pad))
    print("\n| docs/seq (aimed) | docs/window packed | masked tok/s | unmasked tok/s | masked/unmasked | padding |")
    print("|---|---|---|---|---|---|")
    for n_docs, per_window, m, u, ratio, pad in results:
        print(f"| {n_docs} | {per_window:.1f} | {m:,.0f} | {u:,.0f} | {ratio:.2f}x | {pad:.1%} |")
    if not args.tiny:
        pad, per_window = recipe_padding()
        print(f"the recipe's data (sft-tiny.yaml, seq_len 256): {per_window:.1f} records a window, padding {pad:.1%}")


def recipe_padding() -> tuple[float, float]:
    """padding() of README "Fine-tune a model"'s 'complete this function' chats at seq_len 256."""
    from loomtrain.data_pipeline.instructions import corpus_chats, write_jsonl
    from loomtrain.data_pipeline.preprocess import preprocess_files

    with tempfile.TemporaryDirectory(prefix="sft_recipe_") as tmp:
        src = Path(tmp) / "functions.jsonl"
        write_jsonl(corpus_chats(max_files=400), src)
        preprocess_files([src], Path(tmp) / "functions", "byte", val_fraction=0.0, progress=False, log=None)
        return padding(Path(tmp) / "functions", 256)


if __name__ == "__main__":
    main()
