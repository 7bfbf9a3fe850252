"""Bytes moved by tensor-parallel collectives per training step, next to Megatron's count.

    python benchmarks/tp_comm.py [--tp 2 4] [--batch 4 --seq 128 --d-model 256 --layers 4]

Spawns tp CPU ranks (gloo), runs one forward + backward of a parallelized model
(vocab-parallel loss) with and without sequence parallelism, and reads the byte
counters every collective in loomtrain.parallel.collectives keeps.

Megatron-LM's count (Korthikanti et al. 2022, sec. 4.2.2): per transformer layer,
forward and backward together, 4 all-reduces of b*s*h elements; with sequence
parallelism 4 all-gathers + 4 reduce-scatters of b*s*h, the same bytes on the wire
since a ring all-reduce is a reduce-scatter followed by an all-gather. Two columns:

  tensor: size of the full tensor each collective works on (all-reduce of N = N,
          all-gather/reduce-scatter of N = N); theory 4 b*s*h per layer without
          SP and 8 b*s*h with it
  wire:   bytes each rank sends with a ring algorithm on p ranks; theory
          4 * 2(p-1)/p * b*s*h per layer with or without SP

The step total is also compared with `loomtrain plan`'s prediction
(loomtrain.launcher.planning.memory_model.tp_comm_bytes_per_microbatch).

"layers" are the collectives tagged blocks.N.{attn,ffn}_{in,out}; everything else
(embedding, lm_head input, vocab-parallel cross-entropy, SP norm-gradient sums,
replicated-KV gradient sums) is listed under "outside the layers".
"""

from __future__ import annotations

import argparse
import os
import socket
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, tp, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    from loomtrain.model import ModelConfig, Transformer
    from loomtrain.parallel import Topology, parallelize
    from loomtrain.parallel import collectives as C

    topo = Topology(tp, rank, tp)
    results = {}
    for positions in ("rope", "learned", "sinusoidal"):
        cfg = ModelConfig(
            vocab_size=args.vocab,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            n_kv_heads=args.kv_heads,
            max_seq_len=args.seq,
            positions=positions,
            norm="rmsnorm",
            activation="swiglu",
            tie_embeddings=True,
        )
        for sp in (False, True):
            model = parallelize(Transformer(cfg, seed=0), topo, sequence_parallel=sp)
            tokens = torch.randint(
                0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)
            )
            C.COMM_STATS.clear()
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            results[(positions, sp)] = {k: list(v) for k, v in C.COMM_STATS.items()}
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def report(tp: int, results: dict, args) -> list[str]:
    bsh_bytes = args.batch * args.seq * args.d_model * 4  # fp32
    L = args.layers
    lines = [
        f"\n== tp={tp}  b={args.batch} s={args.seq} h={args.d_model} layers={L} "
        f"(b*s*h*4 bytes = {bsh_bytes / 2**20:.3f} MiB) =="
    ]
    from loomtrain.launcher.planning.memory_model import tp_comm_bytes_per_microbatch
    from loomtrain.model import ModelConfig

    plan_cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=L,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq_len=args.seq,
    )
    plan_w = tp_comm_bytes_per_microbatch(plan_cfg, args.seq, args.batch, tp, "fp32")[1]
    for (positions, sp), stats in results.items():
        layer = defaultdict(float)  # (phase, col) -> bytes
        outside = defaultdict(lambda: [0, 0, 0.0])
        for (tag, op, phase), (calls, nbytes, wire) in stats.items():
            if tag.startswith("blocks.") and tag.rsplit(".", 1)[-1] in ("attn_in", "attn_out", "ffn_in", "ffn_out"):
                layer[(phase, "tensor")] += nbytes
                layer[(phase, "wire")] += wire
                layer[(phase, "calls")] += calls
                layer[(phase, op)] += calls
            else:
                key = (tag.split(".")[-1] if tag.startswith("blocks.") else tag, op, phase)
                o = outside[key]
                o[0] += calls
                o[1] += nbytes
                o[2] += wire
        theory_tensor = (8 if sp else 4) * bsh_bytes
        theory_wire = 4 * 2 * (tp - 1) / tp * bsh_bytes
        per = {k: v / L for k, v in layer.items()}
        ops = ", ".join(
            f"{ph} {int(per.get((ph, op), 0))}x{op}"
            for ph in ("fwd", "bwd")
            for op in ("all_reduce", "all_gather", "reduce_scatter")
            if per.get((ph, op))
        )
        meas_t = per.get(("fwd", "tensor"), 0) + per.get(("bwd", "tensor"), 0)
        meas_w = per.get(("fwd", "wire"), 0) + per.get(("bwd", "wire"), 0)
        lines.append(f"-- positions={positions} sequence_parallel={sp}")
        lines.append(f"   per layer: {ops}")
        lines.append(
            f"   per layer tensor bytes: fwd {per.get(('fwd', 'tensor'), 0) / 2**20:.3f} MiB + "
            f"bwd {per.get(('bwd', 'tensor'), 0) / 2**20:.3f} MiB = {meas_t / 2**20:.3f} MiB; "
            f"Megatron {theory_tensor / 2**20:.3f} MiB; measured/theory = {meas_t / theory_tensor:.3f}"
        )
        lines.append(
            f"   per layer wire bytes/rank: {meas_w / 2**20:.3f} MiB; Megatron 4 all-reduces "
            f"{theory_wire / 2**20:.3f} MiB; measured/theory = {meas_w / theory_wire:.3f}"
        )
        total_w = layer[("fwd", "wire")] + layer[("bwd", "wire")] + sum(o[2] for o in outside.values())
        lines.append(
            f"   step total wire bytes/rank: {total_w / 2**20:.3f} MiB = "
            f"{total_w / (L * theory_wire):.3f} x (layers x Megatron per-layer); "
            f"`loomtrain plan` predicts {plan_w / 2**20:.3f} MiB (measured/plan = {total_w / plan_w:.3f})"
        )
        lines.append("   outside the layers:")
        for (tag, op, phase), (calls, nbytes, wire) in sorted(outside.items()):
            lines.append(
                f"     {tag:18s} {phase} {calls:2d}x {op:14s} tensor {nbytes / 2**20:8.4f} MiB  "
                f"wire {wire / 2**20:8.4f} MiB  ({nbytes / bsh_bytes:.3f} b*s*h)"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1000)
    args = ap.parse_args()
    for tp in args.tp:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        procs = mp.start_processes(
            _worker, args=(tp, _free_port(), args, queue), nprocs=tp, start_method="spawn", join=False
        )
        results = queue.get()
        while not procs.join():
            pass
        print("\n".join(report(tp, results, args)))


if __name__ == "__main__":
    main()
