"""The output layer + loss alone: loomtrain's fused chunked cross-entropy vs logits + cross_entropy.

    python benchmarks/output_layer.py                       # CPU: the cpu_vs_hf shape, fp32
    python benchmarks/output_layer.py --device cuda --precision bf16 --tokens 16384 \\
        --d-model 2048 --vocab 32768                        # configs/gpt-1b.yaml at micro batch 8
    python benchmarks/output_layer.py --rows 512 1024 4096  # other chunk sizes as well

One forward + backward of `hidden [tokens, d] -> loss` each way, measured alternately in
rounds (median of per-round ratios; >1 means the fused path is faster), and the memory
each needs above its inputs: on CUDA the measured peak (max_memory_allocated); on CPU,
where no allocator statistics exist, the closed form of what each holds (plain: logits,
their float32 copy below fp32, the float32 log-softmax and its gradient; fused: one
chunk of logits in both dtypes, the hidden states' gradient, the weight's float32
gradient). The plain path is `nn.Linear` then `cross_entropy` on float32 logits, as HF's `labels=` does.
First checks that all give the same loss and gradients.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits = h @ w.t()
    return F.cross_entropy(logits.float(), t)


def fused(rows: int | None):
    from loomtrain.model.loss import linear_cross_entropy

    return lambda h, w, t: linear_cross_entropy(h, w, t, rows=rows)


def one_step(fn, h, w, t, device) -> tuple[float, float]:
    """(seconds, peak bytes above the inputs) of forward + backward."""
    h.grad = w.grad = None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        sync()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    fn(h, w, t).backward()
    sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else float("nan")
    return seconds, peak


def check_same(fns: dict, h, w, t) -> str:
    out = []
    ref = None
    for name, fn in fns.items():
        h.grad = w.grad = None
        loss = fn(h, w, t)
        loss.backward()
        got = (loss.detach().float(), h.grad.float(), w.grad.float())
        if ref is None:
            ref = got
            continue
        d = [float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(got, ref)]
        out.append(f"{name}: loss {d[0]:.1e}, grad hidden {d[1]:.1e}, grad weight {d[2]:.1e} (max rel. diff)")
    return "; ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--precision", default="fp32", choices=sorted(_DTYPES))
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per micro batch (batch x seq)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", type=int, nargs="*", default=[], help="chunk sizes to try besides the default")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (smoke test of the script)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.tokens, args.d_model, args.vocab, args.rounds, args.rows = 64, 16, 100, 2, [*args.rows, 7]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("output_layer: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), _DTYPES[args.precision]
    from loomtrain.model.loss import chunk_rows

    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.d_model, generator=g).to(device, dtype).requires_grad_()
    w = (0.02 * torch.randn(args.vocab, args.d_model, generator=g)).to(device, dtype).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    default_rows = chunk_rows(args.vocab, device.type)
    fns = {"plain": plain, f"fused (rows {default_rows})": fused(None)}
    for r in args.rows:
        fns[f"fused (rows {r})"] = fused(r)
    p = dtype.itemsize
    print(
        f"output layer: {args.tokens} tokens x d_model {args.d_model} x vocab {args.vocab}, {args.precision} "
        f"on {device}; load average {common.loadavg()}"
    )
    print(f"  same results: {check_same(fns, h, w, t)}")
    for fn in fns.values():  # warm-up
        one_step(fn, h, w, t, device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    peaks: dict[str, float] = {}
    for r in range(args.rounds):
        names = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in names:
            s, peak = one_step(fns[name], h, w, t, device)
            times[name].append(s)
            peaks[name] = max(peaks.get(name, 0.0), peak)
    plain_s = times["plain"]
    for name in fns:
        ratio = common.median([a / b for a, b in zip(plain_s, times[name])])
        if device.type == "cuda":
            mem = f"peak +{peaks[name] / 2**20:,.0f} MiB"
        elif name == "plain":
            per_logit = p + (4 if p < 4 else 0) + 8
            mem = f"~{args.tokens * args.vocab * per_logit / 2**20:,.0f} MiB held (closed form)"
        else:
            rows = int(name.split("rows ")[1].rstrip(")"))
            held = min(rows, args.tokens) * args.vocab * (p + (4 if p < 4 else 0)) + args.tokens * args.d_model * p
            mem = f"~{(held + args.vocab * args.d_model * 4) / 2**20:,.0f} MiB held (closed form)"
        print(f"  {name:>20}: {1e3 * common.median(times[name]):8.1f} ms  speed vs plain {ratio:5.2f}x  {mem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
