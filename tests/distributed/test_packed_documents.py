"""Packed documents never see each other, and the loss is the mean over the global batch's targets.

A packed batch gives, per token, what each document gives alone (every positions variant, GQA,
activation checkpointing); masked targets add exactly zero loss and zero gradient; the stream
packs whole documents with their ids and targets; one global batch split into other micro
batches, accumulation or DP sizes gives the same losses and weights."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import small_configs
import torch
import torch.nn.functional as F
from loomtrain.data_pipeline.preprocess import preprocess_files
from loomtrain.data_pipeline.shards import DataError
from loomtrain.data_pipeline.stream import TokenStream, packed_windows
from loomtrain.launcher.training.activation_checkpointing import apply_activation_checkpointing
from loomtrain.model import ModelConfig, Transformer
from loomtrain.model.loss import linear_cross_entropy
from stream_support import write_arrays

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
DOCS = [5, 9, 1, 7]  # lengths; the 1-token document has nothing to predict


def tiny(positions: str, n_kv_heads: int = 4, **extra) -> Transformer:
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        max_seq_len=32,
        positions=positions,
        init_std=0.2,  # far from uniform logits, so a leak across documents shows
        tie_embeddings=False,
        **extra,
    )
    return Transformer(cfg, seed=0).eval()


def packed(lengths=DOCS, pad: int = 3, seed: int = 0):
    """Documents back to back, then padding: (tokens [1, T], document ids [1, T], the documents)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), len(lengths))])
    tokens = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])
    return tokens[None], ids[None], docs


def per_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:], reduction="none")


@pytest.mark.parametrize(
    "positions, kv", [("learned", 4), ("sinusoidal", 4), ("rope", 4), ("alibi", 4), ("none", 4), ("rope", 2)]
)
def test_a_packed_batch_gives_each_document_its_own_loss(positions, kv):
    model = tiny(positions, kv)
    tokens, ids, docs = packed()
    with torch.no_grad():
        together = model(tokens, document_ids=ids)
        leaky = model(tokens)  # the same row without document ids: later documents see earlier ones
        start, worst, leak = 0, 0.0, 0.0
        for doc in docs:
            alone = model(doc[None])
            n = doc.numel()
            assert torch.allclose(together[:, start : start + n], alone, atol=1e-5, rtol=0)
            if n > 1:
                mine = per_token_loss(together[:, start : start + n], doc[None])
                worst = max(worst, float((mine - per_token_loss(alone, doc[None])).abs().max()))
                if start:
                    leak = max(leak, float((per_token_loss(leaky[:, start : start + n], doc[None]) - mine).abs().max()))
            start += n
    assert worst <= 1e-5
    assert leak > 1e-3  # the comparison can tell packed from unpacked


def test_masked_targets_add_zero_loss_and_zero_gradient():
    # The fused loss: ignored rows get exactly zero gradient, and the mean is over the others only.
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(12, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (12,), generator=g)
    targets[[0, 3, 4, 11]] = -100
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    keep = targets != -100
    ref = F.cross_entropy(hidden.detach() @ weight.detach().T, targets, ignore_index=-100)
    assert torch.allclose(loss, ref, atol=1e-6)
    assert (hidden.grad[~keep] == 0).all() and (hidden.grad[keep] != 0).any()

    # The model with packed documents: targets only in document 0 -> no gradient reaches the
    # embedding rows of tokens that occur only in the other documents.
    model = tiny("rope").train()
    tokens, ids, _ = packed()
    tokens[0, :5] = torch.arange(5)  # document 0 uses tokens 0..4, the rest 10..
    tokens[0, 5:] = 10 + tokens[0, 5:] % (VOCAB - 10)
    targets = torch.full_like(tokens, -100)
    targets[0, :4] = tokens[0, 1:5]
    model(tokens, targets=targets, document_ids=ids).backward()
    grad = model.tok_emb.weight.grad
    assert (grad[10:] == 0).all() and (grad[:5] != 0).any()


def test_activation_checkpointing_and_document_ids_give_the_same_gradients():
    tokens, ids, _ = packed()
    targets = torch.roll(tokens, -1, 1)
    grads = []
    for ac in (False, True):
        model = tiny("rope", 2).train()
        if ac:
            apply_activation_checkpointing(model)
        model(tokens, targets=targets, document_ids=ids).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


BYTE = {"hash": "synthetic", "name": "byte", "vocab_size": 257, "eos_id": 256}


def test_the_stream_packs_whole_documents_with_ids_and_targets(tmp_path):
    lengths = [6, 4, 9, 3, 7]
    tokens = np.concatenate([np.arange(n, dtype=np.uint16) + 10 * i for i, n in enumerate(lengths)])
    mask = np.concatenate([[0, 0] + [1] * (n - 2) for n in lengths]).astype(np.uint8)  # 2 prompt tokens each
    write_arrays(tmp_path, {"train": tokens}, BYTE, doc_lengths={"train": lengths}, masks={"train": mask})
    with TokenStream(tmp_path, seq_len=11, micro_batch_size=3, shuffle=False, prefetch=0) as s:
        # Best fit, longest first: [9 3] fills a window of 12 exactly, then [4 7] (in stream order), then [6].
        assert s.document_masking and s.samples_per_epoch == 3
        x, y, ids = next(s)
    assert x[0].tolist() == [20, 21, 22, 23, 24, 25, 26, 27, 28, 30, 31]
    assert ids[0].tolist() == [0] * 9 + [1] * 2
    assert y[0].tolist() == [-100, 22, 23, 24, 25, 26, 27, 28, -100, -100, 32]
    assert x[1].tolist() == [10, 11, 12, 13, 40, 41, 42, 43, 44, 45, 46] and ids[1].tolist() == [0] * 4 + [1] * 7
    assert y[1].tolist() == [-100, 12, 13, -100, -100, 42, 43, 44, 45, 46, -100]
    assert ids[2].tolist() == [0] * 6 + [1] * 5 and y[2].tolist() == [-100, 2, 3, 4, 5] + [-100] * 6
    # A record longer than seq_len + 1 is refused, not cut.
    with pytest.raises(Exception, match=r"record 2 of split 'train' is 9 tokens, more than train.seq_len \+ 1 = 8"):
        TokenStream(tmp_path, seq_len=7, micro_batch_size=1)


def test_plain_text_is_unchanged_unless_asked(tmp_path):
    write_arrays(tmp_path, {"train": np.arange(50, dtype=np.uint16)}, BYTE, doc_lengths={"train": [20, 30]})
    with TokenStream(tmp_path, seq_len=8, micro_batch_size=2, shuffle=False, prefetch=0) as s:
        assert not s.document_masking
        x, y = next(s)
    assert x[0].tolist() == list(range(8)) and y[0].tolist() == list(range(1, 9))
    with TokenStream(tmp_path, seq_len=8, micro_batch_size=7, shuffle=False, prefetch=0, document_masking=True) as s:
        assert s.samples_per_epoch == 7
        x, y, ids = next(s)
    # A long document is cut into windows that share one token: [0, 9) [8, 17) [20, 29) [28, 37) [36, 45);
    # the tails [44, 50) and [16, 20) are packed as documents (6 + 4 > 9: one window each).
    assert x[1].tolist() == list(range(8, 16)) and y[1].tolist() == list(range(9, 17))
    assert x[2].tolist() == list(range(20, 28))
    assert x[5].tolist()[:6] == list(range(44, 50)) and y[5].tolist() == list(range(45, 50)) + [-100] * 3
    assert x[6].tolist()[:4] == [16, 17, 18, 19] and y[6].tolist() == [17, 18, 19] + [-100] * 5


@pytest.mark.parametrize("per_window", [4, 16])
def test_best_fit_leaves_under_one_percent_padding_and_takes_every_token_once(per_window):
    # Lengths around span / per_window (0.5-1.5x, as benchmarks/sft_masking.py makes them): next
    # fit left 13.9% and 3.4% padding here.
    span = 257
    rng = np.random.default_rng(per_window)
    lengths = np.maximum(2, np.round(rng.uniform(0.5, 1.5, 8000) * span / per_window)).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    windows = packed_windows(starts, int(lengths.sum()), span)
    assert windows.padding(span) <= 0.01
    taken = np.zeros(int(lengths.sum()), dtype=np.int64)
    for i in range(len(windows)):
        ranges = windows.ranges(i)
        assert sum(b - a for a, b in ranges) <= span
        assert all(a in set(starts.tolist()) for a, _ in ranges)  # whole documents only
        for a, b in ranges:
            taken[a:b] += 1
    assert (taken == 1).all()


def test_a_state_saved_with_next_fit_packing_is_refused_in_one_line(tmp_path):
    lengths = [6, 4, 9, 3, 7]
    tokens = np.concatenate([np.arange(n, dtype=np.uint16) for n in lengths])
    write_arrays(tmp_path, {"train": tokens}, BYTE, doc_lengths={"train": lengths})
    with TokenStream(tmp_path, seq_len=11, micro_batch_size=1, prefetch=0, document_masking=True) as s:
        state = s.state_dict()
        assert state["packing"] == "best-fit"
        s.load_state_dict(state)
        del state["packing"]  # as an earlier loomtrain saved it
        with pytest.raises(DataError, match=r"packed next-fit \(an earlier loomtrain\), this one packs them best-fit"):
            s.load_state_dict(state)


def chat_jsonl(path, n: int = 48, seed: int = 0):
    rng = random.Random(seed)
    words = "alpha beta gamma delta eps zeta eta theta".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
            a = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
            f.write("\n")
    return path


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory):
    work = tmp_path_factory.mktemp("chat")
    preprocess_files(
        [chat_jsonl(work / "chat.jsonl")], work / "shards", "byte", val_fraction=0.0, progress=False, log=None
    )
    return work / "shards"


# A 1-layer model on 96-token windows of chat records, 2 steps of a global batch of 4.
SFT = [
    *small_configs.SFT,
    *small_configs.QUIET,
    "model.positions=rope",
    "train.max_steps=2",
    "train.warmup_steps=0",
    "train.lr=1e-2",
    "train.eps=1.0",  # Adam's step ~ lr x gradient: rounding in a near-zero gradient stays rounding
    "checkpoint.every_steps=0",
]


def sft_cfg(run_dir, shards, *extra):
    from launch import TINY
    from loomtrain.launcher.config_loader import load_config

    return load_config(TINY, [*SFT, f"data.path={shards}", f"run.dir={run_dir}", *extra])


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_one_global_batch_split_otherwise_gives_the_same_step(tmp_path, chat_shards):
    """micro 4 x accum 1 == micro 1 x accum 4 == micro 2 x accum 2: losses and weights (<= 1e-6),
    the micro batches holding unequal numbers of targets (a mean of their means would differ)."""
    from loomtrain.launcher.training.loop import run_training

    with TokenStream(chat_shards, seq_len=96, micro_batch_size=1, shuffle=True, prefetch=0) as s:
        counts = [int((next(s)[1] != -100).sum()) for _ in range(4)]
    assert len(set(counts)) > 1, counts
    runs = {}
    for micro in (4, 1, 2):
        run_dir = tmp_path / f"micro{micro}"
        runs[micro] = (run_training(sft_cfg(run_dir, chat_shards, f"train.micro_batch_size={micro}")).losses, run_dir)
    ref_losses, ref_dir = runs[4]
    ref = final_weights(ref_dir)
    assert ref
    for micro in (1, 2):
        losses, run_dir = runs[micro]
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=0)
        for name, w in final_weights(run_dir).items():
            assert torch.allclose(w, ref[name], atol=1e-6, rtol=0), name


@pytest.mark.slow
def test_other_dp_sizes_and_tensor_parallel_give_the_same_step(tmp_path, chat_shards):
    """dp 4 x micro 1, and tp 2 x dp 2 x accumulation 2 with sequence parallelism at ZeRO 2 (the
    document mask per sequence, broadcast over local heads), == one process with micro 4. Both
    variants run in one torchrun of 4 (tests/zero_driver.py): one start-up for the two."""
    from launch import records, run_variants
    from loomtrain.launcher.training.loop import run_training

    ref_losses = run_training(sft_cfg(tmp_path / "one", chat_shards, "train.micro_batch_size=4")).losses
    ref = final_weights(tmp_path / "one")
    variants = {
        "dp4": ["train.micro_batch_size=1"],
        "tp2_dp2": [
            "train.micro_batch_size=1",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.zero_stage=2",
        ],
    }
    run_variants("zero_driver.py", tmp_path, [*SFT, f"data.path={chat_shards}"], {4: variants}, timeout=600)
    for name in variants:
        run_dir = tmp_path / name
        losses = [r["loss"] for r in records(run_dir) if "loss" in r]
        # <= 1e-6 of the loss: each micro batch's mean is rounded to float32 (~5e-7 at a loss of 6)
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0), name
        for key, w in final_weights(run_dir).items():
            assert torch.allclose(w, ref[key], atol=1e-6, rtol=0), (name, key)
