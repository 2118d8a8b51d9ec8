"""The dense backend: the vectorised form, which materialises the M x N matrix.

For losses of embeddings it is :func:`flashcl.engine.dense_values`: the whole
score matrix as one tile, the head's differentiable formula
(:meth:`flashcl.heads.Head.dense`) and the positives gathered from it,
differentiated by autograd. Fast for small batches; memory O(M N). Excluded
entries are masked to ``-inf`` before a logsumexp (never ``sum(exp) - exp(diag)``).

This module holds its form for a given score matrix (the sampled-neighbours loss).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .core import CoreSpec
from .utils import compute_dtype

__all__ = ["scores_loss", "scores_output"]


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


def scores_output(scores: Tensor, spec: CoreSpec, reduce_weights: Optional[Tensor]) -> Tensor:
    """:func:`scores_loss`, reduced with weights ``r`` when given."""
    row = scores_loss(scores, spec)
    return row if reduce_weights is None else (reduce_weights * row).sum()
