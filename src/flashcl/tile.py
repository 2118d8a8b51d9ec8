"""A tile of a loss's score matrix: which rows and columns it covers. The one type
that the engine, the heads, the masks a loss computes from its data, and the
reference backend all speak."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

__all__ = ["Tile", "Exclusions"]


@dataclass(frozen=True)
class Tile:
    """Rows ``r0:r1`` and columns ``c0:c1`` of the problem's score matrix.

    ``offset``: column of anchor 0 (the self column of row ``i`` is ``i + offset``).
    """

    r0: int
    r1: int
    c0: int
    c1: int
    offset: int = 0

    @property
    def self_diagonal(self) -> int:
        """The diagonal of the tile (``tensor.diagonal(offset=...)``) that holds
        the self entries ``(i, i + offset)``; it is empty when none is in the tile."""
        return self.r0 + self.offset - self.c0

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
