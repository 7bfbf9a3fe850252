"""Which keys each query sees, described in O(T), and attention that applies it block by block.

A `MaskSpec` holds the queries' and the keys' positions in their window ([Tq], [Tk]) and, for
packed documents, their document ids ([B, Tq], [B, Tk]): O(T) numbers instead of the dense
[B, 1, T, T] mask (1 GiB a sequence at T = 32,768). Query i sees key j when
k_pos[j] <= q_pos[i], q_pos[i] - k_pos[j] < window (with a sliding window) and both are in the
same document. Positions are positions in the window, never the per-document ones (RoPE's):
a key's distance inside its document is the same either way.

`blocked_attention` applies it: the queries in blocks of `rows`, each block's mask built from
the description ([B, 1, rows, keys]), over only the keys its causal and window bounds reach,
through SDPA; the backward recomputes each block's scores (nothing of size T x T is saved), as
FlashAttention does. Memory for the mask is O(rows x T), not O(T^2).

Why not FlexAttention: torch 2.13 refuses its backward on CPU ("FlexAttention does not support
backward on CPU"), eager and compiled alike (measured here); on a GPU its block masks would be the
faster choice, chosen in `Attention` and nowhere else.

A slice of a window (`WindowSlice`: context parallelism hands a rank two chunks of each
sequence) keeps the whole window's document ids in `window_docs`, so the keys of the whole
window (`whole_window`, once an exchange brought them) are described too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .positions import alibi_bias, document_positions

# Bytes of float32 scores a query block may take ([B, H, rows, keys]): 32 MiB.
_BLOCK_BYTES = 32 << 20


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """bool [Tq, Tk]: True where the query at position q_pos[i] may attend the key at k_pos[j]:
    k <= q, and with a window q - window < k (the last `window` keys, itself included)."""
    dist = q_pos[:, None] - k_pos[None, :]
    allowed = dist >= 0
    if window is not None:
        allowed &= dist < window
    return allowed


@dataclass(frozen=True)
class WindowSlice:
    """Tokens that are part of a longer window: `index` [Tl] their positions in it (ascending),
    `length` the window's length. Handed to `Transformer.forward(window_slice=...)`."""

    index: torch.Tensor
    length: int


@dataclass(eq=False)
class MaskSpec:
    q_pos: torch.Tensor  # [Tq] long, ascending
    k_pos: torch.Tensor  # [Tk] long, ascending
    q_docs: torch.Tensor | None = None  # [B, Tq]
    k_docs: torch.Tensor | None = None  # [B, Tk]
    window_docs: torch.Tensor | None = None  # [B, window length]: the whole window's ids
    window_len: int | None = None  # set when the queries are a slice of a longer window
    q_doc_start: torch.Tensor | None = None  # [B, Tq]: where each query's document starts in the window
    _bounds: dict = field(default_factory=dict, repr=False)  # (rows, window) -> key ranges, shared by layers

    @classmethod
    def for_tokens(cls, t: int, device, document_ids=None, window_slice: WindowSlice | None = None) -> MaskSpec:
        """The mask of a forward over t tokens: the whole window (document_ids [B, t] or None), or
        a slice of it (document_ids then the whole window's [B, window_slice.length])."""
        starts = None
        if document_ids is not None:  # keys before a query's document are never seen: not visited
            width = document_ids.shape[1]
            starts = torch.arange(width, device=device) - document_positions(document_ids)
        if window_slice is None:
            pos = torch.arange(t, device=device)
            return cls(pos, pos, document_ids, document_ids, q_doc_start=starts)
        idx = window_slice.index.to(device)
        docs = None if document_ids is None else document_ids[:, idx]
        starts = None if starts is None else starts[:, idx]
        return cls(idx, idx, docs, docs, document_ids, window_slice.length, starts)

    @property
    def sliced(self) -> bool:
        return self.window_len is not None

    @property
    def plain(self) -> bool:
        """One whole window without documents: SDPA's is_causal says it (the window aside)."""
        return not self.sliced and self.q_docs is None

    def whole_window(self) -> MaskSpec:
        """The same queries against every key of the window, in window order."""
        k_pos = torch.arange(self.window_len, device=self.q_pos.device)
        return MaskSpec(
            self.q_pos, k_pos, self.q_docs, self.window_docs, self.window_docs, self.window_len, self.q_doc_start
        )

    def allowed(self, s: int, e: int, ks: int, ke: int, window: int | None) -> torch.Tensor:
        """bool [B or 1, 1, e - s, ke - ks]: queries s:e against keys ks:ke."""
        ok = causal_mask(self.q_pos[s:e], self.k_pos[ks:ke], window)[None, None]
        if self.q_docs is not None:
            ok = ok & (self.q_docs[:, None, s:e, None] == self.k_docs[:, None, None, ks:ke])
        return ok

    def dense(self, window: int | None) -> torch.Tensor:
        return self.allowed(0, len(self.q_pos), 0, len(self.k_pos), window)

    def key_bounds(self, rows: int, window: int | None) -> list[tuple[int, int, int, int]]:
        """[(s, e, ks, ke)]: each query block and the keys its causal, window and document bounds
        reach (keys ascending). Computed once per forward (one read of O(T / rows) numbers), shared
        by every layer."""
        key = (rows, window)
        if key not in self._bounds:
            tq = len(self.q_pos)
            starts = list(range(0, tq, rows))
            ends = [min(s + rows, tq) for s in starts]
            q_max = torch.stack([self.q_pos[s:e].max() for s, e in zip(starts, ends)])
            q_min = torch.stack([self.q_pos[s:e].min() for s, e in zip(starts, ends)])
            hi = torch.searchsorted(self.k_pos, q_max, right=True)
            first = q_min - window + 1 if window is not None else torch.zeros_like(q_min)
            if self.q_doc_start is not None:
                doc = torch.stack([self.q_doc_start[:, s:e].min() for s, e in zip(starts, ends)])
                first = torch.maximum(first, doc)
            lo = torch.searchsorted(self.k_pos, first)
            bounds = torch.stack([lo, hi]).tolist()
            self._bounds[key] = [(s, e, a, b) for s, e, a, b in zip(starts, ends, *bounds)]
        return self._bounds[key]


def block_rows(batch: int, heads: int, keys: int) -> int:
    return max(16, _BLOCK_BYTES // max(1, 4 * batch * heads * keys))


def _block_mask(spec, s, e, ks, ke, window, slopes, dtype):
    ok = spec.allowed(s, e, ks, ke, window)
    if slopes is None:
        return ok
    bias = alibi_bias(slopes.to(dtype), spec.q_pos[s:e], spec.k_pos[ks:ke])  # [H, rows, keys]
    return bias.masked_fill(~ok, float("-inf"))


class _Blocked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec, window, slopes, gqa, rows):
        out = torch.empty_like(q)
        for s, e, ks, ke in spec.key_bounds(rows, window):
            m = _block_mask(spec, s, e, ks, ke, window, slopes, q.dtype)
            out[:, :, s:e] = F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, ks:ke], v[:, :, ks:ke], attn_mask=m, enable_gqa=gqa
            )
        ctx.save_for_backward(q, k, v)
        ctx.args = (spec, window, slopes, gqa, rows)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        spec, window, slopes, gqa, rows = ctx.args
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s, e, ks, ke in spec.key_bounds(rows, window):
            m = _block_mask(spec, s, e, ks, ke, window, slopes, q.dtype)
            with torch.enable_grad():
                qb = q[:, :, s:e].detach().requires_grad_()
                kb = k[:, :, ks:ke].detach().requires_grad_()
                vb = v[:, :, ks:ke].detach().requires_grad_()
                ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, enable_gqa=gqa)
                gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), grad[:, :, s:e])
            dq[:, :, s:e] = gq
            dk[:, :, ks:ke] += gk
            dv[:, :, ks:ke] += gv
        return dq, dk, dv, None, None, None, None, None


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: MaskSpec,
    window: int | None = None,
    slopes: torch.Tensor | None = None,
    gqa: bool = False,
    rows: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [B, H, Tq, D] over k, v [B, Hkv, Tk, D] as `spec` describes (window,
    ALiBi slopes [H] optional); equals SDPA with `spec.dense(window)` in value and gradients."""
    rows = rows or block_rows(q.shape[0], q.shape[1], k.shape[2])
    return _Blocked.apply(q, k, v, spec, window, slopes, gqa, rows)


def leave_out_of_compile() -> None:
    """torch.compile traces around `blocked_attention`, never into it: its Python loop over query
    blocks runs eagerly (a graph break at the call). Called by whoever compiles (parallel.compile),
    not at import: `torch.compiler.disable` imports torch._dynamo, 1-2 s of every process's
    start-up, compiled or not."""
    global blocked_attention
    if not hasattr(blocked_attention, "_torchdynamo_disable"):
        blocked_attention = torch.compiler.disable(blocked_attention)
