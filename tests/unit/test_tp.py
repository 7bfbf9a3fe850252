"""Tensor parallelism computes what one process computes (CPU, gloo, fp32).

One multi-process run per TP size (2 and 4) checks every model variant, with and
without sequence parallelism: logits, loss and every parameter gradient (gathered
back to full shape) against the unsharded model; the TP=2 run also trains 10 steps
with AdamW next to the single-process model. Workers write their largest
differences to a JSON file that the test asserts on.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from loomtrain.model import ModelConfig, Transformer
from loomtrain.parallel import Topology, check_tp, gathered_logits, padded_vocab_size, parallelize
from loomtrain.parallel.plan import gather_shards, spec_of
from s3_server import free_port

TOL = 1e-5

# Each variant differs from the single-process model in a way the plan must handle.
VARIANTS = {
    # learned positions, LayerNorm pre-norm, GELU, tied embeddings, vocab 51 (not divisible by 2 or 4)
    "base_tied_learned": dict(
        vocab_size=51, n_heads=4, positions="learned", norm="layernorm", activation="gelu", tie_embeddings=True
    ),
    # MQA (1 KV head < tp), RoPE, RMSNorm, SwiGLU, untied
    "mqa_rope_swiglu": dict(
        vocab_size=61,
        n_heads=4,
        n_kv_heads=1,
        positions="rope",
        norm="rmsnorm",
        activation="swiglu",
        tie_embeddings=False,
    ),
    # GQA 2 KV heads (== tp at 2, < tp at 4), ALiBi, post-norm, ReLU, biases everywhere
    "gqa_alibi_post_bias": dict(
        vocab_size=64,
        n_heads=4,
        n_kv_heads=2,
        positions="alibi",
        norm="layernorm",
        norm_placement="post",
        activation="relu",
        bias=True,
        tie_embeddings=False,
    ),
    # 8 heads / 4 KV heads, sinusoidal positions, SwiGLU with biases, tied
    "gqa_sinusoidal_tied": dict(
        vocab_size=70,
        n_heads=8,
        n_kv_heads=4,
        positions="sinusoidal",
        norm="rmsnorm",
        activation="swiglu",
        bias=True,
        tie_embeddings=True,
    ),
}
COMMON = dict(d_model=32, n_layers=2, max_seq_len=32, dropout=0.0)
BATCH, SEQ = 2, 8


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _tokens(vocab: int, seed: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def _check_variant(name, overrides, topo, sp):
    cfg = ModelConfig(**COMMON, **overrides)
    ref = Transformer(cfg, seed=0)
    model = parallelize(copy.deepcopy(ref), topo, sequence_parallel=sp)
    batch = _tokens(cfg.vocab_size, seed=1)
    inputs, targets = batch[:, :-1], batch[:, 1:]

    ref_logits = ref(inputs)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    ref_loss.backward()

    with torch.no_grad():
        logits = model(inputs)
    assert logits.shape == (BATCH, SEQ, padded_vocab_size(cfg.vocab_size, topo.tp_size) // topo.tp_size), logits.shape
    loss = model(inputs, targets=targets)  # the training path: vocab-parallel cross-entropy
    loss.backward()

    full_logits = _gather_logits(logits, topo, cfg.vocab_size)
    out = {"logits": _max_diff(full_logits, ref_logits), "loss": abs(loss.item() - ref_loss.item())}
    ref_params = dict(ref.named_parameters())
    names = dict(model.named_parameters())
    assert set(names) == set(ref_params), set(names) ^ set(ref_params)
    grad = 0.0
    for pname, p in names.items():
        g = gather_shards(p.grad, spec_of(p), topo)
        assert g.shape == ref_params[pname].grad.shape, (pname, g.shape)
        d = _max_diff(g, ref_params[pname].grad)
        grad = max(grad, d)
        assert d <= TOL, f"{name} sp={sp}: grad of {pname} differs by {d}"
    out["grad"] = grad
    # Replicated parameters start equal and get equal gradients on every TP rank.
    for pname, p in names.items():
        if not hasattr(p, "tp_meta"):
            gathered = [torch.empty_like(p.grad) for _ in range(topo.tp_size)]
            dist.all_gather(gathered, p.grad.contiguous(), group=topo.tp_group)
            spread = max(_max_diff(x, gathered[0]) for x in gathered)
            assert spread == 0.0 or spread <= 1e-7, f"{name}: replicated {pname} grads differ by {spread}"
    assert out["logits"] <= TOL and out["loss"] <= TOL, (name, sp, out)

    # The consolidated state dict is the single-process one (keys, shapes, values).
    full = {k: gather_shards(t.detach(), spec_of(t), topo) for k, t in model.state_dict(keep_vars=True).items()}
    ref_sd = ref.state_dict()
    assert full.keys() == ref_sd.keys()
    out["state_dict"] = max(_max_diff(full[k], ref_sd[k]) for k in ref_sd)
    if not sp:  # greedy generation with the KV cache, full logits gathered
        prompt = inputs[:, :4]
        with torch.no_grad(), gathered_logits(model):
            tokens = model.generate(prompt, max_new_tokens=8)
        assert torch.equal(tokens, ref.generate(prompt, max_new_tokens=8)), f"{name}: generation differs"
    return out


def _gather_logits(logits, topo, vocab):
    parts = [torch.empty_like(logits) for _ in range(topo.tp_size)]
    dist.all_gather(parts, logits.contiguous(), group=topo.tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab]


def _train_10_steps(topo, sp):
    """10 AdamW steps at TP next to the single-process model: losses follow to 1e-5."""
    cfg = ModelConfig(**COMMON, **VARIANTS["mqa_rope_swiglu"])
    ref = Transformer(cfg, seed=0)
    model = parallelize(copy.deepcopy(ref), topo, sequence_parallel=sp)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    worst = 0.0
    losses = []
    for step in range(10):
        batch = _tokens(cfg.vocab_size, seed=100 + step, batch=4, seq=16)
        x, y = batch[:, :-1], batch[:, 1:]
        ref_loss = F.cross_entropy(ref(x).reshape(-1, cfg.vocab_size), y.reshape(-1))
        loss = model(x, targets=y)
        for optimizer, step_loss in ((opt_ref, ref_loss), (opt, loss)):
            optimizer.zero_grad()
            step_loss.backward()
            optimizer.step()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
        losses.append((ref_loss.item(), loss.item()))
    assert losses[-1][0] < losses[0][0], losses  # it learns
    assert worst <= TOL, (worst, losses)
    # After training, replicated params (norms) are still identical across TP ranks.
    for pname, p in model.named_parameters():
        if not hasattr(p, "tp_meta"):
            gathered = [torch.empty_like(p) for _ in range(topo.tp_size)]
            dist.all_gather(gathered, p.detach().contiguous(), group=topo.tp_group)
            assert all(torch.equal(gathered[0], x) for x in gathered), pname
    return worst


def _check_dropout(topo):
    """dropout > 0: shards get different masks (attention heads, SP sequence chunks), replicated
    activations identical masks (replicas stay equal through training), and activation
    checkpointing replays the same masks (equal gradients with and without it)."""
    from torch.utils.checkpoint import checkpoint

    out = {}
    for sp in (False, True):
        cfg = ModelConfig(**{**COMMON, "dropout": 0.2}, **VARIANTS["mqa_rope_swiglu"])
        torch.manual_seed(5)
        model = parallelize(Transformer(cfg, seed=0), topo, sequence_parallel=sp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            batch = _tokens(cfg.vocab_size, seed=200 + step)
            opt.zero_grad()
            model(batch[:, :-1], targets=batch[:, 1:]).backward()
            opt.step()
        for pname, p in model.named_parameters():
            if not hasattr(p, "tp_meta"):
                gathered = [torch.empty_like(p) for _ in range(topo.tp_size)]
                dist.all_gather(gathered, p.detach().contiguous(), group=topo.tp_group)
                assert all(torch.equal(gathered[0], x) for x in gathered), f"dropout sp={sp}: replica {pname} drifted"

        # Activation checkpointing of a block recomputes the same dropout masks.
        batch = _tokens(cfg.vocab_size, seed=300)
        grads = []
        for use_ckpt in (False, True):
            model.zero_grad()
            torch.manual_seed(7)
            blk = model.blocks[0]
            orig = blk.forward
            if use_ckpt:
                blk.forward = lambda x, *a, _f=orig: checkpoint(_f, x, *a, use_reentrant=False)
            try:
                model(batch[:, :-1], targets=batch[:, 1:]).backward()
            finally:
                blk.forward = orig
            grads.append([p.grad.clone() for p in model.parameters()])
        diff = max(_max_diff(a, b) for a, b in zip(*grads))
        assert diff == 0.0, f"dropout sp={sp}: checkpointed recompute differs by {diff}"
        out[f"dropout/sp={sp}"] = {"ckpt_grad": diff}

    # Different TP ranks draw different attention-dropout masks for their heads.
    drop = torch.nn.Dropout(0.5)
    from loomtrain.parallel.plan import _fork_rng

    _fork_rng(drop, topo.tp_rank)
    torch.manual_seed(11)
    mask = drop(torch.ones(64))
    after = torch.rand(1)
    torch.manual_seed(11)
    torch.randint(0, 2**62, ())
    assert torch.equal(after, torch.rand(1)), "the fork must leave the global RNG as one draw moved it"
    masks = [torch.empty_like(mask) for _ in range(topo.tp_size)]
    dist.all_gather(masks, mask, group=topo.tp_group)
    assert not torch.equal(masks[0], masks[1]), "TP ranks drew the same dropout mask"
    return out


def _worker(rank, world, tp, port, out_path, train):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        topo = Topology(world, rank, tp)
        mpu = topo.mpu  # what deepspeed.initialize(mpu=...) reads
        assert mpu.get_model_parallel_world_size() == mpu.get_tensor_model_parallel_world_size() == tp
        assert dist.get_world_size(mpu.get_model_parallel_group()) == tp
        assert mpu.get_model_parallel_rank() == rank % tp and mpu.get_data_parallel_rank() == rank // tp
        assert mpu.get_data_parallel_world_size() == dist.get_world_size(mpu.get_data_parallel_group()) == 1
        assert mpu.get_data_parallel_group_ranks() == [rank] and mpu.get_tensor_model_parallel_src_rank() == 0
        assert not hasattr(mpu, "initialize_sequence_parallel")  # that would mean Ulysses SP to DeepSpeed
        results = {}
        for name, overrides in VARIANTS.items():
            for sp in (False, True):
                results[f"{name}/sp={sp}"] = _check_variant(name, overrides, topo, sp)
        if train:
            results.update(_check_dropout(topo))
            for sp in (False, True):
                results[f"train10/sp={sp}"] = {"loss": _train_10_steps(topo, sp)}
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_process(tp, tmp_path):
    out = tmp_path / "diffs.json"
    mp.start_processes(
        _worker, args=(tp, tp, free_port(), str(out), tp == 2), nprocs=tp, start_method="spawn", join=True
    )
    results = json.loads(out.read_text())
    print(f"\nTP={tp} max abs diffs:")
    for key, diffs in results.items():
        print(f"  {key:32s} " + "  ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
        assert all(v <= TOL for v in diffs.values()), (key, diffs)
    assert len(results) == 2 * len(VARIANTS) + (4 if tp == 2 else 0)


# Bad tp values fail before training, with one clear line naming parallel.tp -----------
@pytest.mark.parametrize(
    "overrides, tp, world, needle",
    [
        (dict(n_heads=4), 3, 6, "model.n_heads=4 is not divisible by tp"),
        (dict(n_heads=8, n_kv_heads=4), 2, 3, "world size 3 is not divisible by tp"),
        (dict(n_heads=12, n_kv_heads=3, d_model=48), 4, 4, "model.n_kv_heads=3"),
        (dict(n_heads=8, n_kv_heads=4, ffn_hidden=90), 4, 8, "FFN hidden size 90"),
        (dict(n_heads=4), 0, 4, "must be a positive integer"),
    ],
)
def test_bad_tp_fails_clearly(overrides, tp, world, needle):
    cfg = ModelConfig(**{**COMMON, "vocab_size": 64, **overrides})
    with pytest.raises(ValueError) as err:
        check_tp(cfg, tp, world)
    msg = str(err.value)
    assert msg.startswith("parallel.tp") and needle in msg and "\n" not in msg, msg


def test_good_tp_values_pass_and_vocab_is_padded():
    cfg = ModelConfig(**{**COMMON, "vocab_size": 51, "n_heads": 8, "n_kv_heads": 2})
    for tp in (1, 2, 4, 8):  # 2 KV heads replicated at tp 4 and 8
        check_tp(cfg, tp, 8)
    from loomtrain.parallel import padded_vocab_size

    assert [padded_vocab_size(51, t) for t in (1, 2, 4, 8)] == [51, 52, 52, 56]


def test_topology_layout():
    tp_groups, dp_groups = Topology.layout(8, 2)
    assert tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert Topology.layout(8, 8) == ([list(range(8))], [[r] for r in range(8)])


def test_topology_layout_single_process(monkeypatch):
    topo = Topology(1, 0, 1)
    assert (topo.tp_rank, topo.dp_rank, topo.tp_size, topo.dp_size) == (0, 0, 1, 1)
    # In-process tests that ran earlier may have left a world-1 process group behind.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="needs torch.distributed"):
        Topology(4, 1, 2)
