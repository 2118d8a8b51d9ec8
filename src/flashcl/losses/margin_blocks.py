"""The margin softmax over class proxies (CosFace, ArcFace): the target logits
(:func:`target_logits`) and the head over blocks of classes (:class:`MarginHead`, on
:class:`~flashcl.engine.columns.ColumnBlocks`), for the losses of
:mod:`flashcl.losses.margin` on one process and with the classes sharded across
processes (:mod:`flashcl.losses.class_shards`, which joins the slices through a
:class:`Shard`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from .. import backends
from ..core import compute_dtype
from ..engine.engine import Problem, normalize_rows, visit_grads, visit_values
from ..engine.heads import Head, Tile, lse_inplace, row_dot

__all__ = [
    "TARGETS",
    "Shard",
    "MarginHead",
    "Margin",
    "target_rows",
    "target_logits",
    "margin_rows",
    "orthogonal",
    "sine",
    "auto_class_block",
]


def _cosface(c: Tensor, sin: Tensor, margin: float, easy: bool) -> Tensor:
    """CosFace's target logit ``cos - m`` (the arguments as :func:`_arcface`'s)."""
    return c - margin


def _arcface(c: Tensor, sin: Tensor, margin: float, easy: bool) -> Tensor:
    """ArcFace's target logit ``cos(theta + m)``, with ``theta`` the angle whose cosine
    is ``c`` and whose sine is ``sin`` (the norm of the class direction's part
    orthogonal to the embedding, formed from the vectors: accurate at ``theta`` near 0
    and pi, where ``acos`` has an infinite derivative); past ``theta > pi - m``
    (where it would stop decreasing) ``cos - m sin(m)``, as insightface and
    pytorch-metric-learning; ``easy``: ``cos`` itself where ``cos <= 0``. Written
    without ``acos``, so that autograd through it is finite at ``cos = +-1`` as well
    (its derivative times ``sin(theta)`` is ``sin(theta + m)``, ``sin(m)`` at
    ``theta = 0``)."""
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    phi = c * cos_m - sin * sin_m  # cos(theta + m)
    keep = c > 0 if easy else c >= -cos_m  # theta <= pi - m
    return torch.where(keep, phi, c if easy else c - margin * sin_m)


def orthogonal(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a - c b`` for unit rows ``a``, ``b`` with ``c = a . b``: ``a``'s part
    orthogonal to ``b``, whose norm is the sine of their angle."""
    return a - c.unsqueeze(1) * b


def _noise(dtype: torch.dtype) -> float:
    """The largest norm :func:`orthogonal` gives from rounding alone (unit rows along
    one line): below it the angle is 0 or pi and the direction is noise."""
    return 64 * torch.finfo(dtype).eps


def sine(across: Tensor) -> Tensor:
    """The norms of ``across``'s rows (the sines of angles, see :func:`orthogonal`).
    Below the rounding noise no gradient flows through them: at an angle of 0 the
    margin's term is the tip of a cone whose direction rounding cannot tell, and 0 is
    its subgradient (the mean of the gradients on either side), as on the tiled path."""
    sin = torch.linalg.vector_norm(across, dim=1)
    return torch.where(sin > _noise(sin.dtype), sin, sin.detach())


TargetFn = Callable[[Tensor, Tensor, float, bool], Tensor]
#: the target logits by name (a name, not a function, crosses processes in the call check)
TARGETS = {"cosface": _cosface, "arcface": _arcface}


class Shard:
    """How a rank's slice of the classes meets the others' (see
    :mod:`flashcl.losses.class_shards`): ``lse(part)`` joins each row's logsumexp over
    this slice into the global one, ``targets(t)`` the target logits that each row's
    owner formed (zeros elsewhere)."""

    def lse(self, part: Tensor) -> Tensor:
        return part

    def targets(self, t: Tensor) -> Tensor:
        return t


class _MarginState:
    def __init__(self, m: int, like: Tensor, scale_rows: bool) -> None:
        self.lse = like.new_full((m,), float("-inf"))  # over this slice's classes, then every slice's
        self.t: Optional[Tensor] = None  # every row's target logit (joined over the slices)
        self.g: Optional[Tensor] = None
        self.du: Optional[Tensor] = None
        self.scale_rows = like.new_zeros(m) if scale_rows else None


class MarginHead(Head):
    """The margin softmax over class proxies (CosFace, ArcFace): per row
    ``LSE_j a_ij - a_iy`` with ``a_ij = s cos_ij`` (a class's cosine its closest
    proxy's, ``k`` proxies per class in consecutive columns) and the target logit
    ``a_iy = u_i`` given (:func:`target_logits`, the head's one learnable tensor: its
    gradient ``dL/du_i = g_i (p_iy - 1)``, the margin's own through autograd).
    ``labels``: each row's class among the columns' (``-1``: held by another slice of
    the classes, whose ``shard`` joins the rows' logsumexps and target logits in
    :meth:`finish`). Its tiles go by blocks of whole classes
    (:class:`~flashcl.engine.columns.ColumnBlocks`); the gradient's tiles leave each
    row's upstream gradient to the driver. ``scale_rows``: each row's gradient of the
    scale from the tiles (``sum_j p_ij a_ij / s`` without the target), kept in the state."""

    factored_rows = True

    def __init__(
        self, labels: Tensor, u: Tensor, k: int, scale: float, shard: Optional[Shard] = None, scale_rows: bool = False
    ) -> None:
        self.labels, self.u, self.k, self.scale = labels, u, k, scale
        self.shard, self.scale_rows = shard or Shard(), scale_rows
        self.own = (labels >= 0).nonzero().flatten()

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> Any:
        return _MarginState(m, like, self.scale_rows)

    def _logits(self, s: Tensor, tile: Tile) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
        """The tile's class logits (each class's closest proxy, whose index is returned
        for ``k > 1``) with the targets' replaced by ``u``; the rows and columns of the
        targets in the tile."""
        c0, c1 = tile.c0 // self.k, tile.c1 // self.k
        arg = None
        z = s
        if self.k > 1:
            z, arg = s.view(s.shape[0], c1 - c0, self.k).max(2)
        ly = self.labels[self.own]
        inside = (ly >= c0) & (ly < c1)
        rows, cols = self.own[inside], ly[inside] - c0
        z[rows, cols] = self.u[rows]
        return z, arg, rows, cols

    def reduce(self, s: Tensor, tile: Tile, st: Any, p: int = 0) -> None:
        st.lse = torch.logaddexp(st.lse, lse_inplace(self._logits(s, tile)[0])[0])

    def finish(self, st: Any, p: int = 0) -> None:
        st.lse = self.shard.lse(st.lse)
        st.t = self.shard.targets(self.u)

    def values(self, st: Any) -> Tuple[Tensor, Optional[Tensor]]:
        return st.lse - st.t, None

    def begin_grad(self, st: Any, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.g = g_row
        # d rows / d u = p_iy - 1 on the slice that holds the row's class (expm1: no 1 - 1 near p = 1)
        du = torch.zeros_like(self.u)
        du[self.own] = g_row[self.own] * torch.expm1(self.u[self.own] - st.lse[self.own])
        st.du = du

    def grad(self, s: Tensor, tile: Tile, st: Any, buf: Optional[Tensor] = None) -> Tensor:
        z, arg, rows, cols = self._logits(s, tile)
        logits = z.clone() if st.scale_rows is not None else None
        p = z.sub_(st.lse.unsqueeze(1)).exp_()
        p[rows, cols] = 0.0  # the target's gradient is u's
        if logits is not None:
            logits[rows, cols] = 0.0
            st.scale_rows += row_dot(p, logits) / self.scale
        if arg is None:
            return p
        out = s.zero_().view(s.shape[0], -1, self.k)  # each class's gradient to its closest proxy
        out.scatter_(2, arg.unsqueeze(2), p.unsqueeze(2))
        return s

    def row_factor(self, st: Any, tile: Tile) -> Tensor:
        return st.g

    def param_grads(self, st: Any, n: int) -> Tuple[Optional[Tensor], ...]:
        return (st.du,)

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        return margin_rows(s, self.labels, params[0], self.k), None


def margin_rows(s: Tensor, labels: Tensor, u: Tensor, k: int = 1) -> Tensor:
    """Per-row losses ``LSE_j a_ij - u_i`` from the whole logits ``s`` (rows x C k:
    a class's its closest proxy's) with the target logits ``u`` set in (on the rows
    whose class ``s`` holds, ``labels >= 0``), by differentiable torch ops."""
    z = s.view(s.shape[0], -1, k).amax(2) if k > 1 else s
    own = (labels >= 0).nonzero().flatten()
    z = z.index_put((own, labels[own]), u[own])
    return torch.logsumexp(z, dim=1) - u


def target_rows(e: Tensor, w: Tensor, labels: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The rows whose class ``w`` holds (``labels >= 0``) and, for each, the row of
    ``w`` of its class's closest proxy (``k`` per class: rows ``y k .. y k + k - 1``)."""
    own = (labels >= 0).nonzero().flatten()
    ly = labels[own]
    if k == 1:
        return own, ly
    dtype = compute_dtype(e.dtype)
    cand = w.detach().reshape(-1, k, w.shape[1])[ly].to(dtype)
    best = torch.einsum(
        "nkd,nd->nk",
        cand / torch.linalg.vector_norm(cand, dim=2, keepdim=True).clamp_min(1e-12),
        e.detach()[own].to(dtype),
    )
    return own, ly * k + best.argmax(1)


def target_logits(e: Tensor, wy: Tensor, scale: Tensor, target: TargetFn, margin: float, easy: bool) -> Tensor:
    """Each row's target logit ``s f(cos_y)`` (:data:`TARGETS`) from its embedding and
    its class's proxy ``wy`` (rows of the same count), by differentiable torch ops:
    the sine formed from the vectors (:func:`orthogonal`, :func:`sine`), so that the
    gradient is bounded at ``cos = +-1``."""
    dtype = compute_dtype(e.dtype)
    eh, wh = normalize_rows(e.to(dtype)), normalize_rows(wy.to(dtype))
    c = (eh * wh).sum(1)
    return target(c, sine(orthogonal(wh, eh, c)), margin, easy) * scale


class Margin:
    """One call's margin softmax visited by hand (the classes sharded across processes,
    :mod:`flashcl.losses.class_shards`, whose backward joins the ranks; one process calls
    the engine's ``run`` with a :class:`MarginHead` instead): the target logits (O(B D),
    apart) and the head over blocks of ``block`` classes
    (:class:`~flashcl.engine.columns.ColumnBlocks`). ``opts``: ``(target, margin,
    easy, block, k)``; ``shard`` joins the slices of the classes held by other
    processes; ``scale_rows``: each row's part of the scale's gradient is kept."""

    def __init__(
        self,
        e: Tensor,
        w: Tensor,
        scale: Tensor,
        labels: Tensor,
        opts: Tuple[Any, ...],
        shard: Optional[Shard] = None,
        scale_rows: bool = False,
    ) -> None:
        name, self.margin, self.easy, block, k = opts
        self.target = TARGETS[name]
        self.own, self.rows_y = target_rows(e, w, labels, k)
        t = target_logits(
            e.detach()[self.own], w.detach()[self.rows_y], scale.detach(), self.target, self.margin, self.easy
        )
        self.u = t.new_zeros(e.shape[0]).index_copy_(0, self.own, t)
        self.problem = Problem(MarginHead(labels, self.u, k, float(scale), shard, scale_rows))
        self.block = block * k
        self.st: Any = None

    def _driver(self, e: Tensor, w: Tensor) -> Any:
        """Blocks of classes against every row (the tiled backend's column layout)."""
        return backends.layout_driver("columns", e.device.type)

    def values(self, e: Tensor, w: Tensor, scale: Tensor) -> Tensor:
        """Each row's loss (the head's state kept for :meth:`grads`)."""
        rows, self.st = visit_values(e, w, scale, self.problem, self._driver(e, w), self.block)
        return rows

    def grads(self, e: Tensor, w: Tensor, scale: Tensor, g: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The gradients of ``sum_i g_i rows_i``: ``e``'s and ``w``'s (this slice's
        classes' part), and the scale's: per row with ``scale_rows`` (their sum is the
        scale's), else the sum."""
        de, dw, tiles, du = visit_grads(e, w, scale, self.problem, self._driver(e, w), self.block, self.st, g, 1)
        assert de is not None and dw is not None and tiles is not None and du is not None
        with torch.enable_grad():  # the target logits' part, through their formula: into the target rows alone
            leaves = [e.detach()[self.own].requires_grad_(True), w.detach()[self.rows_y].requires_grad_(True)]
            t = target_logits(leaves[0], leaves[1], scale.detach(), self.target, self.margin, self.easy)
            d_e, d_w = torch.autograd.grad(t, leaves, du[self.own])
        de.index_add_(0, self.own, d_e.to(de.dtype))
        dw.index_add_(0, self.rows_y, d_w.to(dw.dtype))
        dscale = du * (self.u / float(scale))  # d u / d s = u / s
        head_rows = self.st.scale_rows  # the tiles' part per row, where kept
        return de, dw, dscale.sum() + tiles if head_rows is None else dscale + g * head_rows


def auto_class_block(b: int, c: int, k: int = 1) -> int:
    """Classes per block: a B x block x k tile of about 4M entries (16 MB in float32)."""
    return max(1, min(c, (1 << 22) // max(1, b * k)))
