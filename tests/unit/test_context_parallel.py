"""Context parallelism's pieces in one process: the chunks each CP rank holds, the topology's
groups, the described masks and the blocked attention that applies them, config refusals.

The multi-rank runs (cp 2, cp 4, tp 2 x cp 2, cp 2 x dp 2, resume) are in
tests/distributed/test_context_parallel_train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dense_masks import document_mask
from loomtrain.launcher.config_loader import ConfigError, load_config
from loomtrain.launcher.training.engine import ds_config
from loomtrain.model import ModelConfig, Transformer, masking
from loomtrain.model.masking import MaskSpec, WindowSlice, blocked_attention
from loomtrain.parallel.context import KVExchange, chunk_index
from loomtrain.parallel.topology import Topology, check_cp

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_cp_rank_holds_chunk_i_and_its_mirror():
    assert chunk_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    parts = [chunk_index(32, 4, r) for r in range(4)]
    assert sorted(torch.cat(parts).tolist()) == list(range(32))
    # causal work (keys seen, summed over the rank's queries) is the same on every rank
    assert len({int((p + 1).sum()) for p in parts}) == 1
    with pytest.raises(ValueError, match="parallel.cp=3"):
        chunk_index(32, 3, 0)


def test_the_exchange_puts_the_gathered_keys_back_in_window_order():
    ex = KVExchange(None, 2, "t")
    gathered = torch.cat([chunk_index(16, 2, r) for r in range(2)])  # rank order
    assert gathered[ex.order(8, "cpu")].tolist() == list(range(16))


def test_cp_groups_sit_between_tp_and_dp():
    # world 8, tp 2, cp 2: rank = data_rank * 4 + cp_rank * 2 + tp_rank
    assert Topology.cp_layout(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    tp_groups, dp_groups = Topology.layout(8, 2)
    assert dp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]  # DeepSpeed's group: data x cp, as at cp 1
    assert tp_groups[0] == [0, 1]
    one = Topology(1, 0, 1)
    assert (one.cp_size, one.cp_rank, one.data_size, one.data_rank) == (1, 0, 1, 0)


@pytest.mark.parametrize(
    "args, needle",
    [
        ((0,), "parallel.cp: must be a positive integer"),
        ((4, 4, 2), "parallel.cp=4: world size 4 is not divisible by tp x cp = 2 x 4"),
        ((3, 6, 1, 32), "parallel.cp=3: train.seq_len=32 must be divisible by 2 x cp = 6"),
    ],
)
def test_check_cp_refuses_in_one_line(args, needle):
    with pytest.raises(ValueError) as err:
        check_cp(*args)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["parallel.cp=3"], 3, "train.seq_len: expected a multiple of 2 x parallel.cp = 6"),
        (["parallel.cp=4", "parallel.tp=2"], 4, "parallel.cp: expected a divisor of the world size 4 / parallel.tp=2"),
        (["parallel.cp=0"], 1, "parallel.cp"),
    ],
)
def test_bad_cp_in_config_fails_before_training(overrides, world, needle):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/tiny.yaml", [*overrides, "train.seq_len=64", "train.global_batch_size=48"], world)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_deepspeed_batch_arithmetic_counts_cp_ranks_as_data_parallel():
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        ["parallel.cp=2", "train.micro_batch_size=2", "train.global_batch_size=8", "train.seq_len=64"],
        world_size=4,
    )
    ds = ds_config(cfg, 4)  # DeepSpeed's dp: 2 data ranks x cp 2
    assert ds["gradient_accumulation_steps"] == 2  # 8 samples / (2 x 2 data ranks)
    assert ds["train_batch_size"] == 2 * 2 * 4


def _qkv(b=2, h=4, hkv=2, t=40, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("alibi", [False, True])
def test_blocked_attention_equals_sdpa_with_the_dense_mask(docs, window, alibi):
    q, k, v = _qkv()
    ids = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 40]) if docs else None
    spec = MaskSpec.for_tokens(40, "cpu", ids)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64) if alibi else None
    dense = spec.dense(window)
    if alibi:
        dist = (spec.q_pos[:, None] - spec.k_pos[None, :]).double()
        dense = (-slopes[:, None, None] * dist).masked_fill(~dense, float("-inf"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    got = blocked_attention(q, k, v, spec, window, slopes, gqa=True, rows=8)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    torch.testing.assert_close(
        torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), rtol=1e-9, atol=1e-9
    )
    if docs:  # the description is the dense mask the model used before
        assert torch.equal(spec.dense(window), document_mask(ids, window))


def test_a_slice_against_the_whole_window_sees_what_those_rows_of_the_dense_mask_see():
    ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2])
    idx = chunk_index(16, 2, 1)
    spec = MaskSpec.for_tokens(8, "cpu", ids, WindowSlice(idx, 16)).whole_window()
    assert torch.equal(spec.dense(4), document_mask(ids, 4)[:, :, idx])


def test_no_mask_of_t_by_t_is_built(monkeypatch):
    """Packed documents at T = 2048: every mask block is at most rows x T (O(T) per block)."""
    sizes = []
    allowed = MaskSpec.allowed

    def spy(self, s, e, ks, ke, window):
        out = allowed(self, s, e, ks, ke, window)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(MaskSpec, "allowed", spy)
    t = 2048
    q, k, v = (x.detach().float()[:1, :, :1].expand(1, x.shape[1], t, 8).contiguous() for x in _qkv())
    ids = (torch.arange(t) // 300)[None]
    blocked_attention(q, k, v, MaskSpec.for_tokens(t, "cpu", ids), None, gqa=True, rows=64)
    assert sizes and max(sizes) <= 64 * t < t * t
    assert masking.block_rows(1, 8, 32768) * 32768 * 8 * 4 <= 32 << 20  # default blocks: 32 MiB of scores


@pytest.mark.parametrize("positions", ["rope", "learned", "alibi"])
def test_a_model_given_its_whole_window_as_a_slice_equals_the_plain_forward(positions):
    """The slice path (blocked attention, positions from the slice, an exchange that returns the
    keys) against the plain one (SDPA's causal kernel)."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, positions=positions
    )
    model = Transformer(cfg, seed=0).double()
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, 1)
    want = model(tokens, targets=targets)
    for block in model.blocks:
        block.attn.kv_exchange = lambda k, v: (k, v)
    got = model(tokens, targets=targets, window_slice=WindowSlice(torch.arange(24), 24))
    torch.testing.assert_close(got, want)


def test_plan_counts_activations_per_cp_rank_and_suggests_a_cp_that_fits():
    """configs/long-context.yaml (Llama 3.2 1B's shape, 131,072-token windows): cp 4 keeps a
    rank's activations well under cp 1's (a quarter of the tokens, plus the window's K/V); at
    cp 1 without recompute it does not fit an H100, and the plan names the cp that does."""
    from loomtrain.launcher.planning.memory_plan import format_plan, load_plan, suggestions

    _, p4 = load_plan(str(ROOT / "configs/long-context.yaml"), [], None, "h100", 0.4)
    _, p1 = load_plan(str(ROOT / "configs/long-context.yaml"), ["parallel.cp=1"], None, "h100", 0.4)
    assert p4.cp == 4 and p4.dp == 8 and p4.fits  # ZeRO's group: dp 2 x cp 4
    assert p4.activations.total < 0.3 * p1.activations.total
    assert "world 16 = tp 2 x cp 4 x dp 2" in format_plan(p4)
    _, tight = load_plan(
        str(ROOT / "configs/long-context.yaml"),
        ["parallel.cp=1", "parallel.activation_checkpointing=false"],
        None,
        "h100",
        0.4,
    )
    assert not tight.fits and tight.cp_that_fits == 2
    assert suggestions(tight)[0].startswith("parallel.cp=2 (splits each sequence of 131072 tokens over 2 ranks")


def test_keys_before_a_querys_document_are_skipped_and_the_result_is_the_same():
    q, k, v = (x[:1] for x in _qkv(t=64))
    ids = (torch.arange(64) // 10)[None]  # documents of 10 tokens
    spec = MaskSpec.for_tokens(64, "cpu", ids)
    bounds = spec.key_bounds(8, None)
    assert sum(ke - ks for _, _, ks, ke in bounds) < sum(e for _, e, _, _ in bounds)  # fewer keys than causal
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=spec.dense(None), enable_gqa=True)
    got = blocked_attention(q, k, v, spec, None, gqa=True, rows=8)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g))


def test_elastic_sizes_name_cp_beside_tp():
    """A group size must be a multiple of tp x cp: the ray.min_workers line says both."""
    with pytest.raises(ConfigError) as err:
        load_config(
            ROOT / "configs/tiny.yaml",
            ["parallel.cp=2", "train.micro_batch_size=2", "train.global_batch_size=8", "train.seq_len=64"]
            + ["ray.num_workers=4", "ray.min_workers=3"],
            world_size=4,
        )
    assert str(err.value).startswith(
        "ray.min_workers: expected a multiple of parallel.tp=1 x parallel.cp=2 whose DP size x "
        "train.micro_batch_size=2 divides train.global_batch_size=8"
    ), str(err.value)
