"""Matryoshka losses in one pass: the loss at every prefix width of the embeddings.

Matryoshka representation learning (Kusupati et al., 2022) trains embeddings whose
first ``d`` coordinates are a good embedding on their own, for several ``d``:
``sum_m w_m loss(q[:, :d_m], k[:, :d_m])``, each term with its own normalisation
of the prefix. Computed as separate calls, that is one loss per width: the three
score GEMMs once per width (``sum_m d_m / D`` times the work at full width:
2.25x for 768, 512, 256, 128, 64).

Here the widths share one pass. The score of prefix ``m`` is a running sum of
per-segment partial products, rescaled by the prefix norms:

    R^m = sum_{segments <= m} Q[:, seg] K[:, seg]^T,   s^m_ij = scale * R^m_ij * a^m_i * b^m_j

with ``a^m_i = 1 / |q_i[:d_m]|`` (``b`` for ``k``; 1 without normalisation). A row
block's partial products are accumulated segment by segment (one GEMM of the full
width in all) and each width's head reduces its own tile. In backward the widths
are visited from the widest down: the gradient of segment ``t`` is
``H_t = sum_{m >= t} scale * G^m * a^m b^m``, one GEMM pair per segment (again the
full width in all), and the prefix norms get theirs from ``sum_j G^m_ij s^m_ij``.
The positives (linear terms) are computed in embedding space per width.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype
from .engine import NORM_EPS, FusedFunction, Problem, autocast_off, finite_rows, normalize_rows
from .heads import Tile

__all__ = ["prefix_scales", "head_values", "linear_terms", "run_widths"]


#: Normalised widths up to this many coordinates are differentiated apart (see
#: :func:`_grad_pass`).
NARROW = 16


def prefix_scales(x: Tensor, dims: List[int], normalize: bool) -> Tensor:
    """(M, rows): ``1 / max(|x[:, :d]|, eps)`` per width (differentiable), or ones."""
    if not normalize:
        return torch.ones(len(dims), x.shape[0], dtype=x.dtype, device=x.device)
    return torch.stack([1.0 / torch.linalg.vector_norm(x[:, :d], dim=1).clamp_min(NORM_EPS) for d in dims])


def _block(m: int, n: int, itemsize: int, device_type: str, widths: int) -> int:
    """Rows per block: the gradient pass's ``widths + 3`` (rows x n) buffers within
    ~128 MB (CPU) or 512 MB."""
    budget = (512 if device_type == "cuda" else 128) * 2**20
    return max(1, min(m, budget // max(1, (widths + 3) * n * itemsize)))


def _bound(q: Tensor, k: Tensor, aq: Tensor, ak: Tensor, dims: List[int], scale: float) -> float:
    """``>= max |s^m_ij|`` over every width (Cauchy-Schwarz per prefix)."""
    best = 0.0
    for i, d in enumerate(dims):
        qn = float((torch.linalg.vector_norm(q[:, :d], dim=1) * aq[i]).max()) if q.shape[0] else 0.0
        kn = float((torch.linalg.vector_norm(k[:, :d], dim=1) * ak[i]).max()) if k.shape[0] else 0.0
        best = max(best, qn * kn)
    return abs(scale) * best


class _HeadValues(FusedFunction):
    """``apply(q, k, aq, ak, scale, problem, dims, block, weights)``: each width's head
    values, (M, m [+ n]) (rows, then the columns of a head with columns); with
    ``weights`` (M, m), the scalar ``sum weights * rows``, whose gradient is then
    formed in the same visit as the values when the head's rows are complete in
    one tile. ``k=None``: the candidates are the anchors. Its backward's rules are
    :class:`~flashcl.engine.FusedFunction`'s."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Optional[Tensor],
        aq: Tensor,
        ak: Tensor,
        scale: Tensor,
        problem: Problem,
        dims: List[int],
        block: int,
        weights: Optional[Tensor],
    ) -> Tensor:
        head = problem.head
        qd, kd = q.detach(), (q if k is None else k).detach()
        aqd, akd = aq.detach(), ak.detach()
        s = float(scale)
        m, n = qd.shape[0], kd.shape[0]
        states = [head.state(m, n, qd, _bound(qd, kd, aqd, akd, dims, s)) for _ in dims]
        ctx.problem, ctx.dims, ctx.block, ctx.states, ctx.same = problem, dims, block, states, k is None
        ctx.weights = weights
        grads = None
        fused = (
            weights is not None
            and any(ctx.needs_input_grad[:5])
            and head.fuses_rows
            and not head.has_columns
            and head.passes == 1
        )
        if fused:
            assert weights is not None
            grads = _fused(qd, kd, aqd, akd, s, problem, dims, block, states, weights, k is None)
        else:
            for p in range(head.passes):
                _visit(qd, kd, aqd, akd, s, problem, dims, block, states, p)
                for st in states:
                    head.finish(st, p)
        out = []
        for st in states:
            rows, cols = head.values(st)
            out.append(rows if cols is None else torch.cat([rows, cols]))
        FusedFunction.setup(ctx, (q, k, aq, ak, scale), grads=grads)
        values = torch.stack(out)
        if weights is None:
            return values
        return (weights * values[:, :m]).sum()

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        q, k, aq, ak, scale = inputs
        values = _dense(q, k, aq, ak, scale, ctx.problem, ctx.dims)
        return values if ctx.weights is None else (ctx.weights * values[:, : q.shape[0]]).sum()

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        q, k, aq, ak, scale = saved
        if ctx.weights is not None:  # the scalar's gradient as the values' (no column terms in it)
            m = q.shape[0]
            n_cols = (m if k is None else k.shape[0]) if ctx.problem.head.has_columns else 0
            full = ctx.weights.new_zeros(len(ctx.dims), m + n_cols)
            full[:, :m] = ctx.weights * grad_out
            grad_out = full
        return _backward(ctx, grad_out, q, k, aq, ak, scale)


def _tile_scores(r: Tensor, a: Tensor, b: Tensor, scale: float, out: Tensor) -> Tensor:
    """``scale * r * a_i * b_j`` into ``out``."""
    torch.mul(r, a.unsqueeze(1), out=out)
    return out.mul_((b * scale).unsqueeze(0))


def _visit(
    q: Tensor,
    k: Tensor,
    aq: Tensor,
    ak: Tensor,
    scale: float,
    problem: Problem,
    dims: List[int],
    block: int,
    states: List[Any],
    p: int,
) -> None:
    """One reduction pass of every width's head over every row block."""
    head = problem.head
    m, n = q.shape[0], k.shape[0]
    r_buf = q.new_empty(min(block, m), n)
    s_buf = torch.empty_like(r_buf)
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        r, s = r_buf[: r1 - r0], s_buf[: r1 - r0]
        r.zero_()
        lo = 0
        for i, d in enumerate(dims):
            r.addmm_(q[r0:r1, lo:d], k[:, lo:d].T)
            lo = d
            head.reduce(
                _tile_scores(r, aq[i, r0:r1], ak[i], scale, s), Tile(r0, r1, 0, n, problem.offset), states[i], p
            )


def _grad_pass(
    q: Tensor,
    k: Tensor,
    aq: Tensor,
    ak: Tensor,
    scale: float,
    problem: Problem,
    dims: List[int],
    block: int,
    same: bool,
    tile_grad: Callable[..., Tensor],
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]:
    """The gradients of q, k, aq, ak and the scale from one visit of row blocks:
    every width's products (one GEMM of the full width in all), then the widths
    from the widest down; segment
    ``t``'s gradient ``scale H_t K_t`` as soon as ``H_t`` (the sum of
    ``X^m = G^m a^m b^m`` over the widths that contain it) is complete.
    ``tile_grad(i, s, tile, a, b, buf)`` returns width ``i``'s ``X`` for the tile's
    scores ``s`` (``buf``: a free (rows x N) buffer).

    Each width's ``R`` is a prefix sum formed from the narrowest width up, as in the
    forward pass, and kept: obtaining a narrow width's ``R`` by subtracting the
    other segments from the full product would leave float32 cancellation of the
    order of ``eps |q| |k|``, which the prefix norms then divide by ``|q[:d]| |k[:d]|``
    (noise in the gradient at a width of 1 or 2).

    A normalised prefix of width 1 is the sign of its coordinate, which has no
    gradient: that width then gives the scale its gradient and nothing else. Left
    to the general formula, its gradient would be two terms of size ``|g| / |x_0|``
    that cancel only up to float32 rounding (noise where ``x_0`` is small).

    Narrow normalised widths (up to :data:`NARROW` coordinates) are differentiated
    apart: ``Y = X K[:, :d]`` by its own small GEMM and projected, ``Y - a^2 (q . Y) q``,
    so that the two terms that cancel are formed from the same rounded numbers.
    Through ``H`` and the prefix norm they
    would be two sums rounded apart, their difference multiplied by ``a^2 |q|``,
    large where a narrow prefix is short. Their GEMMs are at most ``NARROW``
    columns wide, a small part of the full width's."""
    m, n = q.shape[0], k.shape[0]
    signs = (
        dims[0] == 1
        and problem.normalize
        and bool((q[:, 0].abs() > NORM_EPS).all())
        and bool((k[:, 0].abs() > NORM_EPS).all())
    )
    apart = [problem.normalize and d <= NARROW for d in dims]
    qg = finite_rows(q)  # the gradient GEMMs' operands: a NaN in an excluded key reaches no other gradient
    kg = qg if same else finite_rows(k)
    dq = torch.zeros_like(q)
    dk = dq if same else torch.zeros_like(k)
    daq, dak, dscale = torch.zeros_like(aq), torch.zeros_like(ak), q.new_zeros(())
    r_bufs = [q.new_empty(min(block, m), n) for _ in dims]
    s_buf, h_buf, x_buf = (q.new_empty(min(block, m), n) for _ in range(3))
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        rs = [buf[: r1 - r0] for buf in r_bufs]
        sb, h, x = s_buf[: r1 - r0], h_buf[: r1 - r0], x_buf[: r1 - r0]
        lo = 0
        for i, d in enumerate(dims):  # R of each width, the narrowest first (as the forward pass)
            if i == 0:
                torch.mm(q[r0:r1, :d], k[:, :d].T, out=rs[0])
            else:
                torch.addmm(rs[i - 1], q[r0:r1, lo:d], k[:, lo:d].T, out=rs[i])
            lo = d
        h.zero_()
        tile = Tile(r0, r1, 0, n, problem.offset)
        for i in range(len(dims) - 1, -1, -1):
            r, a, b = rs[i], aq[i, r0:r1], ak[i]
            grad = tile_grad(i, _tile_scores(r, a, b, scale, sb), tile, a, b, x)
            # ds^m/dR = scale a_i b_j; ds^m/da_i = s^m_ij / a_i, and likewise for b and the scale
            torch.mul(grad, r, out=x)  # X R = G s / scale
            rows = x.sum(1)
            dscale += rows.sum()
            if apart[i] and not (i == 0 and signs):
                _add_projected(grad, qg[r0:r1, : dims[i]], kg[:, : dims[i]], a, b, scale, dq[r0:r1], dk)
            elif not apart[i]:
                daq[i, r0:r1] += rows * (scale / a)
                dak[i] += x.sum(0) * (scale / b)
                h.add_(grad)
            lo, d = (dims[i - 1] if i > 0 else 0), dims[i]
            qs, ks = qg[r0:r1, lo:d], kg[:, lo:d]
            dq[r0:r1, lo:d].addmm_(h, ks, alpha=scale)
            dk[:, lo:d].addmm_(h.T, qs, alpha=scale)
    return dq, (None if same else dk), daq, dak, dscale


def _add_projected(
    x: Tensor, qb: Tensor, k: Tensor, a: Tensor, b: Tensor, scale: float, dq: Tensor, dk: Tensor
) -> None:
    """A narrow width's gradient through its normalised prefixes, added to the first
    ``d`` columns of dq (the block's rows) and dk: ``scale (Y - a^2 (q . Y) q)`` with
    ``Y = X K``, and the same for k with ``X^T Q``."""
    d = qb.shape[1]
    y = x @ k
    y.sub_(qb * ((qb * y).sum(1) * a * a).unsqueeze(1))
    dq[:, :d].add_(y, alpha=scale)
    z = x.T @ qb
    z.sub_(k * ((k * z).sum(1) * b * b).unsqueeze(1))
    dk[:, :d].add_(z, alpha=scale)


def _fused(
    q: Tensor,
    k: Tensor,
    aq: Tensor,
    ak: Tensor,
    scale: float,
    problem: Problem,
    dims: List[int],
    block: int,
    states: List[Any],
    weights: Tensor,
    same: bool,
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]:
    """Every width's rows and the gradient of ``sum weights * rows`` in one visit of
    complete row blocks (:func:`_grad_pass`, the head's rows reduced as it goes)."""
    head = problem.head
    weights_a = weights * aq  # the row factor a of X = G a b, folded into the head's row weights

    def tile_grad(i: int, s: Tensor, tile: Tile, a: Tensor, b: Tensor, buf: Tensor) -> Tensor:
        grad = head.rows_fused(s, tile, states[i], weights_a[i])
        assert grad is not None
        return grad.mul_(b.unsqueeze(0))  # X = G a b

    return _grad_pass(q, k, aq, ak, scale, problem, dims, block, same, tile_grad)


def _backward(
    ctx: Any, grad_out: Tensor, q: Tensor, k: Optional[Tensor], aq: Tensor, ak: Tensor, scale: Tensor
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]:
    problem, dims, block, states, same = ctx.problem, ctx.dims, ctx.block, ctx.states, ctx.same
    head = problem.head
    qd = q.detach()
    kd = qd if same else k.detach()  # type: ignore[union-attr]
    m = qd.shape[0]
    g = grad_out.to(qd.dtype)
    for i, st in enumerate(states):
        head.begin_grad(st, g[i, :m], g[i, m:] if head.has_columns else None)

    def tile_grad(i: int, s: Tensor, tile: Tile, a: Tensor, b: Tensor, buf: Tensor) -> Tensor:
        grad = head.grad(s, tile, states[i], buf)  # dL/ds^m
        return grad.mul_(a.unsqueeze(1)).mul_(b.unsqueeze(0))  # X = G a b

    return _grad_pass(qd, kd, aq.detach(), ak.detach(), float(scale), problem, dims, block, same, tile_grad)


def _dense(
    q: Tensor, k: Optional[Tensor], aq: Tensor, ak: Tensor, scale: Tensor, problem: Problem, dims: List[int]
) -> Tensor:
    """The head values by differentiable torch ops on each width's whole score matrix."""
    kk = q if k is None else k
    out = []
    for i, d in enumerate(dims):
        s = (q[:, :d] @ kk[:, :d].T) * aq[i].unsqueeze(1) * ak[i].unsqueeze(0) * scale
        rows, cols = problem.head.dense(s, Tile(0, s.shape[0], 0, s.shape[1], problem.offset))
        out.append(rows if cols is None else torch.cat([rows, cols]))
    return torch.stack(out)


def head_values(
    q: Tensor,
    k: Optional[Tensor],
    aq: Tensor,
    ak: Tensor,
    scale: Tensor,
    problem: Problem,
    dims: List[int],
    block: Optional[int],
    weights: Optional[Tensor] = None,
) -> Tensor:
    """(M, m [+ n]) every width's head values, in one pass over row blocks
    (``block`` rows; None picks them); with ``weights`` (M, m), the scalar
    ``sum weights * rows`` (its gradient formed in the same pass when the head
    allows). q, k, aq, ak in the compute dtype."""
    m = q.shape[0]
    n = m if k is None else k.shape[0]
    blk = block or _block(m, n, q.element_size(), q.device.type, len(dims))
    with autocast_off(q.device.type):
        return _HeadValues.apply(q, k, aq, ak, scale, problem, dims, blk, weights)


def linear_terms(
    q: Tensor,
    k: Optional[Tensor],
    aq: Tensor,
    ak: Tensor,
    scale: Tensor,
    problem: Problem,
    i: int,
    d: int,
    rows: Tensor,
    cols: Optional[Tensor],
) -> Tuple[Tensor, Optional[Tensor]]:
    """Width ``d``'s rows (and columns) with its positive terms, by differentiable ops
    in embedding space (the prefixes scaled by ``aq[i]``, ``ak[i]``)."""
    if problem.normalize:
        qh = normalize_rows(q[:, :d], NORM_EPS)
        kh = qh if k is None else normalize_rows(k[:, :d], NORM_EPS)
    else:
        qh, kh = q[:, :d], (q if k is None else k)[:, :d]
    for lin in problem.linears:
        if lin.target == "row":
            rows = rows - scale * lin.weight * lin.positives.sums(qh, kh)
        else:
            assert cols is not None
            cols = cols - scale * lin.weight * lin.positives.sums(kh, qh)
    return rows, cols


def run_widths(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    problem: Problem,
    ds: List[int],
    ws: List[float],
    weights: Optional[Tuple[Tensor, Optional[Tensor]]],
    block_size: Optional[int],
) -> Tensor:
    """``problem`` (its rows normalised per width with ``problem.normalize``) at every
    prefix width ``ds`` (weights ``ws``), summed, in one pass over per-segment partial
    scores; ``weights``: a scalar reduction's ``(r, u)`` (None: per-row losses)."""
    m, dtype = q.shape[0], compute_dtype(q.dtype)
    with autocast_off(q.device.type):
        qc = q.to(dtype)
        kc = None if k is None else k.to(dtype)
        aq = prefix_scales(qc, ds, problem.normalize)
        ak = aq if kc is None else prefix_scales(kc, ds, problem.normalize)
        sc = scale.to(dtype)
        if weights is not None and not problem.head.has_columns:
            # a scalar: the heads' weighted rows in one call (its gradient formed in the
            # same pass), then each width's positive terms
            per_width = torch.tensor(ws, dtype=dtype, device=q.device).unsqueeze(1) * weights[0].unsqueeze(0)
            out = head_values(qc, kc, aq, ak, scale, problem, ds, block_size, per_width)
            zeros = torch.zeros(m, dtype=dtype, device=q.device)
            for i, d in enumerate(ds):
                rows, _ = linear_terms(qc, kc, aq, ak, sc, problem, i, d, zeros, None)
                out = out + (per_width[i] * rows).sum()
            return out
        values = head_values(qc, kc, aq, ak, scale, problem, ds, block_size)
        total: Optional[Tensor] = None
        for i, (d, w) in enumerate(zip(ds, ws)):
            cols = values[i, m:] if problem.head.has_columns else None
            rows, cols = linear_terms(qc, kc, aq, ak, sc, problem, i, d, values[i, :m], cols)
            if weights is None:
                part = rows if cols is None else 0.5 * (rows + cols)
            else:
                part = (weights[0] * rows).sum()
                if cols is not None and weights[1] is not None:
                    part = part + (weights[1] * cols).sum()
            total = w * part if total is None else total + w * part
    assert total is not None
    return total
