"""The cross-entropy between a teacher's soft targets over K prototypes and the
student's softmax over them (DINO, iBOT, SwAV), the rows x K logits formed a block at a
time: :class:`PrototypeCrossEntropy` on the targets of :mod:`flashcl.engine.prototypes`.

Each row's loss and its logits' gradient are formed without cancellation
(:func:`soft_cross_entropy`): with ``m`` the row's largest logit,
``loss = mass log1p(sum_{k != m} exp(z_k - z_m)) + sum_k p_k (z_m - z_k)``, two
non-negative terms, and the gradient at ``m`` from the targets' and the exponentials'
sums without ``m``; so a tiny loss (a student that agrees with a sharp teacher: 1e-7
against logits of 25) keeps its relative precision in float32, where ``LSE - sum p z``
leaves nothing of it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype
from .engine import FusedFunction, normalize_backward_, normalize_rows
from .prototypes import Blocks, Group, Prototypes, inverse_norms, unit_rows

__all__ = [
    "soft_cross_entropy",
    "soft_terms",
    "soft_gradient_",
    "soft_gradient_rows_",
    "PrototypeCrossEntropy",
    "auto_rows_block",
]


def soft_cross_entropy(z: Tensor, p: Tensor, owned: bool = False) -> Tensor:
    """Each row's cross-entropy ``-sum_k p_k log_softmax_k(z)`` (rows over the last
    dimension) by differentiable torch ops, twice differentiable, with no cancellation:
    with ``m`` a row's largest logit ``z_m``,

        loss = (sum_k p_k) log1p(sum_{k != m} exp(z_k - z_m)) + sum_k p_k (z_m - z_k)

    two non-negative terms, so that a tiny loss (a student that agrees with a sharp
    teacher) keeps its relative precision in float32, where ``LSE(z) - sum_k p_k z_k``
    subtracts two numbers of the logits' size. The gradient at the largest logit comes
    out as ``sum_{k != m} p_k - mass rest / (1 + rest)``, both small there, not as the
    difference of two numbers near 1. A target of probability 0 takes no part
    (``0 log 0 = 0``: a ``-inf`` logit there is no NaN). ``owned``: ``z`` is the caller's
    temporary (the logits formed for this call), shifted in place: the rows x K tensors
    alive at once are then as many as ``log_softmax``'s form."""
    top, idx = z.max(-1, keepdim=True)  # its backward keeps the indices, not z
    # the largest logit's own entry a constant 0: its gradient comes through ``top`` alone (a subtraction and
    # a scatter keep nothing of their input for the backward: in place where the logits are ours)
    d = (z.sub_(top) if owned else z - top).scatter_(-1, idx, 0.0)
    rest = _OthersExpSum.apply(d, idx)
    if bool(torch.isinf(d).any()):  # a logit of -inf (probability 0): its target's term 0, not 0 x inf
        d = torch.where(p > 0, d, torch.zeros_like(d))
    return p.sum(-1) * torch.log1p(rest) - torch.linalg.vecdot(p, d, dim=-1)


class _OthersExpSum(torch.autograd.Function):
    """``apply(d, idx) -> sum_{k != idx} exp(d_k)`` over the last dimension, its backward
    recomputing ``exp(d)`` from ``d`` (which the caller keeps): no rows x K tensor saved
    of its own; differentiable again (second derivatives)."""

    @staticmethod
    def forward(ctx: Any, d: Tensor, idx: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(d, idx)
        return d.scatter(-1, idx, float("-inf")).exp_().sum(-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        d, idx = ctx.saved_tensors
        return d.scatter(-1, idx, float("-inf")).exp() * grad.unsqueeze(-1), None


class _RowStats:
    """Each row's statistics of its logits ``z`` against its targets ``p``, from which its
    loss and its logits' gradient follow without cancellation (:func:`soft_cross_entropy`'s
    form): the largest logit ``top`` and its prototype ``idx``, ``rest = sum_{k != idx}
    exp(z_k - top)``, ``mass = sum_k p_k``, ``prest = sum_{k != idx} p_k`` and ``cross =
    sum_k p_k (top - z_k)`` (:func:`soft_terms`)."""

    def __init__(self, n: int, like: Tensor) -> None:
        self.top = like.new_zeros(n)
        self.idx = torch.zeros(n, dtype=torch.long, device=like.device)
        self.rest, self.mass, self.prest, self.cross = (like.new_zeros(n) for _ in range(4))

    def rows(self) -> Tensor:
        """Each row's loss: ``mass log1p(rest) + cross``, both terms non-negative."""
        return self.mass * torch.log1p(self.rest) + self.cross

    def saved(self) -> Tuple[Tensor, ...]:
        return self.top, self.idx, self.rest, self.mass, self.prest


def soft_terms(d: Tensor, targets: Sequence[Tensor], known: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """For complete rows of logits shifted by their largest, ``d = z - top`` (``<= 0``,
    exactly 0 at the largest), and the targets whose sum is each row's target: ``(mass,
    cross)``, the targets' sum (``known``, where given) and ``sum_k p_k (top - z_k)``,
    a sum of non-negative terms."""
    mass = d.new_zeros(d.shape[0]) if known is None else known
    cross = d.new_zeros(d.shape[0])
    for p in targets:
        if known is None:
            mass += p.sum(1)
        cross -= _row_dots(p, d)
    return mass, cross


def soft_gradient_rows_(
    gz: Tensor, targets: Sequence[Tensor], top: Tensor, idx: Tensor, rest: Tensor, mass: Tensor
) -> Tensor:
    """In place, complete rows of logits ``gz`` into ``dL/dz = mass softmax - p`` (``p``:
    the sum of ``targets``): ``mass exp(z_k - top) / (1 + rest) - p_k``, and at each
    row's largest logit minus the sum of the others (the entries sum to ``mass - sum p =
    0``): small terms added, never the difference of two numbers near 1 (the target
    there, and its softmax, near collapse)."""
    gz.sub_(top.unsqueeze(1)).exp_().mul_((mass / (1.0 + rest)).unsqueeze(1))
    for p in targets:
        gz.sub_(p)
    at = idx.unsqueeze(1)
    gz.scatter_(1, at, 0.0)
    return gz.scatter_(1, at, gz.sum(1, keepdim=True).neg_())


def soft_gradient_(
    gz: Tensor,
    targets: Sequence[Tensor],
    k0: int,
    top: Tensor,
    idx: Tensor,
    rest: Tensor,
    mass: Tensor,
    prest: Tensor,
) -> Tensor:
    """In place, a tile of logits ``gz`` (rows x prototypes ``k0 ..`` of complete rows'
    blocks) into ``dL/dz = mass softmax - p`` (``p``: the sum of ``targets``, tiles of the
    same shape): ``mass exp(z_k - top) / (1 + rest) - p_k``, and at each row's largest
    logit (where it lies in the tile) ``(prest - p_idx rest) / (1 + rest)`` (``prest``:
    the targets' sum without it), not the difference of two numbers near 1."""
    gz.sub_(top.unsqueeze(1)).exp_().mul_((mass / (1.0 + rest)).unsqueeze(1))
    for p in targets:
        gz.sub_(p)
    local = idx - k0
    inside = ((local >= 0) & (local < gz.shape[1])).nonzero().squeeze(1)
    if inside.numel():
        col = local[inside]
        at = sum((p[inside, col] for p in targets), torch.zeros_like(rest[inside]))
        gz[inside, col] = (prest[inside] - at * rest[inside]) / (1.0 + rest[inside])
    return gz


def _stats_of_tile(
    stats: _RowStats, r: slice, z: Tensor, groups: List[Group], views: int, known: Optional[Tensor]
) -> None:
    """:class:`_RowStats` of complete rows (a scalar's pass) but ``prest`` (the gradient's
    pass forms it): ``z`` holds every stacked view's rows ``r`` of a block of images
    against every prototype and is left holding ``exp(z - top)`` with each row's largest
    entry set to 0."""
    top, idx = z.max(1)
    z.sub_(top.unsqueeze(1))  # z - top <= 0, exactly 0 at idx
    m = z.shape[0] // views
    zs, idxs = z.view(views, m, -1), idx.view(views, m)
    stats.top.view(views, -1)[:, r] = top.view(views, m)
    stats.idx.view(views, -1)[:, r] = idxs
    for ss, p in groups:
        if p is None:  # no targets: mass, prest and cross stay 0
            continue
        mass = p.sum(1) if known is None else known[ss[0], r]  # the views of a group share their targets
        for s in ss:
            stats.mass.view(views, -1)[s, r] = mass
            stats.cross.view(views, -1)[s, r] = -_row_dots(p, zs[s])
    e = z.exp_()
    e.scatter_(1, idx.unsqueeze(1), 0.0)
    stats.rest.view(views, -1)[:, r] = e.sum(1).view(views, m)


class PrototypeCrossEntropy(FusedFunction):
    """``apply(x, w, targets, inv_temp, block, normalize[, weights, rows_block]) -> (B,)``:
    each row's cross-entropy between its targets and the softmax of ``x^ . w^_k *
    inv_temp`` over the prototypes (``^``: L2-normalised with ``normalize``); with
    ``weights`` (B,), the scalar ``sum_b weights_b loss_b``. ``targets``:
    :class:`Blocks` (no gradient). The unit prototypes are never formed; the
    normalisation's backward is carried here. Each row's loss and gradient are
    formed as :func:`soft_cross_entropy` forms them (two non-negative terms; no
    cancellation near collapse).

    Per row: blocks of ``block`` prototypes against every row (each row's largest
    logit, its sums and its targets' sums carried across the blocks), the backward
    recomputing each (the student's logits and the targets); beyond the inputs the
    unit rows (B x D), two B x block tiles and O(B + K) vectors. A scalar instead visits
    blocks of ``rows_block`` images (None: :func:`auto_rows_block`), the rows of them in
    each of ``targets.views`` stacked views (``x``: view ``s`` in rows ``s b .. (s +
    1) b``), against every prototype, so that each row's softmax is complete in its
    block: one pass, each logit and each target formed once, the gradients formed in it
    (the backward then scales them); beyond the inputs and the gradients, the rows x K
    tiles (the student's logits, the targets and those they are formed from) and
    O(B + K).

    Second derivatives (``create_graph=True``) come from :func:`soft_cross_entropy` on
    the rows x K logits and targets: memory O(B K) on that path only."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        w: Tensor,
        targets: Blocks,
        inv_temp: float,
        block: int,
        normalize: bool,
        weights: Optional[Tensor] = None,
        rows_block: Optional[int] = None,
    ) -> Tensor:
        ctx.targets, ctx.inv_temp, ctx.block, ctx.normalize = targets, inv_temp, block, normalize
        ctx.weights = weights
        if weights is not None:
            return _fused_rows(ctx, x, w, targets, inv_temp, normalize, weights, rows_block)
        dtype = compute_dtype(x.dtype)
        xh, _ = unit_rows(x.detach().to(dtype), normalize)
        protos = Prototypes(w.detach().to(dtype), normalize)
        b, k = xh.shape[0], protos.k
        z_buf, p_buf = xh.new_empty(b, min(block, k)), xh.new_empty(b, min(block, k))
        st = _RowStats(b, xh)
        at = xh.new_zeros(b)  # the target at the largest logit so far
        rows = torch.arange(b, device=xh.device)
        for k0 in range(0, k, block):
            k1 = min(k0 + block, k)
            z = protos.tile(xh, k0, k1, inv_temp, z_buf)
            p = targets(k0, k1, p_buf)  # this pass's own buffer
            bm, bi = z.max(1)
            if k0 == 0:
                up, new = torch.ones_like(bm, dtype=torch.bool), bm
            else:
                up, new = bm > st.top, torch.maximum(st.top, bm)
                # the sums so far, taken to the new largest logit: sum p (new - z) = cross + mass (new - top)
                st.cross += st.mass * (new - st.top)
                st.rest = torch.where(up, (st.rest + 1.0) * torch.exp(st.top - new), st.rest)
                # a new largest logit: the old one's target joins the others' sum
                st.prest = torch.where(up, st.prest + at, st.prest)
            st.cross -= _row_dots(p, z.sub_(new.unsqueeze(1)))
            e = z.exp_()
            moved = up.nonzero().squeeze(1)
            at = torch.where(up, p[rows, bi], at)
            st.mass += p.sum(1)
            # the new largest logit's entries left out of rest and of the targets' sum without it (no 1 - 1)
            e[moved, bi[moved]] = 0.0
            p[moved, bi[moved]] = 0.0
            st.rest += e.sum(1)
            st.prest += p.sum(1)
            st.idx = torch.where(up, bi + k0, st.idx)
            st.top = new
        FusedFunction.setup(ctx, (x, w), st.saved())
        return st.rows()  # in the compute dtype (float32 for half-precision inputs)

    @classmethod
    def dense(cls, ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        return _dense_output(ctx, x, w)

    @classmethod
    def recompute(cls, ctx: Any, grad: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        x, w, top, idx, rest, mass, prest = saved
        dtype = compute_dtype(x.dtype)
        xh, _ = unit_rows(x.detach().to(dtype), ctx.normalize)
        protos = Prototypes(w.detach().to(dtype), ctx.normalize)
        b, k, s = xh.shape[0], protos.k, ctx.inv_temp
        g = grad.to(dtype) if ctx.weights is None else ctx.weights.to(dtype) * grad.to(dtype)
        grads = _Grads(xh, protos, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        z_buf, p_buf = xh.new_empty(b, min(ctx.block, k)), xh.new_empty(b, min(ctx.block, k))
        for k0 in range(0, k, ctx.block):
            k1 = min(k0 + ctx.block, k)
            gz = protos.tile(xh, k0, k1, s, z_buf)
            soft_gradient_(gz, [ctx.targets(k0, k1, p_buf)], k0, top, idx, rest, mass, prest)
            grads.add(gz.mul_(g.unsqueeze(1) * s), k0, k1)
        return grads.finish(x, w, ctx.normalize)


def _dense_output(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
    """:class:`PrototypeCrossEntropy`'s output as a differentiable function of ``x`` and
    ``w`` (second derivatives): :func:`soft_cross_entropy` on the rows x K logits
    against every row's targets."""
    dtype = compute_dtype(x.dtype)
    xs, ws = x.to(dtype), w.to(dtype)
    if ctx.normalize:
        xs, ws = normalize_rows(xs), normalize_rows(ws)
    p = ctx.targets(0, ws.shape[0], xs.new_empty(xs.shape[0], ws.shape[0]))
    rows = soft_cross_entropy((xs @ ws.T) * ctx.inv_temp, p.detach(), owned=True)
    return rows if ctx.weights is None else (ctx.weights.to(dtype) * rows).sum()


def auto_rows_block(k: int, tiles: int) -> int:
    """Images per block of a scalar's pass over every prototype: its ``tiles`` rows x K
    tiles per image (the student views' logits, the teacher views' targets and their
    sums) of about 16M entries together (64 MB in float32), so that its GEMMs' inner
    and outer sizes stay wide."""
    return max(1, (1 << 24) // (max(1, tiles) * max(1, k)))


def _fused_rows(
    ctx: Any,
    x: Tensor,
    w: Tensor,
    targets: Blocks,
    inv_temp: float,
    normalize: bool,
    weights: Tensor,
    rows_block: Optional[int],
) -> Tensor:
    """:class:`PrototypeCrossEntropy`'s scalar: blocks of images (their rows in every
    student view, one GEMM) against every prototype, the value and both gradients in
    one pass (handed to the backward: :class:`~flashcl.engine.engine.FusedFunction`)."""
    dtype = compute_dtype(x.dtype)
    xd = x.detach().to(dtype)
    protos = Prototypes(w.detach().to(dtype), normalize)
    (rows, d), k, views = xd.shape, protos.k, targets.views
    b = rows // views
    inv_x = inverse_norms(xd) if normalize else None
    n = max(1, min(b, rows_block or auto_rows_block(k, views + targets.tiles)))
    z_buf, scratch = xd.new_empty(views * n, k), xd.new_empty(targets.tiles, n, k)
    st = _RowStats(rows, xd)
    # each row's factor of its logits' gradient, negated: the tiles hold p - mass softmax
    neg = (weights.to(dtype) * -inv_temp).view(views, b)
    dx = torch.zeros_like(xd) if ctx.needs_input_grad[0] else None
    dwh = torch.zeros_like(protos.w) if ctx.needs_input_grad[1] else None
    known = None if targets.mass is None else targets.mass.to(dtype).view(views, b)
    for i0 in range(0, b, n):
        i1 = min(i0 + n, b)
        m, r = i1 - i0, slice(i0, i1)
        xr = xd.view(views, b, d)[:, r].reshape(views * m, d)  # of one view: the input's own rows
        if inv_x is not None:
            xr = xr * inv_x.view(views, b)[:, r].reshape(-1, 1)
        z = protos.rows_tile(xr, inv_temp, z_buf[: views * m])
        groups = targets.groups(i0, i1, scratch)
        _stats_of_tile(st, r, z, groups, views, known)  # z now exp(z - top), 0 at each row's largest
        zs = z.view(views, m, k)
        top, idx, rest, mass, prest = (t.view(views, b)[:, r] for t in st.saved())
        for ss, p in groups:  # the logits' gradient, negated: p - mass softmax
            for s in ss:
                if p is None:  # no targets, a mass of 0: no gradient
                    zs[s].zero_()
                    continue
                torch.addcmul(p, zs[s], (mass[s] / (1.0 + rest[s])).unsqueeze(1), value=-1.0, out=zs[s])
                # at the largest logit: minus the others' sum (the row sums to sum p - mass = 0), not p - softmax
                # of two numbers near 1; the targets' sum without it follows (a second backward's)
                at = idx[s].unsqueeze(1)
                zs[s].scatter_(1, at, 0.0)
                others = zs[s].sum(1)
                zs[s].scatter_(1, at, others.neg().unsqueeze(1))
                prest[s] = others + mass[s] * rest[s] / (1.0 + rest[s])
        f = neg[:, r].reshape(-1, 1)
        if dwh is not None:  # d w^_k += sum_b gz_bk x^_b / tau
            dwh.addmm_(z.T, xr * f)
        if dx is not None:  # d x^_b = sum_k gz_bk w^_k / tau
            g = torch.mm(z.mul_(protos.inv) if normalize else z, protos.w).mul_(f)
            dx.view(views, b, d)[:, r] = g.view(views, m, d)
    if dx is not None and inv_x is not None:
        normalize_backward_(dx, xd)
    if dwh is not None and normalize:
        normalize_backward_(dwh, protos.w)
    # handed to the backward, scaled there; a second backward (retain_graph) recomputes
    FusedFunction.setup(ctx, (x, w), st.saved(), grads=(dx, dwh))
    return (weights.to(dtype) * st.rows()).sum()


def _row_dots(p: Tensor, z: Tensor, chunk: int = 8192) -> Tensor:
    """Each row's ``sum_k p_bk z_bk``, a chunk of columns at a time (no copy of the
    tiles); an entry of ``p = 0`` takes no part (0 log 0 = 0: a ``-inf`` logit there is
    no NaN)."""
    out = p.new_zeros(p.shape[0])
    scratch = p.new_empty(p.shape[0], min(chunk, p.shape[1]))
    for c0 in range(0, p.shape[1], chunk):
        c1 = min(c0 + chunk, p.shape[1])
        out += torch.mul(p[:, c0:c1], z[:, c0:c1], out=scratch[:, : c1 - c0]).sum(1)
    bad = torch.isnan(out)
    if bool(bad.any()):  # 0 x inf in a row: its terms again, those of p = 0 left out
        rows = bad.nonzero().squeeze(1)
        pr, zr = p[rows], z[rows]
        out[rows] = torch.where(pr > 0, pr * zr, torch.zeros_like(zr)).sum(1)
    return out


class _Grads:
    """The rows' and the prototypes' gradients from the logits' gradient a block at a
    time: ``d w^_k = gz_k^T x^`` (then through ``w^ = w / |w|``), ``d x^ += gz w^``."""

    def __init__(
        self, xh: Tensor, protos: Prototypes, rows: bool, prototypes: bool, factor: Optional[Tensor] = None
    ) -> None:
        self.xh, self.protos = xh, protos
        # ``factor``: each row's factor of the logits' gradient; one value for every row (a mean, a
        # sum) is applied to the gradients' blocks, not to every tile; else to each tile
        self.scalar: Optional[float] = None
        self.rowwise: Optional[Tensor] = None
        if factor is not None and factor.numel() and bool((factor == factor[0]).all()):
            self.scalar = float(factor[0])
        elif factor is not None:
            self.rowwise = factor.unsqueeze(1)
        self.dxh = torch.zeros_like(xh) if rows else None
        self.dw = torch.zeros_like(protos.w) if prototypes else None

    def add(self, gz: Tensor, k0: int, k1: int) -> None:
        unit = self.protos.unit(k0, k1)
        if self.rowwise is not None:
            gz.mul_(self.rowwise)
        if self.dw is not None:
            dwh = torch.mm(gz.T, self.xh, out=self.dw[k0:k1])
            if self.scalar is not None:
                dwh.mul_(self.scalar)
            if self.protos.normalized:
                normalize_backward_(dwh, self.protos.w[k0:k1])
        if self.dxh is not None:  # d x^ += gz w^_k
            self.dxh.addmm_(gz, unit)

    def finish(self, x: Tensor, w: Tensor, normalize: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        dx = None
        if self.dxh is not None:
            dx = self.dxh if self.scalar is None else self.dxh.mul_(self.scalar)
            if normalize:  # through x^ = x / |x|, in place
                normalize_backward_(dx, x)
            dx = dx.to(x.dtype)
        return dx, None if self.dw is None else self.dw.to(w.dtype)
