"""KV-cache decoding equals the full forward; generate() is greedy at temperature 0 and honours
top_k / top_p / eos / length limits."""

import pytest
import torch
from loomtrain.model import ModelConfig, Transformer, sample_next

# Tiny models gain nothing from threads; on a shared 2-core box they only spin.
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=24)
    base.update(kw)
    return ModelConfig(**base)


DECODE_VARIANTS = {
    "gqa-rope": dict(n_kv_heads=2, positions="rope", norm="rmsnorm", activation="swiglu"),
    "gqa-alibi": dict(n_kv_heads=2, positions="alibi"),
    "mqa-rope-post": dict(n_kv_heads=1, positions="rope", norm_placement="post", bias=True),
    "mha-learned": dict(positions="learned", tie_embeddings=False),
    "mha-sinusoidal": dict(positions="sinusoidal", activation="relu"),
    "mqa-alibi-post": dict(n_kv_heads=1, positions="alibi", norm_placement="post"),
    "gqa-none": dict(n_kv_heads=2, positions="none", bias=True),
}


@pytest.mark.parametrize("name", list(DECODE_VARIANTS))
def test_kv_cache_decode_matches_full_forward_every_step(name):
    model = Transformer(tiny(**DECODE_VARIANTS[name]), seed=1).eval()
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache()
        # A prompt of 5, a chunk of 3 (queries after cached keys: offset mask), then one at a time.
        steps = [(0, 5), (5, 8)] + [(p, p + 1) for p in range(8, 20)]
        for start, end in steps:
            assert cache.length == start
            out = model(tokens[:, start:end], cache)
            err = (out - full[:, start:end]).abs().max().item()
            assert err <= 1e-5, (name, start, err)
        assert cache.length == 20


def test_cache_capacity_and_table_limits_raise():
    model = Transformer(tiny(positions="rope"), seed=0).eval()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 25, dtype=torch.long))
    cache = model.new_cache(capacity=6)
    model(torch.zeros(1, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="capacity"):
        model(torch.zeros(1, 3, dtype=torch.long), cache)
    # ALiBi and `none` have no table, so they run past max_seq_len.
    alibi = Transformer(tiny(positions="alibi"), seed=0)
    assert alibi(torch.zeros(1, 30, dtype=torch.long)).shape == (1, 30, 64)


def naive_greedy(model, tokens, n):
    for _ in range(n):
        nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], 1)
    return tokens


@pytest.mark.parametrize("name", ["gqa-rope", "gqa-alibi", "mha-learned"])
def test_generate_greedy_equals_recomputed_argmax(name):
    model = Transformer(tiny(**DECODE_VARIANTS[name]), seed=2)
    prompt = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, max_new_tokens=10)
    assert out.shape == (3, 14) and torch.equal(out[:, :4], prompt)
    with torch.no_grad():
        assert torch.equal(out, naive_greedy(model.eval(), prompt, 10))
    # top_k=1 and a tiny top_p both reduce sampling to the argmax.
    assert torch.equal(model.generate(prompt, 10, temperature=1.0, top_k=1), out)
    assert torch.equal(model.generate(prompt, 10, temperature=0.7, top_p=1e-6), out)
    # A 1-D prompt gives a 1-D result.
    assert torch.equal(model.generate(prompt[0], 10), out[0])


def test_generate_restores_training_mode_and_checks_length():
    model = Transformer(tiny(positions="learned", dropout=0.1), seed=0).train()
    prompt = torch.zeros(1, 4, dtype=torch.long)
    a, b = model.generate(prompt, 6), model.generate(prompt, 6)
    assert torch.equal(a, b)  # dropout was off while generating
    assert model.training
    assert torch.equal(model.generate(prompt, 0), prompt)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(prompt, 21)


def test_generate_stops_at_eos_and_pads_finished_rows():
    model = Transformer(tiny(), seed=5)
    prompt = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(5))
    prompt = prompt[[0, 0, 1]]  # rows 0 and 1 equal: they finish together
    greedy = model.generate(prompt, 12)
    cases = [
        (prompt, greedy, greedy[0, 3].item()),
        (prompt, greedy, greedy[2, 3].item()),
        (prompt[:2], greedy[:2], greedy[0, 3].item()),
    ]  # the last one stops after one token
    for prompt, greedy, eos in cases:
        out = model.generate(prompt, 12, eos_id=eos)
        firsts = []
        for row in range(prompt.shape[0]):
            new = greedy[row, 3:].tolist()
            firsts.append(new.index(eos) if eos in new else None)
        # Stops once every row has emitted eos; otherwise runs all 12 steps.
        length = 3 + (max(firsts) + 1 if None not in firsts else 12)
        assert out.shape == (prompt.shape[0], length)
        for row, f in enumerate(firsts):
            upto = 3 + (f + 1 if f is not None else 12)
            assert torch.equal(out[row, :upto], greedy[row, :upto])  # greedy up to and with eos
            assert (out[row, upto:] == eos).all()  # then padded with eos


def test_sampling_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, -5.0]])
    g = torch.Generator().manual_seed(0)
    draws = sample_next(logits.expand(500, -1), 1.0, top_k=2, generator=g)
    assert set(draws.unique().tolist()) == {0, 1}
    # softmax([4, 3, 2, ...]): p0 ~ 0.66, p0 + p1 ~ 0.91, so top_p 0.8 keeps tokens 0 and 1.
    draws = sample_next(logits.expand(500, -1), 1.0, top_p=0.8, generator=g)
    assert set(draws.unique().tolist()) == {0, 1}
    draws = sample_next(logits.expand(2000, -1), 1.0, generator=g)
    assert set(draws.unique().tolist()) >= {0, 1, 2}
    # Seeded sampling is reproducible.
    a = sample_next(logits.expand(50, -1), 0.9, generator=torch.Generator().manual_seed(3))
    b = sample_next(logits.expand(50, -1), 0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    for bad in (dict(temperature=-1.0), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_p=0.0)):
        with pytest.raises(ValueError):
            sample_next(logits, **bad)
