"""TokenStream: exactly-once per epoch across DP ranks, TP sameness, resume (also
across a DP-size change), determinism, prefetch, permutation."""

import numpy as np
import pytest
import stream_support
import torch
from loomtrain.data_pipeline import DataError, TokenStream
from loomtrain.data_pipeline.shard_set import ShardSet
from loomtrain.data_pipeline.stream import SeededPermutation
from stream_support import write_arrays

T = 8  # seq_len
INFO = {"hash": "synthetic0000000", "name": "synthetic", "vocab_size": 1 << 20, "eos_id": 0}


def make_shards(path, n_samples, shard_tokens=37):
    """Tokens 0..N-1 (uint32), so sample i's first input token is i * T."""
    n_tokens = n_samples * T + 1
    write_arrays(
        path,
        {"train": np.arange(n_tokens, dtype=np.uint32), "val": np.arange(3 * T + 1, dtype=np.uint32)},
        INFO,
        shard_tokens=shard_tokens,
    )
    return path


def sample_ids(inputs):
    return (inputs[:, 0] // T).tolist()


def global_order(shard_dir, m, d, rounds, **kw):
    """Run d ranks for `rounds` rounds; return the global sequence of sample ids and the final states."""
    return stream_support.global_order(shard_dir, m, d, rounds, sample_ids, seq_len=T, **kw)


@pytest.mark.parametrize("n_samples,m,d", [(24, 2, 1), (24, 2, 2), (24, 2, 3), (25, 2, 2), (29, 3, 3), (7, 2, 3)])
def test_every_sample_once_per_epoch_across_dp_ranks(tmp_path, n_samples, m, d):
    shard_dir = make_shards(tmp_path, n_samples)
    rounds = -(-2 * n_samples // (m * d)) + 1  # a bit over two epochs
    order, _ = global_order(shard_dir, m, d, rounds)
    assert sorted(order[:n_samples]) == list(range(n_samples))
    assert sorted(order[n_samples : 2 * n_samples]) == list(range(n_samples))
    assert order[:n_samples] != order[n_samples : 2 * n_samples]  # each epoch reshuffled
    # The global order does not depend on how it is cut into micro batches and ranks.
    reference, _ = global_order(shard_dir, 1, 1, len(order))
    assert order == reference[: len(order)]


def test_ranks_disjoint_and_contract_positions(tmp_path):
    shard_dir = make_shards(tmp_path, 30)
    m, d = 2, 3
    ref = TokenStream(shard_dir, seq_len=T, micro_batch_size=1, seed=5, prefetch=0)
    expected = [sample_ids(next(ref)[0])[0] for _ in range(2 * m * d)]
    for r in range(d):
        s = TokenStream(shard_dir, seq_len=T, micro_batch_size=m, dp_rank=r, dp_size=d, seed=5)
        for k in range(2):
            got = sample_ids(next(s)[0])
            assert got == expected[k * m * d + r * m : k * m * d + (r + 1) * m]
        s.close()


def test_tp_ranks_of_one_dp_group_get_identical_batches(tmp_path):
    shard_dir = make_shards(tmp_path, 20)
    a = TokenStream(shard_dir, seq_len=T, micro_batch_size=2, dp_rank=1, dp_size=2, seed=3, prefetch=2)
    b = TokenStream(shard_dir, seq_len=T, micro_batch_size=2, dp_rank=1, dp_size=2, seed=3, prefetch=0)
    for _ in range(12):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    a.close(), b.close()


def test_inputs_targets_packed_and_shifted(tmp_path):
    shard_dir = make_shards(tmp_path, 10, shard_tokens=5)  # samples cross many shard files
    s = TokenStream(shard_dir, seq_len=T, micro_batch_size=4, seed=0)
    x, y = next(s)
    assert x.dtype == torch.long and x.shape == (4, T) and y.shape == (4, T)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(x, x[:, :1] + torch.arange(T))
    assert s.samples_per_epoch == 10 and s.tokens_per_epoch == 10 * T
    s.close()


def test_same_seed_same_order_other_seed_other_order(tmp_path):
    shard_dir = make_shards(tmp_path, 40)
    a, _ = global_order(shard_dir, 4, 1, 10, seed=7)
    b, _ = global_order(shard_dir, 4, 1, 10, seed=7, prefetch=0)
    c, _ = global_order(shard_dir, 4, 1, 10, seed=8)
    assert a == b and a != c
    unshuffled, _ = global_order(shard_dir, 4, 1, 10, shuffle=False)
    assert unshuffled == list(range(40))


@pytest.mark.parametrize("m,d_before,d_after,rounds_before", [(2, 2, 2, 5), (2, 2, 3, 3), (2, 4, 2, 3), (1, 3, 1, 4)])
def test_resume_equals_uninterrupted(tmp_path, m, d_before, d_after, rounds_before):
    n = 23  # uneven on purpose: the resume crosses an epoch boundary
    shard_dir = make_shards(tmp_path, n)
    total = 3 * n
    full, _ = global_order(shard_dir, 1, 1, total)
    first, states = global_order(shard_dir, m, d_before, rounds_before)
    assert len({s["global_position"] for s in states}) == 1  # all ranks agree
    pos = states[0]["global_position"]
    assert pos == rounds_before * m * d_before
    rest_rounds = (total - pos) // (m * d_after)
    second, _ = global_order(shard_dir, m, d_after, rest_rounds, start_state=states[0])
    assert first + second == full[: len(first) + len(second)]


def test_resume_refuses_a_position_off_the_round_boundary(tmp_path):
    shard_dir = make_shards(tmp_path, 20)
    _, states = global_order(shard_dir, 2, 2, 1)  # position 4
    s = TokenStream(shard_dir, seq_len=T, micro_batch_size=2, dp_rank=0, dp_size=3)
    with pytest.raises(DataError, match=r"global position 4: not a round boundary .* = 6"):
        s.load_state_dict(states[0])
    s2 = TokenStream(shard_dir, seq_len=T, micro_batch_size=2, seed=99)
    with pytest.raises(DataError, match="seed=0.*seed=99"):
        s2.load_state_dict(states[0])


def test_load_state_mid_iteration_restarts_prefetch(tmp_path):
    shard_dir = make_shards(tmp_path, 20)
    s = TokenStream(shard_dir, seq_len=T, micro_batch_size=2, seed=1, prefetch=3)
    first = [sample_ids(next(s)[0]) for _ in range(3)]
    state = s.state_dict()
    after = [sample_ids(next(s)[0]) for _ in range(4)]
    s.load_state_dict({**state, "global_position": 2})
    assert [sample_ids(next(s)[0]) for _ in range(2)] == first[1:]
    s.load_state_dict(state)
    assert [sample_ids(next(s)[0]) for _ in range(4)] == after
    s.close()


def test_split_too_small_is_refused(tmp_path, monkeypatch):
    shard_dir = make_shards(tmp_path, 5)
    closed = []
    monkeypatch.setattr(ShardSet, "close", lambda self: closed.append(self.split))
    with pytest.raises(DataError, match="split 'val' has 25 tokens, fewer than one sample of seq_len \\+ 1 = 33"):
        TokenStream(shard_dir, "val", seq_len=32, micro_batch_size=1)
    assert closed == ["val"]  # the refused stream's shards are closed


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4097])
def test_seeded_permutation_is_a_permutation(n):
    perm = SeededPermutation(n, seed=11, epoch=2)(np.arange(n))
    assert sorted(perm.tolist()) == list(range(n))
    assert np.array_equal(perm, SeededPermutation(n, seed=11, epoch=2)(np.arange(n)))
    if n >= 17:
        assert not np.array_equal(perm, SeededPermutation(n, seed=11, epoch=3)(np.arange(n)))


def test_dropped_stream_stops_its_prefetch_thread(tmp_path):
    import gc
    import threading

    shard_dir = make_shards(tmp_path, 20)
    s = TokenStream(shard_dir, seq_len=T, micro_batch_size=2, prefetch=2)
    next(s)
    thread = s._thread
    assert thread.is_alive()
    del s
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("TokenStream-prefetch") and t is thread]


def test_errors_in_the_prefetch_thread_reach_the_consumer(tmp_path):
    shard_dir = make_shards(tmp_path, 20)
    s = TokenStream(shard_dir, seq_len=T, micro_batch_size=2, prefetch=2)
    s.sources[0].segments = []  # simulate a failure while reading
    with pytest.raises(IndexError):
        next(s)
    s.close()


def _step_digests(shard_dir, m, d, steps, grad_accum=1, start_state=None, prefetch=2):
    """Per optimizer step: the DP ranks' sample digests summed, as the loop does."""
    streams = [
        TokenStream(shard_dir, seq_len=T, micro_batch_size=m, dp_rank=r, dp_size=d, seed=4, prefetch=prefetch)
        for r in range(d)
    ]
    if start_state is not None:
        for s in streams:
            s.load_state_dict(start_state)
    digests = []
    for _ in range(steps):
        for s in streams:
            for _ in range(grad_accum):
                next(s)
        digests.append(sum(s.take_samples_digest() for s in streams) % 2**40)
    state = streams[0].state_dict()
    for s in streams:
        s.close()
    return digests, state


def test_samples_digest_names_the_global_batch_whatever_the_dp_size(tmp_path):
    """data/samples_hash: the same global batch of 8 has the same digest read as 1 x 8, 2 x 4
    (also with accumulation), 4 x 2, with or without prefetch, and across a resume at another
    DP size; another batch (a repeated or skipped sample) has another."""
    shard_dir = make_shards(tmp_path, 29)  # 29 samples: step 4 wraps into the second epoch
    reference, _ = _step_digests(shard_dir, 8, 1, steps=6)
    assert len(set(reference)) == 6
    assert _step_digests(shard_dir, 4, 2, steps=6)[0] == reference
    assert _step_digests(shard_dir, 2, 2, steps=6, grad_accum=2, prefetch=0)[0] == reference
    first, state = _step_digests(shard_dir, 2, 4, steps=3)
    rest, _ = _step_digests(shard_dir, 4, 2, steps=3, start_state=state)
    assert first + rest == reference
    # One sample too many or too few changes the digest.
    s = TokenStream(shard_dir, seq_len=T, micro_batch_size=1, seed=4, prefetch=0)
    for _ in range(9):
        next(s)
    assert s.take_samples_digest() % 2**40 != reference[0]
    s.close()
