"""PositiveTerm terms of a loss: ``sum_j m_ij s_ij``, computed in embedding space.

A positive term is bilinear in the embeddings: for labels it is
``q^_i . (sum of the k^_j of i's class)``, for explicit column indices a gather
of ``k^`` rows, so that neither it nor its gradient needs the M x N matrix:
O((M + N) D) work and memory.

:class:`Positives` says which pairs ``(i, j)`` are positive, with multiplicity
``m_ij``: same class id (``labels``; never the anchor itself when
``self_pairs``), or the columns ``index[i]`` (repeats count). A
:class:`PositiveTerm` term adds ``-weight_i * sum_j m_ij s_ij`` to row ``i``'s loss
(or, ``target="col"``, ``-weight_j * sum_i m_ji s_ij`` to column ``j``'s, with the
positives given from the columns' side: CLIP's column direction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..core import CoreSpec, Tile

__all__ = [
    "RowScaled",
    "rows_dtype",
    "Positives",
    "PositiveTerm",
    "class_sums",
    "positives",
    "positive_counts",
    "row_weights",
    "valid_rows",
    "self_mask",
    "column_spec",
    "one_positive",
    "single_positives",
]


Rows = Any  # a Tensor or a RowScaled


class RowScaled:
    """Rows of ``x`` times ``s``, made on demand (``rows[i:j]``, ``rows[index]``):
    normalised embeddings without a copy of the raw ones."""

    def __init__(self, x: Tensor, s: Tensor) -> None:
        self.x, self.s, self.shape = x, s, x.shape

    def __getitem__(self, idx: Any) -> Tensor:
        return self.x[idx] * self.s[idx].unsqueeze(-1)


def raw_rows(rows: Rows) -> Tuple[Tensor, Optional[Tensor]]:
    """(the tensor behind rows, the row scale or None)."""
    return (rows.x, rows.s) if isinstance(rows, RowScaled) else (rows, None)


def rows_dtype(rows: Rows) -> torch.dtype:
    """The dtype of ``rows``' blocks: a :class:`RowScaled` of half-precision rows and
    float32 scales gives float32 blocks."""
    raw, inv = raw_rows(rows)
    return raw.dtype if inv is None else torch.promote_types(raw.dtype, inv.dtype)


#: ``class_sums(x, ids, num_classes, block, weight)``: sum of the rows of x (times
#: weight) per class id, (num_classes, D). The distributed ring swaps in a version
#: that adds every rank's rows.
ClassSums = Callable[[Rows, Tensor, int, int, Optional[Tensor]], Tensor]


def class_sums(x: Rows, ids: Tensor, num_classes: int, block: int, weight: Optional[Tensor] = None) -> Tensor:
    """Sum of the rows of x (times weight) per class id: (num_classes, D), in row
    blocks so that no temporary of x's size is made."""
    out = raw_rows(x)[0].new_zeros(num_classes, x.shape[1], dtype=rows_dtype(x))
    for r0 in range(0, x.shape[0], block):
        rows = x[r0 : r0 + block]
        out.index_add_(0, ids[r0 : r0 + block], rows if weight is None else rows * weight[r0 : r0 + block].unsqueeze(1))
    return out


@dataclass(frozen=True, eq=False)
class Positives:
    """Which pairs are positive; tensors in it are constants.

    Attributes:
        index: (M, k) int64 positive columns (repeats count), or None.
        row_labels, col_labels: class ids in ``[0, num_classes)``, (M,) and (N,).
        num_classes: number of class ids.
        self_pairs: column ``i + offset`` (or ``self_index[i]``) is anchor ``i`` itself,
            never its positive.
        offset: column of anchor 0.
        self_index: (M,) the column of each anchor itself, when not ``i + offset``
            (a queue's slot of the anchor); -1 for none.
    """

    index: Optional[Tensor] = None
    row_labels: Optional[Tensor] = None
    col_labels: Optional[Tensor] = None
    num_classes: int = 0
    self_pairs: bool = False
    offset: int = 0
    self_index: Optional[Tensor] = None

    def self_hits(self) -> Tensor:
        """(M,) bool: rows whose own column (``self_index``) is a same-label column."""
        assert self.self_index is not None and self.row_labels is not None and self.col_labels is not None
        valid = self.self_index >= 0
        own = self.col_labels[self.self_index.clamp_min(0)]
        return valid & (own == self.row_labels)

    def counts(self, m: int, n: int) -> Tensor:
        """|Pos(i)| with multiplicity, (m,) int64, in O(M + N)."""
        if self.index is not None:
            return torch.full((m,), self.index.shape[1], dtype=torch.int64, device=self.index.device)
        assert self.row_labels is not None and self.col_labels is not None
        counts = torch.bincount(self.col_labels, minlength=self.num_classes)[self.row_labels]
        if self.self_pairs and self.self_index is not None:
            return counts - self.self_hits().to(counts.dtype)
        if self.self_pairs:
            cols = torch.arange(m, device=counts.device) + self.offset
            counts = counts - ((cols >= 0) & (cols < n)).to(counts.dtype)
        return counts

    def self_rows(self, r0: int, r1: int, n: int) -> Tuple[int, int]:
        """Rows [a, b) of the block [r0, r1) whose own column i + offset lies in [0, n)."""
        a = min(max(r0, -self.offset), r1)
        b = max(min(r1, n - self.offset), a)
        return a, b

    def sums(self, q: Tensor, k: Tensor) -> Tensor:
        """``sum_j m_ij q_i . k_j`` per row (M,) by differentiable torch ops in
        embedding space (class sums of ``k`` for labels, a gather for indices): the
        positive term of losses composed of several parts."""
        if self.index is not None:
            return (q.unsqueeze(1) * k[self.index]).sum(-1).sum(1)
        assert self.row_labels is not None and self.col_labels is not None
        sums = torch.zeros(self.num_classes, k.shape[1], dtype=k.dtype, device=k.device).index_add(
            0, self.col_labels, k
        )
        out = (q * sums[self.row_labels]).sum(1)
        if self.self_pairs:
            own = (
                self.self_index
                if self.self_index is not None
                else (torch.arange(q.shape[0], device=q.device) + self.offset)
            )
            valid = (own >= 0) & (own < k.shape[0])
            valid = valid & (self.col_labels[own.clamp(0, k.shape[0] - 1)] == self.row_labels)
            out = out - torch.where(valid, (q * k[own.clamp(0, k.shape[0] - 1)]).sum(1), torch.zeros_like(out))
        return out

    def mask(self, r0: int, r1: int, c0: int, c1: int, device: torch.device) -> Tensor:
        """(r1 - r0, c1 - c0) multiplicities ``m_ij`` of a tile (for dense forms and tests)."""
        if self.index is not None:
            out = torch.zeros(r1 - r0, c1 - c0, device=device)
            idx = self.index[r0:r1] - c0
            inside = (idx >= 0) & (idx < c1 - c0)
            out.scatter_add_(1, idx.clamp(0, max(c1 - c0 - 1, 0)), inside.to(out.dtype))
            return out
        assert self.row_labels is not None and self.col_labels is not None
        pos = self.row_labels[r0:r1].unsqueeze(1) == self.col_labels[c0:c1].unsqueeze(0)
        if self.self_pairs and self.self_index is not None:
            rows = torch.arange(r0, r1, device=device)
            cols = self.self_index[r0:r1] - c0
            inside = (self.self_index[r0:r1] >= 0) & (cols >= 0) & (cols < c1 - c0)
            pos[(rows - r0)[inside], cols[inside]] = False
        elif self.self_pairs:
            Tile(r0, r1, c0, c1, self.offset).self_diagonal(pos).fill_(False)
        return pos.to(torch.float32)


@dataclass(frozen=True, eq=False)
class PositiveTerm:
    """``-weight_i * sum_j m_ij s_ij`` added to row ``i``'s loss (``target="row"``), or
    ``-weight_j * sum_i m_ji s_ij`` to column ``j``'s (``target="col"``: the positives
    and the weights are given from the columns' side, and the engine computes the
    term with the two sides swapped)."""

    positives: Positives
    weight: Tensor
    target: str = "row"

    def raw(self, q: Rows, k: Rows, block: int, sums: ClassSums = class_sums) -> Tensor:
        """``sum_j m_ij q^_i . k^_j`` per anchor (M,), without the M x N matrix."""
        pos = self.positives
        m, n = q.shape[0], k.shape[0]
        out = raw_rows(q)[0].new_empty(m, dtype=rows_dtype(q))
        k_sums = None
        if pos.index is None:
            assert pos.row_labels is not None and pos.col_labels is not None
            k_sums = sums(k, pos.col_labels, pos.num_classes, block, None)
        for r0 in range(0, m, block):
            r1 = min(r0 + block, m)
            qb = q[r0:r1]
            if k_sums is None:
                assert pos.index is not None
                out[r0:r1] = torch.einsum("bd,bkd->b", qb, k[pos.index[r0:r1]])
                continue
            assert pos.row_labels is not None
            out[r0:r1] = (qb * k_sums[pos.row_labels[r0:r1]]).sum(1)
            if pos.self_pairs and pos.self_index is None:
                a, b = pos.self_rows(r0, r1, n)
                out[a:b] -= (q[a:b] * k[a + pos.offset : b + pos.offset]).sum(1)
        if pos.self_pairs and pos.self_index is not None:
            rows = pos.self_hits().nonzero().squeeze(1)
            if rows.numel():
                out[rows] -= (q[rows] * k[pos.self_index[rows]]).sum(1)
        return out

    def grad_(
        self,
        q: Rows,
        k: Rows,
        scale: float,
        w: Tensor,
        dq: Tensor,
        dk: Tensor,
        block: int,
        sums: ClassSums = class_sums,
    ) -> None:
        """Adds the gradient of ``-sum_i w_i sum_j m_ij s_ij`` (``s = scale q^.k^``) to
        dq, dk (gradients with respect to the normalised rows; dk may be dq): the rows'
        side (:meth:`grad_rows_`) a block at a time, then the columns' (:meth:`grad_cols_`)."""
        k_sums = self.column_sums(k, block, sums)
        for r0 in range(0, q.shape[0], block):
            r1 = min(r0 + block, q.shape[0])
            self.grad_rows_(k, scale, w[r0:r1], dq[r0:r1], r0, k_sums)
        self.grad_cols_(q, k, scale, w, dk, block, sums)

    def column_sums(self, k: Rows, block: int, sums: ClassSums = class_sums) -> Optional[Tensor]:
        """What :meth:`grad_rows_` reads of the columns once: each class's sum of ``k^``
        (labels), or None (explicit columns)."""
        pos = self.positives
        if pos.index is not None:
            return None
        assert pos.col_labels is not None
        return sums(k, pos.col_labels, pos.num_classes, block, None)

    def grad_rows_(self, k: Rows, scale: float, w: Tensor, out: Tensor, r0: int, k_sums: Optional[Tensor]) -> None:
        """The rows' side of the gradient, of the rows ``r0 .. r0 + len(out)`` into ``out``
        (``w``: their weights): ``-scale w_i sum_j m_ij k^_j``. A row's part is whole here
        (the columns' side adds to the columns' gradient only), so that a driver whose
        stripes hold every column can complete each row's gradient in its stripe."""
        pos = self.positives
        r1, n = r0 + out.shape[0], k.shape[0]
        if pos.index is not None:
            out.add_(k[pos.index[r0:r1]].sum(1) * (w * -scale).unsqueeze(1))
            return
        assert pos.row_labels is not None and k_sums is not None
        out.sub_(k_sums[pos.row_labels[r0:r1]] * (w * scale).unsqueeze(1))
        if pos.self_pairs and pos.self_index is not None:
            rows = pos.self_hits()[r0:r1].nonzero().squeeze(1)
            if rows.numel():
                out.index_add_(0, rows, k[pos.self_index[r0:r1][rows]] * (w[rows] * scale).unsqueeze(1))
        elif pos.self_pairs:
            a, b = pos.self_rows(r0, r1, n)
            out[a - r0 : b - r0].add_(k[a + pos.offset : b + pos.offset] * (w[a - r0 : b - r0] * scale).unsqueeze(1))

    def grad_cols_(
        self, q: Rows, k: Rows, scale: float, w: Tensor, dk: Tensor, block: int, sums: ClassSums = class_sums
    ) -> None:
        """The columns' side of the gradient into ``dk``: ``-scale sum_i w_i m_ij q^_i``."""
        pos = self.positives
        m, n = q.shape[0], k.shape[0]
        if pos.index is not None:
            kk = pos.index.shape[1]
            for r0 in range(0, m, block):
                r1 = min(r0 + block, m)
                wb = (w[r0:r1] * -scale).unsqueeze(1)
                dk.index_add_(0, pos.index[r0:r1].reshape(-1), (q[r0:r1] * wb).repeat_interleave(kk, dim=0))
            return
        assert pos.row_labels is not None and pos.col_labels is not None
        wq_sums = sums(q, pos.row_labels, pos.num_classes, block, w)
        for c0 in range(0, n, block):
            c1 = min(c0 + block, n)
            dk[c0:c1].sub_(wq_sums[pos.col_labels[c0:c1]], alpha=scale)
        if pos.self_pairs and pos.self_index is not None:
            rows = pos.self_hits().nonzero().squeeze(1)
            if rows.numel():
                dk.index_add_(0, pos.self_index[rows], q[rows] * (w[rows] * scale).unsqueeze(1))
        elif pos.self_pairs:
            for r0 in range(0, m, block):
                a, b = pos.self_rows(r0, min(r0 + block, m), n)
                dk[a + pos.offset : b + pos.offset].add_(q[a:b] * (w[a:b] * scale).unsqueeze(1))

    def dense(self, s: Tensor) -> Tensor:
        """``sum_j m_ij s_ij`` per row from the whole score matrix, by differentiable ops."""
        pos = self.positives
        if pos.index is not None:
            return s.gather(1, pos.index).sum(1)
        m, n = s.shape
        mask = pos.mask(0, m, 0, n, s.device) > 0
        # where(), not s * mask: a masked -inf or NaN must not leak into rows that do not select it
        return torch.where(mask, s, torch.zeros((), dtype=s.dtype, device=s.device)).sum(1)


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


def one_positive(pos: Positives, m: int, n: int, keep: bool = False) -> Optional[Tensor]:
    """Each row's one positive column, -1 for a row with none or several (or one outside
    ``[0, n)``): one explicit column per row, or the one other column of a row's label
    (SimCLR's views as SupCon's classes); None for several explicit columns per row, and
    for labels where no row has exactly one unless ``keep`` (across processes: whether
    there are pivots may not depend on one rank's rows)."""
    if pos.index is not None:
        if pos.index.dim() != 2 or pos.index.shape[1] != 1:
            return None
        col = pos.index[:, 0]
        return torch.where((col >= 0) & (col < n), col, torch.full_like(col, -1))
    if pos.row_labels is None or pos.col_labels is None:
        return None
    single = pos.counts(m, n) == 1
    if not keep and not bool(single.any()):
        return None
    if m == 0 or n == 0:
        return torch.full((m,), -1, dtype=torch.long, device=pos.row_labels.device)
    # a class's first and last column: a row with one positive takes the one that is not its own column
    cols = torch.arange(n, device=pos.col_labels.device)
    first = torch.full((pos.num_classes,), n, dtype=torch.long, device=cols.device).scatter_reduce(
        0, pos.col_labels, cols, "amin"
    )
    last = torch.full((pos.num_classes,), -1, dtype=torch.long, device=cols.device).scatter_reduce(
        0, pos.col_labels, cols, "amax"
    )
    own = torch.full((m,), -1, dtype=torch.long, device=cols.device)
    if pos.self_pairs:
        own = pos.self_index if pos.self_index is not None else torch.arange(m, device=cols.device) + pos.offset
    a, b = first[pos.row_labels], last[pos.row_labels]
    col = torch.where(a == own, b, a)
    return torch.where(single, col, torch.full_like(col, -1))


def single_positives(
    spec: CoreSpec, m: int, n: int, a: Tensor, a_col: Optional[Tensor], keep: bool = False
) -> Tuple[Optional[Tuple[Tensor, Tensor]], Optional[Tuple[Tensor, Tensor]]]:
    """The softmax head's pivots (:class:`~flashcl.engine.heads.SoftmaxHead`): each row's
    one positive column with its positive term's weight ``a``, taken into the head so
    that a dominant positive (a tiny loss) keeps its precision; none for a row with
    several positives, none where masks computed from the data might leave the positive
    out of the denominator, and none (with the column direction) where the columns'
    positives are not the same entries. ``keep``: see :func:`one_positive`."""
    rows = one_positive(positives(spec), m, n, keep)
    if rows is None or spec.exclude is not None:
        return None, None
    if spec.exclude_self:  # a positive that is the anchor itself is out of the denominator: no pivot there
        own = spec.self_index if spec.self_index is not None else torch.arange(m, device=rows.device) + spec.offset
        rows = torch.where(rows == own, torch.full_like(rows, -1), rows)
    if not spec.both_directions:
        return (rows, a), None
    cols = one_positive(positives(column_spec(spec)), n, m, keep)
    if cols is None or a_col is None or cols.shape[0] != n:
        return None, None
    # the same entries from both sides: row i's pivot is column j exactly where column j's is row i
    ids = torch.arange(m, device=rows.device)
    seen = rows >= 0
    if bool((cols[rows[seen]] != ids[seen]).any()) or int(seen.sum()) != int((cols >= 0).sum()):
        return None, None
    return (rows, a), (cols, a_col)
