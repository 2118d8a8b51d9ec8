"""Late interaction (ColBERT, ColPali): the MaxSim score matrix of token embeddings,
tile by tile, never the B x N x Lq x Ld token scores.

``s_ij = sum over the real tokens t of query i of max over the real tokens u of
document j of <q_it, d_ju>`` (or, with ``smooth=tau``, ``tau * logsumexp_u(. / tau)``
instead of the max). :class:`MaxSimScores` forms the (B, N) scores from one GEMM of
a block of query tokens against a block of document tokens at a time; its backward
recomputes each tile and routes each (query token, document) pair's gradient to its
winning document token: two gathers of O(B Lq N D) instead of two more token GEMMs
(with ``smooth``, the softmax over the document's tokens weighs every token: two
GEMMs). Memory: the (B, N) scores and one tile.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import Tile, compute_dtype
from ..engine.engine import FusedFunction
from ..engine.given import run_given
from ..engine.heads import Head

__all__ = [
    "MaxSimScores",
    "PairedMaxSimScores",
    "CrossEntropyHead",
    "cross_entropy_rows",
    "dense_scores",
    "paired_scores",
    "auto_blocks",
]

#: bytes of one tile of token scores (a block of query tokens x a block of document tokens)
TILE_BYTES = 8 * 2**20

#: the forward pass keeps each (query token, document) pair's winning token (int16) when
#: they fit in this many bytes: the backward then needs no second GEMM
WINNERS_BYTES = 64 * 2**20


def auto_blocks(lq: int, ld: int, n: int, itemsize: int = 4) -> Tuple[int, int]:
    """(queries, documents) per tile: about :data:`TILE_BYTES` of token scores, the
    document block as wide as it fits (up to every document) with at least 8 queries."""
    pair = max(1, lq * ld * itemsize)
    docs = max(1, min(n, TILE_BYTES // (8 * pair)))
    return max(1, TILE_BYTES // (pair * docs)), docs


def _tile(q: Tensor, d: Tensor, dmask: Optional[Tensor]) -> Tensor:
    """(b, Lq, n, Ld) token scores of a query block against a document block, the
    documents' padding tokens at -inf (``dmask`` None: every token is real)."""
    b, lq, dim = q.shape
    n, ld, _ = d.shape
    s = (q.reshape(b * lq, dim) @ d.reshape(n * ld, dim).T).view(b, lq, n, ld)
    return s if dmask is None else s.masked_fill_(~dmask.view(1, 1, n, ld), float("-inf"))


def _reduce(s: Tensor, smooth: Optional[float]) -> Tensor:
    """Each (query token, document) pair's max (or smooth max) over the document's tokens."""
    if smooth is None:
        return s.amax(dim=3)
    return smooth * torch.logsumexp(s / smooth, dim=3)


class MaxSimScores(FusedFunction):
    """``apply(q, d, qmask, dmask, smooth, blocks) -> s``: the (B, N) MaxSim scores in
    the compute dtype; ``qmask`` (B, Lq) in the compute dtype (1 for a real token, 0
    for padding) and ``dmask`` (N, Ld) bool. Ties in the max: the gradient goes to
    one winning token (``torch.argmax``'s: the first), one valid subgradient.
    Second derivatives go through :func:`dense_scores`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, d: Tensor, qmask: Tensor, dmask: Tensor, smooth: Optional[float], blocks: Tuple[int, int]
    ) -> Tensor:
        dtype = compute_dtype(q.dtype)
        bq, bd = blocks
        (b, lq, _), (n, ld, _) = q.shape, d.shape
        out = torch.empty(b, n, dtype=dtype, device=q.device)
        masks = None if bool(dmask.all()) else dmask
        keep = smooth is None and ld <= 2**15 and 2 * b * lq * n <= WINNERS_BYTES and any(ctx.needs_input_grad[:2])
        winners = torch.empty(b, lq, n, dtype=torch.int16, device=q.device) if keep else None
        for i0 in range(0, b, bq):
            qb = q[i0 : i0 + bq].to(dtype)
            pad = qmask[i0 : i0 + bq].unsqueeze(2) == 0  # a padding query token adds exactly 0 (even NaN)
            for j0 in range(0, n, bd):
                s = _tile(qb, d[j0 : j0 + bd].to(dtype), None if masks is None else masks[j0 : j0 + bd])
                if winners is None:
                    m = _reduce(s, smooth)
                else:
                    m, at = s.max(dim=3)
                    winners[i0 : i0 + bq, :, j0 : j0 + bd] = at
                out[i0 : i0 + bq, j0 : j0 + bd] = m.masked_fill_(pad, 0.0).sum(1)
        MaxSimScores.setup(ctx, (q, d), (qmask, dmask) if winners is None else (qmask, dmask, winners))
        ctx.smooth, ctx.blocks, ctx.all_real = smooth, blocks, masks is None
        return out

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        qmask, dmask = ctx.saved_tensors[2:4]
        return dense_scores(inputs[0], inputs[1], qmask, dmask, ctx.smooth)

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        q, d, qmask, dmask = saved[:4]
        winners = saved[4] if len(saved) > 4 else None
        dtype = compute_dtype(q.dtype)
        bq, bd = ctx.blocks
        if winners is not None:  # no GEMM to feed: smaller blocks keep the gathers' buffers small
            bd = max(1, bd // 4)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device) if ctx.needs_input_grad[0] else None
        dd = torch.zeros(d.shape, dtype=dtype, device=d.device) if ctx.needs_input_grad[1] else None
        grad = grad_out.to(dtype)
        for i0 in range(0, q.shape[0], bq):
            # padding query tokens as zeros: whatever they hold (NaN) sends nothing anywhere
            qb = q[i0 : i0 + bq].to(dtype).masked_fill(qmask[i0 : i0 + bq].unsqueeze(2) == 0, 0.0)
            b, lq, dim = qb.shape
            for j0 in range(0, d.shape[0], bd):
                db = d[j0 : j0 + bd].to(dtype)
                if not ctx.all_real:  # padding document tokens as zeros (they may hold NaN)
                    db = db.masked_fill(~dmask[j0 : j0 + bd].unsqueeze(2), 0.0)
                n, ld, _ = db.shape
                # each (query token, document) pair's weight dL/ds_ij; 0 for a padding query token
                g = grad[i0 : i0 + b, j0 : j0 + n].unsqueeze(1) * qmask[i0 : i0 + b].unsqueeze(2)
                if ctx.smooth is None:  # the winning token alone: gathers, not token GEMMs
                    if winners is not None:  # kept by the forward pass
                        at = winners[i0 : i0 + b, :, j0 : j0 + n].long()
                    else:
                        at = _tile(qb, db, None if ctx.all_real else dmask[j0 : j0 + bd]).argmax(dim=3)
                    rows = (at + torch.arange(n, device=q.device).view(1, 1, n) * ld).reshape(-1)
                    flat = db.reshape(n * ld, dim)
                    if dq is not None:
                        dq[i0 : i0 + b] += torch.einsum("btn,btnd->btd", g, flat[rows].view(b, lq, n, dim))
                    if dd is not None:
                        vals = (g.unsqueeze(3) * qb.unsqueeze(2)).reshape(-1, dim)
                        dd[j0 : j0 + n].view(n * ld, dim).index_add_(0, rows, vals)
                    continue
                s = _tile(qb, db, None if ctx.all_real else dmask[j0 : j0 + bd])
                w = torch.softmax(s.div_(ctx.smooth), dim=3).mul_(g.unsqueeze(3)).view(b * lq, n * ld)
                if dq is not None:
                    dq[i0 : i0 + b] += (w @ db.reshape(n * ld, dim)).view(b, lq, dim)
                if dd is not None:
                    dd[j0 : j0 + n] += (w.T @ qb.reshape(b * lq, dim)).view(n, ld, dim)
        return dq, dd


def dense_scores(q: Tensor, d: Tensor, qmask: Tensor, dmask: Tensor, smooth: Optional[float]) -> Tensor:
    """The same scores from the whole (B, Lq, N, Ld) token-score tensor (the ``"dense"``
    backend, as the peers write it; ``amax`` spreads a tied maximum's gradient equally
    over the tied tokens)."""
    dtype = compute_dtype(q.dtype)
    # padding tokens as zeros first: whatever they hold (NaN) reaches no value and no gradient
    q = q.to(dtype).masked_fill(qmask.unsqueeze(2) == 0, 0.0)
    d = d.to(dtype).masked_fill(~dmask.unsqueeze(2), 0.0)
    s = torch.einsum("btd,nud->btnu", q, d)
    s = s.masked_fill(~dmask.view(1, 1, *dmask.shape), float("-inf"))
    return _reduce(s, smooth).masked_fill(qmask.unsqueeze(2) == 0, 0.0).sum(1)


def paired_scores(q: Tensor, d: Tensor, qmask: Tensor, dmask: Tensor, smooth: Optional[float]) -> Tensor:
    """(b, n) MaxSim scores of each query against its own ``n`` documents: ``q`` (b, Lq,
    D), ``d`` (b, n, Ld, D), ``qmask`` (b, Lq) in the compute dtype, ``dmask`` (b, n, Ld)
    bool; from the (b, n, Lq, Ld) token scores (``amax``: a tied maximum's gradient
    spread equally over the tied tokens)."""
    dtype = compute_dtype(q.dtype)
    q = q.to(dtype).masked_fill(qmask.unsqueeze(2) == 0, 0.0)
    d = d.to(dtype).masked_fill(~dmask.unsqueeze(3), 0.0)
    s = torch.einsum("btd,bnud->bntu", q, d).masked_fill(~dmask.unsqueeze(2), float("-inf"))
    return _reduce(s, smooth).masked_fill(qmask.unsqueeze(1) == 0, 0.0).sum(2)


def paired_block(n: int, lq: int, ld: int, itemsize: int = 4) -> int:
    """Queries per block of :class:`PairedMaxSimScores`: about :data:`TILE_BYTES` of
    token scores."""
    return max(1, TILE_BYTES // max(1, n * lq * ld * itemsize))


class PairedMaxSimScores(FusedFunction):
    """``apply(q, d, qmask, dmask, smooth, block) -> s``: :func:`paired_scores` (each
    query against its own documents: distillation, hard negatives per query) a block
    of ``block`` queries at a time; the backward pass recomputes one block's token
    scores and differentiates them (memory: one block's (b, n, Lq, Ld) tile)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, d: Tensor, qmask: Tensor, dmask: Tensor, smooth: Optional[float], block: int
    ) -> Tensor:
        out = torch.empty(d.shape[:2], dtype=compute_dtype(q.dtype), device=q.device)
        for i0 in range(0, q.shape[0], block):
            c = slice(i0, i0 + block)
            out[c] = paired_scores(q[c], d[c], qmask[c], dmask[c], smooth)
        PairedMaxSimScores.setup(ctx, (q, d), (qmask, dmask))
        ctx.smooth, ctx.block = smooth, block
        return out

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        qmask, dmask = ctx.saved_tensors[2:4]
        return paired_scores(inputs[0], inputs[1], qmask, dmask, ctx.smooth)

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        q, d, qmask, dmask = saved
        needs = ctx.needs_input_grad[:2]
        dq = torch.zeros(q.shape, dtype=compute_dtype(q.dtype), device=q.device) if needs[0] else None
        dd = torch.zeros(d.shape, dtype=compute_dtype(d.dtype), device=d.device) if needs[1] else None
        for i0 in range(0, q.shape[0], ctx.block):
            c = slice(i0, i0 + ctx.block)
            with torch.enable_grad():
                qb = q[c].detach().requires_grad_(needs[0])
                db = d[c].detach().requires_grad_(needs[1])
                s = paired_scores(qb, db, qmask[c], dmask[c], ctx.smooth)
                leaves = [x for x, need in ((qb, needs[0]), (db, needs[1])) if need]
                grads = list(torch.autograd.grad(s, leaves, grad_out[c].to(s.dtype)))
            if dq is not None:
                dq[c] = grads.pop(0)
            if dd is not None:
                dd[c] = grads.pop(0)
        return dq, dd


#: rows per block of :class:`CrossEntropyHead`
CE_ROWS = 256


class _CrossEntropyState:
    """Each row's log-sum-exp and target score, the factors' gradient, the upstream one."""

    def __init__(self, m: int, like: Tensor) -> None:
        self.lse, self.target, self.df = like.new_empty(m), like.new_empty(m), like.new_zeros(m)
        self.g_row: Optional[Tensor] = None


class CrossEntropyHead(Head):
    """``LSE_j f_i s_ij - f_i s_i index[i]`` on blocks of complete rows of given (B, N)
    scores ``s`` (:func:`~flashcl.engine.given.run_given`), ``f`` (B,) per-row factors
    (an inverse temperature, over a query's token count for normalised scores): the
    head's learnable tensor where it requires a gradient (``params=(f,)``)."""

    fuses_rows = True

    def __init__(self, f: Tensor, index: Tensor) -> None:
        self.f, self.index, self.learns = f.detach(), index, f.requires_grad

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _CrossEntropyState:
        return _CrossEntropyState(m, like)

    def _scaled_(self, s: Tensor, tile: Tile, grad: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
        """In place, ``z = f s``; and, for a gradient, a copy of ``s`` where ``f`` learns (its gradient reads it)."""
        raw = s.clone() if grad and self.learns else None
        return s.mul_(self.f[tile.r0 : tile.r1].to(s.dtype).unsqueeze(1)), raw

    def _grad_(self, z: Tensor, raw: Optional[Tensor], tile: Tile, st: _CrossEntropyState, g: Tensor) -> Tensor:
        """In place, the rows' softmax ``p`` of ``z``, then ``dL/ds = g f (p - onehot)``;
        with a learnable ``f``, ``dL/df = g (sum_j p_ij s_ij - s_i index[i])`` into the state."""
        rows = slice(tile.r0, tile.r1)
        idx = self.index[rows].unsqueeze(1)
        p = z.sub_(st.lse[rows].unsqueeze(1)).exp_()
        if raw is not None:
            st.df[rows] = g * ((p * raw).sum(1) - raw.gather(1, idx)[:, 0])
        p.scatter_add_(1, idx, torch.full_like(p[:, :1], -1.0))
        return p.mul_((g * self.f[rows].to(p.dtype)).unsqueeze(1))

    def rows_fused(self, s: Tensor, tile: Tile, st: _CrossEntropyState, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        z, raw = self._scaled_(s, tile, g_row is not None)
        st.lse[rows] = torch.logsumexp(z, dim=1)
        st.target[rows] = z.gather(1, self.index[rows].unsqueeze(1))[:, 0]
        return None if g_row is None else self._grad_(z, raw, tile, st, g_row[rows])

    def reduce(self, s: Tensor, tile: Tile, st: _CrossEntropyState, p: int = 0) -> None:
        self.rows_fused(s, tile, st, None)

    def values(self, st: _CrossEntropyState) -> Tuple[Tensor, Optional[Tensor]]:
        return st.lse - st.target, None

    def grad(self, s: Tensor, tile: Tile, st: _CrossEntropyState, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        z, raw = self._scaled_(s, tile)
        return self._grad_(z, raw, tile, st, st.g_row[tile.r0 : tile.r1])

    def param_grads(self, st: _CrossEntropyState, n: int) -> Tuple[Optional[Tensor], ...]:
        return (st.df,) * n

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        f = params[0] if params else self.f
        z = s * f.to(s.dtype).unsqueeze(1)
        return torch.logsumexp(z, dim=1) - z.gather(1, self.index.unsqueeze(1))[:, 0], None


def cross_entropy_rows(s: Tensor, f: Tensor, index: Tensor) -> Tensor:
    """Each row's ``LSE_j f_i s_ij - f_i s_i index[i]`` (:class:`CrossEntropyHead`) for
    (B, N) scores ``s``, a block of rows at a time: no B x N tensor beyond the scores
    and, in the backward pass, their gradient."""
    one = torch.ones((), dtype=s.dtype, device=s.device)
    params = (f,) if f.requires_grad else ()
    return run_given(s, one, CrossEntropyHead(f, index), None, CE_ROWS, params)[0]
