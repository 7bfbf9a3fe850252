"""TokenStream: the rank-sharded, packed, shuffled, resumable stream over token shards.

Ordering contract (see the package docstring): a split of N tokens holds
S = (N - 1) // seq_len packed samples; sample i is tokens [i*T, i*T + T + 1)
(T = seq_len), so consecutive samples share one boundary token and every token
after the first is a target exactly once per epoch. Documents are packed across
their EOS boundaries. Global position P (0, 1, 2, ... over the whole run) maps
to epoch P // S and to sample perm_epoch(P % S), perm_epoch being a seeded
permutation of [0, S). Positions run straight on across epoch ends ("wrap"):
nothing is dropped, and when S is not a multiple of the round size the last
round of an epoch is completed with the first samples of the next epoch.

With micro batch m and DP size d, round k is global positions
[k*m*d, (k+1)*m*d); DP rank r takes k*m*d + r*m + [0, m). So optimizer step s
with global batch G = m*d*grad_accum reads positions [s*G, (s+1)*G) whatever d
is, and the state (global position, seed) can be loaded under another d when
the position is a multiple of m*d.

Document masking (`document_masking`, default: on when a source holds instruction or chat
records, off for text): a sample is a packed window instead: whole documents, packed best-fit
(a window opens with the longest document left, and a short search picks the documents that fill
the rest best) within blocks of consecutive documents, the rest of a window padded with EOS; a
document longer than seq_len + 1 tokens (text only) is cut into pieces of seq_len + 1 that share
a boundary token, like the windows above, and its tail is packed as a document. Samples are then
these windows, permuted and dealt out exactly as above. The batch is (inputs, targets,
document_ids): ids count the documents of each row from 0 (padding is one more), and a target
is -100 (not trained on) where it is padding, the first token of another document, or not a
target in the shards' loss mask. Without document masking, a loss mask still sets its
non-targets to -100 in the plain windows.

Mixtures (several shard directories with weights): a `Blend` maps global
position P to one source k and a position p_k inside it, deterministically;
source k's epochs then wrap on their own exactly as above (epoch p_k // S_k,
sample perm_{k,epoch}(p_k % S_k)), so every sample of a source is read at most
once per epoch of that source, and the round/DP/resume rules are unchanged.
"""

from __future__ import annotations

import bisect
import queue
import threading
import weakref
from typing import NamedTuple

import numpy as np
import torch
from loomtrain.data_pipeline.remote import WindowCache
from loomtrain.data_pipeline.shard_set import ShardSet
from loomtrain.data_pipeline.shards import DataError

STATE_VERSION = 1
IGNORE_INDEX = -100  # a target not trained on (model/loss.py's, the Hugging Face convention)
# Document masking's packing; a state saved before it was named came from next-fit packing
# (windows of consecutive documents), whose positions are other samples.
PACKING = "best-fit"
SAMPLE_DIGEST_SHIFT = 24  # a sample's digest is the top 40 bits of its mixed id
# Shards in object storage: the windows of up to this many batches ahead are fetched (remote.py);
# the read-ahead starts at prefetch + 1 batches and doubles per batch up to it, within half of
# cache_bytes, so a stream read for a few batches (an evaluation) fetches little it does not use.
READ_AHEAD_BATCHES = 64
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class SeededPermutation:
    """A seeded pseudorandom permutation of [0, n), evaluated per position.

    A Feistel network over the next even power of two, with cycle walking back
    into [0, n). Written by hand on purpose: `numpy.random.permutation(n)` would
    hold n int64 per epoch in every rank (625 MB for 10 B tokens at seq 128);
    this needs O(1) memory at any corpus size and gives each DP rank its
    positions without materialising anyone else's.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int, source: int = 0):
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        # Source 0 keeps the one-source key, so a one-source stream is unchanged by mixtures.
        key = [int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch), 0x10047] + ([int(source)] if source else [])
        rng = np.random.default_rng(key)
        self.keys = rng.integers(0, 2**63, size=self.ROUNDS, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions) -> np.ndarray:
        x = self._encrypt(np.asarray(positions, dtype=np.uint64))
        out = x >= self.n
        while out.any():  # cycle walking: the domain is < 4n, so few passes
            x[out] = self._encrypt(x[out])
            out = x >= self.n
        return x.astype(np.int64)


class Blend:
    """Deterministic weighted interleaving of sources: global position -> (source, position inside it).

    Positions come in periods of PERIOD; in every period source k owns q_k slots
    (weights normalised, rounded by largest remainder so the q_k sum to PERIOD),
    spread evenly: slot j of source k sits at time (j + 0.5) / q_k, and the
    period is all slots sorted by time. So position P goes to source
    s = source_of[P % PERIOD], at position (P // PERIOD) * q_s + rank[P % PERIOD]
    inside it: O(1) per position, any position computable on its own (resume),
    and the share of every source within 1/PERIOD of its weight over any period.
    """

    PERIOD = 1 << 14

    def __init__(self, weights):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or not w.size or not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise DataError(f"data.sources: every weight must be a positive finite number, got {list(weights)}")
        share = w / w.sum() * self.PERIOD
        quotas = np.floor(share).astype(np.int64)
        short = self.PERIOD - int(quotas.sum())
        quotas[np.argsort(-(share - quotas), kind="stable")[:short]] += 1
        if np.any(quotas == 0):
            k = int(np.flatnonzero(quotas == 0)[0])
            raise DataError(f"data.sources[{k}].weight: {w[k]} is below 1/{self.PERIOD} of the total weight {w.sum()}")
        self.weights = w / w.sum()
        self.quotas = quotas
        src = np.concatenate([np.full(q, k, dtype=np.int64) for k, q in enumerate(quotas)])
        rank = np.concatenate([np.arange(q, dtype=np.int64) for q in quotas])
        time = (rank + 0.5) / quotas[src]
        order = np.lexsort((src, time))
        self.source_of, self.rank = src[order], rank[order]

    def __call__(self, positions) -> tuple[np.ndarray, np.ndarray]:
        period, offset = np.divmod(np.asarray(positions, dtype=np.int64), self.PERIOD)
        source = self.source_of[offset]
        return source, period * self.quotas[source] + self.rank[offset]

    def counts(self, end: int) -> np.ndarray:
        """Positions [0, end) per source."""
        period, offset = divmod(int(end), self.PERIOD)
        return period * self.quotas + np.bincount(self.source_of[:offset], minlength=len(self.quotas))


PACK_BLOCK_WINDOWS = 1024  # documents are packed in blocks of about this many windows' worth of tokens
FILL_SEARCH_BACKTRACKS = 128  # per window, how far best_fill searches past the greedy fill


class PackedWindows(NamedTuple):
    """Packed windows, each a list of token ranges: window i holds [start[j], end[j]) for j in
    first[i]:first[i + 1], in stream order; each range is one document or one piece of a cut one."""

    first: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def __len__(self) -> int:
        return len(self.first) - 1

    def ranges(self, i: int) -> list[tuple[int, int]]:
        j0, j1 = int(self.first[i]), int(self.first[i + 1])
        return list(zip(self.start[j0:j1].tolist(), self.end[j0:j1].tolist()))

    def padding(self, span: int) -> float:
        """The share of the windows' span tokens that is padding."""
        return 1.0 - float((self.end - self.start).sum()) / max(1, len(self) * span)


def document_pieces(doc_starts: np.ndarray, num_tokens: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """The token stream as (starts, ends) of documents of at most `span` tokens: a longer one is cut
    into pieces of `span` tokens, each starting on the last token of the one before (that token is
    an input again, not a target), and a shorter tail. A piece of one token (nothing to predict) goes."""
    bounds = np.unique(np.concatenate([[0], doc_starts[doc_starts < num_tokens], [num_tokens]])).astype(np.int64)
    starts, ends = bounds[:-1].copy(), bounds[1:].copy()
    long = np.flatnonzero(ends - starts > span)
    if long.size:
        cut_starts, cut_ends = [starts], [ends]
        for d in long.tolist():
            a, b = int(starts[d]), int(ends[d])
            cuts = np.arange(a, b - span, span - 1, dtype=np.int64)  # full pieces; the tail starts after them
            cut_starts.append(cuts)
            cut_ends.append(cuts + span)
            starts[d] = cuts[-1] + span - 1
        starts, ends = np.concatenate(cut_starts), np.concatenate(cut_ends)
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
    keep = ends - starts >= 2
    return starts[keep], ends[keep]


def best_fill(room: int, left: list[int], count: dict[int, int], max_backtracks: int) -> list[int]:
    """The lengths that fill `room` best, from `left` (sorted; `count` pieces of each): a
    depth-first search, longest first, in non-increasing order, that stops at an exact fill or
    after `max_backtracks` steps back (the first path it tries is the greedy one). `count` is restored."""
    best_slack, best, chosen, backtracks = room, [], [], 0
    rooms, nexts = [room], [bisect.bisect_right(left, room) - 1]  # per depth: room, next length to try
    while nexts and best_slack and backtracks <= max_backtracks:
        i = nexts[-1]
        while i >= 0 and not count[left[i]]:
            i -= 1
        if i < 0:  # every length tried at this depth: back up one choice
            if rooms[-1] < best_slack:
                best_slack, best = rooms[-1], chosen.copy()
            nexts.pop(), rooms.pop()
            if chosen:
                count[chosen.pop()] += 1
            backtracks += 1
            continue
        n = left[i]
        nexts[-1] = i - 1
        count[n] -= 1
        chosen.append(n)
        rooms.append(rooms[-1] - n)
        nexts.append(bisect.bisect_right(left, min(rooms[-1], n)) - 1)
    if rooms and rooms[-1] < best_slack:  # stopped inside a path (an exact fill, or out of steps back)
        best = chosen.copy()
    for n in chosen:
        count[n] += 1
    return best


def best_fit(lengths: np.ndarray, span: int) -> list[list[int]]:
    """Bin packing of `lengths` into bins of `span` (minimum bin slack): a bin opens with the
    longest piece left and best_fill picks the pieces that fill the rest -> the indices of each
    bin's pieces. Pieces of one length are taken in stream order."""
    order = np.argsort(lengths, kind="stable")
    values, first = np.unique(lengths[order], return_index=True)
    order = order.tolist()
    left = values.tolist()  # the lengths with a piece left, sorted
    nxt = dict(zip(left, first.tolist()))  # per length: its next piece in `order`
    count = dict(zip(left, np.diff(np.append(first, len(order))).tolist()))
    bins = []
    while left:
        opener = left[-1]
        count[opener] -= 1
        sizes = [opener, *best_fill(span - opener, left, count, FILL_SEARCH_BACKTRACKS)]
        count[opener] += 1
        members = []
        for n in sizes:
            members.append(order[nxt[n]])
            nxt[n] += 1
            count[n] -= 1
            if not count[n]:
                del left[bisect.bisect_left(left, n)]
        bins.append(members)
    return bins


def packed_windows(doc_starts: np.ndarray, num_tokens: int, span: int) -> PackedWindows:
    """Best-fit packing of whole documents (document_pieces) into windows of at most `span` tokens.

    Packed in blocks of consecutive documents (PACK_BLOCK_WINDOWS windows' worth of tokens), so a
    window's documents lie near each other in the shards (few reads in object storage) and the
    sort stays small; the last windows of a block are the only ones left part empty."""
    starts, ends = document_pieces(doc_starts, num_tokens, span)
    lengths = ends - starts
    block = np.cumsum(lengths) // (PACK_BLOCK_WINDOWS * span)
    edges = np.flatnonzero(np.diff(block)) + 1
    first, order = [0], []
    for lo, hi in zip(np.concatenate([[0], edges]).tolist(), np.concatenate([edges, [len(lengths)]]).tolist()):
        for members in best_fit(lengths[lo:hi], span):
            order.extend(lo + j for j in sorted(members))  # stream order inside a window
            first.append(len(order))
    order = np.asarray(order, dtype=np.int64)
    return PackedWindows(np.asarray(first, dtype=np.int64), starts[order], ends[order])


class TokenStream:
    """Iterator of (inputs, targets) LongTensors [micro_batch_size, seq_len] for one DP rank,
    or with document masking (inputs, targets, document_ids) (see the module docstring).

    Infinite: epochs follow one another (see `epoch`). Tensor-parallel ranks of
    one DP group pass the same dp_rank and get identical batches.
    `shard_dir` is one shard directory, or a mixture: [(dir, weight), ...]; a directory may be
    an object-store URI (remote.py: read window by window, with read-ahead and a cache of at most
    `cache_bytes`, 0 = the read-ahead only), which yields exactly what the same shards on disk do.
    """

    def __init__(
        self,
        shard_dir,
        split: str = "train",
        *,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        prefetch: int = 2,
        expected_tokenizer_hash: str | None = None,
        shuffle: bool = True,
        document_masking: bool | None = None,
        cache_bytes: int = 0,
    ):
        for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("dp_size", dp_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TokenStream: {name} must be a positive integer, got {value!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"TokenStream: dp_rank {dp_rank} not in [0, {dp_size})")
        if prefetch < 0:
            raise ValueError(f"TokenStream: prefetch must be >= 0, got {prefetch}")
        if cache_bytes < 0:
            raise ValueError(f"TokenStream: cache_bytes must be >= 0, got {cache_bytes}")
        mixture = isinstance(shard_dir, (list, tuple))  # [(dir, weight), ...] (corpus.prepare_sources)
        sources = [(path, float(weight)) for path, weight in shard_dir] if mixture else [(shard_dir, 1.0)]
        if not sources:
            raise DataError("data.sources: empty list")
        self.source_weights = [w for _, w in sources]  # as data.sources gives them (the blend normalises)
        self.blend = Blend(self.source_weights)
        # One cache for the sources in object storage (its fetch threads start when one is asked for).
        self.cache = WindowCache(cache_bytes)
        self.sources: list[ShardSet] = []
        self.windows: list[PackedWindows] = []  # per source, with document masking
        instruction = []
        try:
            for path, _ in sources:
                self.sources.append(ShardSet(path, split, expected_tokenizer_hash, self.cache))
                instruction.append(self.sources[-1].records != "text")
            first = self.sources[0]
            other = next((s for s in self.sources if s.tokenizer_hash != first.tokenizer_hash), None)
            if other is not None:
                raise DataError(
                    f"data.sources: {other.dir} was made by tokenizer {other.tokenizer_hash}, "
                    f"{first.dir} by {first.tokenizer_hash}; all sources must share one tokenizer"
                )
            self.document_masking = any(instruction) if document_masking is None else bool(document_masking)
            if self.document_masking:
                for s, whole in zip(self.sources, instruction):
                    self.windows.append(self._pack(s, seq_len + 1, must_fit=whole))
                self.source_samples = [len(w) for w in self.windows]
            else:
                self.source_samples = [(s.num_tokens - 1) // seq_len if s.num_tokens else 0 for s in self.sources]
            for s, n in zip(self.sources, self.source_samples):
                if n <= 0:
                    hint = "; re-run `loomtrain preprocess` with a larger --val-fraction" if split == "val" else ""
                    raise DataError(
                        f"{s.dir}: split {split!r} has {s.num_tokens} tokens, "
                        f"fewer than one sample of seq_len + 1 = {seq_len + 1}{hint}"
                    )
        except BaseException:
            for s in self.sources:
                s.close()
            self.cache.close()
            raise
        self.reads_ahead = any(not s.local for s in self.sources)  # windows fetched before a batch asks
        self.split, self.seq_len, self.micro_batch_size, self.shuffle = split, seq_len, micro_batch_size, shuffle
        self.dp_rank, self.dp_size, self.seed, self.prefetch = dp_rank, dp_size, int(seed), prefetch
        self.tokenizer_hash = self.sources[0].tokenizer_hash
        self.loss_masked = any(s.mask is not None for s in self.sources)
        # One source: its samples; a mixture: all sources' together (each wraps on its own).
        self.samples_per_epoch = sum(self.source_samples)
        self.round_size = micro_batch_size * dp_size
        self._position = 0  # global position of the next round this rank yields
        self._samples_digest = 0  # of the samples yielded since take_samples_digest
        self._perms: dict[int, SeededPermutation] = {}
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        if self.reads_ahead:
            itemsize = max(s.dtype.itemsize for s in self.sources) + (1 if self.loss_masked else 0)
            batch_bytes = micro_batch_size * (seq_len + 1) * itemsize
            self._ahead_max = min(READ_AHEAD_BATCHES, max(1, cache_bytes // 2 // batch_bytes))
            if not cache_bytes:
                self._ahead_max = prefetch + 1
            self._reset_read_ahead()

    # Positions ----------------------------------------------------------
    @property
    def position(self) -> int:
        """Global samples consumed by all DP ranks together (a round boundary)."""
        return self._position

    @property
    def epoch(self) -> int:
        """Completed epochs; for a mixture, of the source that has completed fewest."""
        return min(int(c) // n for c, n in zip(self.blend.counts(self._position), self.source_samples))

    @property
    def tokens_per_epoch(self) -> int:
        return self.samples_per_epoch * self.seq_len

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """Global positions -> (source, sample index within that source's epoch)."""
        sources, local = self.blend(positions)
        out = np.empty_like(local)
        for k in np.unique(sources):
            sel = sources == k
            out[sel] = self._source_indices(int(k), local[sel])
        return sources, out

    def _source_indices(self, k: int, positions: np.ndarray) -> np.ndarray:
        epochs, pos = np.divmod(positions, self.source_samples[k])
        if not self.shuffle:
            return pos
        out = np.empty_like(pos)
        for e in np.unique(epochs):
            perm = self._perms.get((k, int(e)))
            if perm is None:
                perm = SeededPermutation(self.source_samples[k], self.seed, int(e), source=k)
                self._perms = {
                    (k, int(e)): perm,
                    **{key: v for key, v in self._perms.items() if key[0] != k or key[1] > e - 2},
                }
            sel = epochs == e
            out[sel] = perm(pos[sel])
        return out

    @staticmethod
    def _pack(shards: ShardSet, span: int, must_fit: bool) -> PackedWindows:
        """The source's packed windows; an instruction or chat record longer than a window is
        refused (cut, it would train on an answer without its question)."""
        starts = shards.doc_starts
        if must_fit and starts.size:
            lengths = np.diff(np.append(starts, shards.num_tokens))
            k = int(np.argmax(lengths))
            if lengths[k] > span:
                raise DataError(
                    f"{shards.dir}: record {k} of split {shards.split!r} is {int(lengths[k])} tokens, more than "
                    f"train.seq_len + 1 = {span}; re-run `loomtrain preprocess` with --seq-len {span - 1} (names "
                    f"such records by file and line; --truncate cuts them), or raise train.seq_len"
                )
        return packed_windows(starts, shards.num_tokens, span)

    def packed_rows(self, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Document masking: global positions -> (inputs, targets, document_ids), int64 [n, seq_len] each."""
        sources, idx = self.locate(positions)
        span = self.seq_len + 1
        n = len(idx)
        tokens = np.empty((n, span), dtype=np.int64)
        docs = np.empty((n, span), dtype=np.int64)
        target = np.zeros((n, span), dtype=bool)
        length = np.empty((n, 1), dtype=np.int64)
        for row, (k, i) in enumerate(zip(sources, idx)):
            src = self.sources[int(k)]
            at = 0
            for doc, (a, b) in enumerate(self.windows[int(k)].ranges(int(i))):  # one document each
                tokens[row, at : at + b - a] = src.read(a, b - a)
                target[row, at : at + b - a] = src.read_mask(a, b - a).astype(bool)
                docs[row, at : at + b - a] = doc
                at += b - a
            length[row] = at
            tokens[row, at:] = src.eos_id  # padding
            docs[row, at:] = docs[row, at - 1] + 1
        # A target counts when it is a target in the shards, inside a document and not padding.
        keep = target[:, 1:] & (docs[:, 1:] == docs[:, :-1]) & (np.arange(1, span) < length)
        targets = np.where(keep, tokens[:, 1:], IGNORE_INDEX)
        return tokens[:, :-1], targets, docs[:, :-1]

    def rows(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """Global positions -> (int64 [n, seq_len + 1] token rows, source of each row)."""
        sources, idx = self.locate(positions)
        span = self.seq_len + 1
        rows = [self.sources[int(k)].read(int(i) * self.seq_len, span) for k, i in zip(sources, idx)]
        return np.stack(rows).astype(np.int64), sources

    def rank_positions(self, round_start: int) -> np.ndarray:
        start = round_start + self.dp_rank * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size, dtype=np.int64)

    def sample_ids(self, positions) -> np.ndarray:
        """Each position's sample as one uint64: (source, that source's epoch, index in the
        epoch). The same sample has the same id whatever DP size or rank read it."""
        sources, local = self.blend(positions)
        epochs = local // np.asarray(self.source_samples, dtype=np.int64)[sources]
        _, index = self.locate(positions)
        u = np.uint64
        return (sources.astype(u) << u(56)) | (epochs.astype(u) << u(36)) | index.astype(u)

    # Read-ahead (shards in object storage) ----------------------------------
    def _reset_read_ahead(self) -> None:
        self._ahead_to = None  # the first round whose windows are not asked for yet
        self._ahead_batches = min(self._ahead_max, self.prefetch + 1)

    def _read_ahead(self, round_start: int) -> None:
        """Ask for the windows of this rank's rounds [round_start, + read-ahead) not asked for yet:
        the same token and mask ranges _batch reads, so its reads find them."""
        end = round_start + self._ahead_batches * self.round_size
        start = round_start if self._ahead_to is None or self._ahead_to < round_start else self._ahead_to
        for r in range(start, end, self.round_size):
            sources, idx = self.locate(self.rank_positions(r))
            for k, i in zip(sources.tolist(), idx.tolist()):
                src = self.sources[k]
                if self.document_masking:
                    for a, b in self.windows[k].ranges(i):
                        src.prefetch(a, b - a)
                        src.prefetch_mask(a, b - a)
                else:
                    src.prefetch(i * self.seq_len, self.seq_len + 1)
                    if self.loss_masked:
                        src.prefetch_mask(i * self.seq_len + 1, self.seq_len)
        self._ahead_to = max(end, start)
        self._ahead_batches = min(self._ahead_max, 2 * self._ahead_batches)

    def _batch(self, round_start: int):
        """(inputs, targets[, document_ids]) of this rank's micro batch, and the digest of its sample ids."""
        if self.reads_ahead:
            self._read_ahead(round_start)
        positions = self.rank_positions(round_start)
        digest = int((_mix64(self.sample_ids(positions)) >> np.uint64(SAMPLE_DIGEST_SHIFT)).sum(dtype=np.uint64))
        if self.document_masking:
            return tuple(torch.from_numpy(a) for a in self.packed_rows(positions)), digest
        rows, sources = self.rows(positions)
        block = torch.from_numpy(rows)
        targets = block[:, 1:].contiguous()
        if self.loss_masked:  # plain windows of masked records: the prompt tokens are no targets
            for row, (k, i) in enumerate(zip(sources, self.locate(positions)[1])):
                keep = self.sources[int(k)].read_mask(int(i) * self.seq_len + 1, self.seq_len)
                targets[row, torch.from_numpy(keep == 0)] = IGNORE_INDEX
        return (block[:, :-1].contiguous(), targets), digest

    def take_samples_digest(self) -> int:
        """The sum of the digests of every sample this rank yielded since the last call.

        A sum (of each sample's 40-bit hash), so that DP ranks' parts add up to the same figure
        for the same global batch whatever the DP size."""
        digest, self._samples_digest = self._samples_digest, 0
        return digest

    # Iteration with background prefetch ---------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self.prefetch == 0:
            batch, digest = self._batch(self._position)
        else:
            if self._thread is None:
                self._start()
            position, item = self._queue.get()
            if isinstance(item, BaseException):
                self._thread = None
                raise item
            assert position == self._position, (position, self._position)
            batch, digest = item
        self._position += self.round_size
        self._samples_digest += digest
        return batch

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        # The thread holds only a weak reference, so a stream dropped without
        # close() is still collected (and its thread stopped by __del__).
        self._thread = threading.Thread(
            target=TokenStream._produce,
            args=(weakref.ref(self), self._position, self.round_size, self._stop, self._queue),
            name=f"TokenStream-prefetch-dp{self.dp_rank}",
            daemon=True,
        )
        self._thread.start()

    @staticmethod
    def _produce(ref, position: int, step: int, stop: threading.Event, q: queue.Queue) -> None:
        # Batches are a pure function of position, so producing them ahead in a
        # thread cannot change what the consumer sees.
        while not stop.is_set():
            stream = ref()
            if stream is None:
                return
            try:
                item = (position, stream._batch(position))
            except BaseException as exc:  # hand the error to the consumer
                item = (position, exc)
            del stream
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item[1], BaseException):
                return
            position += step

    def _halt(self) -> None:
        thread, self._thread, self._queue = self._thread, None, None
        if thread is not None:
            self._stop.set()
            if thread is not threading.current_thread():
                thread.join()
        if self.reads_ahead:
            self.cache.drop_ahead()
            self._reset_read_ahead()

    def close(self) -> None:
        self._halt()
        for s in self.sources:
            s.close()
        self.cache.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._halt()
        except Exception:
            pass

    # State ---------------------------------------------------------------
    def _mixture_state(self) -> dict | None:
        if len(self.sources) == 1:
            return None
        return {
            "quotas": self.blend.quotas.tolist(),
            "samples_per_epoch": list(self.source_samples),
            # What data.sources said, for the line that refuses a resume with other sources.
            "sources": [{"path": str(s.dir), "weight": w} for s, w in zip(self.sources, self.source_weights)],
        }

    def state_dict(self) -> dict:
        state = {
            "version": STATE_VERSION,
            "global_position": self._position,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.seq_len,
            "samples_per_epoch": self.samples_per_epoch,
            "split": self.split,
            "tokenizer_hash": self.tokenizer_hash,
        }
        if self.document_masking:  # another sample layout: a state of one is no position in the other
            state["document_masking"] = True
            state["packing"] = PACKING
        if len(self.sources) > 1:
            state["mixture"] = self._mixture_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data state version {state.get('version')!r} is not supported (expected {STATE_VERSION})")
        packing = state.get("packing", "next-fit") if state.get("document_masking") else None
        if self.document_masking and packing not in (None, PACKING):
            raise DataError(
                f"cannot resume the data stream: the checkpoint's documents were packed {packing} (an earlier "
                f"loomtrain), this one packs them {PACKING}, so its positions are other samples; start afresh "
                "with checkpoint.resume=never (earlier checkpoints are set aside) or another run.dir"
            )
        change = mixture_change(state.get("mixture"), self._mixture_state())
        if change:
            raise DataError(
                f"cannot resume the data stream: data.sources differs from the run's checkpoint: {change}; "
                "to resume, keep the data.sources the run started with; to train on the new mixture, start "
                "afresh with checkpoint.resume=never (earlier checkpoints are set aside) or another run.dir"
            )
        mine = {**self.state_dict(), "document_masking": self.document_masking}  # False as well
        for key in ("seed", "shuffle", "seq_len", "samples_per_epoch", "tokenizer_hash", "split", "document_masking"):
            if state.get(key, False if key == "document_masking" else None) != mine[key]:
                raise DataError(
                    f"cannot resume the data stream: the saved state has {key}={state.get(key)!r}, this stream has "
                    f"{key}={mine[key]!r}"
                )
        position = int(state["global_position"])
        if position < 0 or position % self.round_size:
            raise DataError(
                f"cannot resume the data stream at global position {position}: not a round boundary for "
                f"micro_batch_size {self.micro_batch_size} x dp_size {self.dp_size} = {self.round_size} "
                f"(choose a DP size whose micro_batch_size x dp_size divides {position})"
            )
        self._halt()
        self._position = position


def mixture_change(saved: dict | None, now: dict | None) -> str | None:
    """How the mixture a stream state was saved with (TokenStream._mixture_state; None: one source)
    differs from this stream's, in data.sources terms; None when the blend is the same (same
    quotas and samples per source: weights 3:7 and 0.3:0.7 are one mixture)."""
    keys = ("quotas", "samples_per_epoch")
    if saved == now or (saved and now and all(saved.get(k) == now.get(k) for k in keys)):
        return None
    if saved is None or now is None:
        had = "one source (data.path)" if saved is None else f"{len(saved['quotas'])} sources"
        has = "one source" if now is None else f"{len(now['quotas'])}"
        return f"the run read {had}, data.sources now lists {has}"
    before, after = _described_sources(saved), _described_sources(now)
    if len(before) != len(after):
        return f"the run read {len(before)} sources, data.sources now lists {len(after)}"
    paths_before, paths_after = [d["path"] for d in before], [d["path"] for d in after]
    known = None not in paths_before  # states saved before paths were kept name sources by position
    if known and paths_before != paths_after and sorted(paths_before) == sorted(paths_after):
        return f"the same sources in another order: was [{', '.join(paths_before)}], now [{', '.join(paths_after)}]"
    changes = []
    for k, (b, a) in enumerate(zip(before, after)):
        if known and b["path"] != a["path"]:
            changes.append(f"data.sources[{k}].path was {b['path']}, now {a['path']}")
        elif b["samples"] != a["samples"]:
            changes.append(f"data.sources[{k}] ({a['path']}) held {b['samples']} samples, now {a['samples']}")
        elif b["share"] != a["share"]:
            changes.append(f"data.sources[{k}].weight was {b['weight']}, now {a['weight']}")
    return "; ".join(changes) or f"the blend was {saved['quotas']} of {Blend.PERIOD}, now {now['quotas']}"


def _described_sources(mixture: dict) -> list[dict]:
    """Per source: path (None in a state saved before paths were kept), weight as given with its
    share of the blend (the share alone in such a state), quota, samples per epoch."""
    given = mixture.get("sources") or [{} for _ in mixture["quotas"]]
    out = []
    for quota, samples, src in zip(mixture["quotas"], mixture["samples_per_epoch"], given):
        share = f"{quota / Blend.PERIOD:.1%} of the samples"
        weight = f"{src['weight']:g} ({share})" if "weight" in src else share
        out.append({"path": src.get("path"), "weight": weight, "share": quota, "samples": samples})
    return out


__all__ = ["TokenStream", "SeededPermutation"]
