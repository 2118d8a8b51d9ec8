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
import torch.distributed as dist
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_labels, example_rows
from ..compiled import compiles
from ..core import Tile, compute_dtype
from ..engine.engine import FusedFunction, autocast_off, normalize_rows
from ..parallel.ring import RingDriver, ring_pass
from ..reference.families import triplet_rows as _reference_rows
from .triplet_rows import (
    ColumnMiner,
    TripletRows,
    auto_triplet_block,
    block_distances,
    dense_rows,
    distances,
    grads_from,
)

__all__ = ["triplet_loss", "TripletLoss", "distances"]

MININGS = ("all", "hard", "semi-hard")
DISTANCES = ("euclidean", "squared", "cosine")
TRIPLET_BACKENDS = ("auto", "reference", "dense", "tiled")


# ---------------------------------------------------------------- backends


# ---------------------------------------------------------------- public


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
    B x B matrix: ``O(block x B)`` memory (``backend="tiled"``). Across processes with
    ``strategy="ring"`` no rank holds the global batch: each rank's rows visit the
    others round the ring, the anchors keeping their positives' distances and a few
    extremes (``O(rows x (positives + block))``; only the labels are gathered), every
    mining, distance and option as on one process.

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
    embeddings, labels = checks.validate_labelled(embeddings, labels, empty=process_group is not None)
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
    cols = parallel.columns(x, opts.strategy, group, own=True)
    k, yk, offset = cols.keys, cols.gather(labels), cols.offset
    if isinstance(cols, parallel.Columns) and cols.ring:
        backends.pick_name(backend, ("tiled",), 0, x, "triplet_loss", source=cols)  # the ring: tiled alone
        block = opts.block_size or auto_triplet_block(x.shape[0], max(cols.sizes))
        spec = (offset, mining, margin, soft, distance, block)
        rows, counts = _TripletRing.apply(x, labels, yk, spec, cols.sizes, group)
        if opts.reduction == "none":
            return rows
        total = rows.sum()
    else:

        def reference_rows() -> Tuple[Tensor, Optional[Tensor]]:
            return _reference_rows(x, labels, mining, margin, soft, distance, k, yk, offset)

        def dense() -> Tuple[Tensor, Optional[Tensor]]:
            return dense_rows(x, k, labels, yk, offset, mining, margin, soft, distance)

        def tiled() -> Tuple[Tensor, Optional[Tensor]]:
            block = opts.block_size or auto_triplet_block(x.shape[0], k.shape[0])
            if opts.reduction == "none":
                return TripletRows.apply(x, k, labels, yk, offset, mining, margin, soft, distance, None, block)[0], None
            ones = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
            return TripletRows.apply(x, k, labels, yk, offset, mining, margin, soft, distance, ones, block)

        impls = {"reference": reference_rows, "dense": dense, "tiled": tiled}
        out, counts = backends.pick(backend, impls, x.shape[0] * k.shape[0], x, "triplet_loss", auto="tiled")()
        if opts.reduction == "none":
            return out
        total = out.sum()  # the tiled backend's reduced total is a scalar already
        assert counts is not None
    return runner.reduce_total(total, counts.sum(), opts.reduction, opts.grad_scale, cols)


class _TripletRing(FusedFunction):
    """``apply(x, yq, yk, spec, sizes, group) -> (rows, counts)``: the triplet losses of
    this rank's anchors ``x`` (labels ``yq``) against every rank's rows, the blocks
    passed round the ring (no rank holds more than its own rows and one visitor):
    :class:`flashcl.losses.triplet_rows.ColumnMiner` over the visiting blocks, once for
    batch-hard, twice for batch-all and semi-hard (the positives' distances, then the
    negatives); ``yk``: every rank's labels. Backward passes the blocks again, each
    block's gradient travelling with it back to its owner."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, yq: Tensor, yk: Tensor, spec: Tuple[Any, ...], sizes: List[int], group: Any
    ) -> Tuple[Tensor, Tensor]:
        offset, mining, margin, soft, distance, _ = spec
        xd = x.detach()
        miner = ColumnMiner(yq, yk, offset, mining, margin, soft, xd.dtype)
        for step in range(miner.passes):
            _round(xd, spec, sizes, group, lambda d, slope, tile, kb, travel, s=step: miner.visit(s, d, tile))
            miner.end_pass(step)
        rows, counts = miner.finish()
        FusedFunction.setup(ctx, (x,))
        ctx.miner, ctx.spec, ctx.sizes, ctx.group = miner, spec, sizes, group
        ctx.mark_non_differentiable(counts)
        return rows, counts

    @classmethod
    def no_second_derivatives(cls, ctx: Any) -> Optional[str]:
        return RingDriver.no_second_derivatives

    @classmethod
    def recompute(cls, ctx: Any, grad: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        (x,) = saved
        xd, distance = x.detach(), ctx.spec[4]
        dq = torch.zeros_like(xd)
        weights = grad.to(xd.dtype)

        def visit(d: Tensor, slope: Optional[Tensor], tile: Tile, kb: Tensor, travel: Optional[Tensor]) -> None:
            assert travel is not None
            g = ctx.miner.grad(d, tile, weights)
            grads_from(g, slope, xd[tile.r0 : tile.r1], kb, distance, dq[tile.r0 : tile.r1], travel)

        travel = _round(xd, ctx.spec, ctx.sizes, ctx.group, visit, with_gradient=True)
        return (dq + travel,)


def _round(
    x: Tensor, spec: Tuple[Any, ...], sizes: List[int], group: Any, visit: Any, with_gradient: bool = False
) -> Tensor:
    """Every rank's block of rows round the ring, this rank's first: ``visit(d, slope,
    tile, block, travel)`` for each row block of this rank's anchors against it
    (``travel``: the block's gradient accumulator, ``with_gradient``, which goes on
    with it and arrives back home: returned)."""
    offset, _, _, _, distance, block = spec
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    starts = [sum(sizes[:i]) for i in range(world)]
    m, width = x.shape
    xn = (x * x).sum(1)
    kb, travel = x, torch.zeros_like(x)
    for step in range(world):
        owner = (rank - step) % world
        if sizes[owner]:
            kn = (kb * kb).sum(1)
            for r0 in range(0, m, block):
                r1 = min(r0 + block, m)
                tile = Tile(r0, r1, starts[owner], starts[owner] + sizes[owner], offset)
                d, slope = block_distances(x[r0:r1], kb, xn[r0:r1], kn, distance, tile, with_gradient)
                visit(d, slope, tile, kb, travel if with_gradient else None)
        if step < world - 1 or with_gradient:  # the gradient's last pass takes it home
            shape = (sizes[(owner - 1) % world], width)
            if with_gradient:
                kb, travel = ring_pass([kb, travel], [shape, shape], group)
            else:
                (kb,) = ring_pass([kb], [shape], group)
    return travel


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


def _example_triplet(g: torch.Generator) -> Example:
    return Example((example_rows(g, 30, 24), example_labels(g, 30, 4)), {"margin": 0.5, "mining": "semi-hard"})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "triplet_loss": _example_triplet,
}
