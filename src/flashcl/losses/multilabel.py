"""Multi-label SupCon: positives weighted by the Jaccard similarity of multi-hot label
sets, formed tile by tile from the label rows (never B x B): :class:`JaccardHead` and
the body of :func:`flashcl.supcon_loss` with (B, C) labels."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import checks, parallel, runner
from ..core import compute_dtype
from ..engine.engine import Problem, autocast_off
from ..engine.heads import Head, Tile, WorkBuffer, lse_inplace, mask_self_, row_dot
from ..runner import auto_block

__all__ = ["JaccardHead", "jaccard", "multilabel_supcon"]


def jaccard(yq: Tensor, yk: Tensor) -> Tensor:
    """``|y_i & y_j| / |y_i | y_j|`` of multi-hot rows (0 where both sets are empty)."""
    inter = yq @ yk.T
    union = yq.sum(1, keepdim=True) + yk.sum(1).unsqueeze(0) - inter
    return torch.where(union > 0, inter / union.clamp_min(1), torch.zeros_like(inter))


def _weights(
    yq: Tensor,
    yk: Tensor,
    nq: Tensor,
    nk: Tensor,
    tile: Tile,
    threshold: float,
    out: Optional[Tensor] = None,
    work: Optional[Tensor] = None,
) -> Tensor:
    """The tile's positive weights ``J_ij [J_ij > threshold]`` with the anchor's own
    column 0, from the label rows and their sizes ``nq``, ``nk``; into ``out``, with
    ``work`` for the unions (free buffers of the tile's shape; made when None)."""
    rows, cols = slice(tile.r0, tile.r1), slice(tile.c0, tile.c1)
    inter = torch.mm(yq[rows], yk[cols].T, out=out)
    union = torch.add(nq[rows].unsqueeze(1), nk[cols].unsqueeze(0), out=work)
    # both sets empty: inter = 0 = union, and J = 0 / 1 = 0 (jaccard's convention)
    w = inter.div_(union.sub_(inter).clamp_min_(1.0))
    w.masked_fill_(w <= threshold, 0.0)
    mask_self_(w, tile, 0.0)
    return w


class _JaccardState:
    def __init__(self, m: int, like: Tensor) -> None:
        self.lse = like.new_full((m,), float("-inf"))
        self.ws = like.new_zeros(m)  # sum_j w_ij s_ij
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None
        self.work = (WorkBuffer(), WorkBuffer())


class JaccardHead(Head):
    """Multi-label SupCon's row loss ``c_i LSE_{j in Den(i)} s_ij - a_i sum_j w_ij s_ij``
    with ``w_ij = J_ij [J_ij > threshold]`` (``j != i``) formed in each tile from the
    label rows, ``c_i = a_i sum_j w_ij`` and ``a_i = 1 / |P(i)|`` (``positives="mean"``)
    or 1 (``"sum"``): ``c``, ``a`` precomputed (:func:`row_weights`). On complete rows
    the loss and its gradient are formed in one visit (:meth:`rows_fused`), in the
    tile and two work buffers of its size."""

    fuses_rows = True

    def __init__(
        self, yq: Tensor, yk: Tensor, threshold: float, c: Tensor, a: Tensor, exclude_self: bool, offset: int = 0
    ) -> None:
        self.yq, self.yk, self.threshold = yq, yk, threshold
        self.nq = yq.sum(1)
        self.nk = self.nq if yk is yq else yk.sum(1)
        self.c, self.a = c, a
        self.exclude_self, self.offset = exclude_self, offset

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> Any:
        return _JaccardState(m, like)

    def _tile_weights(self, s: Tensor, tile: Tile, st: Any) -> Tensor:
        w = _weights(self.yq, self.yk, self.nq, self.nk, tile, self.threshold, st.work[0].like(s), st.work[1].like(s))
        return w if w.dtype == s.dtype else w.to(s.dtype)

    def _lse_(self, s: Tensor, tile: Tile) -> Tuple[Tensor, Tensor]:
        """The rows' LSE over the denominator; leaves ``exp(s - rowmax)`` in ``s``."""
        if self.exclude_self:
            mask_self_(s, tile, float("-inf"))
        return lse_inplace(s)

    def reduce(self, s: Tensor, tile: Tile, st: Any, p: int = 0) -> None:
        rows = slice(tile.r0, tile.r1)
        st.ws[rows] += row_dot(self._tile_weights(s, tile, st), s)
        st.lse[rows] = torch.logaddexp(st.lse[rows], self._lse_(s, tile)[0])

    def rows_fused(self, s: Tensor, tile: Tile, st: Any, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        w = self._tile_weights(s, tile, st)
        st.ws[rows] = row_dot(w, s)
        lse, total = self._lse_(s, tile)
        st.lse[rows] = lse
        if g_row is None:
            return None
        # g (c softmax - a w): s holds exp(s - rowmax), whose row sum is total
        coef = (g_row[rows] * self.c[rows]).unsqueeze(1) / total
        s.mul_(torch.where(total > 0, coef, torch.zeros_like(coef)))
        return s.sub_(w.mul_((g_row[rows] * self.a[rows]).unsqueeze(1)))

    def values(self, st: Any) -> Tuple[Tensor, Optional[Tensor]]:
        return torch.where(self.c > 0, self.c * st.lse, torch.zeros_like(st.lse)) - self.a * st.ws, None

    def grad(self, s: Tensor, tile: Tile, st: Any, buf: Optional[Tensor] = None) -> Tensor:
        rows = slice(tile.r0, tile.r1)
        g = st.g_row[rows]
        if self.exclude_self:
            mask_self_(s, tile, float("-inf"))
        lse = st.lse[rows]
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # an empty denominator: exp(-inf) = 0
        s.sub_(lse.unsqueeze(1)).exp_().mul_((g * self.c[rows]).unsqueeze(1))
        return s.sub_(self._tile_weights(s, tile, st).mul_((g * self.a[rows]).unsqueeze(1)))

    def dense(self, s: Tensor, tile: Tile, param: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        w = _weights(self.yq, self.yk, self.nq, self.nk, tile, self.threshold).to(s.dtype)
        masked = s.clone()
        if self.exclude_self:
            mask_self_(masked, tile, float("-inf"))
        lse = torch.logsumexp(masked, dim=1)
        return torch.where(self.c > 0, self.c * lse, torch.zeros_like(lse)) - self.a * (w * s).sum(1), None


def row_weights(
    yq: Tensor, yk: Tensor, threshold: float, positives: str, offset: int, block: int, dtype: torch.dtype
) -> Tuple[Tensor, Tensor, Tensor]:
    """(c, a, has a positive) per anchor, from the label rows by row blocks."""
    m, n = yq.shape[0], yk.shape[0]
    count = torch.zeros(m, dtype=dtype, device=yq.device)
    wsum = torch.zeros(m, dtype=dtype, device=yq.device)
    nq = yq.sum(1)
    nk = nq if yk is yq else yk.sum(1)
    out, work = yq.new_empty(min(block, m), n), yq.new_empty(min(block, m), n)
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        w = _weights(yq, yk, nq, nk, Tile(r0, r1, 0, n, offset), threshold, out[: r1 - r0], work[: r1 - r0])
        count[r0:r1] = (w > 0).sum(1).to(dtype)
        wsum[r0:r1] = w.sum(1).to(dtype)
    valid = count > 0
    a = 1.0 / count.clamp_min(1) if positives == "mean" else torch.ones_like(count)
    a = torch.where(valid, a, torch.zeros_like(a))
    return a * wsum, a, valid


def check_multi_hot(labels: Tensor, like: Tensor, name: str) -> Tensor:
    """(B, C) multi-hot labels (bool or 0/1) as the compute dtype."""
    if labels.dim() != 2 or labels.shape[0] != like.shape[0]:
        raise ValueError(
            f"{name} must be (B,) class ids or (B, C) multi-hot sets with B = {like.shape[0]}, got "
            f"shape {tuple(labels.shape)}"
        )
    checks.same_device(labels, like, name, "embeddings")
    if labels.dtype != torch.bool and not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError(f"{name} of shape (B, C) must be multi-hot: 0/1 or bool entries")
    return labels.to(compute_dtype(like.dtype))


def _reference(
    q: Tensor,
    k: Tensor,
    yq: Tensor,
    yk: Tensor,
    scale: Tensor,
    threshold: float,
    positives: str,
    include_self: bool,
    normalize: bool,
    offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """The per-anchor losses by the formula on the whole matrices (the oracle): the
    self column at ``i + offset`` (the anchors are k's rows from ``offset``)."""
    dtype = compute_dtype(q.dtype)
    q, k = q.to(dtype), k.to(dtype)
    if normalize:
        q, k = torch.nn.functional.normalize(q, dim=1), torch.nn.functional.normalize(k, dim=1)
    s = scale.to(dtype) * q @ k.T
    j = jaccard(yq, yk)
    own = torch.zeros_like(s, dtype=torch.bool)
    own[torch.arange(q.shape[0]), torch.arange(q.shape[0]) + offset] = True
    pos = (j > threshold) & ~own
    den = s.masked_fill(own, float("-inf")) if not include_self else s
    log_prob = s - torch.logsumexp(den, dim=1, keepdim=True)
    terms = torch.where(pos, j * log_prob, torch.zeros_like(s)).sum(1)
    count = pos.sum(1).to(dtype)
    rows = -terms / count.clamp_min(1) if positives == "mean" else -terms
    return torch.where(count > 0, rows, torch.zeros_like(rows)), (count > 0).to(dtype)


def multilabel_supcon(
    embeddings: Tensor,
    labels: Tensor,
    scale: Tensor,
    threshold: float,
    positives: str,
    include_self: bool,
    opts: checks.Options,
    ref: Optional[Tensor],
    ref_labels: Optional[Tensor],
) -> Tensor:
    """:func:`flashcl.supcon_loss` with (B, C) multi-hot labels (checked by the caller
    but for the labels' values); ``embeddings`` (B, D) or (B, V, D)."""
    b = embeddings.shape[0]
    views = 1 if embeddings.dim() == 2 else embeddings.shape[1]
    flat = embeddings if views == 1 and embeddings.dim() == 2 else embeddings.transpose(0, 1).reshape(b * views, -1)
    y = check_multi_hot(labels, embeddings, "labels").repeat(views, 1)
    y_ref = None
    if ref is not None:
        if ref_labels is None:
            raise ValueError("ref_labels is None: the keys of ref need their label sets")
        y_ref = check_multi_hot(ref_labels, ref, "ref_labels")
        if y_ref.shape[1] != y.shape[1]:
            raise ValueError(f"ref_labels must have the labels' {y.shape[1]} classes, got {y_ref.shape[1]}")
    body = _multilabel
    out = body(flat, y, ref, y_ref, scale, threshold, positives, include_self, opts)
    if opts.reduction == "none" and embeddings.dim() == 3:
        out = out.reshape(views, b).T
    return out


def _multilabel(
    flat: Tensor,
    y: Tensor,
    ref: Optional[Tensor],
    ref_labels: Optional[Tensor],
    scale: Tensor,
    threshold: float,
    positives: str,
    include_self: bool,
    opts: checks.Options,
) -> Tensor:
    """Multi-label SupCon's body, one process being a world of one: this rank's rows
    against every rank's (and the queue's keys once)."""
    cols = parallel.columns(flat, opts.strategy, opts.process_group, shared=ref)
    yk = cols.gather(y, ref_labels)
    if cols.total - cols.shared < 2 and not include_self and ref is None:
        raise ValueError(
            "supcon_loss needs at least 2 samples when include_self=False (across processes: in the global batch)"
        )
    name = runner.backend_for(opts, cols, flat, None)
    if name == "triton":
        raise ValueError("multi-label supcon_loss has no Triton kernel: use backend='tiled'")
    dtype = compute_dtype(flat.dtype)
    with autocast_off(flat.device.type):
        if name == "reference":
            rows, valid = _reference(
                flat, cols.keys, y, yk, scale, threshold, positives, include_self, opts.normalize, cols.offset
            )
            return runner.reduce(rows, valid, opts.reduction, opts.grad_scale, cols)
        block = auto_block(y.shape[0], yk.shape[0], dtype)
        c, a, valid_b = row_weights(y, yk, threshold, positives, cols.offset, block, dtype)
        head = JaccardHead(y, yk, threshold, c, a, not include_self, cols.offset)
        valid = valid_b.to(dtype)
        r = runner.share(opts.reduction, opts.grad_scale, cols, valid)
        weights = None if r is None else (r, None)
        problem = Problem(head, (), opts.normalize, cols.offset)
        return cols.run(flat, scale, problem, weights, opts.block_size, backend=name)
