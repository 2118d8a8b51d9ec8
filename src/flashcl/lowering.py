"""A :class:`~flashcl.core.CoreSpec` in the engine's form.

The configuration of the softmax core (:mod:`flashcl.core`) says which columns are
each anchor's positives and which leave its denominator; here it becomes what the
engine runs (:class:`~flashcl.engine.Problem`: a :class:`~flashcl.heads.SoftmaxHead`
and positive terms) and the per-row weights the reductions need. The reference
backend never comes here: it counts positives and forms each row's loss itself.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .core import CoreSpec
from .engine import Problem
from .heads import SoftmaxHead
from .positives import Positives, PositiveTerm

__all__ = ["positives", "positive_counts", "row_weights", "valid_rows", "problem", "self_mask", "column_spec"]


def positives(spec: CoreSpec) -> Positives:
    """The positive pairs of ``spec`` (explicit columns or shared labels), never as a mask."""
    return Positives(
        index=spec.index,
        row_labels=spec.row_labels,
        col_labels=spec.col_labels,
        num_classes=spec.num_classes,
        self_pairs=spec.self_pairs,
        offset=spec.offset,
        self_index=spec.self_index,
    )


def positive_counts(spec: CoreSpec, m: int) -> Tensor:
    """|Pos(i)| with multiplicity, shape (m,), int64; computed in O(M + N)."""
    n = spec.col_labels.shape[0] if spec.col_labels is not None else 0
    return positives(spec).counts(m, n)


def row_weights(spec: CoreSpec, m: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """The per-row weights ``(c, a)`` of the LSE term and of the positive sum."""
    counts = positive_counts(spec, m).to(dtype)
    ones = torch.ones_like(counts)
    if spec.pos_mode == "mean":
        has = counts > 0
        return has.to(dtype), torch.where(has, 1.0 / counts.clamp_min(1), torch.zeros_like(counts))
    if spec.pos_mode == "pairs":
        return counts, ones
    return ones, ones


def valid_rows(spec: CoreSpec, m: int) -> Tensor:
    """Rows that take part in a ``"mean"`` reduction: all, except rows without a
    positive under ``pos_mode="mean"`` (their term is undefined)."""
    if spec.pos_mode == "mean":
        return positive_counts(spec, m) > 0
    device = next((t.device for t in (spec.index, spec.row_labels) if t is not None), torch.device("cpu"))
    return torch.ones(m, dtype=torch.bool, device=device)


def problem(spec: CoreSpec, m: int, n: int, dtype: torch.dtype) -> Problem:
    """The engine's form: a :class:`~flashcl.heads.SoftmaxHead` with the LSE weights
    ``c`` and the positive term ``-a_i sum_j m_ij s_ij`` (for ``both_directions``, the
    column direction's positive term too: ``-s_jj``, or with labels the mean of
    column ``j``'s same-label scores)."""
    c, a = row_weights(spec, m, dtype)
    if spec.positive_weight is not None:
        a = a * spec.positive_weight
    head = SoftmaxHead(
        c,
        exclude_self=spec.exclude_self,
        offset=spec.offset,
        columns=spec.both_directions,
        self_index=spec.self_index,
        exclude=spec.exclude,
    )
    terms = [PositiveTerm(positives(spec), a)]
    if spec.both_directions:
        cols = column_spec(spec)
        terms.append(PositiveTerm(positives(cols), row_weights(cols, n, dtype)[1], target="col"))
    return Problem(head, tuple(terms), spec.normalize, spec.offset)


def self_mask(spec: CoreSpec, m: int, n: int, device: torch.device) -> Tensor:
    """(m, n) bool: True at the column of each anchor itself (a dense mask: for the
    paths that hold the whole score matrix)."""
    cols = spec.self_index if spec.self_index is not None else torch.arange(m, device=device) + spec.offset
    return cols.to(device).unsqueeze(1) == torch.arange(n, device=device).unsqueeze(0)


def column_spec(spec: CoreSpec) -> CoreSpec:
    """The column direction of ``both_directions`` seen from the columns: the same
    positives with rows and columns swapped (the diagonal ``index`` stays the
    diagonal; labels swap sides)."""
    return CoreSpec(
        row_labels=spec.col_labels,
        col_labels=spec.row_labels,
        num_classes=spec.num_classes,
        index=spec.index,
        pos_mode=spec.pos_mode,
        normalize=spec.normalize,
    )
