"""The core on a given score matrix (the sampled-neighbours loss): its dense form
(:func:`dense_rows`) and its head on the engine's given-matrix road
(:class:`NeighborHead`, run by :func:`~flashcl.engine.given.run_given`).

``neighbor_loss`` gets an n x n matrix that already exists and whose gradient is n x n
too: the engine hands the head blocks of complete rows, and each block's gradient is
formed in the one n x n tensor that becomes ``scores.grad`` (during the forward pass
when the loss is reduced to a scalar): nothing else of that size is allocated. Its
create-graph path (second derivatives) is the dense formula (:func:`dense_rows`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..core import CoreSpec, Tile, compute_dtype
from ..engine.heads import Head, mask_self_
from ..engine.positives import row_weights, self_mask

__all__ = ["NeighborHead", "auto_scores_block", "dense_rows"]


def auto_scores_block(n: int) -> int:
    """Rows per block for a given score matrix: about 4M entries (16 MB of
    float32). Few large elementwise ops measured faster on the 2-core CPU than
    L2-sized blocks, whose per-op overhead dominates (n = 2000: one 2000-row
    block 5.1 ms, 131-row blocks 7.1 ms)."""
    return max(1, min(n, (1 << 22) // max(1, n)))


class _NeighborState:
    """Each row's log-sum-exp and positive sum, the weights ``(c, a)`` of the two, and
    the upstream gradient."""

    def __init__(self, spec: CoreSpec, m: int, like: Tensor) -> None:
        self.lse, self.pos = like.new_empty(m), like.new_empty(m)
        self.c, self.a = (w.to(like.device) for w in row_weights(spec, m, like.dtype))
        self.g_row: Optional[Tensor] = None


class NeighborHead(Head):
    """The core's head on complete rows of a given score matrix, its positives sampled
    columns (``spec.index``, (M, k), repeats allowed; the tiles' offset is ``spec.offset``)::

        loss_i = c_i * LSE_{j != i} s_ij - a_i * sum_t s_{i, index[i, t]}

    A hand-written gradient: the masked softmax times ``c_i`` with ``-a_i`` scattered at
    each sampled column, formed in the tile itself. Kept for its measure against the same
    head as its dense form alone (an :class:`~flashcl.engine.heads.AutogradHead`), n =
    20,000, k = 2, float32, forward and backward on the 2-core CPU: 0.9-1.0 s with 0-8 MB
    beyond the gradient, against 2.2-2.7 s with 140-170 MB."""

    fuses_rows = True

    def __init__(self, spec: CoreSpec) -> None:
        if spec.index is None:
            raise ValueError("NeighborHead takes positives as sampled columns (spec.index)")
        self.spec = spec

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _NeighborState:
        return _NeighborState(self.spec, m, like)

    def _masked_exp_(self, s: Tensor, tile: Tile, st: _NeighborState) -> Tensor:
        """In place: ``s <- exp(s - max)`` over each row's denominator (the self entry 0,
        the shift the rows' masked maxima, so that nothing overflows and the largest term
        is 1); the rows' log-sum-exp into the state; returns their sums (rows, 1)."""
        if self.spec.exclude_self:
            mask_self_(s, tile, float("-inf"))
        mx = s.amax(1, keepdim=True)
        mx.masked_fill_(mx.abs() == float("inf"), 0.0)  # as torch.logsumexp: a row of -inf, or one with +inf
        total = s.sub_(mx).exp_().sum(1, keepdim=True)
        st.lse[tile.r0 : tile.r1] = mx.add_(total.log()).squeeze(1)
        return total

    def _grad_(self, e: Tensor, tile: Tile, st: _NeighborState, lse_coef: Tensor, g: Tensor) -> Tensor:
        """In place: ``e`` (the rows' masked exp, each over ``lse_coef``'s divisor) becomes
        ``dL/ds``: ``lse_coef * e``, less ``g * a`` at each sampled column."""
        rows = slice(tile.r0, tile.r1)
        idx = self.spec.index[rows]  # type: ignore[index]
        e.mul_(lse_coef)
        return e.scatter_add_(1, idx, (-(g * st.a[rows])).to(e.dtype).unsqueeze(1).expand_as(idx))

    def rows_fused(self, s: Tensor, tile: Tile, st: _NeighborState, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        st.pos[rows] = s.gather(1, self.spec.index[rows]).sum(1)  # type: ignore[index]
        total = self._masked_exp_(s, tile, st)
        if g_row is None:
            return None
        g = g_row[rows]
        return self._grad_(s, tile, st, (g * st.c[rows]).unsqueeze(1) / total, g)

    def reduce(self, s: Tensor, tile: Tile, st: _NeighborState, p: int = 0) -> None:
        self.rows_fused(s, tile, st, None)

    def values(self, st: _NeighborState) -> Tuple[Tensor, Optional[Tensor]]:
        return st.c * st.lse - st.a * st.pos, None

    def grad(self, s: Tensor, tile: Tile, st: _NeighborState, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        rows = slice(tile.r0, tile.r1)
        s.sub_(st.lse[rows].unsqueeze(1))
        if self.spec.exclude_self:
            mask_self_(s, tile, float("-inf"))
        g = st.g_row[rows]
        return self._grad_(s.exp_(), tile, st, (g * st.c[rows]).unsqueeze(1), g)

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        return dense_rows(s, self.spec), None


def dense_rows(scores: Tensor, spec: CoreSpec) -> Tensor:
    """Row losses (M,) of the core on the score matrix ``scores`` (M, N), by
    differentiable torch ops on the whole matrix (the dense backend)."""
    scores = scores.to(compute_dtype(scores.dtype))
    m, n = scores.shape
    lse_in = scores
    if spec.exclude_self:
        lse_in = scores.masked_fill(self_mask(spec, m, n, scores.device), float("-inf"))
    lse = torch.logsumexp(lse_in, dim=1)
    if spec.index is not None:
        pos_sum = scores.gather(1, spec.index).sum(1)
    else:
        assert spec.row_labels is not None and spec.col_labels is not None
        pos = spec.row_labels.unsqueeze(1) == spec.col_labels.unsqueeze(0)
        if spec.self_pairs:
            pos &= ~self_mask(spec, m, n, scores.device)
        # where(), not scores * pos: a masked -inf or NaN must not leak into
        # rows that do not select it.
        pos_sum = torch.where(pos, scores, torch.zeros((), dtype=scores.dtype, device=scores.device)).sum(1)
    c, a = row_weights(spec, m, scores.dtype)
    return c * lse - a * pos_sum
