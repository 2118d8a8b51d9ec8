"""Triplet losses mined in the batch, in row blocks of distances: :func:`triplet_loss`
and :class:`TripletLoss`.

For an anchor ``i``, its positives ``P(i)`` (same label, not ``i``) and negatives
``N(i)`` (another label), with distances ``d``:

* ``mining="all"``: ``sum_{p in P(i)} sum_{n in N(i)} relu(d_ip - d_in + margin)``.
  A row's negative distances are sorted once; each positive meets them through a
  binary search (how many negatives violate the margin) and a prefix sum (their
  total), so the ``|P| x |N|`` triplets are never formed: ``O(B^2 log B)`` time,
  ``O(block x B)`` memory. The mean is over the triplets with a positive loss
  (sentence-transformers' ``BatchAllTripletLoss``, pytorch-metric-learning's
  ``TripletMarginLoss`` with its ``AvgNonZeroReducer``).
* ``mining="hard"``: ``relu(max_{P(i)} d - min_{N(i)} d + margin)`` per anchor, the
  mean over every anchor (``BatchHardTripletLoss``; with ``soft_margin=True``
  ``softplus`` instead of ``relu``: ``BatchHardSoftMarginTripletLoss`` at
  ``margin=0``).
* ``mining="semi-hard"``: per positive pair, the closest negative farther than the
  positive (else the farthest negative), ``relu(d_ip - d_in* + margin)``, the mean
  over the positive pairs (``BatchSemiHardTripletLoss``).

The degenerate cases are the peers': an anchor without positives has a hardest
positive distance of 0; without negatives, its hardest negative distance is its
largest distance plus its smallest, and its semi-hard negative its smallest
distance (sentence-transformers' masked formulas).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import checks, parallel, registry, runner
from ..base import LossModule, shared_docs
from ..compiled import compiles
from ..core import Tile, compute_dtype
from ..engine.engine import FusedFunction, autocast_off, normalize_rows
from ..engine.heads import mask_self_

__all__ = ["triplet_loss", "TripletLoss", "distances"]

MININGS = ("all", "hard", "semi-hard")
DISTANCES = ("euclidean", "squared", "cosine")
TRIPLET_BACKENDS = ("auto", "reference", "dense", "tiled")


def distances(q: Tensor, k: Tensor, distance: str, offset: int = 0) -> Tensor:
    """The distances of the rows ``q`` to the rows ``k`` as sentence-transformers forms
    them: ``|q|^2 - 2 q.k + |k|^2`` clamped at 0 (``"squared"``), its square root
    (``"euclidean"``, gradient 0 at a zero distance) or ``1 - q.k`` (``"cosine"``:
    rows already unit); ``q``'s own column (row ``r`` at column ``r + offset``) 0.
    Differentiable."""
    dot = q @ k.T
    if distance == "cosine":
        d = 1.0 - dot
    else:
        sq = ((k * k).sum(1).unsqueeze(0) - 2.0 * dot) + (q * q).sum(1).unsqueeze(1)
        sq = sq.clamp_min(0.0)
        if distance == "squared":
            d = sq
        else:
            zero = sq == 0
            d = torch.where(zero, torch.zeros_like(sq), torch.sqrt(torch.where(zero, torch.ones_like(sq), sq)))
    own = torch.arange(q.shape[0], device=q.device) + offset
    inside = own < k.shape[0]
    eye = torch.zeros_like(d, dtype=torch.bool)
    eye[torch.arange(q.shape[0], device=q.device)[inside], own[inside]] = True
    return d.masked_fill(eye, 0.0)


# ---------------------------------------------------------------- per-row losses


def _masks(yq: Tensor, yk: Tensor, tile: Tile) -> Tuple[Tensor, Tensor]:
    """(positive, negative) masks of the tile: same label and not the anchor itself;
    another label."""
    same = yq[tile.r0 : tile.r1].unsqueeze(1) == yk[tile.c0 : tile.c1].unsqueeze(0)
    pos = same.clone()
    mask_self_(pos, tile, False)
    return pos, ~same


def _all_rows(
    d: Tensor, pos: Tensor, neg: Tensor, margin: float, want_grad: bool
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``mining="all"``: per row the sum over its (p, n) of ``relu(d_p - d_n + margin)``,
    the number of those that are positive, and ``d sum / d d`` (``want_grad``)."""
    inf = float("inf")
    sorted_neg = d.masked_fill(~neg, inf).sort(1).values
    a = d + margin
    # c_ip: the negatives with d_in < d_ip + margin (their triplets violate the margin)
    c = torch.searchsorted(sorted_neg, a)
    acc = torch.float64 if d.dtype != torch.float64 else d.dtype
    prefix = torch.cat([d.new_zeros(d.shape[0], 1, dtype=acc), sorted_neg.to(acc).cumsum(1)], dim=1)
    terms = c.to(acc) * a.to(acc) - prefix.gather(1, c)
    rows = torch.where(pos, terms, torch.zeros_like(terms)).sum(1).to(d.dtype)
    count = torch.where(pos, c, torch.zeros_like(c)).sum(1)
    if not want_grad:
        return rows, count, None
    # each negative's triplets: the positives with d_ip + margin > d_in
    sorted_a = a.masked_fill(~pos, inf).sort(1).values
    n_pos = pos.sum(1, keepdim=True)
    active = n_pos - torch.searchsorted(sorted_a, d, right=True)
    g = torch.where(pos, c.to(d.dtype), torch.zeros_like(d))
    return rows, count, g.sub_(torch.where(neg, active.to(d.dtype), torch.zeros_like(d)))


def _hinge(v: Tensor, soft: bool) -> Tuple[Tensor, Tensor]:
    """(loss, d loss / d v): ``relu`` or ``softplus``."""
    if soft:
        return torch.nn.functional.softplus(v), torch.sigmoid(v)
    return v.clamp_min(0.0), (v > 0).to(v.dtype)


def _hard_rows(
    d: Tensor, pos: Tensor, neg: Tensor, margin: float, soft: bool, want_grad: bool
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``mining="hard"``: per row ``hinge(max_P d - min_N d + margin)``."""
    hp, hp_idx = d.masked_fill(~pos, 0.0).max(1)
    has_neg = neg.any(1)
    hn, hn_idx = d.masked_fill(~neg, float("inf")).min(1)
    mx, mx_idx = d.max(1)
    mn, mn_idx = d.min(1)
    hn = torch.where(has_neg, hn, mx + mn)
    loss, slope = _hinge(hp - hn + margin, soft)
    count = torch.ones_like(hp_idx)
    if not want_grad:
        return loss, count, None
    g = torch.zeros_like(d)
    rows = torch.arange(d.shape[0], device=d.device)
    g.index_put_((rows, hp_idx), torch.where(pos.any(1), slope, torch.zeros_like(slope)), accumulate=True)
    g.index_put_((rows, torch.where(has_neg, hn_idx, mx_idx)), -slope, accumulate=True)
    g.index_put_((rows, mn_idx), torch.where(has_neg, torch.zeros_like(slope), -slope), accumulate=True)
    return loss, count, g


def _semi_hard_rows(
    d: Tensor, pos: Tensor, neg: Tensor, margin: float, soft: bool, want_grad: bool
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``mining="semi-hard"``: per row the sum over its positives of
    ``hinge(d_p - d_n* + margin)``, ``n*`` the closest negative farther than ``p``,
    else the farthest negative (no negative: the row's smallest distance)."""
    n = d.shape[1]
    sorted_neg, order = d.masked_fill(~neg, float("inf")).sort(dim=1, stable=True)
    at = torch.searchsorted(sorted_neg, d, right=True).clamp_max(n - 1)
    outside, outside_idx = sorted_neg.gather(1, at), order.gather(1, at)
    has_neg = neg.any(1, keepdim=True)
    inside, inside_idx = d.masked_fill(~neg, float("-inf")).max(1, keepdim=True)
    mn, mn_idx = d.min(1, keepdim=True)
    inside, inside_idx = torch.where(has_neg, inside, mn), torch.where(has_neg, inside_idx, mn_idx)
    found = torch.isfinite(outside)
    semi = torch.where(found, outside, inside)
    semi_idx = torch.where(found, outside_idx, inside_idx)
    loss, slope = _hinge(d - semi + margin, soft)
    zero = torch.zeros_like(d)
    rows = torch.where(pos, loss, zero).sum(1)
    count = pos.sum(1)
    if not want_grad:
        return rows, count, None
    slope = torch.where(pos, slope, zero)
    return rows, count, slope.clone().scatter_add_(1, semi_idx, -slope)


def rows_of(
    d: Tensor, pos: Tensor, neg: Tensor, mining: str, margin: float, soft: bool, want_grad: bool
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The rows' losses, their counts (triplets, anchors or positive pairs: what the
    mean divides by) and, with ``want_grad``, the gradient of their sum w.r.t. ``d``.
    Differentiable in ``d`` when ``want_grad`` is False (the dense backend)."""
    if mining == "all":
        return _all_rows(d, pos, neg, margin, want_grad)
    if mining == "hard":
        return _hard_rows(d, pos, neg, margin, soft, want_grad)
    return _semi_hard_rows(d, pos, neg, margin, soft, want_grad)


# ---------------------------------------------------------------- backends


def _value(t: Tensor) -> float:
    return float(t.detach())


def _reference_rows(
    x: Tensor,
    y: Tensor,
    mining: str,
    margin: float,
    soft: bool,
    distance: str,
    k: Optional[Tensor] = None,
    yk: Optional[Tensor] = None,
    offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Per-anchor losses and counts by loops over the anchors, positives and
    negatives, each distance formed on its own (the oracle). ``k``, ``yk``: every
    sample of the batch and its label when the anchors ``x`` are its rows from
    ``offset`` (default: the anchors themselves)."""
    k = x if k is None else k
    yk = y if yk is None else yk

    def dist(i: int, j: int) -> Tensor:
        if j == i + offset:
            return x[i, :0].sum()
        if distance == "cosine":
            return 1.0 - (x[i] * k[j]).sum()
        sq = (k[j] * k[j]).sum() - 2.0 * (x[i] * k[j]).sum() + (x[i] * x[i]).sum()
        sq = sq.clamp_min(0.0)
        return sq if distance == "squared" or bool(sq == 0) else sq.sqrt()

    def hinge(v: Tensor) -> Tensor:
        return torch.nn.functional.softplus(v) if soft else v.clamp_min(0.0)

    b, n = x.shape[0], k.shape[0]
    rows, counts = [], []
    for i in range(b):
        ps = [j for j in range(n) if j != i + offset and bool(yk[j] == y[i])]
        ns = [j for j in range(n) if bool(yk[j] != y[i])]
        if mining == "all":
            terms = [hinge(dist(i, p) - dist(i, n) + margin) for p in ps for n in ns]
            rows.append(sum(terms, x[i, :0].sum()))
            counts.append(sum(int(_value(t) > 0) for t in terms))
        elif mining == "hard":
            every = [dist(i, j) for j in range(n)]
            hp = max([every[p] for p in ps], key=_value) if ps else x[i, :0].sum()
            if ns:
                hn = min([every[n] for n in ns], key=_value)
            else:
                hn = max(every, key=_value) + min(every, key=_value)
            rows.append(hinge(hp - hn + margin))
            counts.append(1)
        else:
            every = [dist(i, j) for j in range(n)]
            total = x[i, :0].sum()
            for p in ps:
                farther = [every[n] for n in ns if _value(every[n]) > _value(every[p])]
                if farther:
                    semi = min(farther, key=_value)
                elif ns:
                    semi = max([every[n] for n in ns], key=_value)
                else:
                    semi = min(every, key=_value)
                total = total + hinge(every[p] - semi + margin)
            rows.append(total)
            counts.append(len(ps))
    return torch.stack(rows), torch.tensor(counts, device=x.device)


def _dense_rows(
    q: Tensor, k: Tensor, yq: Tensor, yk: Tensor, offset: int, mining: str, margin: float, soft: bool, distance: str
) -> Tuple[Tensor, Tensor]:
    """Per-anchor losses and counts on the whole distance matrix (differentiable)."""
    d = distances(q, k, distance, offset)
    pos, neg = _masks(yq, yk, Tile(0, q.shape[0], 0, k.shape[0], offset))
    rows, count, _ = rows_of(d, pos, neg, mining, margin, soft, want_grad=False)
    return rows, count


def auto_triplet_block(m: int, n: int) -> int:
    """Rows per block: about 2^20 distances (a block's sorts, searches and prefix
    sums hold about ten arrays of its size)."""
    return max(1, min(m, (1 << 20) // max(1, n)))


def _grads_from(
    g: Tensor, slope: Optional[Tensor], qb: Tensor, k: Tensor, distance: str, dq_rows: Tensor, dk: Tensor
) -> None:
    """Accumulates ``d/dq`` (this block's rows) and ``d/dk`` from ``g = d loss / d d``;
    ``slope``: ``d d / d sq`` for the distances of ``sq = |q|^2 - 2 q.k + |k|^2``."""
    if distance == "cosine":  # d = 1 - q.k
        dq_rows.addmm_(g, k, alpha=-1.0)
        dk.addmm_(g.T, qb, alpha=-1.0)
        return
    assert slope is not None
    h = g.mul_(slope)
    # d/dq = 2 (rowsum(h) q - h k), d/dk = 2 (colsum(h) k - h^T q)
    dq_rows.add_(qb * h.sum(1, keepdim=True), alpha=2.0).addmm_(h, k, alpha=-2.0)
    dk.add_(k * h.sum(0).unsqueeze(1), alpha=2.0).addmm_(h.T, qb, alpha=-2.0)


class _TripletRows(FusedFunction):
    """The rows' triplet losses in row blocks of distances, with their gradient
    formed in the same visit for a scalar loss (``weights``: each row's factor).

    ``apply(q, k, yq, yk, offset, mining, margin, soft, distance, weights, block)``
    returns (per-row losses, per-row counts); with ``weights``, the first is their
    weighted sum. q's rows are k's from ``offset`` on (the self column)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        yq: Tensor,
        yk: Tensor,
        offset: int,
        mining: str,
        margin: float,
        soft: bool,
        distance: str,
        weights: Optional[Tensor],
        block: int,
    ) -> Tuple[Tensor, Tensor]:
        needs = ctx.needs_input_grad[:2]
        fused = weights is not None and any(needs)
        ctx.opts = (offset, mining, margin, soft, distance, block)
        ctx.weights = weights
        rows, counts, grads = _visit(q, k, yq, yk, ctx.opts, weights if fused else None)
        FusedFunction.setup(ctx, (q, k), (yq, yk), grads=grads)
        ctx.mark_non_differentiable(counts)
        return (rows if weights is None else (weights * rows).sum()), counts

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        q, k = inputs
        yq, yk = ctx.saved_tensors[2:]
        offset, mining, margin, soft, distance, _ = ctx.opts
        rows, _ = _dense_rows(q, k, yq, yk, offset, mining, margin, soft, distance)
        return rows if ctx.weights is None else (ctx.weights * rows).sum()

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        q, k, yq, yk = saved
        g = grad_out.to(compute_dtype(q.dtype))
        weights = g if ctx.weights is None else ctx.weights * g
        _, _, grads = _visit(q, k, yq, yk, ctx.opts, weights)
        assert grads is not None
        return grads


def _visit(
    q: Tensor, k: Tensor, yq: Tensor, yk: Tensor, opts: Tuple[Any, ...], weights: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Optional[List[Tensor]]]:
    """Every row block: losses, counts and, with ``weights``, the weighted gradients."""
    offset, mining, margin, soft, distance, block = opts
    dtype = compute_dtype(q.dtype)
    qc, kc = q.detach().to(dtype), k.detach().to(dtype)
    m, n = qc.shape[0], kc.shape[0]
    rows = qc.new_empty(m)
    counts = torch.empty(m, dtype=torch.long, device=q.device)
    dq = torch.zeros_like(qc) if weights is not None else None
    dk = torch.zeros_like(kc) if weights is not None else None
    qn = (qc * qc).sum(1)
    kn = (kc * kc).sum(1)
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        qb = qc[r0:r1]
        tile = Tile(r0, r1, 0, n, offset)
        dot = qb @ kc.T
        slope: Optional[Tensor] = None  # d d / d sq (None: the cosine distance)
        if distance == "cosine":
            d = dot.neg_().add_(1.0)
        else:
            sq = dot.mul_(-2.0).add_(kn.unsqueeze(0)).add_(qn[r0:r1].unsqueeze(1))
            if distance == "squared":  # the clamped entries (rounding below 0) have no gradient
                slope = (sq >= 0).to(sq.dtype) if weights is not None else None
                d = sq.clamp_min_(0.0)
            else:  # d = sqrt(sq): 1 / (2 d), 0 at a zero distance
                d = sq.clamp_min_(0.0).sqrt_()
                if weights is not None:
                    slope = torch.where(d > 0, 0.5 / d.clamp_min(torch.finfo(d.dtype).tiny), torch.zeros_like(d))
        mask_self_(d, tile, 0.0)
        pos, neg = _masks(yq, yk, tile)
        r, c, g = rows_of(d, pos, neg, mining, margin, soft, want_grad=weights is not None)
        rows[r0:r1], counts[r0:r1] = r, c
        if g is not None:
            assert weights is not None and dq is not None and dk is not None
            mask_self_(g, tile, 0.0)
            _grads_from(g.mul_(weights[r0:r1].unsqueeze(1)), slope, qb, kc, distance, dq[r0:r1], dk)
    return rows, counts, None if dq is None else [dq, dk]  # type: ignore[list-item]


# ---------------------------------------------------------------- public


@registry.loss
@shared_docs
@compiles()
def triplet_loss(
    embeddings: Tensor,
    labels: Tensor,
    *,
    margin: float,
    mining: str = "all",
    soft_margin: bool = False,
    distance: str = "euclidean",
    normalize: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Triplet losses mined in the batch (Schroff et al. 2015; Hermans et al. 2017):
    an anchor should be closer to each sample of its label than to every sample of
    another label by ``margin``.

    $$
    \text{all: } \sum_i \sum_{p \in P(i)} \sum_{n \in N(i)} [d_{ip} - d_{in} + m]_+ ,\qquad
    \text{hard: } [\max_{P(i)} d - \min_{N(i)} d + m]_+ ,\qquad
    \text{semi-hard: } \sum_{p} [d_{ip} - d_{in^*(p)} + m]_+
    $$

    with ``P(i)`` the other samples of ``i``'s label, ``N(i)`` the samples of other
    labels and ``n*(p)`` the closest negative farther than ``p`` (else the farthest).
    ``reduction="mean"`` divides by what the peers divide by: the triplets with a
    positive loss (``"all"``), the anchors (``"hard"``), the positive pairs
    (``"semi-hard"``). Equal to sentence-transformers' ``BatchAllTripletLoss``,
    ``BatchHardTripletLoss``, ``BatchSemiHardTripletLoss`` and (``soft_margin=True``,
    ``margin=0``) ``BatchHardSoftMarginTripletLoss`` on their distances, and to
    pytorch-metric-learning's ``TripletMarginLoss`` (all triplets, its default
    reducer) with ``normalize=True``. The batch-all sum is formed from each row's
    sorted negative distances and prefix sums, never the B^3 triplets nor the
    B x B matrix: ``O(block x B)`` memory (``backend="tiled"``).

    Args:
        embeddings: (B, D); raw by default (as sentence-transformers).
        labels: (B,) integer class labels.
        margin: ``m`` (>= 0).
        mining: ``"all"`` | ``"hard"`` | ``"semi-hard"``.
        soft_margin: ``softplus`` instead of the hinge (``"hard"`` and ``"semi-hard"``).
        distance: ``"euclidean"`` | ``"squared"`` | ``"cosine"`` (``1 - cos``).
        normalize: L2-normalise the embeddings first (pytorch-metric-learning's
            default distance). Default: False.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (per anchor: the sum of its
            triplets' losses).
        backend: ``"auto"`` | ``"tiled"`` (row blocks) | ``"dense"`` (the B x B
            distances) | ``"reference"`` (loops over the triplets).
        block_size: rows per block of the tiled backend; None picks one.
        @process_group@

    Shape:
        - embeddings: (B, D); labels: (B,); output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> emb, labels = torch.randn(32, 8), torch.randint(0, 4, (32,))
        >>> loss = flashcl.triplet_loss(emb, labels, margin=1.0)                  # batch-all
        >>> hard = flashcl.triplet_loss(emb, labels, margin=1.0, mining="hard")
    """
    embeddings, labels = checks.validate_labelled(embeddings, labels)
    checks.check_choice(mining, "mining", MININGS)
    checks.check_choice(distance, "distance", DISTANCES)
    checks.check_choice(backend, "backend", TRIPLET_BACKENDS)
    checks.check_bool(soft_margin, "soft_margin")
    m = _check_margin(margin)
    if soft_margin and mining == "all":
        raise ValueError("soft_margin goes with mining='hard' or 'semi-hard' (the batch-all sum is of hinges)")
    opts = checks.Options(normalize, reduction, backend, block_size, process_group, strategy, grad_scale)
    with autocast_off(embeddings.device.type):
        x = embeddings.to(compute_dtype(embeddings.dtype))
        if normalize or distance == "cosine":
            x = normalize_rows(x)
        return _triplet(x, labels, mining, m, soft_margin, distance, backend, opts)


def _check_margin(margin: object) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be a float, got {type(margin).__name__}")
    value = float(margin)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    return value


def _triplet(
    x: Tensor,
    labels: Tensor,
    mining: str,
    margin: float,
    soft: bool,
    distance: str,
    backend: str,
    opts: checks.Options,
) -> Tensor:
    """The body, one process being a world of one: this rank's anchors against every
    rank's samples (gathered with their gradient); the mean's divisor counted over
    every rank."""
    group = opts.process_group
    if group is not None and opts.strategy == "ring":
        raise ValueError(
            "triplet_loss needs every distance of an anchor's row at once (its sorted negatives): "
            "use strategy='all_gather'"
        )
    cols = parallel.columns(x, "all_gather", group, own=True)
    k, yk, offset = cols.keys, cols.gather(labels), cols.offset
    if backend in ("reference", "dense"):
        if backend == "reference":
            rows, counts = _reference_rows(x, labels, mining, margin, soft, distance, k, yk, offset)
        else:
            rows, counts = _dense_rows(x, k, labels, yk, offset, mining, margin, soft, distance)
        if opts.reduction == "none":
            return rows
        total = rows.sum()
    else:
        block = opts.block_size or auto_triplet_block(x.shape[0], k.shape[0])
        if opts.reduction == "none":
            rows, _ = _TripletRows.apply(x, k, labels, yk, offset, mining, margin, soft, distance, None, block)
            return rows
        ones = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
        total, counts = _TripletRows.apply(x, k, labels, yk, offset, mining, margin, soft, distance, ones, block)
    return runner.reduce_total(total, counts.sum(), opts.reduction, opts.grad_scale, cols)


@registry.module
class TripletLoss(LossModule):
    """Module form of :func:`triplet_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.TripletLoss(margin=0.2, mining="semi-hard", normalize=True)
        >>> loss = loss_fn(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    """

    def __init__(
        self,
        margin: float,
        mining: str = "all",
        soft_margin: bool = False,
        distance: str = "euclidean",
        normalize: bool = False,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        return triplet_loss(embeddings, labels, **self.loss_options())
