"""Your own contrastive loss as small functions of each pair, exact and O(batch):
:func:`flex_loss` and :class:`FlexLoss`, on the flex head of :mod:`flashcl.losses.flex_head`
(the engine's drivers visit the tiles; the functions see each tile's anchors and keys)."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_labels, example_rows
from ..core import Tile, compute_dtype
from ..engine.engine import Problem, autocast_off, normalize_rows, squared_distance_rows
from ..engine.given import run_given
from ..engine.heads import softplus
from ..engine.sparsity import BlockSparsity
from ..reference.flex import FlexSpec, flex_rows, flex_statistics
from .flex_blocks import BlockMask
from .flex_head import (
    KINDS,
    POSITIVES,
    STATISTICS,
    FlexFunctions,
    FlexHead,
    PairSets,
    PairSum,
    StatisticsHead,
    View,
    captured_tensors,
    reads_statistics,
    takes_scores,
)

__all__ = ["flex_loss", "FlexLoss", "flex_dense_mask", "FlexMultiSimilarity", "FlexCircle", "FlexPairSum"]

Fn = Optional[Callable[..., Any]]


# ----------------------------------------------------------------------------- two-set kinds


class FlexMultiSimilarity(PairSets):
    """The Multi-Similarity kind of :func:`flex_loss` (``kind="multi_similarity"`` is this
    with its defaults): each anchor's loss ::

        1/alpha log(1 + sum_{j in P_i} w_ij exp(s'_ij)) + 1/beta log(1 + sum_{j in N_i} w_ij exp(s'_ij))

    over its positives ``P_i`` and its other pairs ``N_i`` in play, with ``s' =
    -alpha (s - base)`` on the positives and ``beta (s - base)`` on the negatives unless
    ``pos_mod`` / ``neg_mod`` are given; ``"mean"`` counts every anchor (as
    pytorch-metric-learning's ``MultiSimilarityLoss``).

    Args:
        alpha: the positives' scale (> 0). Default: 2.
        beta: the negatives' scale (> 0). Default: 50.
        base: the scores' shift. Default: 0.5.

    Examples::

        >>> x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        >>> loss = flashcl.flex_loss(x, rows={"y": y}, positive=lambda a, b: a.y == b.y,
        ...                          kind=flashcl.FlexMultiSimilarity(beta=40.0), temperature=1.0)
    """

    name = "multi_similarity"

    def __init__(self, alpha: float = 2.0, beta: float = 50.0, base: float = 0.5) -> None:
        self.alpha = checks.number(alpha, "alpha", positive=True)
        self.beta = checks.number(beta, "beta", positive=True)
        self.base = checks.number(base, "base")

    def __repr__(self) -> str:
        return f"FlexMultiSimilarity(alpha={self.alpha}, beta={self.beta}, base={self.base})"

    def pos_mod(self, s: Tensor, a: Any, b: Any) -> Tensor:
        return (s - self.base) * -self.alpha

    def neg_mod(self, s: Tensor, a: Any, b: Any) -> Tensor:
        return (s - self.base) * self.beta

    def loss(self, p: Tensor, n: Tensor) -> Tensor:
        return softplus(p) / self.alpha + softplus(n) / self.beta

    def slopes(self, p: Tensor, n: Tensor) -> Tuple[Tensor, Tensor]:
        return torch.sigmoid(p) / self.alpha, torch.sigmoid(n) / self.beta

    def counted(self, p: Tensor, n: Tensor) -> Tensor:
        return torch.ones_like(p, dtype=torch.bool)


class FlexCircle(PairSets):
    """The Circle kind of :func:`flex_loss` (``kind="circle"`` is this with its
    defaults): each anchor's loss ::

        log(1 + sum_{j in P_i} w_ij exp(s'_ij) * sum_{k in N_i} w_ik exp(s'_ik))

    with ``s' = -gamma a_p (s - (1 - m))`` on the positives and ``gamma a_n (s - m)`` on
    the negatives, ``a_p = relu(1 + m - s)`` and ``a_n = relu(s + m)`` taken as constants
    (as the paper and pytorch-metric-learning's ``CircleLoss``), unless ``pos_mod`` /
    ``neg_mod`` are given; ``"mean"`` counts the anchors with both sets.

    Args:
        m: the relaxation margin. Default: 0.4.
        gamma: the scale (> 0). Default: 80.

    Examples::

        >>> x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        >>> loss = flashcl.flex_loss(x, rows={"y": y}, positive=lambda a, b: a.y == b.y,
        ...                          kind=flashcl.FlexCircle(m=0.25, gamma=64.0), temperature=1.0)
    """

    name = "circle"

    def __init__(self, m: float = 0.4, gamma: float = 80.0) -> None:
        self.m = checks.number(m, "m")
        self.gamma = checks.number(gamma, "gamma", positive=True)

    def __repr__(self) -> str:
        return f"FlexCircle(m={self.m}, gamma={self.gamma})"

    def pos_mod(self, s: Tensor, a: Any, b: Any) -> Tensor:
        return (1.0 + self.m - s.detach()).clamp_min(0.0) * -self.gamma * (s - (1.0 - self.m))

    def neg_mod(self, s: Tensor, a: Any, b: Any) -> Tensor:
        return (s.detach() + self.m).clamp_min(0.0) * self.gamma * (s - self.m)

    def loss(self, p: Tensor, n: Tensor) -> Tensor:
        return softplus(p + n)

    def slopes(self, p: Tensor, n: Tensor) -> Tuple[Tensor, Tensor]:
        d = torch.sigmoid(p + n)
        return d, d

    def counted(self, p: Tensor, n: Tensor) -> Tensor:
        return ~torch.isneginf(p) & ~torch.isneginf(n)


class FlexPairSum(PairSum):
    """The pair-sum kind of :func:`flex_loss` (``kind="pair_sum"`` is this without a
    distance): each anchor's loss ::

        sum_{j in P_i} w_ij pos_mod(x_ij, a, b) + sum_{k in N_i} w_ik neg_mod(x_ik, a, b)

    over its positives ``P_i`` and its other pairs in play ``N_i``, no log-sum-exp: the
    classic contrastive loss (Hadsell et al. 2006), pytorch-metric-learning's
    ``ContrastiveLoss``, TCN's hinge. ``x`` is the scaled score ``s``, or with
    ``distance`` a distance (``temperature=1``): of the normalised rows ``"euclidean"``,
    ``sqrt(2 - 2 s)`` (its slope at 0 taken as 0, as ``torch.cdist``'s), or
    ``"squared"``, ``2 - 2 s``; with ``normalize=False`` of the rows as given, from
    ``|x|^2 + |y|^2 - 2 x.y`` (an ``exclude`` of the scores and the row statistics are
    not taken there). ``reduction``: ``"mean_nonzero"`` averages each set's
    terms above 0 over their count and adds the two sets (pytorch-metric-learning's
    ``AvgNonZeroReducer``), ``"mean"`` each set's terms over its pairs (its
    ``MeanReducer``), ``"sum"`` every term, ``"none"`` each anchor's sum.

    Args:
        distance: None (the scores), ``"euclidean"`` or ``"squared"``. Default: None.

    Examples::

        >>> x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        >>> loss = flashcl.flex_loss(x, rows={"y": y}, positive=lambda a, b: a.y == b.y,
        ...                          kind=flashcl.FlexPairSum(distance="euclidean"), temperature=1.0,
        ...                          pos_mod=lambda d, a, b: d.pow(2),
        ...                          neg_mod=lambda d, a, b: (1.0 - d).clamp_min(0).pow(2), reduction="sum")
    """


class PositiveLSE(PairSets):
    """The softmax kind with ``positives="lse"``: each anchor's loss ``LSE_{Den} (s' + log w)
    - LSE_{Pos} (s' + log w)``, the probability mass of its positives (MIL-NCE, the soft
    nearest-neighbour loss, SupCon's ``L_in`` but its ``log |P|``), computed as
    ``softplus(N - P)`` from the log-sum-exps over the positives (``P``) and over the other
    pairs of the denominator (``N``): exact near a loss of 0, where the difference of two
    log-sum-exps would cancel. Binary positives; an anchor without one is not counted."""

    name = "softmax"

    def __init__(self, score_mod: Fn = None) -> None:
        mod = score_mod if score_mod is not None else (lambda s, a, b: s)
        self.pos_mod = self.neg_mod = mod  # type: ignore[method-assign,assignment]

    def loss(self, p: Tensor, n: Tensor) -> Tensor:
        return softplus(n - p)

    def slopes(self, p: Tensor, n: Tensor) -> Tuple[Tensor, Tensor]:
        d = torch.sigmoid(n - p)
        return -d, d

    def counted(self, p: Tensor, n: Tensor) -> Tensor:
        return ~torch.isneginf(p)


def _binary(fn: Fn) -> Fn:
    """``positive`` checked to give binary positives (``positives="lse"``)."""
    if fn is None:
        return None

    def positive(a: Any, b: Any) -> Any:
        out = fn(a, b)
        if isinstance(out, Tensor) and out.dtype != torch.bool and bool(((out != 0) & (out != 1)).any()):
            raise ValueError("positives='lse' takes binary positives: positive must return bool (or 0/1)")
        return out

    return positive


#: the kinds with sets of their own by name, as ``kind=`` takes them (their defaults)
PAIR_SETS = {"multi_similarity": FlexMultiSimilarity, "circle": FlexCircle, "pair_sum": FlexPairSum}
#: the reductions of the pair-sum kind beyond every loss's
PAIR_SUM_REDUCTIONS = ("mean", "mean_nonzero", "sum", "none")


# ----------------------------------------------------------------------------- checks


def _check_data(data: object, name: str, n: int, like: Tensor) -> Dict[str, Tensor]:
    """Per-sample data: a dict of tensors whose first dimension is ``n``, on ``like``'s
    device, refused by name before any function runs (never modified: detached)."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise TypeError(
            f"{name} must be a dict of per-sample tensors (field name -> (n, ...)), got {type(data).__name__}"
        )
    out = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key.isidentifier() or key == "index" or key.startswith("_"):
            raise ValueError(f"{name}: field names are identifiers (not 'index', not starting with '_'), got {key!r}")
        if key in STATISTICS:
            raise ValueError(f"{name}: {key!r} is a row statistic's name (the loss computes it): rename the field")
        if not isinstance(value, Tensor):
            raise TypeError(f"{name}[{key!r}] must be a tensor, got {type(value).__name__}")
        if value.dim() == 0 or value.shape[0] != n:
            raise ValueError(f"{name}[{key!r}] must hold one entry per sample ({n}), got shape {tuple(value.shape)}")
        checks.same_device(value, like, f"{name}[{key!r}]", "the embeddings")
        out[key] = value.detach()
    return out


def _check_fn(fn: object, name: str) -> Fn:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a function of (a, b) or None, got {type(fn).__name__}")
    return fn  # type: ignore[return-value]


def _probe(fns: FlexFunctions, rows: Dict[str, Tensor], cols: Dict[str, Tensor], like: Tensor) -> Callable[..., Any]:
    """Calls ``score_mod`` on a tile of (at most) one anchor and one key whose scores
    require grad: the tensors it captures are found in its result's graph."""

    def probe(fn: Callable[..., Any]) -> Any:
        r = min(1, next(iter(rows.values())).shape[0]) if rows else 1
        c = min(1, next(iter(cols.values())).shape[0]) if cols else 1
        a = View(rows, 0, r, 0, "a", "the anchors' data (rows=)", "a")
        b = View(cols, 0, c, 0, "b", "the keys' data (cols=)", "b")
        s = torch.zeros(r, c, dtype=like.dtype, device=like.device, requires_grad=True)
        s._flex_probe = True  # type: ignore[attr-defined]
        return fn(s, a, b)

    return probe


# ----------------------------------------------------------------------------- the reference


def _spec(head_args: Dict[str, Any]) -> FlexSpec:
    """The oracle's reading of a call (:class:`flashcl.reference.flex.FlexSpec`), from the
    call's options as the loss hands them to a head, not from the head."""
    kind = head_args["kind"]
    name = "sets" if isinstance(kind, PairSets) else ("pair_sum" if isinstance(kind, PairSum) else kind)
    return FlexSpec(
        fns=head_args["fns"],
        kind=name,
        sets=kind if isinstance(kind, PairSets) else None,
        positives=head_args["positives"],
        set_means=head_args.get("set_means"),
        rows=head_args["rows"],
        cols=head_args["cols"],
        row_base=head_args.get("row_base", 0),
        own=head_args.get("own", False),
        exclude_self=head_args.get("exclude_self", False),
        offset=head_args.get("offset", 0),
        swapped=head_args.get("swapped", False),
        join=head_args.get("join") or (lambda x: x),
    )


def flex_block(n: int, dtype: torch.dtype) -> int:
    """Rows per block of a flex loss against ``n`` columns. Up to n = 16,384 (float32) the
    tiled backend's own choice (tiles near 16 MB, at least 256 rows: the products
    ``G^T Q_blk`` lose speed below that; InfoNCE as flex at B = 8,192, D = 768 ran 1.33x
    the built-in with 128-row blocks); wider, tiles near 4 MB (at least 16 rows): the
    functions' temporaries are a few tiles each, and 8 MB tiles peaked at 144 MB beyond
    the inputs and their gradient at B = 65,536, D = 256, 4 MB tiles at 128 MB."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if n * itemsize * 256 <= 16 * 2**20:
        return backends.auto_block(n, n, dtype)
    return int(max(16, (4 * 2**20) // max(1, n * itemsize)))


@torch.no_grad()
def _check_block_mask(q: Tensor, k: Tensor, scale: Tensor, head: FlexHead, normalize: bool) -> None:
    """The block mask's promise, on the whole matrix: every pair of a skipped tile is out
    of every set (a ValueError naming the first that is not)."""
    sparsity = head.sparsity
    assert sparsity is not None
    dtype = compute_dtype(q.dtype)
    qn, kn = q.detach().to(dtype), k.detach().to(dtype)
    if normalize:
        qn, kn = normalize_rows(qn), normalize_rows(kn)
    s = scale.detach().to(dtype) * (qn @ kn.T)
    out = head.dense_terms(s, _tile(q.shape[0], k.shape[0], head.offset))[0]
    b = sparsity.block
    kept = sparsity.keep.to(out.device).repeat_interleave(b, 0)[: out.shape[0]].repeat_interleave(b, 1)
    broken = (~kept[:, : out.shape[1]] & ~out).nonzero()
    if broken.numel():
        i, j = (int(x) for x in broken[0])
        if head.swapped:
            i, j = j, i
        raise ValueError(
            f"block_mask skips tile ({i // b}, {j // b}) (blocks of {b}), where the pair (anchor {i}, key {j}) "
            "is not excluded: the tiled backend would leave it out. Keep that tile, or exclude the pair"
        )


def _tile(m: int, n: int, offset: int) -> Tile:
    return Tile(0, m, 0, n, offset)


# ----------------------------------------------------------------------------- the backends

Fields = Dict[str, Tensor]
Params = Tuple[Tensor, ...]


class _Oracle:
    """The reference backend's road: the functions called one anchor at a time
    (:mod:`flashcl.reference.flex`, which reads the call's options, never a head), on the
    embeddings or on a given score matrix; the anchors' statistics a pass of their own."""

    #: the anchors' statistics may be formed in a first pass of the losses' own visit
    inline_statistics = False
    #: a block mask's skipped tiles are never visited (else its promise is checked whole)
    skips_tiles = False
    #: the pair sum's tile functions may be compiled
    compiles = False

    @staticmethod
    def _rows_and_keys(q: Tensor, source: backends.Source, normalize: bool) -> Tuple[Tensor, Tensor]:
        dtype = compute_dtype(q.dtype)
        qn, kn = q.to(dtype), (q if source.own else source.keys).to(dtype)
        if normalize:
            qn = normalize_rows(qn)
            kn = qn if source.own else normalize_rows(kn)
        return qn, kn

    @torch.no_grad()
    def statistics(self, q: Tensor, source: backends.Source, scale: Tensor, args: Dict, opts: Any) -> Fields:
        """The row statistics of the anchors ``q`` against ``source``, by name."""
        qn, kn = self._rows_and_keys(q.detach(), source, opts.normalize)
        sc, spec = scale.detach().to(qn.dtype), _spec(args)
        return flex_statistics(lambda i: sc * (qn[i : i + 1] @ kn.T), q.shape[0], kn.shape[0], spec, q)

    def rows(
        self, q: Tensor, source: backends.Source, scale: Tensor, args: Dict, params: Params, bias: Any, opts: Any
    ) -> Tuple[Tensor, Tensor]:
        """``(the per-row losses or, reduced, their sum, each row's validity)`` of the rows
        ``q`` against ``source`` (``args``: the head's arguments, the data ``rows`` and
        ``cols`` among them; ``bias``: the oracle's, ``params``: the engine's)."""
        qn, kn = self._rows_and_keys(q, source, opts.normalize)
        sc, spec = scale.to(qn.dtype), _spec(args)
        with autocast_off(q.device.type):
            out, valid = flex_rows(lambda i: sc * (qn[i : i + 1] @ kn.T), q.shape[0], kn.shape[0], spec, bias, q)
        if q.shape[0] == 0:  # no anchors: the keys stay in the graph (a gathered key's backward is collective)
            out = (qn @ kn.T).sum(1)
        return _summed(out, valid, opts), valid

    @torch.no_grad()
    def score_statistics(self, scores: Tensor, scale: Tensor, args: Dict, block: Optional[int]) -> Fields:
        """:meth:`statistics` on a given score matrix."""
        sc = scale.detach().to(compute_dtype(scores.dtype))
        spec = _spec(args)
        m, n = scores.shape
        return flex_statistics(lambda i: sc * scores[i : i + 1].detach().to(sc.dtype), m, n, spec, scores)

    def score_rows(
        self, scores: Tensor, scale: Tensor, args: Dict, params: Params, bias: Any, opts: Any
    ) -> Tuple[Tensor, Tensor]:
        """:meth:`rows` on a given score matrix."""
        sc, spec = scale.to(compute_dtype(scores.dtype)), _spec(args)
        m, n = scores.shape
        out, valid = flex_rows(lambda i: sc * scores[i : i + 1].to(sc.dtype), m, n, spec, bias, scores)
        return _summed(out, valid, opts), valid


class _Engine:
    """The engine's road, here its tiled backend (:class:`_Dense` its dense one): the flex
    head on the engine's drivers (:meth:`flashcl.backends.Source.run`), a given
    score matrix a block of complete rows at a time
    (:func:`~flashcl.engine.given.run_given`), the anchors' statistics a first pass
    of the same head where they are the anchors' alone; a block mask's tiles skipped, the
    pair sum's tile functions compiled."""

    name = "tiled"
    inline_statistics = True
    skips_tiles = True
    compiles = True

    def _run(
        self, q: Tensor, source: backends.Source, head: FlexHead, scale: Tensor, weights: Any, params: Params, opts: Any
    ) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        """``head`` on the rows ``q`` against ``source`` on this road's backend: its losses
        and what it reports."""
        block = opts.block_size or flex_block(source.total, compute_dtype(q.dtype))
        problem = Problem(head, (), opts.normalize, head.offset)
        return source.run(q, scale, problem, weights, block, params, backend=self.name)

    @torch.no_grad()
    def statistics(self, q: Tensor, source: backends.Source, scale: Tensor, args: Dict, opts: Any) -> Fields:
        _, found = self._run(q.detach(), source, StatisticsHead(**args), scale.detach(), None, (), opts)
        return dict(zip(STATISTICS, found))

    def rows(
        self, q: Tensor, source: backends.Source, scale: Tensor, args: Dict, params: Params, bias: Any, opts: Any
    ) -> Tuple[Tensor, Tensor]:
        per_row = opts.reduction == "none"
        weights = None if per_row else (torch.ones(q.shape[0], dtype=compute_dtype(q.dtype), device=q.device), None)
        out, (valid,) = self._run(q, source, FlexHead(**args), scale, weights, params, opts)
        return out, valid

    @torch.no_grad()
    def score_statistics(self, scores: Tensor, scale: Tensor, args: Dict, block: Optional[int]) -> Fields:
        block = block or flex_block(scores.shape[1], compute_dtype(scores.dtype))
        _, found = run_given(scores.detach(), scale.detach(), StatisticsHead(**args), None, block)
        return dict(zip(STATISTICS, found))

    def score_rows(
        self, scores: Tensor, scale: Tensor, args: Dict, params: Params, bias: Any, opts: Any
    ) -> Tuple[Tensor, Tensor]:
        m, n = scores.shape
        dtype = compute_dtype(scores.dtype)
        weights = None if opts.reduction == "none" else torch.ones(m, dtype=dtype, device=scores.device)
        block = opts.block_size or flex_block(n, dtype)
        out, (valid,) = run_given(scores, scale, FlexHead(**args), weights, block, params)
        return out, valid


class _Dense(_Engine):
    """The engine's dense backend: the whole score matrix at once, a given one by the
    head's differentiable dense form; a block mask's promise checked whole."""

    name = "dense"
    skips_tiles = False
    compiles = False

    def score_rows(
        self, scores: Tensor, scale: Tensor, args: Dict, params: Params, bias: Any, opts: Any
    ) -> Tuple[Tensor, Tensor]:
        s = scale * scores.to(compute_dtype(scores.dtype))
        head = FlexHead(**args)
        (out, _), (valid,) = head.dense_reported(s, _tile(s.shape[0], s.shape[1], 0), params)
        return _summed(out, valid, opts), valid


_Road = Union[_Oracle, _Engine]

#: the backends flex_loss computes with, each its road
ROADS: Dict[str, _Road] = {"reference": _Oracle(), "dense": _Dense(), "tiled": _Engine()}
FLEX_BACKENDS = tuple(ROADS)


def _summed(out: Tensor, valid: Tensor, opts: Any) -> Tensor:
    """Per-row losses (``reduction="none"``), or the sum of the valid rows'."""
    return out if opts.reduction == "none" else torch.where(valid, out, torch.zeros_like(out)).sum()


# ----------------------------------------------------------------------------- the body


def _direction(
    q: Tensor, source: backends.Source, scale: Tensor, args: Dict, params: Params, bias: Any, road: _Road, opts: Any
) -> Tuple[Tensor, Tensor]:
    """One direction's rows on ``road``: ``(the per-row losses or their sum, each row's
    validity)`` of the rows ``q`` against ``source`` (``args``: the head's arguments, the
    rows' and columns' data among them); a block mask's promise checked where its tiles
    are visited."""
    if args["sparsity"] is not None and not road.skips_tiles:
        _check_block_mask(q, q if source.own else source.keys, scale, FlexHead(**args), opts.normalize)
    return road.rows(q, source, scale, args, params, bias, opts)


def _captured(fns: FlexFunctions, rows: Dict[str, Tensor], cols: Dict[str, Tensor], like: Tensor) -> Tuple[Tensor, ...]:
    """The tensors requiring grad that the modifying functions capture, each once."""
    found: list = []
    for fn in fns.mods():
        for t in captured_tensors(fn, _probe(fns, rows, cols, like)):
            if all(t is not f for f in found):
                found.append(t)
    return tuple(found)


@shared_docs
def flex_loss(
    q: Optional[Tensor] = None,
    keys: Optional[Tensor] = None,
    *,
    scores: Optional[Tensor] = None,
    rows: Optional[Dict[str, Tensor]] = None,
    cols: Optional[Dict[str, Tensor]] = None,
    positive: Fn = None,
    exclude: Fn = None,
    score_mod: Fn = None,
    weight: Fn = None,
    pos_mod: Fn = None,
    neg_mod: Fn = None,
    kind: Any = "softmax",
    positives: str = "mean",
    include_self: bool = False,
    both_directions: bool = False,
    symmetric: bool = False,
    block_mask: Optional[BlockMask] = None,
    temperature: Any = 0.1,
    bias: Any = None,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
    shared_keys: Optional[bool] = None,
    compiled: Optional[bool] = None,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
) -> Tensor:
    r"""A contrastive loss of your own, written as small functions of each pair and
    computed exactly, tile by tile, in O(batch) memory: positives from time windows, graph
    edges or soft labels, negatives that leave out duplicates or likely false negatives, a
    margin or a per-pair weight, on the engine every built-in loss runs on (every backend,
    across processes), never as a B x B matrix (as FlexAttention does for attention).

    Anchors ``q`` (M, D) against ``keys`` (N, D), or against each other (self-contrast,
    ``keys=None``: the self pair is never a positive and is out of the denominator unless
    ``include_self``). With ``s_ij = q^_i . k^_j / temperature`` and ``s'`` its modified
    score, ``m_ij`` the positive weights and ``w_ij`` the denominator weights:

    $$
    L_i = \log \sum_{j \in Den(i)} w_{ij} e^{s'_{ij}}, \qquad
    \ell_i = \frac{1}{|Pos(i)|} \sum_{j \in Pos(i)} m_{ij} (L_i - s'_{ij}) \quad (\text{positives="mean"})
    $$

    (``"weighted_mean"``: divided by ``sum_j m_ij`` instead, a cross-entropy against soft
    targets; ``"pairs"``: not divided, the neighbour loss; ``"sum"``: ``L_i - sum_j m_ij
    s'_ij``, supervised SimCSE as commonly written). ``kind="sigmoid"``: ``sum_j w_ij
    [m_ij softplus(-(s'_ij + b)) + (1 - m_ij) softplus(s'_ij + b)]``, SigLIP's binary
    cross-entropy with your positives. The two-set kinds, ``"multi_similarity"`` and
    ``"circle"`` (:class:`flashcl.FlexMultiSimilarity`, :class:`flashcl.FlexCircle`), take
    one log-sum-exp over each anchor's positives, ``P_i = LSE_j (pos_mod(s, a, b)_ij +
    log w_ij)``, and one over its negatives (its other pairs in play), ``N_i`` with
    ``neg_mod``, and combine them as pytorch-metric-learning's ``MultiSimilarityLoss`` and
    ``CircleLoss`` do.

    The functions take two views of a tile of pairs: ``a``, its anchors, each field of
    ``rows`` shaped (R, 1, ...), and ``b``, its keys, each field of ``cols`` shaped
    (1, C, ...); both have ``.index``, the samples' global positions. They return tensors
    that broadcast to (R, C) by torch's rules::

        positive=lambda a, b: (a.t - b.t).abs() <= 2            # time windows
        exclude=lambda a, b: a.doc == b.doc                      # duplicates out of every set
        exclude=lambda a, b, s: s > s_pos_bound                  # with the tile's scores (detached)
        score_mod=lambda s, a, b: s - margin * (a.y == b.y)      # a margin; a captured tensor learns
        weight=lambda a, b: torch.where(a.y == b.y, 0.5, 1.0)    # the denominator's weights

    Row statistics: ``a.hardest_positive`` (the lowest scaled score ``s`` among the
    anchor's positives), ``a.hardest_negative`` (the highest among its other pairs) and
    ``a.positive_score`` (its positives' mean ``s``, weighted by ``m``), from ``s`` before
    any modification, the self pair left out and ``exclude`` not applied, over the whole
    batch (every rank's keys); ``+inf`` (``-inf`` for the hardest negative) where the set
    is empty; no gradient. ``exclude``, ``score_mod``, ``weight``, ``pos_mod`` and
    ``neg_mod`` may read them (with self-contrast ``b``'s too; which are read is seen by
    calling each function once on a pair). The anchors' are formed in the loss's own visit
    of the tiles; the keys', or with ``both_directions`` or ``block_mask``, cost a visit of
    their own first::

        exclude=lambda a, b, s: s > a.positive_score + 0.1       # likely false negatives out
        exclude=lambda a, b, s: torch.where(a.y == b.y,          # Multi-Similarity's miner
                                            s >= a.hardest_negative + 0.1,
                                            s <= a.hardest_positive - 0.1)

    Args:
        q: the anchors (M, D).
        keys: the keys (N, D); None: self-contrast.
        scores: instead of ``q`` and ``keys``, a given (M, N) score matrix (the
            sampled-neighbours loss's form): ``s = scores / temperature``, read a block of
            rows at a time; self-contrast (the diagonal the self pair, M == N) unless
            ``cols`` is given. One process; not with ``both_directions``,
            ``symmetric``, ``block_mask`` or ``matryoshka_dims``; ``normalize`` does not
            apply.
        rows: per-anchor data, ``{"name": (M, ...) tensor}``; never differentiated.
        cols: per-key data ((N, ...)); with self-contrast the keys' data is ``rows``.
        positive: ``positive(a, b)``: bool, or weights ``m_ij >= 0`` (0: not a positive).
            Default: the diagonal ``a.index == b.index`` for two towers; required for
            self-contrast.
        exclude: ``exclude(a, b)`` or ``exclude(a, b, s)`` (bool): pairs out of every set.
        score_mod: ``score_mod(s, a, b)``: the score a pair enters with, differentiable in
            ``s`` and in the tensors it captures (their gradients are computed); ``-inf``
            takes a pair out of the denominator (on a positive: an error).
        weight: ``weight(a, b) >= 0``: the denominator's importance weights (softmax), a
            factor on each pair's term (sigmoid), on each term of both sets (two-set
            kinds); no gradient.
        pos_mod, neg_mod: a two-set kind's modified scores, ``pos_mod(s, a, b)`` on the
            positives and ``neg_mod(s, a, b)`` on the negatives, differentiable as
            ``score_mod`` (``-inf``: out of its set). Default: the kind's.
        kind: ``"softmax"`` (default) | ``"sigmoid"`` | ``"multi_similarity"`` |
            ``"circle"`` | a :class:`flashcl.FlexMultiSimilarity` or
            :class:`flashcl.FlexCircle` with its constants. The two-set kinds take
            ``positive`` as membership (``m > 0``), not ``score_mod``, ``positives``,
            ``include_self`` or ``both_directions``.
        positives: ``"mean"`` (default) | ``"weighted_mean"`` | ``"pairs"`` | ``"sum"``.
            An anchor without positives (but with ``"sum"``) or with an empty denominator
            contributes 0 and is not counted by ``reduction="mean"``.
        include_self: self-contrast: the self pair in the denominator. Default: False.
        both_directions: two towers (softmax): the column direction too, the keys as
            anchors against the queries (the functions still see ``(anchor, key)`` pairs),
            the two averaged as :func:`flashcl.clip_loss` does. Default: False.
        symmetric: self-contrast with functions that answer alike for ``(a, b)`` and
            ``(b, a)``: the symmetric panels are visited (about 2/3 of the products).
        block_mask: a :class:`flashcl.BlockMask` over the (M, N) pairs: the tiled backend
            visits only its tiles, whose pairs must be all the loss can use (every pair
            of a skipped tile excluded); the dense and reference backends check that
            promise. Sets the block size; one process (not with ``process_group``).
        temperature: a float or a 0-dim tensor (learnable). Default: 0.1.
        bias: the sigmoid kind's bias, a float or a 0-dim tensor (learnable). Default: 0.
        normalize: L2-normalise ``q`` and ``keys``. Default: True.
        reduction: ``"mean"`` (default: over the counted anchors; the sigmoid kind over
            every anchor) | ``"sum"`` | ``"none"`` ((M,); with ``both_directions`` M == N,
            each pair's two directions averaged).
        @backend@ No Triton kernel: ``"auto"`` picks ``"tiled"`` from 2^20 pairs,
            ``"dense"`` below; ``"reference"`` calls the functions one anchor at a time.
        @process_group@
        shared_keys: across processes, whether ``keys`` are keys that every rank holds
            alike (a queue, a memory bank, cluster prototypes): they enter the global loss
            once (as rank 0's), and ranks that pass different ones get a ValueError each;
            False: each rank's own keys, gathered from every rank (a frozen tower's keys,
            without gradient). Default (None): shared when ``keys`` carries no gradient
            (``requires_grad`` False) and not ``both_directions``, each rank's own
            otherwise. True takes keys without gradient, not ``both_directions``. One
            process: no effect.
        compiled: the pair-sum kind's tile work (the functions, the masks, the sums, the
            gradient) compiled by ``torch.compile`` into one or two loops per tile (C++ on
            the CPU, Triton on CUDA), as FlexAttention compiles ``score_mod``: the first
            call compiles (seconds, once per process), the tiles then run several times
            faster than the eager passes. Default (None): on the tiled backend from 2^24
            pairs, where no function captures a tensor that learns; a compile that fails
            falls back to the eager tiles with one warning.
        @matryoshka@

    Matryoshka widths visit the tiles once per width. Under ``torch.compile`` the call is
    one graph break: the functions run eagerly, as written (a compiled step around it
    keeps its other graphs; ``fullgraph=True`` refuses it).

    Shape:
        - q: (M, D); keys: (N, D); rows: fields (M, ...); cols: fields (N, ...); output:
          scalar, or (M,) with ``reduction="none"``.

    Examples::

        >>> emb, t = torch.randn(64, 32, requires_grad=True), torch.arange(64.0)
        >>> loss = flashcl.flex_loss(emb, rows={"t": t}, positive=lambda a, b: (a.t - b.t).abs() <= 2)
        >>> loss.backward()
    """
    options = dict(locals())
    dims, weights = options.pop("matryoshka_dims"), options.pop("matryoshka_weights")
    if scores is not None and (dims is not None or weights is not None):
        raise ValueError("matryoshka_dims takes embeddings, not a given score matrix (scores=)")
    if dims is None and weights is None:
        return _flex(options)
    if dims is None:
        raise ValueError("matryoshka_weights needs matryoshka_dims")
    q_ = checks.check_float_tensor(q, "q", (2,), process_group is not None)
    ds, ws = checks.check_dims(dims, weights, q_.shape[-1])
    parts = []
    for d, w in zip(ds, ws):
        parts.append(w * _flex(dict(options, q=q_[:, :d], keys=None if keys is None else keys[:, :d])))
    return torch.stack(parts).sum(0)


def _flex(o: Dict[str, Any]) -> Tensor:
    """:func:`flex_loss` at one width: eager under ``torch.compile`` (the user's functions
    are Python run on each tile), the compiler's ``disable`` taken only when compiling, so
    that importing flashcl does not load it."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_flex_eager)(o)
    return _flex_eager(o)


def _flex_eager(o: Dict[str, Any]) -> Tensor:
    if o["scores"] is not None or o["q"] is None:
        return _flex_scores(o)
    kind = o["kind"]
    if isinstance(kind, PairSum) and kind.distance is not None and not kind.squared_scores and o["normalize"] is False:
        return _flex_eager(_squared_distances(o))
    q, keys, rows, cols, kind = o["q"], o["keys"], o["rows"], o["cols"], o["kind"]
    include_self, both_directions, symmetric = o["include_self"], o["both_directions"], o["symmetric"]
    block_mask, block_size, process_group, backend = o["block_mask"], o["block_size"], o["process_group"], o["backend"]
    empty = process_group is not None
    q = checks.check_float_tensor(q, "q", (2,), empty)
    own = keys is None
    if not own:
        keys = checks.check_keys(keys, "keys", q, empty)
    for flag, flag_name in (
        (include_self, "include_self"),
        (both_directions, "both_directions"),
        (symmetric, "symmetric"),
    ):
        checks.check_bool(flag, flag_name)
    sparsity = None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a flashcl.BlockMask, got {type(block_mask).__name__}")
        if process_group is not None:
            raise ValueError("block_mask takes one process: its tiles are the whole batch's (no process_group)")
        if block_size is not None and block_size != block_mask.block_size:
            raise ValueError(f"block_size={block_size} and the block mask's blocks ({block_mask.block_size}) differ")
        block_size = block_mask.block_size
        n_keys = q.shape[0] if own else keys.shape[0]  # type: ignore[union-attr]
        sparsity = BlockSparsity(block_mask.keep, block_size, q.shape[0], n_keys)
    reduction, set_means = _pair_reductions(o)
    opts = checks.Options(o["normalize"], reduction, backend, block_size, process_group, o["strategy"], o["grad_scale"])
    checks.check_choice(backend, "backend", ("auto", *FLEX_BACKENDS, "triton"))
    kind, fns, scale, bias_t = _functions_and_scalars(o, own, q)
    if own and cols is not None:
        raise ValueError("cols is the keys' data; with keys=None the keys are the anchors: give their data as rows=")
    if both_directions and (own or kind != "softmax"):
        raise ValueError("both_directions takes two towers (keys given) and kind='softmax'")
    if both_directions and opts.reduction == "none" and q.shape[0] != keys.shape[0]:  # type: ignore[union-attr]
        raise ValueError("reduction='none' with both_directions needs as many queries as keys (M == N)")
    if symmetric and not own:
        raise ValueError("symmetric=True is for self-contrast (keys=None): the pairs (i, j) and (j, i) alike")
    row_data = _check_data(rows, "rows", q.shape[0], q)
    col_data = row_data if own else _check_data(cols, "cols", keys.shape[0], q)  # type: ignore[union-attr]
    learn_bias = bias_t is not None and bias_t.requires_grad
    params: Tuple[Tensor, ...] = (bias_t,) if learn_bias else ()  # type: ignore[assignment]
    group = opts.process_group
    shared = _shared_keys(o["shared_keys"], keys, group, both_directions)
    with autocast_off(q.device.type):
        if shared:  # every rank's keys alike: once, after rank 0's none (compared across the ranks)
            assert keys is not None
            try:
                source = parallel.columns(keys[:0], opts.strategy, group, shared=keys)
                col_all = {k: source.gather(v[:0], shared=v) for k, v in col_data.items()}
            except ValueError as e:
                raise ValueError(
                    f"{e}. flex_loss: keys without gradient are taken as shared keys (a queue, prototypes) that "
                    "every rank holds alike; for each rank's own keys without gradient (a frozen tower's) pass "
                    "shared_keys=False"
                ) from e
        else:
            source = parallel.columns(q if own else keys, opts.strategy, group, own=own)  # type: ignore[arg-type]
            col_all = {k: source.gather(v) for k, v in col_data.items()}
        if own:
            row_base = source.offset
        elif group is None:
            row_base = 0
        else:
            row_base = sum(parallel.row_counts(q.shape[0], q.device, group)[: parallel.rank_of(group)])
        # round the ring (strategy="ring") the tiled backend, or a refusal of another
        family = "flex_loss (its functions run on each tile in torch)"
        road = ROADS[backends.pick_name(backend, FLEX_BACKENDS, q.shape[0] * source.total, q, family, source=source)]
        head_args: Dict[str, Any] = dict(
            kind=kind,
            positives=o["positives"],
            fns=fns,
            row_base=row_base,
            own=own,
            exclude_self=own and not include_self,
            offset=source.offset if own else 0,
            symmetric=symmetric,
            sparsity=sparsity,
            bias=0.0 if bias_t is None else float(bias_t.detach()),
            learn_bias=learn_bias,
            set_means=set_means,
            join=None if group is None else functools.partial(parallel.sum_across, group=group),
        )
        sides = reads_statistics(fns, row_data, col_all, q, keys_too=own)
        if sides and o.get("lowered"):
            raise ValueError(
                "the row statistics (hardest_negative, ...) are of the scores, which a distance of unnormalised rows "
                "does not form: normalize=True, or a pair sum without them"
            )
        if sides == ("a",) and road.inline_statistics and sparsity is None and not both_directions:
            # the anchors' own: formed by the loss's head in a first pass (complete row blocks: on the
            # scores they hold); the fields here stand in for them where a function is probed
            dtype = compute_dtype(q.dtype)
            row_data = {**row_data, **{k: q.new_zeros(q.shape[0], dtype=dtype) for k in STATISTICS}}
            head_args["inline_statistics"] = True
        elif sides:
            stats = road.statistics(q, source, scale, dict(head_args, rows=row_data, cols=col_all), opts)
            row_data = {**row_data, **stats}
            if own:  # the keys are every rank's anchors: their statistics travel with them
                col_all = {**col_all, **{k: source.gather(v) for k, v in stats.items()}}
        captured = _captured(fns, row_data, col_all, q)
        head_args["captured"] = captured
        head_args["compiled"] = _compiles(o["compiled"], kind, captured, road, q.shape[0] * source.total)
        all_params = params + captured
        args = dict(head_args, rows=row_data, cols=col_all)
        out, valid = _direction(q, source, scale, args, all_params, bias_t, road, opts)
        parts = [(out, valid)]
        if both_directions:
            # the column direction: the keys as anchors against every rank's queries, the functions still
            # called on (anchor, key) pairs (swapped), as clip_loss's second direction
            assert keys is not None
            back = parallel.columns(q, opts.strategy, group)
            q_all = {k: back.gather(v) for k, v in row_data.items()}
            key_base = (
                0
                if group is None
                else sum(parallel.row_counts(keys.shape[0], q.device, group)[: parallel.rank_of(group)])
            )
            swapped = dict(
                args, rows=col_data, cols=q_all, row_base=key_base, swapped=True,
                sparsity=None if sparsity is None else sparsity.transposed(),
            )  # fmt: skip
            parts.append(_direction(keys, back, scale, swapped, all_params, bias_t, road, opts))
        return _reduce(parts, opts, source)


def _squared_distances(o: Dict[str, Any]) -> Dict[str, Any]:
    """A pair sum on distances of unnormalised rows, lowered to one whose scores are the
    squared distances (:func:`~flashcl.engine.engine.squared_distance_rows`, in float32 for
    half inputs). Self-contrast becomes the anchors against their lowered twins, each self
    pair left out by its global position (``a.index == b.index``), the anchors' data the
    keys' too."""
    q, keys = o["q"], o["keys"]
    empty = o["process_group"] is not None
    q = checks.check_float_tensor(q, "q", (2,), empty)
    own = keys is None
    if own:
        if o["cols"] is not None:
            raise ValueError(
                "cols is the keys' data; with keys=None the keys are the anchors: give their data as rows="
            )
        if o["positive"] is None:
            raise ValueError("positive is required for self-contrast (keys=None): which pairs are positives?")
        _shared_keys(o["shared_keys"], None, None, False)  # shared_keys=True refused
    else:
        keys = checks.check_keys(keys, "keys", q, empty)
    exclude = _check_fn(o["exclude"], "exclude")
    if exclude is not None and takes_scores(exclude):
        raise ValueError(
            "exclude of (a, b, s) reads the scores, which a distance of unnormalised rows does not form (the loss "
            "computes the squared distances): write it of (a, b), or as pos_mod / neg_mod of the distance"
        )
    dtype = compute_dtype(q.dtype)
    x, y = q.to(dtype), (q if own else keys).to(dtype)
    lowered = copy.copy(o["kind"])
    lowered.squared_scores = True
    anchors, candidates = squared_distance_rows(x, y)
    out = dict(o, q=anchors, keys=candidates, kind=lowered, lowered=True)
    if own:
        out.update(cols=o["rows"], exclude=_self_pairs_out(exclude), shared_keys=False, symmetric=False)
    return out


def _self_pairs_out(exclude: Fn) -> Fn:
    """``exclude`` with each self pair (the same global position) out of every set too."""

    def out(a: Any, b: Any) -> Any:
        same = a.index == b.index
        if exclude is None:
            return same
        e = exclude(a, b)
        # anything but a bool tensor: the head's check names exclude and what it must return
        return same | e if isinstance(e, Tensor) and e.dtype == torch.bool else e

    return out


def _shared_keys(flag: Any, keys: Optional[Tensor], group: Any, both_directions: bool) -> bool:
    """Whether ``keys`` join the column source once, as keys every rank holds alike
    (``shared_keys``: None, the keys without gradient); checked on one process too."""
    if flag is not None:
        checks.check_bool(flag, "shared_keys")
    if keys is None:
        if flag:
            raise ValueError("shared_keys takes keys: with keys=None the keys are every rank's anchors")
        return False
    # both directions make the keys anchors too: a batch of each rank's own
    shared = not (keys.requires_grad or both_directions) if flag is None else bool(flag)
    if shared and keys.requires_grad:
        raise ValueError(
            "shared_keys=True takes keys without gradient (a queue, prototypes: the same on every rank); "
            "keys with gradient are each rank's own (shared_keys=False)"
        )
    if shared and both_directions:
        raise ValueError(
            "shared_keys=True with both_directions: shared keys (the same on every rank, entering once) would be "
            "anchors on every rank; both directions take each rank's own keys"
        )
    return shared and group is not None


def _flex_scores(o: Dict[str, Any]) -> Tensor:
    """:func:`flex_loss` on a given score matrix (``scores=``)."""
    scores, rows, cols, backend, block_size = o["scores"], o["rows"], o["cols"], o["backend"], o["block_size"]
    if scores is None:
        raise ValueError("flex_loss takes the anchors q (M, D), or a given score matrix as scores= (M, N)")
    scores = checks.check_float_tensor(scores, "scores", (2,))
    for flag_name in ("both_directions", "symmetric"):
        if checks.check_bool(o[flag_name], flag_name):
            raise ValueError(f"{flag_name}=True takes embeddings, not a given score matrix (scores=)")
    include_self = checks.check_bool(o["include_self"], "include_self")
    if o["block_mask"] is not None:
        raise ValueError("block_mask takes embeddings, not a given score matrix (scores=)")
    if o["process_group"] is not None:
        raise ValueError("scores= takes one process (each rank's rows of a given matrix: use neighbor_loss)")
    checks.check_choice(backend, "backend", ("auto", *FLEX_BACKENDS))
    reduction, set_means = _pair_reductions(o)
    opts = checks.Options(True, reduction, backend, block_size, None, o["strategy"], o["grad_scale"])
    m, n = scores.shape
    own = cols is None
    if own and m != n:
        raise ValueError(
            f"scores is {m} x {n}: self-contrast (no cols=) takes a square matrix whose diagonal is the self "
            "pair; for two towers give the keys' data as cols="
        )
    kind, fns, scale, bias_t = _functions_and_scalars(o, own, scores)
    row_data = _check_data(rows, "rows", m, scores)
    col_data = row_data if own else _check_data(cols, "cols", n, scores)
    learn_bias = bias_t is not None and bias_t.requires_grad
    head_args: Dict[str, Any] = dict(
        kind=kind,
        positives=o["positives"],
        fns=fns,
        own=own,
        exclude_self=own and not include_self,
        bias=0.0 if bias_t is None else float(bias_t.detach()),
        learn_bias=learn_bias,
        set_means=set_means,
    )
    road = ROADS[backends.pick_name(backend, FLEX_BACKENDS, m * n, scores, "flex_loss (a given score matrix)")]
    if reads_statistics(fns, row_data, col_data, scores, keys_too=own):
        stats = road.score_statistics(scores, scale, dict(head_args, rows=row_data, cols=col_data), block_size)
        row_data = {**row_data, **stats}
        col_data = {**col_data, **stats} if own else col_data
    captured = _captured(fns, row_data, col_data, scores)
    args = dict(head_args, rows=row_data, cols=col_data, captured=captured)
    params: Params = ((bias_t,) if learn_bias else ()) + captured  # type: ignore[assignment]
    with autocast_off(scores.device.type):
        out, valid = road.score_rows(scores, scale, args, params, bias_t, opts)
    return _reduce([(out, valid)], opts, backends.local(scores))


def _kind(o: Dict[str, Any]) -> Any:
    """The call's kind, checked: ``"softmax"``, ``"sigmoid"`` or a two-set kind (by name: its
    defaults); the options a kind does not take refused."""
    kind = o["kind"]
    if kind == "softmax" and o["positives"] == "lse":  # the positives' log-sum-exp: two sets
        if o["pos_mod"] is not None or o["neg_mod"] is not None:
            raise ValueError(
                "pos_mod and neg_mod are for the kinds with two sets of pairs: positives='lse' takes score_mod"
            )
        if o["include_self"] or o["both_directions"]:
            raise ValueError(
                "positives='lse' leaves the self pair out and takes one direction (no include_self, no both_directions)"
            )
        return PositiveLSE(o["score_mod"])
    if isinstance(kind, str):
        checks.check_choice(kind, "kind", KINDS + tuple(PAIR_SETS))
        kind = PAIR_SETS[kind]() if kind in PAIR_SETS else kind
    elif not isinstance(kind, (PairSets, PairSum)):
        raise TypeError(
            f"kind must be 'softmax', 'sigmoid', 'multi_similarity', 'circle', 'pair_sum' or a kind with sets "
            f"(flashcl.FlexMultiSimilarity, flashcl.FlexCircle, flashcl.FlexPairSum), got {type(kind).__name__}"
        )
    if isinstance(kind, PairSum):
        if o["pos_mod"] is None or o["neg_mod"] is None:
            raise ValueError("kind='pair_sum' sums each pair's own term: give both pos_mod and neg_mod")
        if o["both_directions"]:
            raise ValueError("both_directions takes kind='softmax'")
    if o["positives"] == "lse":
        raise ValueError("positives='lse' is the softmax kind's (the positives' log-sum-exp)")
    if isinstance(kind, (PairSets, PairSum)):
        if o["score_mod"] is not None:
            raise ValueError(f"kind={kind.name!r} modifies the scores per set: give pos_mod and neg_mod, not score_mod")
        if o["positives"] != "mean":
            raise ValueError(f"positives= is the softmax kind's; kind={kind.name!r} has its own reduction of each set")
        if o["include_self"]:
            raise ValueError(
                f"include_self is the softmax and sigmoid kinds'; kind={kind.name!r} leaves the self pair out"
            )
    elif o["pos_mod"] is not None or o["neg_mod"] is not None:
        raise ValueError(
            "pos_mod and neg_mod are for the kinds with two sets of pairs (kind='multi_similarity', 'circle' or "
            "'pair_sum'): use score_mod"
        )
    if o["reduction"] == "mean_nonzero" and not isinstance(kind, PairSum):
        raise ValueError("reduction='mean_nonzero' averages a pair sum's terms: kind='pair_sum'")
    return kind


def _pair_reductions(o: Dict[str, Any]) -> Tuple[str, Optional[str]]:
    """``(the engine's reduction, the pair sum's set means)`` of a call's ``reduction``: a
    pair sum's ``"mean"`` and ``"mean_nonzero"`` are each set's means, their rows summed."""
    reduction = o["reduction"]
    pair_sum = o["kind"] == "pair_sum" or isinstance(o["kind"], PairSum)
    if pair_sum:
        checks.check_choice(reduction, "reduction", PAIR_SUM_REDUCTIONS)
        if reduction in ("mean", "mean_nonzero"):
            return "sum", reduction
    elif reduction == "mean_nonzero":
        raise ValueError("reduction='mean_nonzero' averages a pair sum's terms: kind='pair_sum'")
    return reduction, None


def _functions_and_scalars(o: Dict[str, Any], own: bool, like: Tensor) -> Tuple[Any, FlexFunctions, Tensor, Any]:
    """The checked kind, functions, ``1 / temperature`` and the bias tensor (None: none)
    of a call's options; the positives' mode checked."""
    checks.check_choice(o["positives"], "positives", POSITIVES + ("lse",))
    kind = _kind(o)
    names = ("positive", "exclude", "score_mod", "weight", "pos_mod", "neg_mod")
    given = [_check_fn(o[name], name) for name in names]
    if isinstance(kind, PositiveLSE):  # the modified scores are each set's; positives binary
        given[0], given[2] = _binary(given[0]), None
    if isinstance(kind, PairSets):  # the kind's own modified scores where none is given
        given[4] = given[4] or kind.pos_mod
        given[5] = given[5] or kind.neg_mod
    if isinstance(kind, PairSum) and kind.distance is not None:
        temperature = o["temperature"]
        if isinstance(temperature, Tensor) or float(temperature) != 1.0:
            raise ValueError(
                f"distance={kind.distance!r} is a distance of the rows (normalised with normalize=True): "
                "temperature=1.0"
            )
        given[4], given[5] = (_on_distance(fn, kind) for fn in given[4:6])
    fns = FlexFunctions(*given)
    if own and fns.positive is None:
        raise ValueError("positive is required for self-contrast (keys=None): which pairs are positives?")
    dtype = compute_dtype(like.dtype)
    scale = 1.0 / checks.check_positive_scalar(o["temperature"], "temperature", like.device, dtype)
    bias_t: Optional[Tensor] = None
    if o["bias"] is not None:
        if o["kind"] != "sigmoid":
            raise ValueError("bias is the sigmoid kind's: kind='sigmoid'")
        bias_t = checks.check_real_scalar(o["bias"], "bias", like.device, dtype)
    return kind, fns, scale, bias_t


#: pairs of a call from which a pair sum's tile functions are compiled by default: a compile
#: takes seconds the first time (once per process), its tiles then run 6x faster on the
#: 2-core CPU (a 512 x 8,192 tile of the contrastive loss: 8.5 ms against 51 ms eager)
COMPILE_FROM = 1 << 24


def _compiles(given: Any, kind: Any, captured: Tuple[Tensor, ...], road: _Road, pairs: int) -> bool:
    """Whether the pair sum's tile functions are compiled (``compiled``: None, the rule)."""
    if given is not None:
        checks.check_bool(given, "compiled")
    if not isinstance(kind, PairSum) or not road.compiles or torch.compiler.is_compiling():
        if given:
            raise ValueError("compiled=True takes kind='pair_sum' on the tiled backend")
        return False
    if captured:
        if given:
            raise ValueError("compiled=True: a function captures a tensor that learns (its gradient is taken eagerly)")
        return False
    return bool(given) if given is not None else pairs >= COMPILE_FROM


def _on_distance(fn: Fn, kind: PairSum) -> Fn:
    """``fn`` called on the pair sum's distance view of the scores."""
    if fn is None:
        return None
    return lambda s, a, b: fn(kind.view(s), a, b)


def _reduce(parts: Any, opts: checks.Options, source: backends.Source) -> Tensor:
    """The directions' rows reduced: per row (``"none"``; two directions: their average),
    or over every rank's counted rows (``"mean"``), or summed, each times the
    ``grad_scale`` factor; two directions weigh half each."""
    if opts.reduction == "none":
        return parts[0][0] if len(parts) == 1 else 0.5 * (parts[0][0] + parts[1][0])
    half = 1.0 / len(parts)
    total = [
        runner.reduce_total(out, valid.sum(), opts.reduction, opts.grad_scale, source) * half for out, valid in parts
    ]
    return total[0] if len(total) == 1 else total[0] + total[1]


@torch.no_grad()
def flex_dense_mask(
    q: Tensor,
    keys: Optional[Tensor] = None,
    *,
    rows: Optional[Dict[str, Tensor]] = None,
    cols: Optional[Dict[str, Tensor]] = None,
    positive: Fn = None,
    exclude: Fn = None,
    score_mod: Fn = None,
    weight: Fn = None,
    include_self: bool = False,
    temperature: float = 0.1,
    normalize: bool = True,
) -> Dict[str, Tensor]:
    """What a flex loss's functions say, as dense (M, N) tensors, for debugging (as
    FlexAttention's ``create_mask``): ``"positive"`` (the weights ``m``, 0 where a pair is
    left out), ``"excluded"`` (out of every set, the self pair included), ``"score"``
    (the modified scores ``s'``) and ``"weight"``; and the row statistics the functions read
    (``"hardest_positive"``, ... (M,)). O(M N) memory: small batches.

    Args:
        q, keys, rows, cols: the embeddings and their data, as :func:`flex_loss`.
        positive, exclude, score_mod, weight: the functions, as :func:`flex_loss`.
        include_self, temperature, normalize: as :func:`flex_loss`.

    Shape:
        - q: (M, D); keys: (N, D); output: a dict of (M, N) tensors (N = M for
          self-contrast) and of the statistics read, (M,).

    Examples::

        >>> t = torch.arange(6.0)
        >>> masks = flashcl.flex_dense_mask(torch.randn(6, 4), rows={"t": t},
        ...                                 positive=lambda a, b: (a.t - b.t).abs() <= 1)
        >>> masks["positive"].shape
        torch.Size([6, 6])
    """
    q = checks.check_float_tensor(q, "q", (2,))
    own = keys is None
    k = q if keys is None else checks.check_keys(keys, "keys", q)
    row_data = _check_data(rows, "rows", q.shape[0], q)
    col_data = row_data if own else _check_data(cols, "cols", k.shape[0], q)
    fns = FlexFunctions(positive, exclude, score_mod, weight)
    if own and positive is None:
        raise ValueError("positive is required for self-contrast (keys=None)")
    args: Dict[str, Any] = dict(
        kind="softmax", positives="mean", fns=fns, own=own, exclude_self=own and not include_self
    )
    dtype = compute_dtype(q.dtype)
    qn, kn = q.to(dtype), k.to(dtype)
    if normalize:
        qn, kn = normalize_rows(qn), normalize_rows(kn)
    s = (qn @ kn.T) / temperature
    tile = _tile(q.shape[0], k.shape[0], 0)
    stats: Dict[str, Tensor] = {}
    if reads_statistics(fns, row_data, col_data, q, keys_too=own):
        counter = StatisticsHead(rows=row_data, cols=col_data, **args)
        stats = dict(zip(STATISTICS, counter.dense_reported(s, tile)[1]))
        row_data = {**row_data, **stats}
        col_data = {**col_data, **stats} if own else col_data
    head = FlexHead(rows=row_data, cols=col_data, **args)
    out, m, logw, sp = head.dense_terms(s, tile)
    return {
        "positive": m,
        "excluded": out,
        "score": sp,
        "weight": torch.ones_like(s) if logw is None else torch.exp(logw),
        **stats,
    }


class FlexLoss(LossModule):
    """Module form of :func:`flex_loss`: the functions and the options given to the
    constructor, the embeddings and the data to each call.

    Examples::

        >>> loss_fn = flashcl.FlexLoss(positive=lambda a, b: (a.t - b.t).abs() <= 2)
        >>> loss = loss_fn(torch.randn(64, 32), rows={"t": torch.arange(64.0)})
    """

    def __init__(
        self,
        positive: Fn = None,
        exclude: Fn = None,
        score_mod: Fn = None,
        weight: Fn = None,
        pos_mod: Fn = None,
        neg_mod: Fn = None,
        kind: Any = "softmax",
        positives: str = "mean",
        include_self: bool = False,
        both_directions: bool = False,
        symmetric: bool = False,
        temperature: Any = 0.1,
        bias: Any = None,
        normalize: bool = True,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
        shared_keys: Optional[bool] = None,
        compiled: Optional[bool] = None,
        matryoshka_dims: Optional[Sequence[int]] = None,
        matryoshka_weights: Optional[Sequence[float]] = None,
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self,
        q: Optional[Tensor] = None,
        keys: Optional[Tensor] = None,
        rows: Optional[Dict[str, Tensor]] = None,
        cols: Optional[Dict[str, Tensor]] = None,
        block_mask: Optional[BlockMask] = None,
        scores: Optional[Tensor] = None,
    ) -> Tensor:
        return flex_loss(q, keys, scores=scores, rows=rows, cols=cols, block_mask=block_mask, **self.loss_options())


def _example_flex(g: torch.Generator) -> Example:
    return Example(
        (example_rows(g, 37, 24),),
        {
            "rows": {"t": example_labels(g, 37, 12), "doc": example_labels(g, 37, 30)},
            "positive": lambda a, b: (a.t - b.t).abs() <= 1,
            "exclude": lambda a, b: (a.doc == b.doc) & ((a.t - b.t).abs() > 1),
            "score_mod": lambda s, a, b: s - 0.2 * ((a.t - b.t).abs() <= 1),
            "temperature": 0.2,
        },
    )


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "flex_loss": _example_flex,
}
