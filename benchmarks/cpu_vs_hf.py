"""loomtrain's Transformer against Hugging Face LlamaForCausalLM, training on CPU, side by side.

    python benchmarks/cpu_vs_hf.py                        # fp32 and bf16, 2 threads
    python benchmarks/cpu_vs_hf.py --precision fp32 --rounds 30 --profile

The same architecture in both (RMSNorm, SwiGLU, RoPE, untied embeddings, no
biases; d_model 256, 4 layers, 8 heads, vocab 8192, seq 256, batch 8, the same
FFN width), the same training step (forward, cross-entropy in fp32, backward,
fused torch AdamW step; bf16 = torch.autocast for both), SDPA attention in both.
Each computes its loss its own way: HF as `labels=` does (logits, upcast to float32,
cross-entropy), loomtrain as its training loop does (`model(x, targets=y)`: the output
layer and the loss fused chunk by chunk, loomtrain.model.loss).

On a shared machine absolute numbers drift with the others' load, so the two
models are measured ALTERNATELY: many short rounds, each timing a few steps of
one model then of the other (the order flips every round) and a square matmul
of comparable size. Reported: median seconds per step and tokens/s of each, the
median of the per-round ratios (loomtrain tok/s / HF tok/s; >1 means loomtrain
is faster), and the achieved model FLOP/s (PaLM FLOPs per token x tokens/s, see
loomtrain.model.flops) as a fraction of the matmul FLOP/s measured in the same
rounds. Targets on a 2-core CPU: ratio >= 1.0, >= 60% of matmul in fp32.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402


def build_hf(shape: dict, ffn: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["d_model"],
        intermediate_size=ffn,
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=shape["seq"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        attention_dropout=0.0,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def hf_loss(hf: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What `LlamaForCausalLM(input_ids, labels=...)` computes (logits upcast to float32,
    cross-entropy), on inputs and targets already shifted."""
    logits = hf(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))


def contenders(shape: dict, bf16: bool):
    from loomtrain.model import Transformer, flops_per_token

    mcfg = common.loomtrain_config(shape)
    torch.manual_seed(0)
    lt = Transformer(mcfg, seed=0).train()
    hf = build_hf(shape, mcfg.ffn_dim).train()
    n_lt = sum(p.numel() for p in lt.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    if n_lt != n_hf:
        raise SystemExit(f"parameter counts differ: loomtrain {n_lt:,} vs HF {n_hf:,}")
    x, y = common.batch(shape)
    steps = {}
    for name, model, loss_of in (
        ("loomtrain", lt, lambda t, y: lt(t, targets=y)),  # as launcher/training/loop.py: fused output layer + loss
        ("hf", hf, lambda t, y: hf_loss(hf, t, y)),
    ):
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)  # as launcher/training/engine.py
        steps[name] = lambda f=loss_of, p=params, o=opt: common.train_step(f, p, o, x, y, bf16)
    return steps, flops_per_token(mcfg, shape["seq"]), n_lt, mcfg.ffn_dim


def run(precision: str, shape: dict, rounds: int, steps_per_round: int, do_profile: bool) -> dict:
    bf16 = precision == "bf16"
    steps, fpt, n_params, ffn = contenders(shape, bf16)
    tokens = shape["batch"] * shape["seq"]
    mm_dtype = torch.bfloat16 if bf16 else torch.float32
    mm_size = 1024 if shape is common.SHAPE else 256
    print(
        f"\n== {precision}: {n_params / 1e6:.2f} M params each (ffn {ffn}), {tokens} tokens/step, "
        f"{fpt / 1e6:.1f} MFLOP/token; load average {common.loadavg()}"
    )
    for fn in steps.values():  # warm-up: allocator, autocast caches, optimizer state
        for _ in range(2):
            fn()
    t = {"loomtrain": [], "hf": []}
    ratios, mm, fracs = [], [], []
    for r in range(rounds):
        order = ("loomtrain", "hf") if r % 2 == 0 else ("hf", "loomtrain")
        mm.append(common.matmul_flops(mm_dtype, mm_size, seconds=0.2))
        for name in order:
            t[name].append(common.timed(steps[name], steps_per_round))
        ratios.append(t["hf"][-1] / t["loomtrain"][-1])
        fracs.append(fpt * tokens / t["loomtrain"][-1] / mm[-1])
        print(
            f"  round {r + 1:2d}/{rounds}: loomtrain {t['loomtrain'][-1]:.3f} s  hf {t['hf'][-1]:.3f} s  "
            f"ratio {ratios[-1]:.3f}  matmul {mm[-1] / 1e9:.0f} GFLOP/s",
            flush=True,
        )
    lt_s, hf_s = common.median(t["loomtrain"]), common.median(t["hf"])
    res = {
        "precision": precision,
        "loomtrain_tok_s": tokens / lt_s,
        "hf_tok_s": tokens / hf_s,
        "ratio_median_of_rounds": common.median(ratios),
        "ratio_of_medians": hf_s / lt_s,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "matmul_flops_median": common.median(mm),
        "loomtrain_flops": fpt * tokens / lt_s,
        "hf_flops": fpt * tokens / hf_s,
        "frac_of_matmul_median_of_rounds": common.median(fracs),
        "loadavg": common.loadavg(),
    }
    print(
        f"  loomtrain {res['loomtrain_tok_s']:,.0f} tok/s ({res['loomtrain_flops'] / 1e9:.1f} GFLOP/s) | "
        f"HF {res['hf_tok_s']:,.0f} tok/s ({res['hf_flops'] / 1e9:.1f} GFLOP/s)"
    )
    print(
        f"  ratio loomtrain/HF: {res['ratio_median_of_rounds']:.3f} (median of {rounds} rounds; "
        f"range {res['ratio_min']:.3f}..{res['ratio_max']:.3f}; ratio of medians {res['ratio_of_medians']:.3f})"
    )
    print(
        f"  matmul {mm_size}^3 {precision}: {res['matmul_flops_median'] / 1e9:.0f} GFLOP/s (median); "
        f"loomtrain at {100 * res['frac_of_matmul_median_of_rounds']:.0f}% of it "
        f"(HF {100 * res['hf_flops'] / res['matmul_flops_median']:.0f}%); load average {res['loadavg']}"
    )
    if do_profile:
        for name, fn in steps.items():
            common.profile(fn, 3, f"{name} {precision}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per model")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (smoke test of the script)")
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc: no mmap/unmap of large blocks (see common.keep_freed_memory); both models",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.keep_freed_memory and not common.keep_freed_memory():
        print("note: --keep-freed-memory: mallopt not available, running with the default allocator")
    shape = common.TINY if args.tiny else common.SHAPE
    print(
        f"torch {torch.__version__}, {args.threads} threads, shape {shape}, "
        f"allocator {'keep-freed-memory' if args.keep_freed_memory else 'default'}"
    )
    results = [run(p, shape, args.rounds, args.steps_per_round, args.profile) for p in args.precision]
    print("\nsummary")
    for r in results:
        print(
            f"  {r['precision']}: loomtrain {r['loomtrain_tok_s']:,.0f} tok/s, HF {r['hf_tok_s']:,.0f} tok/s, "
            f"ratio {r['ratio_median_of_rounds']:.3f}, {100 * r['frac_of_matmul_median_of_rounds']:.0f}% of "
            f"matmul FLOP/s, load average {r['loadavg']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
