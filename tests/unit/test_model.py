"""The model's structure and mathematical properties: causality for every variant, attention
invariances, RoPE/ALiBi, GQA grouping, the tensor-parallel attribute contract, init, params, FLOPs."""

import itertools
import math

import pytest
import torch
from loomtrain.model import Attention, ModelConfig, Transformer, param_count
from loomtrain.model.positions import alibi_bias, alibi_slopes, apply_rope, rope_tables
from small_configs import llama_style
from torch import nn

PLACEMENTS = ("pre", "post")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("relu", "gelu", "swiglu")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
ALL = list(itertools.product(PLACEMENTS, NORMS, ACTIVATIONS, POSITIONS, KV_HEADS))


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=24)
    base.update(kw)
    return ModelConfig(**base)


def variant(i, placement, norm, activation, positions, heads) -> ModelConfig:
    # bias and tying alternate so both settings meet every other axis.
    return tiny(
        norm_placement=placement,
        norm=norm,
        activation=activation,
        positions=positions,
        n_kv_heads=KV_HEADS[heads],
        bias=bool(i % 2),
        tie_embeddings=bool(i // 2 % 2),
    )


# Tiny models gain nothing from threads; on a shared 2-core box they only spin.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("i,placement,norm,activation,positions,heads", [(i, *c) for i, c in enumerate(ALL)])
def test_causal_every_variant(i, placement, norm, activation, positions, heads):
    """Row 0 is the base sequence; row k changes token t_k. Logits before t_k must not move (float64)."""
    model = Transformer(variant(i, placement, norm, activation, positions, heads), seed=i).double().eval()
    g = torch.Generator().manual_seed(i)
    cuts = (0, 7, 15)
    tokens = torch.randint(0, 64, (1, 16), generator=g).repeat(1 + len(cuts), 1)
    for row, t in enumerate(cuts, start=1):
        tokens[row, t] = (tokens[row, t] + 1 + torch.randint(0, 62, (), generator=g)) % 64
    with torch.no_grad():
        out = model(tokens)
    for row, t in enumerate(cuts, start=1):
        assert (out[row, :t] - out[0, :t]).abs().max().item() <= 1e-6 if t else True
        assert (out[row, t] - out[0, t]).abs().max().item() > 1e-6  # the change is seen from t on


def test_forward_shape_and_contract_names():
    cfg = tiny(positions="learned", activation="swiglu", tie_embeddings=False)
    model = Transformer(cfg, seed=0)
    assert model(torch.zeros(3, 5, dtype=torch.long)).shape == (3, 5, 64)
    assert isinstance(model.tok_emb, nn.Embedding) and isinstance(model.pos_emb, nn.Embedding)
    assert isinstance(model.drop, nn.Dropout) and isinstance(model.blocks, nn.ModuleList)
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.bias is None
    block = model.blocks[0]
    for name in ("attn_norm", "attn", "ffn_norm", "ffn"):
        assert hasattr(block, name)
    for name in ("wq", "wk", "wv", "wo"):
        assert isinstance(getattr(block.attn, name), nn.Linear)
    for name in ("up", "down", "gate"):
        assert isinstance(getattr(block.ffn, name), nn.Linear)
    assert not hasattr(Transformer(tiny(activation="gelu")).blocks[0].ffn, "gate")
    tied = Transformer(tiny(tie_embeddings=True))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert Transformer(tiny(positions="rope")).pos_emb is None
    # Post-norm (the 2017 original) ends every block in a norm and has no final one.
    assert isinstance(Transformer(tiny(norm_placement="post")).norm, nn.Identity)
    assert isinstance(Transformer(tiny(norm_placement="pre")).norm, nn.LayerNorm)
    # Position tables are derived, never saved.
    keys = Transformer(tiny(positions="rope")).state_dict().keys()
    assert not any("rope" in k or "alibi" in k or "pos_table" in k for k in keys)


@pytest.mark.parametrize("heads", list(KV_HEADS))
def test_attention_permutation_equivariant_without_mask_or_positions(heads):
    cfg = tiny(positions="none", n_kv_heads=KV_HEADS[heads], bias=True)
    attn = Attention(cfg, causal=False).double()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    perm = torch.randperm(10)
    assert torch.allclose(attn(x[:, perm]), attn(x)[:, perm], atol=1e-12)
    attn.causal = True  # with the mask it is not (sanity check of the test itself)
    assert not torch.allclose(attn(x[:, perm]), attn(x)[:, perm], atol=1e-6)


def reference_attention(attn: Attention, x, bias=None, rope=None):
    """softmax(q k^T / sqrt(d) + bias) v written out, KV heads repeated query-head-major."""
    b, t, _ = x.shape
    q = attn.wq(x).view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.wk(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.wv(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    rep = attn.n_heads // attn.n_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
    if bias is None:
        bias = torch.zeros(t, t, dtype=x.dtype).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores + bias).softmax(-1) @ v
    return attn.wo(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("positions,heads", [("none", "gqa"), ("alibi", "gqa"), ("rope", "mqa"), ("alibi", "mha")])
def test_attention_matches_written_out_formula(positions, heads):
    cfg = tiny(positions=positions, n_heads=8, n_kv_heads={"mha": 8, "gqa": 2, "mqa": 1}[heads], bias=True)
    attn = Attention(cfg).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    rope, bias = None, None
    if positions == "rope":
        rope = tuple(t[:9].double() for t in rope_tables(24, cfg.head_width, cfg.rope_theta))
    if positions == "alibi":
        pos = torch.arange(9)
        bias = alibi_bias(attn.alibi_slopes, pos, pos)
    assert torch.allclose(attn(x, rope), reference_attention(attn, x, bias, rope), atol=1e-12)


def test_rope_score_depends_only_on_relative_offset():
    head_dim = 16
    cos, sin = rope_tables(64, head_dim, theta=500.0, dtype=torch.float64)
    q, k = torch.randn(2, head_dim, dtype=torch.float64)

    def score(m, n):
        qm = apply_rope(q.view(1, 1, 1, -1), cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k.view(1, 1, 1, -1), cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum().item()

    for m, n in [(5, 2), (9, 9), (3, 11), (0, 40)]:
        for shift in (1, 7, 20):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-10)
    assert abs(score(5, 2) - score(5, 3)) > 1e-6  # but it does depend on the offset
    # A rotation keeps the norm, and position 0 is the identity.
    assert torch.allclose(apply_rope(q.view(1, 1, 1, -1), cos[:1], sin[:1]).flatten(), q)
    rotated = apply_rope(q.view(1, 1, 1, -1), cos[30:31], sin[30:31])
    assert rotated.norm().item() == pytest.approx(q.norm().item(), rel=1e-12)


def test_rope_theta_changes_frequencies():
    cos_a, _ = rope_tables(8, 8, 10000.0)
    cos_b, _ = rope_tables(8, 8, 100.0)
    assert not torch.allclose(cos_a, cos_b)
    # Pair i rotates at theta^(-2i/d): the last pair of d=8 at theta^(-3/4).
    assert cos_b[5, 3].item() == pytest.approx(math.cos(5 * 100.0 ** (-6 / 8)), rel=1e-6)


def test_alibi_slopes_and_bias():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    assert torch.allclose(alibi_slopes(4), torch.tensor([2.0 ** -(2 * (i + 1)) for i in range(4)]))
    # 6 heads: the 4-head slopes, then every other one of the 8-head slopes.
    assert torch.allclose(alibi_slopes(6), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]))
    slopes = alibi_slopes(4).double()
    pos = torch.arange(7)
    bias = alibi_bias(slopes, pos, pos)
    for h in range(4):
        for i in range(7):
            for j in range(7):
                want = -slopes[h].item() * (i - j) if j <= i else float("-inf")
                assert bias[h, i, j].item() == want
    # Decoding: queries at positions 5, 6 against keys 0..6 give the same rows.
    assert torch.equal(alibi_bias(slopes, torch.arange(5, 7), pos), bias[:, 5:7])


def test_attention_head_attributes_drive_forward_like_a_tensor_parallel_shard():
    """The TP contract: swap wq/wk/wv/wo for head slices, set local head counts, slice alibi_slopes;
    the shards' outputs (wo without bias) sum to the full layer's output."""
    cfg = tiny(n_heads=8, n_kv_heads=4, positions="alibi")
    full = Attention(cfg).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    tp, d = 2, cfg.head_width
    total = 0
    for r in range(tp):
        shard = Attention(cfg).double()
        hq, hk = cfg.n_heads // tp, cfg.kv_heads // tp
        shard.n_heads, shard.n_kv_heads = hq, hk
        shard.alibi_slopes = full.alibi_slopes[r * hq : (r + 1) * hq]
        for name, rows in (("wq", hq * d), ("wk", hk * d), ("wv", hk * d)):
            lin = nn.Linear(32, rows, bias=False).double()
            lin.weight.data = getattr(full, name).weight.data[r * rows : (r + 1) * rows]
            setattr(shard, name, lin)
        shard.wo = nn.Linear(hq * d, 32, bias=False).double()
        shard.wo.weight.data = full.wo.weight.data[:, r * hq * d : (r + 1) * hq * d]
        total = total + shard(x)
    assert torch.allclose(total, full(x), atol=1e-12)


# Initialisation -------------------------------------------------------------------------


def test_init_is_gpt2_style_and_deterministic():
    cfg = tiny(d_model=256, n_heads=4, n_layers=8, vocab_size=512, bias=True, norm="layernorm")
    model = Transformer(cfg, seed=3)
    std = cfg.init_std
    assert model.tok_emb.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.blocks[0].attn.wq.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.blocks[0].ffn.up.weight.std().item() == pytest.approx(std, rel=0.05)
    scaled = std / math.sqrt(2 * cfg.n_layers)
    assert model.blocks[-1].attn.wo.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert model.blocks[-1].ffn.down.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert model.blocks[0].attn.wq.bias.abs().sum().item() == 0
    assert torch.equal(model.blocks[0].attn_norm.weight, torch.ones(256))
    same = Transformer(cfg, seed=3).state_dict()
    other = Transformer(cfg, seed=4).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, same[k]), k
    assert not torch.equal(model.tok_emb.weight, other["tok_emb.weight"])


@pytest.mark.parametrize("positions", ["rope", "alibi", "sinusoidal"])
def test_meta_device_build_then_init_matches_eager(positions):
    cfg = tiny(positions=positions, tie_embeddings=False)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=7)
    eager = Transformer(cfg, seed=7)
    tokens = torch.randint(0, 64, (2, 9))
    assert torch.equal(lazy(tokens), eager(tokens))


# Parameter count and FLOPs ----------------------------------------------------------------


def num_params(model: Transformer, exclude_embeddings: bool = False) -> int:
    """Parameters the module holds (a tied table once), counted independently of param_count:
    exclude_embeddings drops the input lookup tables (tok_emb, and pos_emb when learned) but keeps
    the lm_head matmul weight, which is tok_emb's table itself when tied (see loomtrain.model.flops)."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        if model.pos_emb is not None:
            total -= model.pos_emb.weight.numel()
        if model.lm_head.weight is not model.tok_emb.weight:
            total -= model.tok_emb.weight.numel()
    return total


@pytest.mark.parametrize(
    "i,placement,norm,activation,positions,heads", [(i, *c) for i, c in enumerate(ALL) if i % 3 == 0]
)
@pytest.mark.parametrize("bias,tie", [(False, True), (True, False)])
def test_num_params_equals_closed_form(i, placement, norm, activation, positions, heads, bias, tie):
    cfg = variant(i, placement, norm, activation, positions, heads)
    cfg.bias, cfg.tie_embeddings = bias, tie
    model = Transformer(cfg)
    assert num_params(model) == param_count(cfg)
    assert num_params(model, exclude_embeddings=True) == param_count(cfg, exclude_embeddings=True)


def test_params_and_flops_by_hand():
    # vocab 100, d 32, 2 layers, 4 heads of 8, 2 KV heads, SwiGLU hidden 64, RMSNorm, pre, RoPE, untied.
    cfg = llama_style(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    model = Transformer(cfg)
    attn = 32 * 32 + 2 * 32 * 16 + 32 * 32  # wq, wk + wv (2 heads x 8), wo  = 3072
    ffn = 3 * 32 * 64  # up, gate, down                = 6144
    layer = attn + ffn + 2 * 32  # + two RMSNorm weights         = 9280
    total = 100 * 32 + 2 * layer + 32 + 32 * 100  # tok_emb, blocks, final norm, lm_head
    assert total == 24992 == num_params(model)
    n = total - 100 * 32  # without the input table; lm_head stays
    assert n == 21792 == num_params(model, exclude_embeddings=True)
    # 6N + 12 * L * H * Q * T at T = 16
    assert model.flops_per_token(16) == 6 * 21792 + 12 * 2 * 4 * 8 * 16 == 143040
    # Tied: the one table is the lm_head matmul, so N is unchanged and the total drops by V*d.
    cfg.tie_embeddings = True
    tied = Transformer(cfg)
    assert num_params(tied) == 24992 - 3200
    assert num_params(tied, exclude_embeddings=True) == 21792
    assert tied.flops_per_token(16) == 143040
    # Learned positions are a lookup table: in the total, not in N.
    cfg.positions = "learned"
    learned = Transformer(cfg)
    assert num_params(learned) == 24992 - 3200 + 16 * 32
    assert num_params(learned, exclude_embeddings=True) == 21792
