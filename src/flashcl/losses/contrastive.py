"""The classic contrastive loss (Hadsell, Chopra and LeCun, CVPR 2006) over labels, exact at
any batch: :func:`contrastive_loss` and :class:`ContrastiveLoss`, a pair-sum flex loss
(:class:`flashcl.FlexPairSum`) on the engine's tiles, as pytorch-metric-learning's
``ContrastiveLoss`` computes it but without its B x B distance matrix.

For each pair of samples, a distance ``d`` (the Euclidean distance of the L2-normalised
rows, or its square) or a similarity ``s`` (cosine, or the plain dot product)::

    positive pair (same label, not itself):  relu(d - pos_margin)    or  relu(pos_margin - s)
    negative pair (another label):           relu(neg_margin - d)    or  relu(s - neg_margin)

each set's terms reduced (pytorch-metric-learning's reducers) and the two sets added.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor

from .. import checks, parallel
from ..base import LossModule, shared_docs
from ..checks import Example, example_labels, example_rows
from ..compiled import compiles
from .flex import FlexPairSum, flex_loss

__all__ = ["contrastive_loss", "ContrastiveLoss", "DISTANCES", "pair_count"]

#: the distances (and similarities) the loss takes
DISTANCES = ("euclidean", "squared", "similarity")


def pair_count(labels: Tensor, ref_labels: Optional[Tensor]) -> tuple:
    """``(positive pairs, negative pairs)`` of a batch's labels against ``ref_labels`` (None:
    the batch itself, a sample never paired with itself), from the labels alone."""
    ref = labels if ref_labels is None else ref_labels
    uniq, inv = torch.unique(torch.cat([labels, ref]), return_inverse=True)
    rows = torch.bincount(inv[: labels.shape[0]], minlength=uniq.shape[0])
    cols = torch.bincount(inv[labels.shape[0] :], minlength=uniq.shape[0])
    same = int((rows * cols).sum())
    pos = same - (labels.shape[0] if ref_labels is None else 0)
    return pos, labels.shape[0] * ref.shape[0] - same


@shared_docs
@compiles()
def contrastive_loss(
    embeddings: Tensor,
    labels: Tensor,
    ref: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
    *,
    pos_margin: float = 0.0,
    neg_margin: float = 1.0,
    distance: str = "euclidean",
    normalize: bool = True,
    reduction: str = "mean_nonzero",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""The classic contrastive loss (Hadsell et al. 2006) over class labels, exact over the
    whole batch without its B x B distance matrix: pytorch-metric-learning's
    ``ContrastiveLoss(pos_margin, neg_margin)`` with its default distance and reducer.
    Positive pairs (the same label, a sample not paired with itself) are pulled within
    ``pos_margin``, negative pairs pushed beyond ``neg_margin``:

    $$
    \ell^+_{ij} = \max(0, d_{ij} - m^+), \qquad \ell^-_{ij} = \max(0, m^- - d_{ij})
    $$

    with ``d`` the Euclidean distance of the L2-normalised rows (``distance="euclidean"``,
    its slope at 0 taken as 0, as ``torch.cdist``'s) or its square (``"squared"``), of the
    rows as given with ``normalize=False`` (from ``|x|^2 + |y|^2 - 2 x.y``, as
    ``torch.cdist`` computes it for more than 25 rows); with ``distance="similarity"`` the
    cosine similarity (the plain dot product with ``normalize=False``) and the margins the
    other way round, ``max(0, m^+ - s)`` and ``max(0, s - m^-)``. ``reduction="mean_nonzero"``
    (default) averages each set's terms above 0 and adds the two (PML's
    ``AvgNonZeroReducer``), ``"mean"`` each set's terms over its pairs (``MeanReducer``),
    ``"sum"`` every term (``SumReducer``), ``"none"`` each anchor's sum (B,). As PML, a
    batch with at most one positive and at most one negative pair gives 0. Hadsell's
    squared form is a flex call (docs/flex.md).

    Args:
        embeddings: (B, D) rows.
        labels: (B,) integer class labels.
        ref: (N, D) reference rows the batch is paired with instead of itself (PML's
            ``ref_emb``), or None.
        ref_labels: (N,) their labels, with ``ref``.
        pos_margin: the positive pairs' margin ``m+``. Default: 0.
        neg_margin: the negative pairs' margin ``m-``. Default: 1.
        distance: ``"euclidean"`` (default) | ``"squared"`` | ``"similarity"``.
        normalize: L2-normalise the rows first. Default: True.
        reduction: ``"mean_nonzero"`` (default) | ``"mean"`` | ``"sum"`` | ``"none"``.
        @backend@
        @process_group@

    Shape:
        - embeddings: (B, D); labels: (B,); ref: (N, D); ref_labels: (N,); output: scalar,
          or (B,) with ``reduction="none"``

    Examples::

        >>> x, y = torch.randn(32, 16, requires_grad=True), torch.randint(0, 4, (32,))
        >>> loss = flashcl.contrastive_loss(x, y)
        >>> loss.backward()
    """
    empty = process_group is not None
    embeddings, labels = checks.validate_labelled(embeddings, labels, empty=empty)
    if (ref is None) != (ref_labels is None):
        raise ValueError("ref and ref_labels come together: the reference rows and their labels")
    if ref is not None:
        ref = checks.check_keys(ref, "ref", embeddings, empty)
        ref, ref_labels = checks.validate_labelled(ref, ref_labels, names=("ref", "ref_labels"), empty=empty)
    checks.check_choice(distance, "distance", DISTANCES)
    checks.check_bool(normalize, "normalize")
    m_pos = checks.number(pos_margin, "pos_margin")
    m_neg = checks.number(neg_margin, "neg_margin")
    if distance == "similarity":
        kind = FlexPairSum()
        pos_mod, neg_mod = (lambda s, a, b: (m_pos - s).relu()), (lambda s, a, b: (s - m_neg).relu())
    else:
        kind = FlexPairSum(distance=distance)
        pos_mod, neg_mod = (lambda d, a, b: (d - m_pos).relu()), (lambda d, a, b: (m_neg - d).relu())
    rows: Dict[str, Tensor] = {"y": labels}
    cols: Optional[Dict[str, Tensor]] = None
    if ref is not None and ref_labels is not None:
        cols = {"y": ref_labels}
    out = flex_loss(
        embeddings,
        ref,
        rows=rows,
        cols=cols,
        positive=lambda a, b: a.y == b.y,
        kind=kind,
        pos_mod=pos_mod,
        neg_mod=neg_mod,
        temperature=1.0,
        normalize=normalize,
        reduction=reduction,
        backend=backend,
        block_size=block_size,
        process_group=process_group,
        strategy=strategy,
        grad_scale=grad_scale,
    )
    # PML's rule for a batch of at most one pair of each kind: its labels over every rank (a shared
    # reference, without gradient, the same on every rank: once)
    if process_group is not None:
        labels = parallel.gather_plain(labels, process_group)
        if ref_labels is not None and ref is not None and ref.requires_grad:
            ref_labels = parallel.gather_plain(ref_labels, process_group)
    pos, neg = pair_count(labels, ref_labels)
    return out * float(pos > 1 or neg > 1)


class ContrastiveLoss(LossModule):
    """Module form of :func:`contrastive_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.ContrastiveLoss(neg_margin=0.8)
        >>> loss = loss_fn(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    """

    def __init__(
        self,
        pos_margin: float = 0.0,
        neg_margin: float = 1.0,
        distance: str = "euclidean",
        normalize: bool = True,
        reduction: str = "mean_nonzero",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self, embeddings: Tensor, labels: Tensor, ref: Optional[Tensor] = None, ref_labels: Optional[Tensor] = None
    ) -> Tensor:
        return contrastive_loss(embeddings, labels, ref, ref_labels, **self.loss_options())


def _example_contrastive(g: torch.Generator) -> Example:
    return Example((example_rows(g, 37, 24), example_labels(g, 37, 5)), {"neg_margin": 1.2})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {"contrastive_loss": _example_contrastive}
