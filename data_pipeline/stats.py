"""What a run will read (`loomtrain data-stats`, launcher/cli/data_stats.py).

One JSON-ready report: the samples and tokens each data source gives over the
first N optimizer steps of the whole run (all DP ranks together: step s reads
global positions [s*G, (s+1)*G), G = train.global_batch_size, whatever the DP
size), and with --show K the first K samples decoded. It opens the shards the
run would open, through the same TokenStream, so what it reports is what the
run gets; it needs no GPU and no process group.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from loomtrain.data_pipeline.corpus import prepare_sources
from loomtrain.data_pipeline.stream import TokenStream


def data_stats(cfg, cache_dir: Path, steps: int, show: int = 0) -> dict:
    """The report for a loaded RunConfig whose prepared data lives under `cache_dir` (the run's
    data cache, where training would prepare it; see the module docstring)."""
    data, tok = prepare_sources(cfg.data, cache_dir, log=None)
    t = cfg.train
    stream = TokenStream(
        data,
        "train",
        seq_len=t.seq_len,
        micro_batch_size=1,
        dp_rank=0,
        dp_size=1,
        seed=t.seed,
        prefetch=0,
        expected_tokenizer_hash=tok.hash,
    )
    try:
        total = steps * t.global_batch_size
        counts = stream.blend.counts(total)
        paths = [str(d) for d, _ in data] if isinstance(data, list) else [str(data)]
        report = {
            "steps": steps,
            "global_batch_size": t.global_batch_size,
            "seq_len": t.seq_len,
            "samples": total,
            "tokens": total * t.seq_len,
            "tokenizer": tok.hash,
            "sources": [
                {
                    "path": path,
                    "weight": float(w),
                    "samples": int(c),
                    "tokens": int(c) * t.seq_len,
                    "fraction": int(c) / total if total else 0.0,
                    "samples_per_epoch": n,
                    "epochs": int(c) / n,
                }
                for path, w, c, n in zip(paths, stream.blend.weights, counts, stream.source_samples)
            ],
        }
        if show > 0:
            rows, sources = stream.rows(np.arange(show))
            report["shown"] = [
                {"position": i, "source": paths[int(k)], "text": tok.decode(row.tolist())}
                for i, (row, k) in enumerate(zip(rows, sources))
            ]
    finally:
        stream.close()
    return report
