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
positives seen from the columns (:func:`flashcl.engine.positives.column_spec`): the diagonal, or
with labels every row of the same label (``pos_mode="mean"``: their mean).

:mod:`flashcl.engine.positives` turns the configuration into the engine's form
(:mod:`flashcl.engine`): a softmax head and a positive (linear) term. The
reference backend (:mod:`flashcl.reference`) reads the configuration directly:
this module imports nothing of the engine, so that the oracle shares no code
with what it checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["Tile", "Exclusions"]


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
            (:class:`~flashcl.core.Exclusions`: per-row columns, or a mask function).
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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a computation on ``dtype`` inputs accumulates in: float32 for half
    and bfloat16, else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(frozen=True)
class Tile:
    """Rows ``r0:r1`` and columns ``c0:c1`` of the problem's score matrix.

    ``offset``: column of anchor 0 (the self column of row ``i`` is ``i + offset``): the
    self entries ``(i, i + offset)`` lie on the tile's diagonal
    ``r0 + offset - c0`` (``tensor.diagonal(offset=...)``), empty when none is in it.
    """

    r0: int
    r1: int
    c0: int
    c1: int
    offset: int = 0

    def self_diagonal(self, t: Tensor) -> Tensor:
        """The view of the self entries ``(i, i + offset)`` in ``t``, a tensor of this
        tile's shape (empty when none is in the tile)."""
        return t.diagonal(offset=self.r0 + self.offset - self.c0)

    def transposed(self) -> Tile:
        """The same entries seen from the columns: for self-contrast (rows and
        columns are the same samples, offset 0), tile ``(c, r)`` of the transposed
        scores is tile ``(c, r)`` of the problem, since ``s_ji = s_ij``."""
        return Tile(self.c0, self.c1, self.r0, self.r1, -self.offset)


class Exclusions:
    """Entries left out of each row's denominator, beyond the self entry: per-row
    columns ``index`` (M, k) (a key that is the anchor itself in a queue, a positive
    kept out of the denominator), and/or ``fn(tile) -> bool mask`` of the tile's
    entries to leave out (same-label keys, a guide model's false negatives).

    Args:
        index: (M, k) or (M,) int64 columns, -1 for none; or None.
        fn: a function of a :class:`Tile` returning a (rows, cols) boolean mask; or None.
    """

    def __init__(self, index: Optional[Tensor] = None, fn: Optional[Any] = None) -> None:
        self.index, self.fn = index, fn
