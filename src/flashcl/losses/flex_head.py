"""The flex head: a loss written as small functions of each pair, on the engine's tiles.

A flex loss is the masked softmax (or the sigmoid loss over pairs) whose positives, exclusions,
score changes and denominator weights come from the user's functions, evaluated on each tile
the drivers visit (:mod:`flashcl.engine.tiled`, :mod:`flashcl.engine.panels`, the ring), never
on the M x N matrix. The functions take two :class:`View` objects: ``a``, the tile's anchors
(each field of the per-anchor data shaped (R, 1, ...), ``a.index`` their global positions),
and ``b``, its keys ((1, C, ...)); they return tensors that broadcast to the tile, (R, C).

With ``s`` the scaled scores and ``s' = score_mod(s, a, b)``, ``m = positive(a, b)`` (0 where
``exclude`` or the self pair leaves a pair out of every set) and ``w = weight(a, b)``:

* ``kind="softmax"``: ``L_i = LSE_{j in Den(i)} (s'_ij + log w_ij)``, ``P_i = sum_j m_ij s'_ij``;
  the row's loss ``c_i L_i - a_i P_i`` with ``(c_i, a_i)`` from ``positives``: ``"mean"``
  ``(M_i / n_i, 1 / n_i)``, ``"weighted_mean"`` ``(1, 1 / M_i)``, ``"pairs"`` ``(M_i, 1)``,
  ``"sum"`` ``(1, 1)`` (``M_i = sum_j m_ij``, ``n_i`` the positives' count). A row with no
  positive (but in ``"sum"``) or an empty denominator contributes 0 and is not counted.
  ``dL/ds'_ij = c_i w_ij exp(s'_ij - L_i) - a_i m_ij``, taken through ``score_mod`` by autograd
  on the tile (and into the tensors it captures).
* ``kind="sigmoid"``: each pair's ``w_ij [m_ij softplus(-t_ij) + (1 - m_ij) softplus(t_ij)]``,
  ``t = s' + bias``; ``dL/dt = w (sigmoid(t) - m)``.
* two-set kinds (:class:`PairSets`: Multi-Similarity, Circle): ``P_i = LSE_{j: m_ij > 0}
  (s'_ij + log w_ij)`` and ``N_i = LSE_{j: m_ij = 0} (s'_ij + log w_ij)`` over the pairs in
  play, ``s' = pos_mod(s, a, b)`` on the positives and ``neg_mod(s, a, b)`` on the negatives;
  the row's loss ``f(P_i, N_i)`` and ``dL/ds'_ij = f_P exp(s'_ij + log w_ij - P_i)`` on a
  positive (``f_N``, ``N_i`` on a negative).

Row statistics (:class:`StatisticsHead`): each anchor's hardest positive, hardest negative
and mean positive score, read by the functions as fields of ``a`` (and, for self-contrast,
of ``b``): the anchors' alone in the head's first reduction pass (``inline_statistics``;
a block of complete rows forms them on the scores it holds), the keys' too in a visit of
their own without gradient.

Every row's statistics complete in one visit of its tiles: one reduction pass; a block of
complete rows forms its gradient in the same visit (three GEMMs).
"""

from __future__ import annotations

import inspect
import warnings
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..core import STATISTICS, View, tile_result
from ..engine.heads import (
    PanelHead,
    ReportingHead,
    SoftmaxHead,
    Tile,
    logsumexp_safe,
    lse_inplace,
    mask_self_,
    row_dot,
    scattered_lse,
    scratch,
    softplus,
)
from ..engine.sparsity import BlockSparsity

__all__ = [
    "View",
    "PairSum",
    "FlexFunctions",
    "FlexHead",
    "PairSets",
    "StatisticsHead",
    "reads_statistics",
    "KINDS",
    "POSITIVES",
    "STATISTICS",
    "captured_tensors",
    "takes_scores",
    "tile_result",
]

KINDS = ("softmax", "sigmoid")
POSITIVES = ("mean", "weighted_mean", "pairs", "sum")

Fn = Callable[..., Any]

_INF = float("inf")


class PairSets:
    """A two-set kind of flex loss: each anchor's loss ``f(P, N)`` of ``P``, the
    log-sum-exp of ``pos_mod(s, a, b) + log w`` over its positives, and ``N``, that of
    ``neg_mod(s, a, b) + log w`` over its negatives (``-inf`` for an empty set). A kind
    gives the two modified scores' defaults, ``f``, its partial derivatives and the rows
    a ``"mean"`` counts."""

    #: the kind's name, as ``kind=`` takes it
    name = ""

    def pos_mod(self, s: Tensor, a: Any, b: Any) -> Tensor:
        raise NotImplementedError

    def neg_mod(self, s: Tensor, a: Any, b: Any) -> Tensor:
        raise NotImplementedError

    def loss(self, p: Tensor, n: Tensor) -> Tensor:
        """Each row's loss from its two log-sum-exps (differentiable)."""
        raise NotImplementedError

    def slopes(self, p: Tensor, n: Tensor) -> Tuple[Tensor, Tensor]:
        """``(dL/dP, dL/dN)`` of each row, finite (0 where a set is empty)."""
        raise NotImplementedError

    def counted(self, p: Tensor, n: Tensor) -> Tensor:
        """The rows a ``"mean"`` counts (bool)."""
        raise NotImplementedError


class PairSum:
    """The pair-sum kind of flex loss: each anchor's loss the sum of its pairs' own terms,
    ``pos_mod(x, a, b)`` on its positives and ``neg_mod(x, a, b)`` on its other pairs in
    play, each times its weight ``w``, with ``x`` the pair's score ``s`` or, with
    ``distance``, a distance from it (at temperature 1): of normalised rows ``"euclidean"``,
    ``sqrt(2 - 2 s)`` (its slope at 0 taken as 0, as ``torch.cdist``'s), or ``"squared"``,
    ``2 - 2 s``, a pair whose ``2 - 2 s`` is within 8 ulps of 0 (identical rows to rounding)
    at distance 0; of unnormalised rows (:attr:`squared_scores`) from the squared distances
    the loss lowers to scores. No log-sum-exp: the classic contrastive loss (Hadsell et
    al.), pytorch-metric-learning's ``ContrastiveLoss`` and TCN's hinge are of this kind."""

    name = "pair_sum"
    DISTANCES = ("euclidean", "squared")
    #: the scores are the squared distances themselves (unnormalised rows, lowered by the
    #: loss to ``[x, |x|^2, 1] . [-2 y, 1, |y|^2]``), not cosines
    squared_scores = False

    def __init__(self, distance: Optional[str] = None) -> None:
        if distance is not None and distance not in self.DISTANCES:
            raise ValueError(f"distance must be None, 'euclidean' or 'squared', got {distance!r}")
        self.distance = distance

    def __repr__(self) -> str:
        return f"FlexPairSum(distance={self.distance!r})"

    def view(self, s: Tensor) -> Tensor:
        """What the functions see of the scores ``s`` (cosines: normalised rows, temperature 1;
        with :attr:`squared_scores` the squared distances, negative ones by rounding at 0)."""
        if self.distance is None:
            return s
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        if self.squared_scores:  # as torch.cdist's matrix-product path: rounding below 0 is 0 (NaN stays)
            squared = torch.where(s < 0, zero, s)
        else:
            squared = 2.0 - 2.0 * s
            # identical rows to rounding (a cosine of 1 within a few ulps: duplicates) are at distance 0, as
            # torch.cdist's exact differences put them; the cosine cannot resolve a closer pair
            squared = torch.where((squared > 8 * torch.finfo(s.dtype).eps) | squared.isnan(), squared, zero)
        if self.distance == "squared":
            return squared
        positive = squared > 0  # sqrt's slope at 0 is infinite: 0 there, as torch.cdist's backward
        tiny = torch.finfo(squared.dtype).tiny
        return torch.where(positive | squared.isnan(), squared.clamp_min(tiny).sqrt(), zero)


def takes_scores(fn: Fn) -> bool:
    """Whether ``exclude`` takes the tile's scores as a third argument."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):  # a builtin without a signature: two arguments
        return False
    return any(p.kind == p.VAR_POSITIONAL for p in params) or len(params) >= 3


class FlexFunctions:
    """The user's functions of a flex loss and their options, checked: ``positive``,
    ``exclude`` (``exclude_scores``: it takes the scores), ``score_mod``, ``weight``, and a
    two-set kind's ``pos_mod`` and ``neg_mod`` (one of them or ``score_mod``, never both)."""

    def __init__(
        self,
        positive: Optional[Fn],
        exclude: Optional[Fn],
        score_mod: Optional[Fn],
        weight: Optional[Fn],
        pos_mod: Optional[Fn] = None,
        neg_mod: Optional[Fn] = None,
    ) -> None:
        self.positive, self.exclude, self.score_mod, self.weight = positive, exclude, score_mod, weight
        self.pos_mod, self.neg_mod = pos_mod, neg_mod
        self.exclude_scores = exclude is not None and takes_scores(exclude)
        #: the scores are modified: the tile's modified scores are formed (and differentiated) by autograd
        self.modifies = score_mod is not None or pos_mod is not None

    def modify(self, s: Tensor, a: Any, b: Any, m: Any) -> Any:
        """The modified scores of the tile ``s``: ``score_mod``'s, or ``pos_mod``'s on the
        positives (``m > 0``, or their positions ``(rows, columns)``) and ``neg_mod``'s
        elsewhere."""
        if self.score_mod is not None:
            return self.score_mod(s, a, b)
        assert self.pos_mod is not None and self.neg_mod is not None
        r, c = s.shape
        pos = tile_result(self.pos_mod(s, a, b), "pos_mod", r, c, s, "float")
        neg = tile_result(self.neg_mod(s, a, b), "neg_mod", r, c, s, "float")
        if isinstance(m, tuple):  # few positives: their entries put into the negatives' tile
            return neg.index_put(m, pos[m])
        return torch.where(m > 0, pos, neg)

    def mods(self) -> Tuple[Fn, ...]:
        """The functions whose results carry the scores' gradient (and the captured tensors')."""
        return tuple(f for f in (self.score_mod, self.pos_mod, self.neg_mod) if f is not None)


def captured_tensors(fn: Optional[Fn], probe: Callable[[Fn], Tensor]) -> Tuple[Tensor, ...]:
    """The leaf tensors requiring grad that ``fn``'s result depends on beyond its own
    arguments (a learnable margin it captures): ``probe(fn)`` calls it on a small tile
    whose scores require grad; the leaves are found in the result's graph."""
    if fn is None:
        return ()
    with torch.enable_grad():
        out = probe(fn)
    if not isinstance(out, Tensor) or out.grad_fn is None:
        return ()
    found: List[Tensor] = []
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf
        if isinstance(variable, Tensor) and not getattr(variable, "_flex_probe", False):
            if all(variable is not f for f in found):
                found.append(variable)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return tuple(found)


class _FlexState:
    """A flex head's accumulators: each row's logsumexp (or, with a fixed shift, its sum
    of ``exp(z - shift)`` until :meth:`FlexHead.finish`), the positives' score sum, weight
    sum and count (softmax); each row's loss sum (sigmoid); the gradients of the captured
    tensors and the bias; the anchors' data the functions read (``fields``: with inline
    statistics, a copy whose statistics are filled as they are formed)."""

    def __init__(
        self, m: int, like: Tensor, n_params: int, kind: str, shift: Optional[float], fields: Dict[str, Tensor]
    ) -> None:
        def vec(fill: float = 0.0) -> Tensor:
            return like.new_full((m,), fill)

        self.fields = fields
        self.shift = shift
        self.summing = shift is not None
        # the sigmoid kind's rows are sums of its pairs' terms; the softmax kind's logsumexps
        self.row = vec(float("-inf") if kind == "softmax" and not self.summing else 0.0)
        self.pos, self.msum, self.cnt = vec(), vec(), vec()
        self.ca: Optional[Tuple[Tensor, Tensor]] = None  # rows' (c, a), once reduced
        self.g_row: Optional[Tensor] = None
        self.lse: Optional[Tensor] = None  # the logsumexps for the gradient (0 where a row has no denominator)
        self.lse_pos: Optional[Tensor] = None  # a two-set kind's: P for the gradient (``pos`` holds P; ``row``, N)
        self.coef: Optional[Tuple[Tensor, Tensor]] = None  # per row (c g e^{shift - L} or c g, a g)
        self.param_grads: List[Optional[Tensor]] = [None] * n_params
        self.stats: Any = None  # the anchors' statistics' accumulators, formed in a first pass
        #: each row's validity once reduced (the rows a "mean" counts): :meth:`FlexHead.report`
        self.valid: Optional[Tensor] = None
        # the pair sum: ``pos`` and ``row`` hold each row's sums of its positives' and its
        # negatives' terms, these their counts; ``scales`` each set's factor once counted
        self.pos_cnt, self.neg_cnt = vec(), vec()
        self.scales: Tuple[Any, Any] = (1.0, 1.0)


#: binary positives are kept as their positions (:class:`_Positives`) while at most this
#: fraction of a tile is positive
SPARSE_POSITIVES_MAX_DENSITY = 1.0 / 16


class _Positives:
    """A tile's binary positives as the (row, column) positions of its ones: the form
    taken on the CPU when they are few (class labels, a time window), so that their
    counts, their scores' sums and their part of the gradient cost a gather or a scatter
    of those entries instead of passes over a float tile. (On CUDA the scatters' float
    atomics would make the sums' rounding vary from run to run: the dense form stays.)"""

    __slots__ = ("ri", "ci", "shape", "dtype")

    def __init__(self, ri: Tensor, ci: Tensor, shape: Tuple[int, int], dtype: torch.dtype) -> None:
        self.ri, self.ci, self.shape, self.dtype = ri, ci, shape, dtype

    def counts(self, dim: int) -> Tensor:
        """The number of positives of each row (``dim=1``) or column (``dim=0``)."""
        idx = self.ri if dim == 1 else self.ci
        return torch.bincount(idx, minlength=self.shape[0 if dim == 1 else 1]).to(self.dtype)

    def score_sums(self, sp: Tensor, dim: int) -> Tensor:
        """The sums of ``sp`` over the positives along ``dim``."""
        idx = self.ri if dim == 1 else self.ci
        out = torch.zeros(self.shape[0 if dim == 1 else 1], dtype=sp.dtype, device=sp.device)
        return out.index_add_(0, idx, sp[self.ri, self.ci])

    def sub_(self, z: Tensor, coef: Tensor, dim: int) -> Tensor:
        """In place: ``z - m * coef`` with ``coef`` one value per row (``dim=1``) or column."""
        idx = self.ri if dim == 1 else self.ci
        z.index_put_((self.ri, self.ci), -coef[idx], accumulate=True)
        return z

    def columns(self, start: int) -> _Positives:
        """The positives of the columns from ``start`` on (renumbered from 0)."""
        keep = self.ci >= start
        return _Positives(self.ri[keep], self.ci[keep] - start, (self.shape[0], self.shape[1] - start), self.dtype)

    def dense(self, device: torch.device) -> Tensor:
        m = torch.zeros(self.shape, dtype=self.dtype, device=device)
        return m.index_put_((self.ri, self.ci), torch.ones((), dtype=self.dtype, device=device))


class _Terms:
    """A tile's terms: ``excl`` (the pairs ``exclude`` leaves out, bool, or None), the
    positives' weights, 0 where excluded and on the self pair, as a float tile of the
    head's own (``m``) or, binary and few, as their positions (``sparse``: see
    :class:`_Positives`; ``m`` is then formed only where a path asks for it), ``binary``
    (the weights are 0/1), ``logw`` (the log denominator weights, or None), ``sp`` (the
    modified scores: the tile itself without ``score_mod``), and for a gradient through
    ``score_mod`` the scores as a leaf and ``sp`` on its graph."""

    __slots__ = ("excl", "_m", "sparse", "binary", "logw", "sp", "s_leaf", "sp_graph")

    def __init__(
        self,
        excl: Optional[Tensor],
        m: Optional[Tensor],
        binary: bool,
        logw: Optional[Tensor],
        sp: Tensor,
        s_leaf: Optional[Tensor],
        sp_graph: Optional[Tensor],
        sparse: Optional[_Positives] = None,
    ) -> None:
        self.excl, self._m, self.sparse, self.binary, self.logw = excl, m, sparse, binary, logw
        self.sp, self.s_leaf, self.sp_graph = sp, s_leaf, sp_graph

    @property
    def m(self) -> Tensor:
        """The positives' weights as a tile."""
        if self._m is None:
            assert self.sparse is not None
            self._m = self.sparse.dense(self.sp.device)
        return self._m

    def counts(self, dim: int) -> Tuple[Tensor, Tensor]:
        """The positives' weight sums and counts along ``dim``."""
        if self.sparse is not None:
            cnt = self.sparse.counts(dim)
            return cnt, cnt
        msum = self.m.sum(dim)
        return msum, (msum if self.binary else (self.m != 0).sum(dim).to(msum.dtype))

    def columns(self, start: int) -> _Terms:
        """The positives of the columns from ``start`` on (a panel's part below the diagonal)."""
        if self.sparse is not None:
            return _Terms(None, None, True, None, self.sp[:, start:], None, None, self.sparse.columns(start))
        return _Terms(None, self.m[:, start:], self.binary, None, self.sp[:, start:], None, None)

    def sub_positive_(self, z: Tensor, coef: Tensor, dim: int) -> Tensor:
        """In place: ``z - m * coef.unsqueeze(dim)`` (``coef`` one value per row along ``dim``)."""
        if self.sparse is not None:
            return self.sparse.sub_(z, coef, dim)
        return z.addcmul_(self.m, coef.unsqueeze(dim), value=-1.0)


class FlexHead(PanelHead, ReportingHead):
    """The flex loss as an engine head (see the module docstring). The softmax, sigmoid
    and two-set kinds' gradient is written out: at B = 8,192, D = 256 on a 2-core CPU
    (tiled, float32), autograd through :meth:`dense_reported` on each block of complete
    rows took 1.3-2.4x as long (``scripts/written_out.py``); the pair sum's is autograd's
    through its one formula (:class:`PairSumTiles`).

    Args:
        kind: ``"softmax"`` | ``"sigmoid"`` | a two-set kind (:class:`PairSets`).
        positives: the softmax kind's ``"mean"`` | ``"weighted_mean"`` | ``"pairs"`` | ``"sum"``.
        fns: the user's functions.
        rows: the data of the tile rows' samples, this process's (M).
        cols: the data of the tile columns' samples, every column of the problem (N; across
            processes every rank's).
        row_base: the global position of anchor 0.
        own: self-contrast: the pair ``(i, i + offset)`` is the anchor itself, never a positive.
        exclude_self: leave that pair out of the denominator too (not ``include_self``).
        offset: the column of anchor 0 (self-contrast).
        swapped: the tile's rows are the keys and its columns the anchors (the column
            direction of ``both_directions``): the functions are called as ``f(b, a)``, so
            that they see every pair as ``(anchor, key)``.
        symmetric: the functions give the same answers for ``(a, b)`` and ``(b, a)`` and the
            keys are the anchors (self-contrast): the symmetric panels may be visited.
        bias: the sigmoid kind's bias (a float; its gradient when ``learn_bias``).
        learn_bias: the bias is the first of the head's parameters.
        captured: the tensors ``score_mod`` captures that require grad (the head's
            parameters after the bias).
        sparsity: the tiles with a pair not excluded (a block mask), or None: every tile.
        inline_statistics: the functions read the anchors' row statistics (``a``'s only; not
            swapped, every tile visited): a first reduction pass forms them (a block of
            complete rows, on the scores it holds), instead of a visit of their own.
    """

    fuses_rows = True  # every row's statistics complete in one visit of its tiles

    def __init__(
        self,
        kind: Any,
        positives: str,
        fns: FlexFunctions,
        rows: Dict[str, Tensor],
        cols: Dict[str, Tensor],
        row_base: int = 0,
        own: bool = False,
        exclude_self: bool = False,
        offset: int = 0,
        swapped: bool = False,
        symmetric: bool = False,
        bias: float = 0.0,
        learn_bias: bool = False,
        captured: Tuple[Tensor, ...] = (),
        sparsity: Optional[BlockSparsity] = None,
        inline_statistics: bool = False,
        set_means: Optional[str] = None,
        join: Optional[Callable[[Tensor], Tensor]] = None,
        compiled: bool = False,
    ) -> None:
        #: a two-set kind, or None (``kind`` is then ``"softmax"``, ``"sigmoid"`` or the pair sum)
        self.sets: Optional[PairSets] = kind if isinstance(kind, PairSets) else None
        #: the pair-sum kind, or None
        self.pair_sum: Optional[PairSum] = kind if isinstance(kind, PairSum) else None
        self.kind: str = kind.name if isinstance(kind, (PairSets, PairSum)) else kind
        #: the pair sum's reduction of each set: None (the terms summed), ``"mean"`` (each set's
        #: terms over its pairs in play) or ``"mean_nonzero"`` (each set's terms above 0, over
        #: their count), the counts over every rank (``join``: their sum over the ranks)
        self.set_means, self.join = set_means, join or (lambda x: x)
        #: the pair sum's tile work, eager or compiled by ``torch.compile`` (:class:`PairSumTiles`)
        self.pairs = PairSumTiles(self, compiled) if self.pair_sum is not None else None
        if set_means is not None:
            self.fuses_rows = False  # the counts of every row come before any gradient
        self.positives, self.fns = positives, fns
        self.sparsity = sparsity
        self.rows, self.cols, self.row_base = rows, cols, row_base
        self.own, self.exclude_self, self.offset, self.swapped = own, exclude_self, offset, swapped
        # the panels visit every tile (a two-set kind's rows are visited one orientation at a time)
        self.symmetric_tiles = symmetric and sparsity is None and self.sets is None and self.pair_sum is None
        self.bias, self.learn_bias, self.captured = bias, learn_bias, captured
        self.n_params = int(learn_bias) + len(captured)
        #: the anchors' statistics' own head (their first pass), or None
        self.counter: Optional[StatisticsHead] = None
        if inline_statistics:  # the statistics' fields are the state's, filled as they are formed
            self.passes = 2
            self.symmetric_tiles = False
            self.counter = StatisticsHead(
                kind="softmax", positives="mean", fns=fns, rows=rows, cols=cols, row_base=row_base, own=own,
                exclude_self=exclude_self, offset=offset,
            )  # fmt: skip

    @staticmethod
    def _publish(st: _FlexState, rows: slice) -> None:
        """The statistics of ``rows`` (complete: every tile of theirs counted) as the
        anchors' fields the functions read (the state's)."""
        for name, value in statistics_of(st.stats, rows).items():
            st.fields[name][rows] = value

    # ------------------------------------------------------------------ a tile's terms
    def _views(self, tile: Tile, fields: Dict[str, Tensor]) -> Tuple[View, View]:
        """The functions' ``(a, b)``: the tile's rows (their data ``fields``) and columns,
        or, swapped, its columns (the anchors, shaped (1, C, ...)) and its rows (the keys,
        (R, 1, ...))."""
        if self.swapped:
            a = View(self.cols, tile.c0, tile.c1, 0, "b", "the anchors' data (rows=)", "a")
            b = View(fields, tile.r0, tile.r1, self.row_base, "a", "the keys' data (cols=)", "b")
            return a, b
        a = View(fields, tile.r0, tile.r1, self.row_base, "a", "the anchors' data (rows=)", "a")
        b = View(self.cols, tile.c0, tile.c1, 0, "b", "the keys' data (cols=)", "b")
        return a, b

    def _terms(
        self, s: Tensor, tile: Tile, fields: Dict[str, Tensor], grad: bool = False, modify: bool = True
    ) -> _Terms:
        """The tile's terms (:class:`_Terms`), the functions called once each (the rows'
        data ``fields``), checked; ``grad``: with the graph of ``score_mod`` for the
        backward through it; ``modify``: False leaves the scores as they are (the pair
        sum's tile functions modify them)."""
        r, c = s.shape
        a, b = self._views(tile, fields)
        fns = self.fns
        excl = None
        if fns.exclude is not None:
            args = (a, b, s.detach()) if fns.exclude_scores else (a, b)
            excl = tile_result(fns.exclude(*args), "exclude", r, c, s, "bool")
        raw = self._raw_positives(a, b, s)
        binary = raw.dtype == torch.bool
        if (
            binary
            and s.device.type == "cpu"
            and (self.sets is not None or (self.kind == "softmax" and not fns.modifies))
        ):
            sparse = self._sparse_positives(raw, excl, tile, s.dtype)
            if sparse is not None:
                logw = self._log_weights(a, b, r, c, s)
                if self.sets is None:
                    return _Terms(excl, None, True, logw, s, None, None, sparse)
                sp, s_leaf, sp_graph = self._modified(s, a, b, (sparse.ri, sparse.ci), grad)
                return _Terms(excl, None, True, logw, sp, s_leaf, sp_graph, sparse)
        m = torch.empty((r, c), dtype=s.dtype, device=s.device)
        m.copy_(raw)
        if not binary and bool((m < 0).any()):
            raise ValueError("positive returned a negative weight: positives are bool, or weights >= 0 (0: none)")
        if excl is not None:
            m.masked_fill_(excl, 0.0)
        if self.own:
            mask_self_(m, tile, 0.0)  # the self pair is never a positive
        logw = self._log_weights(a, b, r, c, s)
        sp, s_leaf, sp_graph = self._modified(s, a, b, m, grad) if fns.modifies and modify else (s, None, None)
        return _Terms(excl, m, binary, logw, sp, s_leaf, sp_graph)

    def _modified(
        self, s: Tensor, a: View, b: View, m: Any, grad: bool
    ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(s', the scores as a leaf, s' on its graph)``: the modified scores, with the
        graph for the backward through them when ``grad``; ``m``: the positives' weights or
        positions (:meth:`FlexFunctions.modify`)."""
        r, c = s.shape
        if not grad:
            with torch.no_grad():
                return tile_result(self.fns.modify(s, a, b, m), "score_mod", r, c, s, "float"), None, None
        with torch.enable_grad():
            s_leaf = s.detach().clone().requires_grad_(True)
            sp_graph = tile_result(self.fns.modify(s_leaf, a, b, m), "score_mod", r, c, s, "float")
        return sp_graph.detach(), s_leaf, sp_graph

    def _raw_positives(self, a: View, b: View, s: Tensor) -> Tensor:
        """``positive(a, b)`` checked and broadcast to the tile (default: the diagonal)."""
        r, c = s.shape
        fn = self.fns.positive
        return tile_result(fn(a, b), "positive", r, c, s, "weight") if fn else (a.index == b.index).expand(r, c)

    def _sparse_positives(
        self, raw: Tensor, excl: Optional[Tensor], tile: Tile, dtype: torch.dtype
    ) -> Optional[_Positives]:
        """The binary positives (less the excluded pairs and the self pair) as their
        positions, or None where more than :data:`SPARSE_POSITIVES_MAX_DENSITY` of the tile is positive."""
        r, c = raw.shape
        keep = raw if excl is None else raw & ~excl
        ri, ci = keep.nonzero(as_tuple=True)
        if self.own:
            off = ci - ri != tile.r0 + tile.offset - tile.c0
            ri, ci = ri[off], ci[off]
        if ri.numel() > SPARSE_POSITIVES_MAX_DENSITY * r * c:
            return None
        return _Positives(ri, ci, (r, c), dtype)

    def _log_weights(self, a: View, b: View, r: int, c: int, s: Tensor) -> Optional[Tensor]:
        """``log weight(a, b)``, checked, or None without a weight function."""
        if self.fns.weight is None:
            return None
        w = tile_result(self.fns.weight(a, b), "weight", r, c, s, "weight").to(s.dtype)
        if bool((w < 0).any()):
            raise ValueError("weight returned a negative weight: weights are >= 0 (0: out of the denominator)")
        return torch.log(w)

    def _positive_scores(self, t: _Terms) -> Tensor:
        """``m * s'`` with 0 off the positives (where ``s'`` may be ``-inf`` or NaN)."""
        if not self.fns.modifies:
            return t.m * t.sp
        return t.m * torch.where(t.m > 0, t.sp, torch.zeros((), dtype=t.sp.dtype, device=t.sp.device))

    def _positive_sums(self, t: _Terms, dim: int) -> Tensor:
        """The sums of ``m * s'`` along ``dim``."""
        if t.sparse is not None:
            return t.sparse.score_sums(t.sp, dim)
        if not self.fns.modifies and dim == 1:
            return row_dot(t.m, t.sp)
        return self._positive_scores(t).sum(dim)

    def _z_(self, t: _Terms, tile: Tile) -> Tensor:
        """The denominator's terms ``s' + log w``, ``-inf`` for the pairs out of it: in the
        tile's own buffer when ``s'`` is the tile (no ``score_mod``). A positive whose
        modified score is ``-inf`` is an error."""
        sp = t.sp
        if self.fns.modifies:
            if bool((torch.isneginf(sp) & (t.m > 0)).any()):
                raise ValueError("score_mod returned -inf on a positive pair: a positive must stay in the denominator")
            z = sp.clone() if t.logw is None else sp + t.logw
        else:
            z = sp if t.logw is None else sp.add_(t.logw)
        if t.excl is not None:
            z.masked_fill_(t.excl, float("-inf"))
        if self.exclude_self:
            mask_self_(z, tile, float("-inf"))
        return z

    def _pair_losses_(self, t: _Terms, tile: Tile) -> Tensor:
        """The sigmoid kind's per-pair terms ``w [m softplus(-x) + (1 - m) softplus(x)] =
        w [softplus(x) - m x]``, ``x = s' + bias``, 0 for the pairs out of every set."""
        x = t.sp + self.bias
        terms = softplus(x).sub_(t.m * x)
        if t.logw is not None:
            terms.mul_(torch.exp(t.logw))
        return self._out_(terms, t, tile, 0.0)

    def _out_(self, x: Tensor, t: _Terms, tile: Tile, value: float) -> Tensor:
        """In place: the pairs out of every set take ``value``."""
        if t.excl is not None:
            x.masked_fill_(t.excl, value)
        if self.exclude_self:
            mask_self_(x, tile, value)
        return x

    # ------------------------------------------------------------------ reduction
    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _FlexState:
        fields = self.rows
        if self.counter is not None:
            fields = {**self.rows, **{name: like.new_zeros(m) for name in STATISTICS}}
        st = self._state(m, like, bound, fields)
        if self.counter is not None:
            st.stats = self.counter.state(m, n, like, None)
        return st

    def _state(self, m: int, like: Tensor, bound: Optional[float], fields: Dict[str, Tensor]) -> _FlexState:
        shift = None
        if self.kind == "softmax" and not self.fns.modifies and self.fns.weight is None:
            # |z| <= |s| <= bound: one exp per entry. Where a fixed shift is usable at all
            # (2 bound within the exponent range) exp(s) itself neither overflows nor
            # underflows, so the shift is 0 and the tile is exponentiated as it is
            shift = None if SoftmaxHead.usable_shift(bound, like.dtype) is None else 0.0
        if self.sets is not None:  # two log-sum-exps per row: P in ``pos``, N in ``row``
            st = _FlexState(m, like, self.n_params, "softmax", None, fields)
            st.pos.fill_(-_INF)
        else:
            st = _FlexState(m, like, self.n_params, self.kind, shift, fields)
        if self.kind in ("sigmoid", "pair_sum"):  # every row counts (none at all on a rank without anchors)
            st.valid = torch.ones(m, dtype=torch.bool, device=like.device)
        return st

    # ------------------------------------------------------------------ the pair sum
    def pair_scales(self, pos_cnt: Tensor, neg_cnt: Tensor) -> Tuple[Any, Any]:
        """The pair sum's factor of each set from its rows' counts (their pairs' weights
        summed): 1 (the terms summed), or 1 / the set's count over every rank (0 for an
        empty set; a collective across processes: every rank calls it alike)."""
        if self.set_means is None:
            return 1.0, 1.0
        counts = self.join(torch.stack([pos_cnt.sum(), neg_cnt.sum()]))
        scales = torch.where(counts > 0, 1.0 / counts.clamp_min(1.0), torch.zeros_like(counts))
        return scales[0], scales[1]

    def _sets_z(self, t: _Terms, tile: Tile) -> Tuple[Tensor, Any]:
        """A two-set kind's terms ``s' + log w`` (``-inf`` for the pairs out of both sets) and
        the positives: a mask, or (few) their positions ``(rows, columns)``."""
        z = t.sp.clone() if t.logw is None else t.sp + t.logw
        if t.sparse is not None:
            return self._out_(z, t, tile, -_INF), (t.sparse.ri, t.sparse.ci)
        if not t.binary:  # a NaN membership weight makes its set NaN
            z.addcmul_(t.m, torch.zeros((), dtype=z.dtype, device=z.device))
        return self._out_(z, t, tile, -_INF), t.m != 0

    def _add_sets(self, st: _FlexState, rows: slice, z: Tensor, pos: Any) -> None:
        """The two log-sum-exps of ``z`` (overwritten) into the accumulators of ``rows``."""
        if not z.shape[1]:
            return
        if isinstance(pos, tuple):
            p = scattered_lse(z[pos], pos[0], z.shape[0])
            z.index_put_(pos, z.new_tensor(-_INF))
        else:
            p = torch.logsumexp(torch.where(pos, z, -_INF), 1)
            z.masked_fill_(pos, -_INF)
        torch.logaddexp(st.pos[rows], p, out=st.pos[rows])
        torch.logaddexp(st.row[rows], torch.logsumexp(z, 1), out=st.row[rows])

    def _sets_grad_(self, z: Tensor, pos: Any, st: _FlexState, rows: slice) -> Tensor:
        """In place in ``z``: a two-set kind's ``dL/ds'``, ``f_P exp(z - P)`` on the positives
        and ``f_N exp(z - N)`` on the negatives (0 out of both sets)."""
        assert st.coef is not None and st.lse is not None and st.lse_pos is not None
        cp, cn = (x[rows] for x in st.coef)
        lp, ln = st.lse_pos[rows], st.lse[rows]
        if isinstance(pos, tuple):  # the negatives' part over the tile, the positives' at their entries
            ri = pos[0]
            zp = z[pos]
            z.sub_(ln.unsqueeze(1)).exp_().mul_(cn.unsqueeze(1))
            return z.index_put_(pos, zp.sub_(lp[ri]).exp_().mul_(cp[ri]))
        z.sub_(torch.where(pos, lp.unsqueeze(1), ln.unsqueeze(1))).exp_()
        return z.mul_(torch.where(pos, cp.unsqueeze(1), cn.unsqueeze(1)))

    def _add_rows(self, st: _FlexState, rows: slice, pos: Tensor, msum: Tensor, cnt: Tensor) -> None:
        st.pos[rows] += pos
        st.msum[rows] += msum
        st.cnt[rows] += cnt

    def _add_lse(self, st: _FlexState, rows: slice, z: Tensor, dim: int) -> None:
        """The logsumexps (or, summing, the sums of ``exp(z - shift)``) of ``z`` along
        ``dim`` into the accumulators of ``rows``; ``z`` may be overwritten."""
        if st.summing:
            st.row[rows] += _exp_shifted_(z, st.shift).sum(dim)  # type: ignore[arg-type]
        else:
            torch.logaddexp(st.row[rows], torch.logsumexp(z, dim), out=st.row[rows])

    def reduce(self, s: Tensor, tile: Tile, st: _FlexState, p: int = 0) -> None:
        if self.counter is not None and p == 0:  # the first pass: the statistics
            self.counter.reduce(s, tile, st.stats)
            return
        if self.pairs is not None:
            self.pairs.reduce(s, tile, st)
            return
        rows = slice(tile.r0, tile.r1)
        t = self._terms(s, tile, st.fields)
        if self.sets is not None:
            self._add_sets(st, rows, *self._sets_z(t, tile))
            return
        if self.kind == "sigmoid":
            st.row[rows] += self._pair_losses_(t, tile).sum(1)
            return
        self._add_rows(st, rows, self._positive_sums(t, 1), *t.counts(1))
        self._add_lse(st, rows, self._z_(t, tile), 1)

    def reduce_panel(self, s: Tensor, tile: Tile, st: _FlexState, p: int, buf: Tensor) -> None:
        """Self-contrast panel ``S[r0:r1, r0:]`` with symmetric functions: its rows' terms
        and, along its columns right of the diagonal block, the terms of the rows it
        stands for below the diagonal (the functions called once)."""
        rows, b, right = slice(tile.r0, tile.r1), tile.r1 - tile.r0, tile.c1 > tile.r1
        below = slice(tile.r1, tile.c1)
        t = self._terms(s, tile, st.fields)
        if self.kind == "sigmoid":
            pair = self._pair_losses_(t, tile)
            st.row[rows] += pair.sum(1)
            if right:
                st.row[below] += pair[:, b:].sum(0)
            return
        self._add_rows(st, rows, self._positive_sums(t, 1), *t.counts(1))
        if right:
            tm = t.columns(b)
            self._add_rows(st, below, self._positive_sums(tm, 0), *tm.counts(0))
        z = self._z_(t, tile)
        if st.summing:
            e = _exp_shifted_(z, st.shift)  # type: ignore[arg-type]
            st.row[rows] += e.sum(1)
            if right:
                st.row[below] += e[:, b:].sum(0)
            return
        if right:
            torch.logaddexp(st.row[below], torch.logsumexp(z[:, b:], 0), out=st.row[below])
        torch.logaddexp(st.row[rows], torch.logsumexp(z, 1), out=st.row[rows])

    def finish(self, st: _FlexState, p: int = 0) -> None:
        if self.counter is not None and p == 0:
            self._publish(st, slice(None))
            return
        if self.sets is not None:
            st.valid = self.sets.counted(st.pos, st.row)
            return
        if self.pair_sum is not None:
            st.scales = self.pair_scales(st.pos_cnt, st.neg_cnt)
            st.valid = torch.ones_like(st.row, dtype=torch.bool)
            return
        if self.kind == "sigmoid":
            st.valid = torch.ones_like(st.row, dtype=torch.bool)
            return
        if st.summing:
            st.row = st.row.log().add_(st.shift)  # type: ignore[arg-type]
            st.summing = False
        c, a, valid = self._weights(self.positives, st.row, st.msum, st.cnt)
        st.ca, st.valid = (c, a), valid

    @staticmethod
    def _weights(positives: str, lse: Tensor, msum: Tensor, cnt: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(c, a, valid)`` of each row from its positives' weight sum and count."""
        has = cnt > 0
        zero = torch.zeros_like(msum)
        if positives == "mean":
            c = torch.where(has, msum / cnt.clamp_min(1), zero)
            a = torch.where(has, 1.0 / cnt.clamp_min(1), zero)
        elif positives == "weighted_mean":
            has = has & (msum != 0)  # a NaN weight's row counted (and NaN)
            c = has.to(msum.dtype)
            a = torch.where(has, 1.0 / torch.where(has, msum, torch.ones_like(msum)), zero)
        elif positives == "pairs":
            c, a = msum, has.to(msum.dtype)
        else:  # "sum": every row with a denominator
            has = torch.ones_like(has)
            c, a = torch.ones_like(msum), torch.ones_like(msum)
        valid = has & ~torch.isneginf(lse)  # an empty denominator; a NaN row stays counted (and NaN)
        return torch.where(valid, c, zero), torch.where(valid, a, zero), valid

    def values(self, st: _FlexState) -> Tuple[Tensor, Optional[Tensor]]:
        if self.sets is not None:
            self.finish(st, self.passes - 1)
            assert st.valid is not None
            rows = self.sets.loss(st.pos, st.row)
            return torch.where(st.valid, rows, torch.zeros_like(rows)), None
        if self.pair_sum is not None:
            if self.set_means is not None and not isinstance(st.scales[0], Tensor):  # not reduced (no rows)
                self.finish(st, self.passes - 1)
            a, b = st.scales
            return a * st.pos + b * st.row, None
        if self.kind == "sigmoid":
            return st.row, None
        if st.ca is None:  # no row was visited (a rank without anchors)
            self.finish(st, self.passes - 1)
        assert st.ca is not None
        c, a = st.ca
        zero = torch.zeros((), dtype=st.row.dtype, device=st.row.device)
        return torch.where(c == 0, zero, c * st.row) - a * st.pos, None  # a NaN c stays NaN

    # ------------------------------------------------------------------ gradient
    def begin_grad(self, st: _FlexState, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.g_row = g_row
        if self.sets is not None:
            self._sets_coef(st, slice(None), g_row)
            return
        if self.kind in ("sigmoid", "pair_sum"):
            return
        assert st.ca is not None
        c, a = st.ca
        # a row with an empty denominator has no gradient: its logsumexp taken as 0 keeps
        # exp(-inf - L) = 0 instead of NaN (its c is 0)
        st.lse = torch.where(torch.isneginf(st.row), torch.zeros_like(st.row), st.row)
        cg = c * g_row
        if st.shift is not None:  # G_ij = exp(z_ij - shift) c_i g_i e^{shift - L_i} - m_ij a_i g_i
            cg = cg * torch.exp(st.shift - st.lse)
        st.coef = (cg, a * g_row)

    def _sets_coef(self, st: _FlexState, rows: slice, g_row: Tensor) -> None:
        """A two-set kind's per-row factors ``(f_P g, f_N g)`` and finite log-sum-exps for the
        gradient of ``rows`` (a row not counted: 0)."""
        assert self.sets is not None and st.valid is not None
        p, n = st.pos[rows], st.row[rows]
        dp, dn = self.sets.slopes(p, n)
        keep = st.valid[rows]
        zero = torch.zeros((), dtype=p.dtype, device=p.device)
        coef = (torch.where(keep, dp * g_row, zero), torch.where(keep, dn * g_row, zero))
        if st.coef is None or st.lse is None or st.lse_pos is None:
            st.coef = (torch.zeros_like(st.pos), torch.zeros_like(st.row))
            st.lse, st.lse_pos = torch.zeros_like(st.row), torch.zeros_like(st.pos)
        st.coef[0][rows], st.coef[1][rows] = coef
        # an empty set's -inf taken as 0: its members' exp(-inf - 0) = 0, never NaN
        st.lse_pos[rows] = torch.where(torch.isfinite(p), p, zero)
        st.lse[rows] = torch.where(torch.isfinite(n), n, zero)

    def _softmax_grad_(self, z: Tensor, t: _Terms, st: _FlexState, rows: slice, dim: int) -> Tensor:
        """In place in ``z``: ``dL/ds'`` of the softmax kind, seen from the rows (``dim=1``:
        the tile's rows; ``dim=0``: its columns are the rows ``rows``)."""
        assert st.coef is not None and st.lse is not None
        cg, ag = (x[rows].unsqueeze(dim) for x in st.coef)
        if st.shift is not None:
            _exp_shifted_(z, st.shift)
        else:
            z.sub_(st.lse[rows].unsqueeze(dim)).exp_()
        return t.sub_positive_(z.mul_(cg), ag.squeeze(dim), dim)

    def _sigmoid_grad_(self, t: _Terms, tile: Tile, g: Tensor, dim: int) -> Tensor:
        """``dL/ds'`` of the sigmoid kind, ``w (sigmoid(s' + bias) - m) g``, 0 for the pairs
        out of every set; ``g`` the rows' upstream gradients along ``dim``."""
        d = torch.sigmoid(t.sp + self.bias).sub_(t.m)
        if t.logw is not None:
            d.mul_(torch.exp(t.logw))
        return self._out_(d.mul_(g.unsqueeze(dim)), t, tile, 0.0)

    def _through_mod(self, g: Tensor, t: _Terms, st: _FlexState, tile: Tile, diagonal: int = 0) -> Tensor:
        """``dL/ds`` from ``dL/ds'`` through ``score_mod`` (the captured tensors' and the
        bias's gradients added to the state's), 0 on the pairs out of every set whatever
        the function's slope there (a NaN or an infinite one: ``0 x inf`` is no gradient
        of a pair the loss leaves out); ``diagonal``: a panel's leading block of that many
        columns holds each of its pairs twice (once per orientation), so the parameters
        take half of it."""
        if self.kind == "sigmoid" and self.learn_bias:
            _add(st.param_grads, 0, g.sum() - (0.5 * g[:, :diagonal].sum() if diagonal else 0.0))
        if t.sp_graph is None:
            return g
        assert t.s_leaf is not None
        if diagonal and self.captured:
            g[:, :diagonal].mul_(0.5)
        grads = torch.autograd.grad(
            t.sp_graph, [t.s_leaf, *self.captured], g, retain_graph=bool(self.captured), allow_unused=True
        )
        first = int(self.learn_bias)
        for i, gp in enumerate(grads[1:]):
            if gp is not None:
                _add(st.param_grads, first + i, gp)
        gs = grads[0] if grads[0] is not None else torch.zeros_like(g)
        if diagonal and self.captured:
            gs[:, :diagonal].mul_(2.0)  # score_mod acts on each pair alone: its gradient is linear in g
        return self._out_(gs, t, tile, 0.0)

    def grad(self, s: Tensor, tile: Tile, st: _FlexState, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        if self.pairs is not None:
            return s.copy_(self.pairs.grad(s, tile, st, st.g_row))
        rows = slice(tile.r0, tile.r1)
        t = self._terms(s, tile, st.fields, grad=self.fns.modifies)
        if self.sets is not None:
            g = self._sets_grad_(*self._sets_z(t, tile), st, rows)
        elif self.kind == "sigmoid":
            g = self._sigmoid_grad_(t, tile, st.g_row[rows], 1)
        else:
            g = self._softmax_grad_(self._z_(t, tile), t, st, rows, 1)
        g = self._through_mod(g, t, st, tile)
        return g if g is s else s.copy_(g)

    def grad_panel(self, s: Tensor, tile: Tile, st: _FlexState, buf: Tensor) -> Tensor:
        """``H = G + G'`` on the panel: the gradient of its rows plus that of the rows it
        stands for (each column's, by the symmetry of the functions), the functions called
        once."""
        assert st.g_row is not None
        rows, b, cols = slice(tile.r0, tile.r1), tile.r1 - tile.r0, slice(tile.r0, tile.c1)
        t = self._terms(s, tile, st.fields, grad=self.fns.modifies)
        if self.kind == "sigmoid":
            g = self._sigmoid_grad_(t, tile, st.g_row[rows], 1)
            g.add_(self._sigmoid_grad_(t, tile, st.g_row[cols], 0))
        else:
            z = self._z_(t, tile)
            other = scratch(buf, z).copy_(z)
            g = self._softmax_grad_(z, t, st, rows, 1).add_(self._softmax_grad_(other, t, st, cols, 0))
        g = self._through_mod(g, t, st, tile, diagonal=b)
        return g if g is s else s.copy_(g)

    def rows_fused(self, s: Tensor, tile: Tile, st: _FlexState, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        if self.counter is not None:  # complete rows: their statistics, then their terms
            self.counter.reduce(s.clone(), tile, st.stats)
            self._publish(st, rows)
        if st.valid is None:
            st.valid = torch.ones_like(st.row, dtype=torch.bool)
        if self.pairs is not None:  # the terms summed (no set's count): complete rows are final here
            st.pos[rows], st.row[rows], st.pos_cnt[rows], st.neg_cnt[rows] = 0.0, 0.0, 0.0, 0.0
            if g_row is None:
                self.pairs.reduce(s, tile, st)
                return None
            return s.copy_(self.pairs.grad(s, tile, st, g_row, add_sums=True))
        t = self._terms(s, tile, st.fields, grad=g_row is not None and self.fns.modifies)
        if self.sets is not None:
            z, pos = self._sets_z(t, tile)
            self._add_sets(st, rows, z.clone(), pos)  # complete rows: final here
            st.valid[rows] = self.sets.counted(st.pos[rows], st.row[rows])
            if g_row is None:
                return None
            self._sets_coef(st, rows, g_row[rows])
            g = self._sets_grad_(z, pos, st, rows)
        elif self.kind == "sigmoid":
            st.row[rows] = self._pair_losses_(t, tile).sum(1)
            if g_row is None:
                return None
            g = self._sigmoid_grad_(t, tile, g_row[rows], 1)
        else:
            msum, cnt = t.counts(1)
            # the positives' scores before the tile becomes the denominator's terms in place
            pos = self._positive_sums(t, 1)
            z = self._z_(t, tile)
            if st.shift is not None:
                total = _exp_shifted_(z, st.shift).sum(1)
                lse = total.log().add_(st.shift)
            else:
                lse, total = lse_inplace(z)  # z: exp(z - the rows' maxima)
                total = total.squeeze(1)
            st.summing = False
            st.row[rows], st.pos[rows], st.msum[rows], st.cnt[rows] = lse, pos, msum, cnt
            c, a, valid = self._weights(self.positives, lse, msum, cnt)
            if st.ca is None:
                st.ca = (torch.zeros_like(st.row), torch.zeros_like(st.row))
            st.ca[0][rows], st.ca[1][rows] = c, a
            st.valid[rows] = valid
            if g_row is None:
                return None
            gr = g_row[rows]
            zero = torch.zeros((), dtype=z.dtype, device=z.device)
            factor = torch.where(total > 0, c * gr / torch.where(total > 0, total, 1.0), zero)
            g = t.sub_positive_(z.mul_(factor.unsqueeze(1)), a * gr, 1)
        g = self._through_mod(g, t, st, tile)
        return g if g is s else s.copy_(g)

    def param_grads(self, st: _FlexState, n: int) -> Tuple[Optional[Tensor], ...]:
        return tuple(st.param_grads[:n]) + (None,) * (n - len(st.param_grads))

    # ------------------------------------------------------------------ dense form
    def dense_terms(
        self, s: Tensor, tile: Tile, guard: bool = False, fields: Optional[Dict[str, Tensor]] = None
    ) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
        """``(out, m, logw, s')`` of the whole matrix: the pairs out of every set (the self
        pair unless ``include_self``), the positives' weights, the log weights, the
        modified scores (differentiable in ``s``). ``guard``: the pairs out of every set
        enter the functions as constants and leave them (and the log weights) as 0, so
        that nothing of theirs (a NaN, an infinite slope) reaches a gradient; ``fields``:
        the rows' data (default: the head's ``rows``)."""
        r, c = s.shape
        fields = self.rows if fields is None else fields
        a, b = self._views(tile, fields)
        t = self._terms(s.detach(), tile, fields)
        out = torch.zeros((r, c), dtype=torch.bool, device=s.device) if t.excl is None else t.excl.clone()
        if self.exclude_self:
            mask_self_(out, tile, True)  # type: ignore[arg-type]
        fns, logw = self.fns, t.logw
        if guard:
            s = torch.where(out, s.detach(), s)
            logw = None if logw is None else torch.where(out, 0.0, logw)
        sp = s if not fns.modifies else tile_result(fns.modify(s, a, b, t.m), "score_mod", r, c, s, "float")
        if guard and fns.modifies:
            sp = torch.where(out, 0.0, sp)
        return out, t.m, logw, sp

    def report(self, st: _FlexState) -> Tuple[Tensor, ...]:
        """Each row's validity once reduced: the rows a "mean" counts."""
        return (torch.ones_like(st.row, dtype=torch.bool) if st.valid is None else st.valid,)

    def dense_reported(
        self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()
    ) -> Tuple[Tuple[Tensor, Optional[Tensor]], Tuple[Tensor, ...]]:
        """The losses from the whole score matrix by differentiable torch ops (the dense
        backend; second derivatives), the captured tensors entering through
        ``score_mod``, and each row's validity (:meth:`report`)."""
        fields = self.rows
        if self.counter is not None:
            counted = self.counter.state(s.shape[0], s.shape[1], s, None)
            self.counter.reduce(s.detach().clone(), tile, counted)
            fields = {**self.rows, **statistics_of(counted, slice(None))}
        r = s.shape[0]
        if self.pairs is not None:
            pos_sum, neg_sum, pos_cnt, neg_cnt = _pair_sum_rows(*self.pairs.inputs(s, tile, fields))
            a, b = self.pair_scales(pos_cnt, neg_cnt)
            return (a * pos_sum + b * neg_sum, None), (torch.ones(r, dtype=torch.bool, device=s.device),)
        out, m, logw, sp = self.dense_terms(s, tile, guard=True, fields=fields)
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        if self.sets is not None:
            z = torch.where(out, -_INF, sp if logw is None else sp + logw)
            z = z + 0.0 * m  # a NaN membership weight makes its set NaN
            pos = m != 0
            p = logsumexp_safe(torch.where(pos, z, -_INF), 1)
            n = logsumexp_safe(torch.where(pos, -_INF, z), 1)
            valid = self.sets.counted(p.detach(), n.detach())
            return (torch.where(valid, self.sets.loss(p, n), zero), None), (valid,)
        if self.kind == "sigmoid":
            bias = params[0].to(s.dtype) if self.learn_bias and params else self.bias
            x = sp + bias
            terms = m * softplus(-x) + (1 - m) * softplus(x)
            if logw is not None:
                terms = terms * torch.exp(logw)
            rows_loss = torch.where(out, zero, terms).sum(1)
            return (rows_loss, None), (torch.ones(r, dtype=torch.bool, device=s.device),)
        if self.fns.modifies and bool((torch.isneginf(sp.detach()) & (m > 0)).any()):
            raise ValueError("score_mod returned -inf on a positive pair: a positive must stay in the denominator")
        z = sp if logw is None else sp + logw
        z = torch.where(out, torch.full((), float("-inf"), dtype=s.dtype, device=s.device), z)
        mp = torch.where(m == 0, zero, m * sp)  # a NaN weight stays NaN
        lse = logsumexp_safe(z, 1)
        c_, a_, valid = self._weights(self.positives, lse.detach(), m.sum(1), (m != 0).sum(1).to(s.dtype))
        return (torch.where(valid, c_ * torch.where(valid, lse, zero) - a_ * mp.sum(1), zero), None), (valid,)


def _namespace(view: View) -> SimpleNamespace:
    """A view's fields as plain attributes (what ``torch.compile`` traces without a guard of
    the view's own)."""
    fields = {name: getattr(view, name) for name in view._data}
    return SimpleNamespace(**fields, index=view.index)


def _pair_sum_rows(
    s: Tensor, member: Tensor, play: Tensor, w: Optional[Tensor], a: Any, b: Any, pos_fn: Fn, neg_fn: Fn, nonzero: bool
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each row's sums of its two sets' terms and the sets' counts (their weights summed):
    ``pos_fn``'s terms on the positives (``member``) in play, ``neg_fn``'s on the others in
    play (with ``nonzero``: the terms above 0 alone); where a gradient is taken, the pairs
    out of play enter the functions as constants (no gradient of theirs: a NaN or an
    infinite slope)."""
    s_in = torch.where(play, s, s.detach()) if torch.is_grad_enabled() else s
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    sums, counts = [], []
    for fn, members in ((pos_fn, play & member), (neg_fn, play & ~member)):
        t = fn(s_in, a, b) if w is None else fn(s_in, a, b) * w
        if nonzero:  # a NaN term is counted (and makes its set NaN)
            members = members & ((t > 0) | t.isnan())
        sums.append(torch.where(members, t, zero).sum(1))
        counts.append(members.sum(1, dtype=s.dtype) if w is None else torch.where(members, w, zero).sum(1))
    return sums[0], sums[1], counts[0], counts[1]


def _pair_sum_grad(
    s: Tensor,
    member: Tensor,
    play: Tensor,
    w: Optional[Tensor],
    a: Any,
    b: Any,
    pos_fn: Fn,
    neg_fn: Fn,
    nonzero: bool,
    coef_pos: Tensor,
    coef_neg: Tensor,
) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """``dL/ds`` of the tile for the rows' factors of each set (by ``torch.func.grad``
    through the functions), and the rows' sums and counts."""

    def total(x: Tensor) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        sums = _pair_sum_rows(x, member, play, w, a, b, pos_fn, neg_fn, nonzero)
        return (sums[0] * coef_pos).sum() + (sums[1] * coef_neg).sum(), sums

    return torch.func.grad(total, has_aux=True)(s)


_COMPILED: Dict[str, Any] = {}


def _compiled(name: str) -> Any:
    """A pair-sum tile function compiled by ``torch.compile`` (made once per process;
    dynamic in the tile's shape, so that a ragged last tile needs no compile of its own)."""
    fn = _COMPILED.get(name)
    if fn is None:
        target: Any = _pair_sum_rows if name == "rows" else _pair_sum_grad
        fn = _COMPILED[name] = torch.compile(target, dynamic=True)
    return fn


class PairSumTiles:
    """The pair-sum kind's tile work: each row's sums and counts by one formula,
    :func:`_pair_sum_rows`, whose gradient autograd takes (into the tensors the functions
    capture too). Compiled (``compiled``), the formula and the user's functions are fused
    by ``torch.compile`` (inductor: C++ on the CPU, Triton on CUDA), as FlexAttention
    compiles ``score_mod``, the gradient by ``torch.func.grad`` (:func:`_pair_sum_grad`):
    the eager tile's two dozen passes become one or two loops, every function's result
    checked eagerly on the first tile's first row. A compile that fails falls back to the
    eager tiles, with one warning. The masks and weights come from the head's terms (the
    functions that decide them run once per tile)."""

    def __init__(self, head: FlexHead, compiled: bool) -> None:
        self.head, self.compiled, self.checked = head, compiled, False

    def inputs(self, s: Tensor, tile: Tile, fields: Dict[str, Tensor]) -> Tuple[Any, ...]:
        """The arguments of :func:`_pair_sum_rows` for the tile ``s`` (its rows' data
        ``fields``): the views and the functions as they are compiled, or, eager, each
        function's result checked against the tile."""
        head, fns, (r, c) = self.head, self.head.fns, s.shape
        assert fns.pos_mod is not None and fns.neg_mod is not None
        if self.compiled and not self.checked:  # the eager checks of every function's result, on one row
            head._terms(s[:1].detach().clone(), Tile(tile.r0, tile.r0 + 1, tile.c0, tile.c1, tile.offset), fields)
            self.checked = True
        t = head._terms(s, tile, fields, modify=False)
        play = torch.ones((r, c), dtype=torch.bool, device=s.device)
        head._out_(play, t, tile, False)  # type: ignore[arg-type]
        w = None if t.logw is None else torch.exp(t.logw)
        a, b = head._views(tile, fields)
        nonzero = head.set_means == "mean_nonzero"
        if self.compiled:
            return s, t.m != 0, play, w, _namespace(a), _namespace(b), fns.pos_mod, fns.neg_mod, nonzero

        def checked(fn: Fn, name: str) -> Fn:
            return lambda x, a_, b_: tile_result(fn(x, a_, b_), name, r, c, x, "float")

        return s, t.m != 0, play, w, a, b, checked(fns.pos_mod, "pos_mod"), checked(fns.neg_mod, "neg_mod"), nonzero

    def _try_compiled(self, name: str, s: Tensor, tile: Tile, st: Any, *coefs: Tensor) -> Any:
        """The compiled tile function's result, or None (eager: not compiled, or a compile
        that failed)."""
        if not self.compiled:
            return None
        try:
            return _compiled(name)(*self.inputs(s, tile, st.fields), *coefs)
        except Exception as e:  # noqa: BLE001 - any compile failure: the eager tiles compute it
            warnings.warn(
                f"flashcl: the pair sum's tile function did not compile ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:120]}); computing it eagerly",
                RuntimeWarning,
                stacklevel=4,
            )
            self.compiled = False
            return None

    def reduce(self, s: Tensor, tile: Tile, st: Any) -> None:
        """The tile's sums and counts into the state."""
        sums = self._try_compiled("rows", s, tile, st)
        if sums is None:
            sums = _pair_sum_rows(*self.inputs(s, tile, st.fields))
        self._add(st, slice(tile.r0, tile.r1), sums)

    def grad(self, s: Tensor, tile: Tile, st: Any, g_row: Tensor, add_sums: bool = False) -> Tensor:
        """``dL/ds`` of the tile (each set's factor from the state's scales), the captured
        tensors' gradients into the state's, with ``add_sums`` the sums and counts too."""
        rows = slice(tile.r0, tile.r1)
        a, b = st.scales
        coef_pos, coef_neg = (g_row[rows] * a).to(s.dtype), (g_row[rows] * b).to(s.dtype)
        out = self._try_compiled("grad", s, tile, st, coef_pos, coef_neg)
        if out is None:
            captured = self.head.captured
            with torch.enable_grad():
                x = s.detach().requires_grad_(True)
                sums = _pair_sum_rows(*self.inputs(x, tile, st.fields))
                total = (sums[0] * coef_pos).sum() + (sums[1] * coef_neg).sum()
            # functions that ignore the scores and capture nothing that learns: no gradient
            g, *grads = torch.autograd.grad(total, [x, *captured], allow_unused=True) if total.grad_fn else [None]
            for i, gp in enumerate(grads):
                if gp is not None:
                    _add(st.param_grads, i, gp)
            out = torch.zeros_like(s) if g is None else g, tuple(v.detach() for v in sums)
        if add_sums:
            self._add(st, rows, out[1])
        return out[0]

    @staticmethod
    def _add(st: Any, rows: slice, sums: Tuple[Tensor, ...]) -> None:
        st.pos[rows] += sums[0]
        st.row[rows] += sums[1]
        st.pos_cnt[rows] += sums[2]
        st.neg_cnt[rows] += sums[3]


class _Statistics:
    """A statistics pass's accumulators per row: the lowest positive score, the highest
    other score, the positives' weighted score sum and weight sum."""

    def __init__(self, m: int, like: Tensor) -> None:
        self.hard_pos, self.hard_neg = like.new_full((m,), _INF), like.new_full((m,), -_INF)
        self.pos_sum, self.weight_sum = like.new_zeros(m), like.new_zeros(m)


class StatisticsHead(FlexHead):
    """The row statistics' pass, a head without gradient: each anchor's scaled scores
    ``s`` before ``score_mod``, over the pairs ``positive`` names (the self pair left out)
    and the others (the self pair left out); ``exclude`` is not applied (the functions that
    read the statistics may be ``exclude`` itself). Every tile is visited (no block mask).
    Its :meth:`values` are zeros; it reports the rows' statistics (:meth:`report`, in the
    order of :data:`~flashcl.core.STATISTICS`):

    * ``hardest_positive``: the lowest ``s`` among the positives (``+inf``: none);
    * ``hardest_negative``: the highest among the others (``-inf``: none);
    * ``positive_score``: the positives' mean ``s``, weighted by ``m`` (``+inf``: none).

    Takes :class:`FlexHead`'s arguments (the kind's are not used).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**dict(kwargs, symmetric=False, sparsity=None))
        self.sets = None

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _Statistics:  # type: ignore[override]
        return _Statistics(m, like)

    def reduce(self, s: Tensor, tile: Tile, st: _Statistics, p: int = 0) -> None:  # type: ignore[override]
        rows = slice(tile.r0, tile.r1)
        a, b = self._views(tile, self.rows)
        raw = self._raw_positives(a, b, s)
        few = self._sparse_positives(raw, None, tile, s.dtype) if raw.dtype == torch.bool else None
        if few is not None:  # the positives' entries gathered; the rest is the tile with them at -inf
            sp = s[few.ri, few.ci]
            st.hard_pos[rows].scatter_reduce_(0, few.ri, sp, "amin")
            st.pos_sum[rows].index_add_(0, few.ri, sp)
            st.weight_sum[rows] += few.counts(1)
            s.index_put_((few.ri, few.ci), s.new_tensor(-_INF))
            if self.own:
                mask_self_(s, tile, -_INF)
            if s.shape[1]:
                torch.maximum(st.hard_neg[rows], s.amax(1), out=st.hard_neg[rows])
            return
        m = torch.zeros(s.shape, dtype=s.dtype, device=s.device).copy_(raw)
        if bool((m < 0).any()):
            raise ValueError("positive returned a negative weight: positives are bool, or weights >= 0 (0: none)")
        others = torch.ones(s.shape, dtype=torch.bool, device=s.device)
        if self.own:
            mask_self_(m, tile, 0.0)
            mask_self_(others, tile, False)
        pos = m > 0
        if s.shape[1]:
            low = torch.where(pos, s, _INF).amin(1)
            torch.minimum(st.hard_pos[rows], low, out=st.hard_pos[rows])
            high = torch.where(others & ~pos, s, -_INF).amax(1)
            torch.maximum(st.hard_neg[rows], high, out=st.hard_neg[rows])
        st.pos_sum[rows] += torch.where(pos, m * s, 0.0).sum(1)
        st.weight_sum[rows] += m.sum(1)

    def rows_fused(  # type: ignore[override]
        self, s: Tensor, tile: Tile, st: _Statistics, g_row: Optional[Tensor]
    ) -> Optional[Tensor]:
        self.reduce(s, tile, st)
        return None

    def finish(self, st: Any, p: int = 0) -> None:
        pass

    def values(self, st: Any) -> Tuple[Tensor, Optional[Tensor]]:
        return torch.zeros_like(st.pos_sum), None

    def report(self, st: Any) -> Tuple[Tensor, ...]:
        """The rows' statistics, in the order of :data:`~flashcl.core.STATISTICS`."""
        found = statistics_of(st, slice(None))
        return tuple(found[name] for name in STATISTICS)

    def dense_reported(
        self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()
    ) -> Tuple[Tuple[Tensor, Optional[Tensor]], Tuple[Tensor, ...]]:
        st = self.state(s.shape[0], s.shape[1], s, None)
        self.reduce(s.detach().clone(), tile, st)  # reduce may overwrite its tile
        return self.values(st), self.report(st)


def statistics_of(st: _Statistics, rows: slice) -> Dict[str, Tensor]:
    """The statistics of ``rows`` from a statistics pass's accumulators, by name."""
    weight_sum = st.weight_sum[rows]
    has = weight_sum > 0
    mean = st.pos_sum[rows] / torch.where(has, weight_sum, torch.ones_like(weight_sum))
    return {
        "hardest_positive": st.hard_pos[rows].clone(),
        "hardest_negative": st.hard_neg[rows].clone(),
        "positive_score": torch.where(has, mean, _INF),
    }


def reads_statistics(
    fns: FlexFunctions, rows: Dict[str, Tensor], cols: Dict[str, Tensor], like: Tensor, keys_too: bool
) -> Tuple[str, ...]:
    """Which views' row statistics (:data:`STATISTICS`) the functions read: ``()``,
    ``("a",)``, ``("b",)`` or both; each function is called once on a tile of one pair
    whose views record the fields read (the keys' statistics only with ``keys_too``,
    self-contrast; elsewhere the view's error). ``positive`` may not read them (they
    are computed from it): a ValueError."""
    seen: set = set()

    class Recording(View):
        __slots__ = ()

        def __getattr__(self, name: str) -> Tensor:
            if name in STATISTICS and name not in self._data and (keys_too or self._role == "a"):
                seen.add((self._role, name))
                return torch.zeros((1, 1), dtype=like.dtype, device=like.device)
            return super().__getattr__(name)

    r = min(1, next(iter(rows.values())).shape[0]) if rows else 1
    c = min(1, next(iter(cols.values())).shape[0]) if cols else 1
    a = Recording(rows, 0, r, 0, "a", "the anchors' data (rows=)", "a")
    b = Recording(cols, 0, c, 0, "b", "the keys' data (cols=)", "b")
    s = torch.zeros(r, c, dtype=like.dtype, device=like.device)
    with torch.no_grad():
        if fns.positive is not None:
            fns.positive(a, b)
            if seen:
                raise ValueError(
                    f"positive reads {', '.join(sorted(n for _, n in seen))}: the row statistics are computed from the "
                    "positives; exclude, score_mod, weight, pos_mod and neg_mod may read them"
                )
        if fns.weight is not None:
            fns.weight(a, b)
        if fns.exclude is not None:
            fns.exclude(a, b, s) if fns.exclude_scores else fns.exclude(a, b)
        for fn in fns.mods():
            fn(s, a, b)
    return tuple(sorted({role for role, _ in seen}))


def _exp_shifted_(z: Tensor, shift: float) -> Tensor:
    """In place: ``exp(z - shift)`` (one pass over the tile when the shift is 0)."""
    return z.exp_() if shift == 0.0 else z.sub_(shift).exp_()


def _add(grads: List[Optional[Tensor]], i: int, g: Tensor) -> None:
    grads[i] = g.detach().clone() if grads[i] is None else grads[i] + g.detach()  # type: ignore[operator]
