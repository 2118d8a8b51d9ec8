"""The reference backend: per-anchor loops, as a loss is first written by hand.

Slow (a Python loop over anchors and over their positives) and obviously
correct: it is the oracle that every other backend is tested against, and the
"naive" line of the benchmarks. It counts each anchor's positives itself rather
than trusting :meth:`CoreSpec.weights`, so that it checks that code too.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .core import CoreSpec, prepare
from .utils import compute_dtype


def _row_loss(sims: Tensor, i: int, spec: CoreSpec) -> Tensor:
    """Loss of anchor ``i`` from its row of scores ``sims`` (N,)."""
    n = sims.shape[0]
    den: List[int] = [j for j in range(n) if not (spec.exclude_self and j == i + spec.offset)]
    lse = torch.logsumexp(sims[den], dim=0)
    pos_sum = sims.new_zeros(())
    count = 0
    if spec.index is not None:
        for j in spec.index[i].tolist():
            pos_sum = pos_sum + sims[j]
            count += 1
    else:
        assert spec.row_labels is not None and spec.col_labels is not None
        yi = int(spec.row_labels[i])
        for j in range(n):
            if int(spec.col_labels[j]) == yi and not (spec.self_pairs and j == i + spec.offset):
                pos_sum = pos_sum + sims[j]
                count += 1
    if spec.pos_mode == "mean":
        if count == 0:
            return 0.0 * lse  # undefined term: 0, but still part of the graph
        return lse - pos_sum / count
    if spec.pos_mode == "pairs":
        return count * lse - pos_sum
    return lse - pos_sum


def core_loss(q: Tensor, k: Optional[Tensor], scale: Tensor, spec: CoreSpec) -> Tuple[Tensor, Optional[Tensor]]:
    """Row losses (M,) and, for ``spec.symmetric``, column losses (N,); ``k=None`` means ``k = q``."""
    q, k = prepare(q, k, spec.normalize)
    scale = scale.to(q.dtype)
    rows = []
    for i in range(q.shape[0]):
        sims = (k @ q[i]) * scale
        rows.append(_row_loss(sims, i, spec))
    row_loss = torch.stack(rows)
    col_loss = None
    if spec.symmetric:
        col_spec = spec.column_spec()
        col_loss = torch.stack([_row_loss((q @ k[j]) * scale, j, col_spec) for j in range(k.shape[0])])
    return row_loss, col_loss


def scores_loss(scores: Tensor, spec: CoreSpec) -> Tensor:
    """Row losses (n,) of the core on a given score matrix, one row at a time."""
    scores = scores.to(compute_dtype(scores.dtype))
    return torch.stack([_row_loss(scores[i], i, spec) for i in range(scores.shape[0])])


def siglip_loss(q: Tensor, k: Tensor, scale: Tensor, bias: Tensor, labels: Optional[Tensor],
                normalize: bool) -> Tensor:
    """Per-image SigLIP losses (B,), one image at a time: ``sum_j -log sigmoid(z_ij
    (scale q_i . k_j + bias))`` with ``z_ij = +1`` for the matching pairs (the
    diagonal, or the same label), -1 elsewhere."""
    q, k = prepare(q, k, normalize)
    rows = []
    for i in range(q.shape[0]):
        logits = (k @ q[i]) * scale.to(q.dtype) + bias.to(q.dtype)
        if labels is None:
            z = -torch.ones_like(logits)
            z[i] = 1.0
        else:
            z = torch.where(labels == labels[i], 1.0, -1.0).to(q.dtype)
        rows.append(-torch.nn.functional.logsigmoid(z * logits).sum())
    return torch.stack(rows)
