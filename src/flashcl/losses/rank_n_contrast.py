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

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import FusedFunction, autocast_off
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


def _block_grads(g: Tensor, dist: Tensor, t: float, qb: Tensor, k: Tensor, dq: Tensor, dk: Tensor, r0: int) -> None:
    """Through ``s = -||q_i - k_j|| / t``: ``H = G / (t d)`` (0 where ``d`` is 0, the norm's
    subgradient), ``dq_i = (H K)_i - rowsum(H)_i q_i``, ``dk_j += (H^T Q)_j - colsum(H)_j k_j``."""
    h = torch.where(dist > 0, g / (t * dist.clamp_min(torch.finfo(dist.dtype).tiny)), torch.zeros_like(g))
    b = qb.shape[0]
    dq[r0 : r0 + b] += h @ k - h.sum(1, keepdim=True) * qb
    dk += h.T @ qb - h.sum(0).unsqueeze(1) * k


def _distances(qb: Tensor, k: Tensor, qsq: Tensor, ksq: Tensor) -> Tensor:
    """``||q_i - k_j||`` of a block, from its products and the squared norms."""
    d2 = (qsq.unsqueeze(1) + ksq.unsqueeze(0)).sub_(2.0 * (qb @ k.T)).clamp_min_(0.0)
    return d2.sqrt_()


class _RankNContrast(FusedFunction):
    """``apply(q, k, yq, yk, t, offset, block, weights, same)``: each row's ``sum_j l_ij``
    (M,), or with ``weights`` their weighted sum and its gradient formed in the same visit;
    ``same``: ``k`` is ``q`` (one gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        yq: Tensor,
        yk: Tensor,
        t: float,
        offset: int,
        block: int,
        weights: Optional[Tensor],
        same: bool,
    ) -> Tensor:
        ctx.t, ctx.offset, ctx.block, ctx.same = t, offset, block, same
        needs = any(ctx.needs_input_grad[:2])
        rows, grads = _visit(q.detach(), k.detach(), yq, yk, t, offset, block, weights if needs else None, same)
        ctx.weights = weights
        FusedFunction.setup(ctx, (q, None if same else k), (yq, yk), grads=grads if needs else None)
        return rows if weights is None else (rows * weights).sum()

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        q, k, yq, yk = saved
        k = q if ctx.same else k
        # the rows' weights: the scalar's own times its upstream gradient, or the per-row upstream gradient
        weights = grad_out.to(q.dtype) * ctx.weights if ctx.weights is not None else grad_out.to(q.dtype)
        _, grads = _visit(q, k, yq, yk, ctx.t, ctx.offset, ctx.block, weights, ctx.same)
        return grads  # type: ignore[return-value]

    @classmethod
    def no_second_derivatives(cls, ctx: Any) -> Optional[str]:
        return "rank_n_contrast_loss does not compute second derivatives (create_graph=True): use backend='dense'"


def _visit(
    q: Tensor,
    k: Tensor,
    yq: Tensor,
    yk: Tensor,
    t: float,
    offset: int,
    block: int,
    weights: Optional[Tensor],
    same: bool,
) -> Tuple[Tensor, Optional[Tuple[Optional[Tensor], Optional[Tensor]]]]:
    """Every block of rows: their losses and, with ``weights``, the gradients (dk None when
    ``same``: added into dq)."""
    m, n = q.shape[0], k.shape[0]
    rows = q.new_empty(m)
    qsq, ksq = (q * q).sum(1), (k * k).sum(1)
    dq = torch.zeros_like(q) if weights is not None else None
    dk = (dq if same else torch.zeros_like(k)) if weights is not None else None
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        qb = q[r0:r1]
        dist = _distances(qb, k, qsq[r0:r1], ksq)
        ld = _label_distances(yq[r0:r1], yk)
        own = torch.arange(r0, r1, device=q.device) + offset
        own = torch.where((own >= 0) & (own < n), own, torch.full_like(own, -1))
        w = None if weights is None else weights[r0:r1]
        rows[r0:r1], g = _rows_and_slopes(-dist / t, ld, own, w)
        if g is not None:
            assert dq is not None and dk is not None
            _block_grads(g, dist, t, qb, k, dq, dk, r0)
    if weights is None:
        return rows, None
    return rows, (dq, None if same else dk)


def _dense_rows(q: Tensor, k: Tensor, yq: Tensor, yk: Tensor, t: float, offset: int) -> Tensor:
    """The rows by differentiable torch ops on the whole matrix (the dense backend; second
    derivatives): the sorted rows' reversed cumulative log-sum-exps, by autograd."""
    diff = q[:, None, :] - k[None, :, :]
    d2 = (diff * diff).sum(-1)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    dist = torch.where(d2 > 0, d2.clamp_min(torch.finfo(q.dtype).tiny).sqrt(), zero)
    own = torch.arange(q.shape[0], device=q.device) + offset
    own = torch.where((own >= 0) & (own < k.shape[0]), own, torch.full_like(own, -1))
    return _rows_and_slopes(-dist / t, _label_distances(yq, yk), own, None)[0]


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
    group = opts.process_group
    m = flat.shape[0]
    if group is None:
        keys, ky, offset = flat, y, 0
    else:
        keys, offset = parallel.all_gather_with_grad(flat, group)
        ky = parallel.gather_plain(y, group)
    n = keys.shape[0]
    if n < 2:
        raise ValueError("rank_n_contrast_loss needs at least 2 samples (views): an anchor needs a positive")
    dtype = compute_dtype(flat.dtype)
    per_anchor = 1.0 / (n - 1)
    q = flat.to(dtype)
    k = q if group is None else keys.to(dtype)
    source = parallel.reduction_over(group)

    def reduced(rows: Tensor) -> Tensor:
        if opts.reduction == "none":
            return rows
        return runner.reduce_total(rows.sum(), torch.tensor(float(m)), opts.reduction, opts.grad_scale, source)

    def tiled() -> Tensor:
        block = opts.block_size or max(1, min(m, (1 << 18) // max(1, n)))
        # each anchor's mean over its positives, summed or over every rank's anchors (n of them)
        weights = runner.share(opts.reduction, opts.grad_scale, source, q.new_full((m,), per_anchor), float(n))
        out = _RankNContrast.apply(q, k, y, ky, t, offset, block, weights, group is None)
        return out if weights is not None else out * per_anchor

    impls = {
        "reference": lambda: reduced(reference_rows(q, k, y, ky, t, offset) * per_anchor),
        "dense": lambda: reduced(_dense_rows(q, k, y, ky, t, offset) * per_anchor),
        "tiled": tiled,
    }
    return backends.pick(opts.backend, impls, m * n, flat, "rank_n_contrast_loss")()


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
