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
with what it checks. It also holds the calling convention of a flex loss's
functions (their views of a tile's anchors and keys, :class:`View`, and the check of
what they return, :func:`tile_result`), which the engine and the flex oracle share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import Tensor

__all__ = ["Tile", "Exclusions", "STATISTICS", "View", "tile_result"]


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


# ----------------------------------------------------------------------------- flex functions
# the calling convention of a flex loss's functions, shared by the engine and the oracle

#: the row statistics the functions may read as fields of ``a`` (self-contrast: of ``b`` too)
STATISTICS = ("hardest_positive", "hardest_negative", "positive_score")


class View:
    """A tile's anchors (``a``) or keys (``b``): the per-sample data's fields as attributes,
    each shaped (R, 1, ...) for the anchors and (1, C, ...) for the keys, and ``index``, their
    global positions (an int64 tensor of the same layout)."""

    __slots__ = ("_data", "_lo", "_hi", "_base", "_side", "_cache", "_owner", "_role")

    def __init__(self, data: Dict[str, Tensor], lo: int, hi: int, base: int, side: str, owner: str, role: str) -> None:
        # side: "a" lays the samples along the tile's rows (R, 1, ...), "b" along its columns (1, C, ...)
        self._data, self._lo, self._hi, self._base, self._side = data, lo, hi, base, side
        self._cache: Dict[str, Tensor] = {}
        self._owner, self._role = owner, role  # for the errors: "the anchors' data (rows=)", "a"

    def _shape(self, x: Tensor) -> Tensor:
        return x.unsqueeze(1) if self._side == "a" else x.unsqueeze(0)

    @property
    def index(self) -> Tensor:
        got = self._cache.get("index")
        if got is None:
            device = next(iter(self._data.values())).device if self._data else None
            got = self._shape(torch.arange(self._lo + self._base, self._hi + self._base, device=device))
            self._cache["index"] = got
        return got

    def __getattr__(self, name: str) -> Tensor:
        if name.startswith("_"):
            raise AttributeError(name)
        got = self._cache.get(name)
        if got is not None:
            return got
        if name in STATISTICS and name not in self._data:
            raise AttributeError(
                f"{self._role}.{name}: the row statistics are the anchors' (a.{name}), and the keys' "
                f"(b.{name}) with self-contrast only (keys=None); they are computed for a call whose functions "
                "read them when called on one pair"
            )
        if name not in self._data:
            fields = ", ".join(sorted(self._data)) or "none"
            raise AttributeError(
                f"{self._role}.{name}: no field {name!r} in {self._owner} (its fields: {fields}; every view has .index)"
            )
        got = self._shape(self._data[name][self._lo : self._hi])
        self._cache[name] = got
        return got


_MUST_RETURN = {
    "bool": "a bool tensor (True: the pair is out of every set)",
    "weight": "a bool or floating tensor (weights >= 0)",
    "float": "a floating tensor",
}


def tile_result(value: Any, name: str, rows: int, cols: int, like: Tensor, kind: str) -> Tensor:
    """A function's result checked against the tile: a tensor on the scores' device that
    broadcasts to (rows, cols) by torch's rules, of the dtype its role takes (``kind``:
    ``"bool"``, ``"weight"`` (bool or floating), ``"float"``); returned broadcast (a view).
    Every error names the function, the tile's shape and what it must return."""
    must = f"{name} must return {_MUST_RETURN[kind]} that broadcasts to the tile's pairs ({rows}, {cols})"
    if not isinstance(value, Tensor):
        if kind == "float" or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{must}, got {type(value).__name__}")
        value = torch.tensor(float(value), dtype=like.dtype, device=like.device)
    if value.device != like.device:
        raise ValueError(f"{must} on the scores' device ({like.device}), got a tensor on {value.device}")
    if (
        (kind == "bool" and value.dtype != torch.bool)
        or (kind == "weight" and value.dtype != torch.bool and not value.is_floating_point())
        or (kind == "float" and not value.is_floating_point())
    ):
        raise TypeError(f"{must}, got {value.dtype}")
    try:
        shape = torch.broadcast_shapes(value.shape, (rows, cols))
    except RuntimeError:
        shape = None
    if shape != (rows, cols):
        raise ValueError(
            f"{must}, got shape {tuple(value.shape)} (a's fields are (R, 1, ...), b's (1, C, ...): reduce a "
            "field's trailing dimensions)"
        )
    return value.expand(rows, cols)
