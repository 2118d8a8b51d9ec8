"""The dense backend: the vectorised form, which materialises the M x N matrix.

The second seed's ``vectorized_supervised_simcse_loss`` generalised, and made
stable: excluded entries are masked to ``-inf`` before a logsumexp (never
``sum(exp) - exp(diag)``). Fast for small batches; memory O(M N).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .core import CoreSpec, compute_dtype, prepare

ReduceWeights = Optional[Tuple[Tensor, Optional[Tensor]]]


def scores_loss(scores: Tensor, spec: CoreSpec) -> Tensor:
    """Row losses (M,) of the core on the score matrix ``scores`` (M, N)."""
    scores = scores.to(compute_dtype(scores.dtype))
    m, n = scores.shape
    lse_in = scores
    if spec.exclude_self:
        lse_in = scores.masked_fill(spec.self_mask(m, n, scores.device), float("-inf"))
    lse = torch.logsumexp(lse_in, dim=1)
    if spec.index is not None:
        pos_sum = scores.gather(1, spec.index).sum(1)
    else:
        assert spec.row_labels is not None and spec.col_labels is not None
        pos = spec.row_labels.unsqueeze(1) == spec.col_labels.unsqueeze(0)
        if spec.self_pairs:
            pos &= ~spec.self_mask(m, n, scores.device)
        # where(), not scores * pos: a masked -inf or NaN must not leak into
        # rows that do not select it.
        pos_sum = torch.where(pos, scores, torch.zeros((), dtype=scores.dtype, device=scores.device)).sum(1)
    c, a = spec.weights(m, scores.dtype)
    return c * lse - a * pos_sum


def core_loss(q: Tensor, k: Optional[Tensor], scale: Tensor, spec: CoreSpec) -> Tuple[Tensor, Optional[Tensor]]:
    """Row losses (M,) and, for ``spec.symmetric``, column losses (N,); ``k=None`` means ``k = q``."""
    q, k = prepare(q, k, spec.normalize)
    scores = (q @ k.T) * scale.to(q.dtype)
    row_loss = scores_loss(scores, spec)
    col_loss = None
    if spec.symmetric:
        col_loss = torch.logsumexp(scores, dim=0) - scores.diagonal()
    return row_loss, col_loss


def core_output(q: Tensor, k: Optional[Tensor], scale: Tensor, spec: CoreSpec, reduce_weights: ReduceWeights) -> Tensor:
    """What the fast backends' Functions return, by the dense formula: the row
    losses (with the column losses appended for ``spec.symmetric``), or
    ``sum r * row + sum u * col`` for ``reduce_weights = (r, u)``."""
    row, col = core_loss(q, k, scale, spec)
    if reduce_weights is None:
        return row if col is None else torch.cat([row, col])
    r, u = reduce_weights
    out = (r * row).sum()
    if col is not None:
        assert u is not None
        out = out + (u * col).sum()
    return out


def scores_output(scores: Tensor, spec: CoreSpec, reduce_weights: Optional[Tensor]) -> Tensor:
    """:func:`scores_loss`, reduced with weights ``r`` when given."""
    row = scores_loss(scores, spec)
    return row if reduce_weights is None else (reduce_weights * row).sum()
