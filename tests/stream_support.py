"""Reading TokenStreams the way data-parallel ranks do, for the data tests."""

from __future__ import annotations

from loomtrain.data_pipeline import TokenStream


def global_order(source, m, d, rounds, decode, *, seq_len, seed=0, start_state=None, prefetch=2, **kw):
    """Run d data-parallel streams over `source` (a shard directory or weighted sources) for
    `rounds` rounds, one micro batch of `m` per rank per round; -> (the global sequence of
    `decode(inputs)` of every micro batch, rank by rank, and each rank's final state)."""
    streams = [
        TokenStream(
            source, seq_len=seq_len, micro_batch_size=m, dp_rank=r, dp_size=d, seed=seed, prefetch=prefetch, **kw
        )
        for r in range(d)
    ]
    if start_state is not None:
        for s in streams:
            s.load_state_dict(start_state)
    order = []
    for _ in range(rounds):
        for s in streams:
            order += decode(next(s)[0])
    states = [s.state_dict() for s in streams]
    for s in streams:
        s.close()
    return order, states
