"""The one masked-softmax core that every flashcl loss is a configuration of.

For anchors ``Q`` (M x D) and candidates ``K`` (N x D), scores
``s_ij = scale * q_i . k_j`` (rows L2-normalised when ``normalize``), and for
every anchor row ``i``::

    loss_i = c_i * LSE_{j in Den(i)} s_ij  -  a_i * sum_{j in Pos(i)} m_ij * s_ij

* ``Den(i)`` is every column, or every column but ``i + offset`` (``exclude_self``).
* ``Pos(i)`` comes from class ids (``labels``: same class, never the anchor
  itself when ``self_pairs``) or from explicit column indices (``index``,
  repeats count as multiplicities ``m_ij``).
* ``c_i, a_i`` follow from ``pos_mode`` and ``|Pos(i)|`` (with multiplicity):

  ============  =========  ===========  ==========================================
  pos_mode      c_i        a_i          used by
  ============  =========  ===========  ==========================================
  ``"mean"``    1          1/|Pos(i)|   SupCon L_out (anchors with no positive: 0)
  ``"sum"``     1          1            supervised SimCSE (positives summed)
  ``"pairs"``   |Pos(i)|   1            one cross-entropy per positive pair
                                        (the sampled-neighbours loss)
  ============  =========  ===========  ==========================================

``both_directions`` adds the column direction of CLIP: for every column ``j``,
``col_loss_j = LSE_i s_ij - a'_j sum_{i in Pos'(j)} s_ij`` (M == N), with the
positives seen from the columns (:meth:`CoreSpec.column_spec`): the diagonal, or
with labels every row of the same label (``pos_mode="mean"``: their mean).

:meth:`CoreSpec.problem` turns the configuration into the engine's form
(:mod:`flashcl.engine`): a softmax head and a positive (linear) term; the
reference backend (:mod:`flashcl.reference`) reads the spec directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .engine import Problem
from .heads import Exclusions, SoftmaxHead
from .positives import Positives, PositiveTerm
from .utils import compute_dtype

POS_MODES = ("mean", "sum", "pairs")


@dataclass(frozen=True, eq=False)
class CoreSpec:
    """Configuration of the core; tensors in it are constants (never differentiated).

    Attributes:
        exclude_self: drop column ``i + offset`` from the denominator of row ``i``.
        self_pairs: column ``i + offset`` is anchor ``i`` itself, so it is never a
            positive of row ``i``.
        offset: column of anchor 0 (non-zero when the anchors are a slice of the
            candidates, as on one rank of a distributed batch).
        row_labels, col_labels: class ids in ``[0, num_classes)``, shapes (M,), (N,).
        num_classes: number of distinct ids when labels are given.
        index: (M, k) int64 positive columns, or None.
        pos_mode: ``"mean"``, ``"sum"`` or ``"pairs"`` (see the module docstring).
        both_directions: add the column direction (CLIP): positives the diagonal ``index``,
            or labels.
        normalize: L2-normalise the rows of Q and K first.
        self_index: (M,) the column of each anchor itself when it is not
            ``i + offset`` (a queue's slot of the anchor), -1 for none; it is left out
            of the denominator (``exclude_self``) and of the positives (``self_pairs``).
        exclude: further entries out of the denominators
            (:class:`~flashcl.heads.Exclusions`: per-row columns, or a mask function).
        positive_weight: (M,) a factor on each row's positive term (decoupled DCLW's
            weights), or None.
    """

    exclude_self: bool = False
    self_pairs: bool = False
    offset: int = 0
    row_labels: Optional[Tensor] = None
    col_labels: Optional[Tensor] = None
    num_classes: int = 0
    index: Optional[Tensor] = None
    pos_mode: str = "sum"
    both_directions: bool = False
    normalize: bool = True
    self_index: Optional[Tensor] = None
    exclude: Optional[Exclusions] = None
    positive_weight: Optional[Tensor] = None

    def self_column(self, i: int) -> int:
        """The column of anchor ``i`` itself (may lie outside the candidates)."""
        return int(self.self_index[i]) if self.self_index is not None else i + self.offset

    def self_mask(self, m: int, n: int, device: torch.device) -> Tensor:
        """(m, n) bool: True at the column of each anchor itself."""
        cols = self.self_index if self.self_index is not None else torch.arange(m, device=device) + self.offset
        return cols.to(device).unsqueeze(1) == torch.arange(n, device=device).unsqueeze(0)

    def positive_counts(self, m: int) -> Tensor:
        """|Pos(i)| with multiplicity, shape (m,), int64; computed in O(M + N)."""
        n = self.col_labels.shape[0] if self.col_labels is not None else 0
        return self.positives().counts(m, n)

    def weights(self, m: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """The per-row weights ``(c, a)`` of the LSE term and of the positive sum."""
        counts = self.positive_counts(m).to(dtype)
        ones = torch.ones_like(counts)
        if self.pos_mode == "mean":
            has = counts > 0
            return has.to(dtype), torch.where(has, 1.0 / counts.clamp_min(1), torch.zeros_like(counts))
        if self.pos_mode == "pairs":
            return counts, ones
        return ones, ones

    def valid_rows(self, m: int) -> Tensor:
        """Rows that take part in a ``"mean"`` reduction: all, except rows without
        a positive under ``pos_mode="mean"`` (their term is undefined)."""
        if self.pos_mode == "mean":
            return self.positive_counts(m) > 0
        return torch.ones(m, dtype=torch.bool, device=self._device())

    def _device(self) -> torch.device:
        for t in (self.index, self.row_labels):
            if t is not None:
                return t.device
        return torch.device("cpu")

    def positives(self) -> Positives:
        return Positives(
            index=self.index,
            row_labels=self.row_labels,
            col_labels=self.col_labels,
            num_classes=self.num_classes,
            self_pairs=self.self_pairs,
            offset=self.offset,
            self_index=self.self_index,
        )

    def column_spec(self) -> CoreSpec:
        """The column direction of ``both_directions`` seen from the columns: the same
        positives with rows and columns swapped (the diagonal stays the diagonal)."""
        return CoreSpec(
            row_labels=self.col_labels,
            col_labels=self.row_labels,
            num_classes=self.num_classes,
            index=self.index,
            pos_mode=self.pos_mode,
            normalize=self.normalize,
        )

    def problem(self, m: int, n: int, dtype: torch.dtype) -> Problem:
        """The engine's form: a :class:`~flashcl.heads.SoftmaxHead` with the LSE weights
        ``c`` and the positive term ``-a_i sum_j m_ij s_ij`` (for ``both_directions``, the
        column direction's positive term too: ``-s_jj``, or with labels the mean of
        column ``j``'s same-label scores)."""
        c, a = self.weights(m, dtype)
        if self.positive_weight is not None:
            a = a * self.positive_weight
        head = SoftmaxHead(
            c,
            exclude_self=self.exclude_self,
            offset=self.offset,
            columns=self.both_directions,
            self_index=self.self_index,
            exclude=self.exclude,
        )
        linears = [PositiveTerm(self.positives(), a)]
        if self.both_directions:
            cols = self.column_spec()
            linears.append(PositiveTerm(cols.positives(), cols.weights(n, dtype)[1], target="col"))
        return Problem(head, tuple(linears), self.normalize, self.offset)


def prepare(q: Tensor, k: Optional[Tensor], normalize: bool) -> Tuple[Tensor, Tensor]:
    """Cast to the compute dtype and L2-normalise rows (autograd-tracked, never in
    place); ``k=None`` means ``k = q`` (normalised once)."""
    dtype = compute_dtype(q.dtype)
    q = q.to(dtype)
    same = k is None
    k = q if k is None else k.to(dtype)
    if normalize:
        q = F.normalize(q, dim=1)
        k = q if same else F.normalize(k, dim=1)
    return q, k
