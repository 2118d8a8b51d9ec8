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

from dataclasses import replace
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_labels, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import Problem, autocast_off, normalize_rows, squared_distance_rows
from ..reference.families import triplet_rows as _reference_rows
from .triplet_rows import TripletHead, auto_triplet_block

__all__ = ["triplet_loss", "TripletLoss"]

MININGS = ("all", "hard", "semi-hard")
DISTANCES = ("euclidean", "squared", "cosine")
TRIPLET_BACKENDS = ("auto", "reference", "dense", "tiled")


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
        return _triplet(x, labels, mining, m, soft_margin, distance, opts)


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
    opts: checks.Options,
) -> Tensor:
    """The body, one process being a world of one: this rank's anchors against every
    rank's samples (gathered with their gradient, or round the ring), a
    :class:`~flashcl.losses.triplet_rows.TripletHead` on the engine; the mean's divisor
    counted over every rank."""
    q, k = (x, x) if distance == "cosine" else squared_distance_rows(x)
    cols = parallel.columns(k, opts.strategy, opts.process_group, own=distance == "cosine")
    yk, offset, width = cols.gather(labels), cols.offset, x.shape[1]
    head = TripletHead(labels, yk, offset, mining, margin, soft, distance)
    one = torch.ones((), dtype=x.dtype, device=x.device)
    weights = None if opts.reduction == "none" else (one.expand(x.shape[0]), None)
    block = opts.block_size or auto_triplet_block(x.shape[0], cols.total)

    def oracle() -> Tuple[Tensor, Tuple[Tensor, ...]]:
        rows, counts = _reference_rows(x, labels, mining, margin, soft, distance, cols.keys[:, :width], yk, offset)
        return rows, (counts,)

    problem = Problem(head, (), False, offset)
    opts = replace(opts, block_size=block)
    out, (counts,) = backends.solve(q, cols, one, problem, weights, opts, "triplet_loss", oracle, x, "tiled")
    if opts.reduction == "none":
        return out
    return runner.reduce_total(out, counts.sum(), opts.reduction, opts.grad_scale, cols)


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
