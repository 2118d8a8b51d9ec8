"""Rank-N-Contrast (Zha et al., NeurIPS 2023): contrastive learning for regression, exact at
any batch: :func:`rank_n_contrast_loss` and :class:`RankNContrastLoss`.

Each sample ``i`` (each view of each sample) is an anchor and every other sample ``j`` its
positive in turn; ``j``'s denominator is every sample ``k`` at least as far from ``i`` in
label space as ``j`` is::

    l_ij = -log( exp(s_ij) / sum_{k != i, |y_i - y_k| >= |y_i - y_j|} exp(s_ik) ),
    s_ij = -||z_i - z_j||_2 / temperature,   |y_i - y_k| the L1 distance of the labels

and the loss is the mean of ``l_ij`` over every ordered pair. With the anchor's row of scores
at hand, the denominators of all its positives are one sort of the row by label distance and
a reversed cumulative log-sum-exp: a block of complete rows at a time, O(batch) memory, where
the published code loops over the batch building a B x B mask at each step (O(B^3) time,
O(B^2) memory).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_rows
from ..compiled import compiles
from ..core import Tile, compute_dtype
from ..engine.engine import Problem, autocast_off, squared_distance_rows
from ..engine.heads import AutogradHead
from ..reference.families import rank_n_contrast_rows as reference_rows

__all__ = ["rank_n_contrast_loss", "RankNContrastLoss"]

_INF = float("inf")


def _label_distances(yq: Tensor, yk: Tensor) -> Tensor:
    """The L1 distances of the rows' labels (m, L) to the columns' (n, L), (m, n)."""
    out = (yq[:, None, 0] - yk[None, :, 0]).abs()
    for d in range(1, yq.shape[1]):
        out.add_((yq[:, None, d] - yk[None, :, d]).abs())
    return out


def _rows_and_slopes(
    s: Tensor, ld: Tensor, own: Optional[Tensor], weights: Optional[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """Each row's ``sum_j l_ij`` of a block of complete rows (scores ``s``, label distances
    ``ld``, ``own``: each row's own column or -1) and, with the rows' ``weights``, the
    gradient ``d (sum_i w_i row_i) / d s`` (0 at the anchor itself): the row sorted by label
    distance, each positive's denominator the reversed cumulative log-sum-exp from the
    first column of its distance (ties share a denominator)."""
    b, n = s.shape
    if own is not None:  # the anchor itself: at the end of the sorted row, out of every sum
        keep = own >= 0
        rows = torch.arange(b, device=s.device)[keep]
        cols = own[keep]
        s = s.clone()
        ld = ld.clone()
        s[rows, cols] = -_INF
        ld[rows, cols] = _INF
    order = ld.argsort(dim=1, stable=True)
    lds = ld.gather(1, order)
    ss = s.gather(1, order)
    suffix = ss.flip(1).logcumsumexp(1).flip(1)  # LSE of the sorted columns from each one on
    start = torch.searchsorted(lds.contiguous(), lds.contiguous(), side="left")  # each tie group's first column
    valid = ~torch.isinf(lds)  # the positives: every column but the anchor itself
    lse = suffix.gather(1, start)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    rows_loss = torch.where(valid, lse - ss, zero).sum(1)
    if weights is None:
        return rows_loss, None
    # d row / d s_p = exp(s_p) sum_{positives j: start_j <= p} exp(-lse_j) - [p a positive]; the sum in log space
    counts = torch.zeros_like(ss).scatter_add_(1, start, valid.to(ss.dtype))
    log_terms = torch.where(counts > 0, counts.clamp_min(1.0).log() - suffix, -_INF)
    slope = torch.exp(ss + log_terms.logcumsumexp(1)) - valid.to(ss.dtype)
    slope = torch.where(valid, slope, zero) * weights.unsqueeze(1)
    return rows_loss, torch.zeros_like(slope).scatter_(1, order, slope)


class RankNContrastHead(AutogradHead):
    """Rank-N-Contrast's rows on the engine's tiles of squared feature distances
    (:func:`~flashcl.engine.engine.squared_distance_rows`), a block of complete rows at a
    time. Its gradient is written out (:func:`_rows_and_slopes`): at B = 2,048 x 2 views,
    D = 128 on a 2-core CPU, 1.24-1.34 s and 58-66 MB against autograd's through the sorted
    row, 1.75-1.80 s and 117-119 MB.

    Args:
        yq: (M, L) the anchors' labels. yk: (N, L) every column's.
        t: the temperature. offset: the column of anchor 0 (its own column, left out).
        norms: ((M,), (N,)) the anchors' and every column's squared norms.
    """

    def __init__(self, yq: Tensor, yk: Tensor, t: float, offset: int, norms: Tuple[Tensor, Tensor]) -> None:
        self.yq, self.yk, self.t, self.offset, self.norms = yq, yk, t, offset, norms

    def _block(self, s: Tensor, tile: Tile, g_row: Optional[Tensor]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(the distances, the rows' losses, with ``g_row`` (the block's rows' upstream
        gradients) their weighted ``dL/ds``, ``s = -d / t``)."""
        # a squared distance within the rounding of its product form, 8 eps (|x_i|^2 + |x_j|^2),
        # is a duplicate's: distance 0, subgradient 0, as the published differences' norm gives
        # (1 / sqrt of the rounding would scale the cancelling terms of its gradient)
        qn, kn = self.norms
        rounding = (qn[tile.r0 : tile.r1, None] + kn[None, tile.c0 : tile.c1]).mul_(8 * torch.finfo(s.dtype).eps)
        dist = torch.where(s > rounding, s.clamp_min(torch.finfo(s.dtype).tiny).sqrt(), torch.zeros_like(s))
        own = torch.arange(tile.r0, tile.r1, device=s.device) + (tile.offset - tile.c0)
        own = torch.where((own >= 0) & (own < s.shape[1]), own, torch.full_like(own, -1))
        ld = _label_distances(self.yq[tile.r0 : tile.r1], self.yk[tile.c0 : tile.c1])
        return (dist, *_rows_and_slopes(dist / -self.t, ld, own, g_row))

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        return self._block(s, tile, None)[1], None

    def block_grad(self, s: Tensor, tile: Tile, g_row: Tensor) -> Tuple[Tensor, Tensor]:
        dist, rows, g = self._block(s, tile, g_row)
        assert g is not None
        # d s / d sq = -1 / (2 t d): 0 where d is 0
        tiny = torch.finfo(dist.dtype).tiny
        return rows, torch.where(dist > 0, g / (dist.clamp_min(tiny) * (-2.0 * self.t)), torch.zeros_like(g))


@shared_docs
@compiles()
def rank_n_contrast_loss(
    features: Tensor,
    labels: Tensor,
    *,
    temperature: float = 2.0,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Rank-N-Contrast (Zha et al. 2023), contrastive learning for regression, exact without
    the B x B matrices: every other sample ``j`` is a positive of anchor ``i`` in turn, and
    its denominator is every sample at least as far from ``i`` in label space,

    $$
    \ell_{ij} = -\log \frac{e^{s_{ij}}}{\sum_{k \ne i,\ |y_i - y_k|_1 \ge |y_i - y_j|_1} e^{s_{ik}}},
    \qquad s_{ij} = -\frac{\lVert z_i - z_j \rVert_2}{\tau}
    $$

    (the published L1 label distance and negative L2 feature distance, not normalised),
    averaged over every ordered pair: the published ``RnCLoss(temperature)``. Each anchor's
    denominators are one sort of its row by label distance and a reversed cumulative
    log-sum-exp (ties share one), a block of rows at a time.

    Args:
        features: (B, V, D) V views of each sample (the published (bs, 2, D); every view is
            an anchor, view-major), or (B, D) one each.
        labels: (B,) or (B, L) regression targets (floating), compared by L1 distance.
        temperature: ``tau`` (> 0). Default: 2 (the published default).
        reduction: ``"mean"`` (default: over every ordered pair, as published) | ``"sum"``
            (of each anchor's mean over its positives) | ``"none"`` (each anchor's mean,
            (B,) or (B, V)).
        @backend@
        @process_group@

    Shape:
        - features: (B, V, D) or (B, D); labels: (B,) or (B, L); output: scalar, or (B, V) /
          (B,) with ``reduction="none"``

    Examples::

        >>> z = torch.randn(16, 2, 8, requires_grad=True)
        >>> age = torch.rand(16) * 80
        >>> loss = flashcl.rank_n_contrast_loss(z, age)
        >>> loss.backward()
    """
    empty = process_group is not None
    features = checks.check_float_tensor(features, "features", (2, 3), empty)
    labels = checks.check_float_tensor(labels, "labels", (1, 2), empty)
    if labels.shape[0] != features.shape[0]:
        raise ValueError(
            f"labels must hold one target per sample ({features.shape[0]}), got shape {tuple(labels.shape)}"
        )
    checks.same_device(labels, features, "labels", "features")
    t = checks.number(temperature, "temperature", positive=True)
    opts = checks.Options(False, reduction, backend, block_size, process_group, strategy, grad_scale)
    if process_group is not None and strategy == "ring":
        raise ValueError("rank_n_contrast_loss sorts whole rows by label distance: strategy='all_gather'")
    b = features.shape[0]
    views = 1 if features.dim() == 2 else features.shape[1]
    if views == 0:
        raise ValueError(f"features must have at least one view, got shape {tuple(features.shape)}")
    flat = features if features.dim() == 2 else features.transpose(0, 1).reshape(b * views, features.shape[-1])
    y = (labels if labels.dim() == 2 else labels.unsqueeze(1)).detach().repeat(views, 1)
    dtype = compute_dtype(flat.dtype)
    with autocast_off(flat.device.type):
        out = _rank_n_contrast(flat, y.to(dtype), t, opts)
    if opts.reduction == "none":
        return out.reshape(views, b).T if features.dim() == 3 else out
    return out


def _rank_n_contrast(flat: Tensor, y: Tensor, t: float, opts: checks.Options) -> Tensor:
    """The one body: this rank's rows against every rank's (one process: its own)."""
    m, width = flat.shape
    x = flat.to(compute_dtype(flat.dtype))
    q, k = squared_distance_rows(x)
    cols = parallel.columns(k, opts.strategy, opts.process_group)
    n = cols.total
    if n < 2:
        raise ValueError("rank_n_contrast_loss needs at least 2 samples (views): an anchor needs a positive")
    ky = cols.gather(y)
    per_anchor = 1.0 / (n - 1)
    # each anchor's mean over its positives, summed or over every rank's anchors (n of them)
    weights = runner.share(opts.reduction, opts.grad_scale, cols, x.new_full((m,), per_anchor), float(n))
    block = opts.block_size or max(1, min(m, (1 << 18) // max(1, n)))

    def oracle() -> Tuple[Tensor, Tuple[Tensor, ...]]:
        return reference_rows(x, cols.keys[:, :width], y, ky, t, cols.offset), ()

    norms = (x.detach() * x.detach()).sum(1)
    head = RankNContrastHead(y, ky, t, cols.offset, (norms, cols.gather(norms)))
    problem = Problem(head, (), False, cols.offset)
    one = torch.ones((), dtype=x.dtype, device=x.device)
    pair = None if weights is None else (weights, None)
    out, _ = backends.solve(
        q, cols, one, problem, pair, replace(opts, block_size=block), "rank_n_contrast_loss", oracle, x
    )
    return out if weights is not None else out * per_anchor


class RankNContrastLoss(LossModule):
    """Module form of :func:`rank_n_contrast_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.RankNContrastLoss(temperature=2.0)
        >>> loss = loss_fn(torch.randn(16, 2, 8), torch.rand(16))
    """

    def __init__(
        self,
        temperature: float = 2.0,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, features: Tensor, labels: Tensor) -> Tensor:
        return rank_n_contrast_loss(features, labels, **self.loss_options())


def _example_rank_n_contrast(g: torch.Generator) -> Example:
    return Example((example_rows(g, 13, 2, 24), example_rows(g, 13)), {"temperature": 2.0}, leaves=(0,))


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {"rank_n_contrast_loss": _example_rank_n_contrast}
