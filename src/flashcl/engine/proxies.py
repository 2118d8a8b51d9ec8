"""The margin softmax's tiles over class proxies (CosFace, ArcFace): the target
logits and the visit of the classes in blocks (:func:`visit`), for the losses of
:mod:`flashcl.losses.margin` on one process and with the classes sharded across
processes (:mod:`flashcl.losses.class_shards`, which joins the slices through a
:class:`Shard`)."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype

__all__ = ["TARGETS", "Shard", "visit", "orthogonal", "sine", "auto_class_block"]


def _cosface(c: Tensor, sin: Tensor, margin: float, easy: bool) -> Tuple[Tensor, Tensor]:
    """CosFace's target logit ``cos - m`` and its derivative in ``cos`` times ``sin``
    (see :func:`_arcface`)."""
    return c - margin, sin


def _arcface(c: Tensor, sin: Tensor, margin: float, easy: bool) -> Tuple[Tensor, Tensor]:
    """ArcFace's target logit ``cos(theta + m)``, with ``theta`` the angle whose cosine
    is ``c`` and whose sine is ``sin`` (the norm of the class direction's part
    orthogonal to the embedding, formed from the vectors: accurate at ``theta`` near 0
    and pi, where ``acos`` has an infinite derivative); past ``theta > pi - m``
    (where it would stop decreasing) ``cos - m sin(m)``, as insightface and
    pytorch-metric-learning; ``easy``: ``cos`` itself where ``cos <= 0``.

    Returns the logit and ``d logit / d cos * sin(theta)``: the gradient's
    coefficient on the unit vector orthogonal to the embedding, bounded where the
    derivative in ``cos`` alone is not (``sin(theta + m)``, ``sin(m)`` at
    ``theta = 0``). Written without ``acos``, so that autograd through it (the dense
    and reference backends) is finite at ``cos = +-1`` as well."""
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    phi = c * cos_m - sin * sin_m  # cos(theta + m)
    slope = sin * cos_m + c * sin_m  # sin(theta + m) = d cos(theta + m) / d cos * sin(theta)
    keep = c > 0 if easy else c >= -cos_m  # theta <= pi - m
    other = c if easy else c - margin * sin_m
    return torch.where(keep, phi, other), torch.where(keep, slope, sin)


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


TargetFn = Callable[[Tensor, Tensor, float, bool], Tuple[Tensor, Tensor]]
#: the target logits by name (a name, not a function, crosses processes in the call check)
TARGETS = {"cosface": _cosface, "arcface": _arcface}


class Shard:
    """How a rank's slice of the classes meets the others' (see
    :mod:`flashcl.losses.proxies`): ``lse(mx, total)`` joins each row's running max and
    sum over this slice into the global logsumexp, ``targets(t)`` the target logits
    that each row's owner formed (zeros elsewhere)."""

    def lse(self, mx: Tensor, total: Tensor) -> Tensor:
        return mx + total.log()

    def targets(self, t: Tensor) -> Tensor:
        return t


def visit(
    e: Tensor,
    w: Tensor,
    scale: Tensor,
    labels: Tensor,
    opts: Tuple[Any, ...],
    weights: Optional[Tensor],
    needs: Tuple[bool, ...],
    lse: Optional[Tensor],
    shard: Optional[Shard] = None,
    scale_rows: bool = False,
) -> Tuple[Tensor, Tensor, Optional[List[Optional[Tensor]]]]:
    """The rows' losses and logsumexps (a first visit unless ``lse`` is given) and,
    with ``weights``, the gradients of ``sum weights * rows`` for the inputs that
    ``needs`` marks (a second visit). ``w`` holds ``k`` proxies per class (rows
    ``c k .. c k + k - 1``; a class's logit is its closest proxy's); ``labels`` index
    ``w``'s classes, -1 for a row whose class another rank's slice holds (``shard``
    then joins the slices: the rows' losses are global, the gradients this slice's
    part). ``scale_rows``: the scale's gradient per row (its sum is the scale's)."""
    name, margin, easy, block, k = opts
    target = TARGETS[name]
    dtype = compute_dtype(e.dtype)
    s = float(scale)
    b, c = e.shape[0], w.shape[0] // k
    ed = e.detach().to(dtype)
    e_norm = torch.linalg.vector_norm(ed, dim=1).clamp_min(1e-12)
    eh = ed / e_norm.unsqueeze(1)
    wd = w.detach()
    # the norms in the wider of the two dtypes (class weights may be wider than the embeddings)
    norm_dtype = torch.promote_types(wd.dtype, dtype)
    w_inv = 1.0 / torch.linalg.vector_norm(wd, dim=1, dtype=norm_dtype).to(dtype).clamp_min(1e-12)
    own = (labels >= 0).nonzero().flatten()  # the rows whose class this slice holds
    ly = labels[own]
    # the target cosines and logits, from the closest proxy of each label's class
    cand = wd.view(c, k, wd.shape[1])[ly].to(dtype) * w_inv.view(c, k)[ly].unsqueeze(2)
    ky = torch.einsum("nkd,nd->nk", cand, eh[own]).argmax(1) if k > 1 else torch.zeros_like(ly)
    wy = cand[torch.arange(own.numel(), device=e.device), ky]
    row_y = ly * k + ky  # the winning proxy's row of w
    eo = eh[own]
    c_y = (eo * wy).sum(1)
    # the target's gradient runs along the unit vectors orthogonal to e^ (for e) and to
    # w^_y (for w), formed from the vectors: through the projections it would carry
    # d logit / d cos, unbounded at cos = +-1 for ArcFace, times a difference of rounding
    across_e = orthogonal(wy, eo, c_y)
    sin = torch.linalg.vector_norm(across_e, dim=1)
    t_own, t_slope = target(c_y, sin, margin, easy)
    t = eh.new_zeros(b).index_copy_(0, own, t_own)
    width = min(block, c)
    buf = eh.new_empty(b, width * k)

    def tile(c0: int, c1: int) -> Tuple[Tensor, Optional[Tensor]]:
        """Block ``c0:c1``'s logits ``s cos`` (each class's closest proxy, whose index
        is returned for ``k > 1``), the targets' replaced by ``s f(cos_y)``."""
        out = torch.mm(eh, wd[c0 * k : c1 * k].to(dtype).T, out=buf[:, : (c1 - c0) * k])
        out.mul_(w_inv[c0 * k : c1 * k].unsqueeze(0) * s)
        arg = None
        if k > 1:
            out, arg = out.view(b, c1 - c0, k).max(2)
        inside = (ly >= c0) & (ly < c1)
        out[own[inside], ly[inside] - c0] = s * t_own[inside]
        return out, arg

    if lse is None:
        mx = eh.new_full((b,), float("-inf"))
        total = eh.new_zeros(b)
        for c0 in range(0, c, block):
            z, _ = tile(c0, min(c0 + block, c))
            new_mx = torch.maximum(mx, z.amax(1))
            total = total * torch.exp(mx - new_mx) + z.sub_(new_mx.unsqueeze(1)).exp_().sum(1)
            mx = new_mx
        lse = (shard or Shard()).lse(mx, total)
    rows = lse - s * (t if shard is None else shard.targets(t))
    if weights is None:
        return rows, lse, None
    need_e, need_w, need_scale = needs
    de_hat = torch.zeros_like(eh) if need_e else None
    dw = torch.empty_like(w) if need_w else None
    # d rows / d s = sum_j p_ij a_ij - a_iy with logit = s a: the logits are kept for it
    logits = eh.new_empty(b, width) if need_scale else None
    wo = weights[own]
    dscale = eh.new_zeros(b).index_add_(0, own, -(wo * t_own))  # per row: a share of it is a rank's
    # d sum(weights * rows) / d logit_y = weighted softmax - weight; times s and the slope;
    # nothing along a direction that is rounding noise (see sine)
    coef = (torch.exp(s * t_own - lse[own]) * wo - wo) * s * t_slope
    coef = torch.where(sin > _noise(dtype), coef, torch.zeros_like(coef))
    unit_e = across_e / sin.clamp_min(_noise(dtype)).unsqueeze(1)
    across_w = orthogonal(eo, wy, c_y)
    unit_w = across_w / torch.linalg.vector_norm(across_w, dim=1).clamp_min(_noise(dtype)).unsqueeze(1)
    for c0 in range(0, c, block):
        c1 = min(c0 + block, c)
        z, arg = tile(c0, c1)
        if logits is not None:
            kept = logits[:, : c1 - c0].copy_(z)
        p = z.sub_(lse.unsqueeze(1)).exp_().mul_(weights.unsqueeze(1))  # weighted softmax of the block
        if logits is not None:
            dscale += torch.bmm(p.unsqueeze(1), kept.unsqueeze(2)).view(b) / s
        # d rows_i / d logit_ij = softmax_ij, d logit / d cos = s; the targets' terms apart (coef)
        inside = (ly >= c0) & (ly < c1)
        p[own[inside], ly[inside] - c0] = 0.0
        g = p.mul_(s)
        if arg is not None:  # each class's gradient to its closest proxy
            g = torch.zeros(b, c1 - c0, k, dtype=dtype, device=e.device).scatter_(2, arg.unsqueeze(2), g.unsqueeze(2))
            g = g.view(b, (c1 - c0) * k)
        wb = wd[c0 * k : c1 * k].to(dtype) * w_inv[c0 * k : c1 * k].unsqueeze(1)
        if de_hat is not None:
            de_hat.addmm_(g, wb)
        if dw is not None:
            dwh = g.T @ eh  # d / d w^ of the block's proxies; through w^ = w / |w|:
            dwh.sub_(wb * (wb * dwh).sum(1, keepdim=True)).mul_(w_inv[c0 * k : c1 * k].unsqueeze(1))
            ys = row_y[inside]
            dwh.index_add_(0, ys - c0 * k, (coef[inside] * w_inv[ys]).unsqueeze(1) * unit_w[inside])
            dw[c0 * k : c1 * k] = dwh
    de = None
    if de_hat is not None:  # through e^ = e / |e|
        de = de_hat - eh * (eh * de_hat).sum(1, keepdim=True)
        de.index_add_(0, own, coef.unsqueeze(1) * unit_e)
        de = de / e_norm.unsqueeze(1)
    return rows, lse, [de, dw, (dscale if scale_rows else dscale.sum()) if need_scale else None]


def auto_class_block(b: int, c: int, k: int = 1) -> int:
    """Classes per block: a B x block x k tile of about 4M entries (16 MB in float32)."""
    return max(1, min(c, (1 << 22) // max(1, b * k)))
