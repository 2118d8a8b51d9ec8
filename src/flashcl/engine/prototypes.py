"""Self-distillation over prototypes (DINO, iBOT, SwAV) without the rows x K logits:
the cross-entropy between a teacher's target distribution over K prototypes and the
student's softmax over them, every logit formed a block of prototypes at a time.

For student rows ``x`` (B, D) and prototypes ``W`` (K, D), teacher rows ``y`` and the
teacher's prototypes ``W_t``, with ``s = x^ W^T`` and ``t = y^ W_t^T`` (rows and
prototypes L2-normalised with ``normalize``, as a weight-normalised last layer)::

    loss_b = -sum_k p_bk log_softmax_k(s_b / tau_s)
           = (sum_k p_bk) LSE_k(s_bk / tau_s) - sum_k p_bk s_bk / tau_s

with the teacher's targets ``p`` either ``softmax_k((t_bk - c_k) / tau_t)`` (a given
center ``c``) or DINOv2's Sinkhorn-Knopp on ``exp(t / tau_t)``, kept in the log domain
as scalings of its rows and columns, ``log p_bk = t_bk / tau_t + u_k + v_b``, so that
the state is O(B + K): each iteration is one pass over the prototypes' blocks (the
prototypes' sums over the rows are complete in a block of all rows; the rows' sums
over the prototypes accumulate across blocks). The backward pass recomputes each block:
``d loss_b / d s_bk = (sum_k p_bk softmax_k(s_b / tau_s) - p_bk) / tau_s``.

This module is the engine's part, for one process; the public loss, its options across
processes (the sums over the rows all-reduced) and the drop-ins build on it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype

__all__ = [
    "Prototypes",
    "RowsJoin",
    "unit_rows",
    "sinkhorn_scalings",
    "softmax_targets",
    "sinkhorn_targets",
    "teacher_center",
    "PrototypeCrossEntropy",
    "summed_targets",
    "auto_prototype_block",
    "nearest_neighbours",
]


def auto_prototype_block(b: int, k: int) -> int:
    """Prototypes per block: a B x block tile of about 2M entries (8 MB in float32; a
    pass holds two)."""
    return max(1, min(k, (1 << 21) // max(1, b)))


def unit_rows(x: Tensor, normalize: bool) -> Tuple[Tensor, Tensor]:
    """``x``'s rows divided by their norms (with ``normalize``; else as given) and the
    inverse norms (ones without ``normalize``)."""
    if not normalize:
        return x, torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    inv = _inverse_norms(x)
    return x * inv.unsqueeze(1), inv


def _inverse_norms(x: Tensor) -> Tensor:
    return 1.0 / torch.linalg.vector_norm(x, dim=1).clamp_min(1e-12)


class Prototypes:
    """Prototypes ``w`` (K, D) as given and their inverse norms (with ``normalize``):
    a tile of logits ``rows w^_k . scale`` for a block of them, the unit prototypes
    never formed (they would be a second K x D tensor)."""

    def __init__(self, w: Tensor, normalize: bool) -> None:
        self.w = w
        self.inv = _inverse_norms(w) if normalize else torch.ones(w.shape[0], dtype=w.dtype, device=w.device)
        self.k = w.shape[0]

    def tile(self, rows: Tensor, k0: int, k1: int, scale: float, out: Tensor) -> Tensor:
        z = torch.mm(rows, self.w[k0:k1].T, out=out[:, : k1 - k0])
        return z.mul_(self.inv[k0:k1].unsqueeze(0) * scale)


def _blocks(k: int, block: int) -> range:
    return range(0, k, block)


class RowsJoin:
    """How one rank's rows meet the other ranks' in Sinkhorn-Knopp (the sums over the
    rows are over the global batch): ``lse(x)``, elementwise logsumexps of this rank's
    rows joined over the ranks; ``total_rows(b)``, the global number of rows. One process:
    as they are."""

    def lse(self, x: Tensor) -> Tensor:
        return x

    def total_rows(self, b: int) -> int:
        return b


def sinkhorn_scalings(
    rows: Tensor, w_t: Prototypes, inv_temp: float, iterations: int, block: int, join: Optional[RowsJoin] = None
) -> Tuple[Tensor, Tensor]:
    """DINOv2's Sinkhorn-Knopp on ``exp(t / tau_t)`` (``t`` the teacher's rows against
    its prototypes) as log scalings ``(u (K,), v (B,))``: the targets are
    ``p_bk = exp(t_bk / tau_t + u_k + v_b)``, each row summing to 1. In its order: the
    whole matrix divided by its sum, then ``iterations`` times each prototype's sum
    over the rows set to 1/K and each row's sum over the prototypes to 1/B; the rows
    then multiplied by B. ``join``: the sums over the rows (the whole matrix's, each
    prototype's) over every rank's rows, B the global count (as DINOv2 all-reduces
    them; uneven batches count their rows)."""
    join = join or RowsJoin()
    b, k = rows.shape[0], w_t.k
    n = join.total_rows(b)
    v = rows.new_zeros(b)
    u = rows.new_zeros(k)
    buf = rows.new_empty(b, min(block, k))
    total = rows.new_full((), float("-inf"))  # the whole matrix's sum: one pass
    for k0 in _blocks(k, block):
        logits = w_t.tile(rows, k0, min(k0 + block, k), inv_temp, buf)
        total = torch.logaddexp(total, torch.logsumexp(logits.flatten(), 0))
    v -= join.lse(total.reshape(1))[0]
    for _ in range(iterations):
        sums = rows.new_full((b,), float("-inf"))
        for k0 in _blocks(k, block):
            k1 = min(k0 + block, k)
            logits = w_t.tile(rows, k0, k1, inv_temp, buf).add_(v.unsqueeze(1))
            # each prototype's sum over every row (this rank's rows are all in the block): to 1/K
            u[k0:k1] = -join.lse(torch.logsumexp(logits, 0)) - math.log(k)
            sums = torch.logaddexp(sums, torch.logsumexp(logits.add_(u[k0:k1].unsqueeze(0)), 1))
        v -= sums + math.log(n)  # each row's sum over the prototypes: to 1/B
    return u, v + math.log(n)


def teacher_center(rows: Tensor, w_t: Prototypes) -> Tensor:
    """The batch mean of the teacher's logits over the rows, (K,) (DINO's center EMA
    takes it): ``mean_b t_bk = (mean_b rows_b) . w^_k``."""
    return (w_t.w @ rows.mean(0)) * w_t.inv


Targets = Callable[[int, int, Tensor], Tensor]


def softmax_targets(rows: Tensor, w_t: Prototypes, center: Optional[Tensor], inv_temp: float, block: int) -> Targets:
    """The centred, sharpened softmax ``softmax_k((t_bk - c_k) / tau_t)`` as a function of
    a block of prototypes written into a buffer (the rows' logsumexp formed in one
    pass first)."""
    b, k = rows.shape[0], w_t.k
    c = rows.new_zeros(k) if center is None else center.to(rows.dtype).reshape(k) * inv_temp
    mx = rows.new_full((b,), float("-inf"))
    total = rows.new_zeros(b)
    buf = rows.new_empty(b, min(block, k))
    for k0 in _blocks(k, block):
        k1 = min(k0 + block, k)
        z = w_t.tile(rows, k0, k1, inv_temp, buf).sub_(c[k0:k1])
        new = torch.maximum(mx, z.amax(1))
        total = total * torch.exp(mx - new) + z.sub_(new.unsqueeze(1)).exp_().sum(1)
        mx = new
    lse = mx + total.log()

    def targets(k0: int, k1: int, out: Tensor) -> Tensor:
        return w_t.tile(rows, k0, k1, inv_temp, out).sub_(c[k0:k1]).sub_(lse.unsqueeze(1)).exp_()

    return targets


def sinkhorn_targets(
    rows: Tensor, w_t: Prototypes, inv_temp: float, iterations: int, block: int, join: Optional[RowsJoin] = None
) -> Targets:
    """DINOv2's Sinkhorn-Knopp targets (:func:`sinkhorn_scalings`) as a function of a
    block of prototypes written into a buffer."""
    u, v = sinkhorn_scalings(rows, w_t, inv_temp, iterations, block, join)

    def targets(k0: int, k1: int, out: Tensor) -> Tensor:
        return w_t.tile(rows, k0, k1, inv_temp, out).add_(u[k0:k1].unsqueeze(0)).add_(v.unsqueeze(1)).exp_()

    return targets


def summed_targets(parts: Sequence[Targets]) -> Targets:
    """The sum of several views' targets (a block at a time, one scratch block): the
    cross-entropy is linear in its targets, so a student view against several teacher
    views (DINO's crop pairs) is one pass with their sum."""
    scratch: List[Optional[Tensor]] = [None]

    def targets(k0: int, k1: int, out: Tensor) -> Tensor:
        first = parts[0](k0, k1, out)
        if len(parts) > 1 and (scratch[0] is None or scratch[0].shape != out.shape):
            scratch[0] = torch.empty_like(out)
        for part in parts[1:]:
            buf = scratch[0]
            assert buf is not None
            first.add_(part(k0, k1, buf[:, : k1 - k0]))
        return first

    return targets


class PrototypeCrossEntropy(torch.autograd.Function):
    """``apply(x, w, targets, inv_temp, block, normalize) -> (B,)``: each row's
    cross-entropy between its targets and the softmax of ``x^ . w^_k * inv_temp`` over
    the prototypes (``^``: L2-normalised with ``normalize``). ``targets(k0, k1, out)``:
    the target probabilities of a block of prototypes written into ``out`` (no
    gradient). Beyond the inputs: the unit rows (B x D), two B x block tiles and O(B +
    K) vectors; the unit prototypes are never formed; the backward recomputes each
    block and carries the normalisation's backward itself."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, w: Tensor, targets: Targets, inv_temp: float, block: int, normalize: bool
    ) -> Tensor:
        dtype = compute_dtype(x.dtype)
        xh, inv_x = unit_rows(x.detach().to(dtype), normalize)
        protos = Prototypes(w.detach().to(dtype), normalize)
        b, k = xh.shape[0], protos.k
        mx = xh.new_full((b,), float("-inf"))
        total = xh.new_zeros(b)
        mass = xh.new_zeros(b)  # sum_k p_bk (1 up to rounding)
        cross = xh.new_zeros(b)  # sum_k p_bk s_bk / tau_s
        z_buf, p_buf = xh.new_empty(b, min(block, k)), xh.new_empty(b, min(block, k))
        for k0 in _blocks(k, block):
            k1 = min(k0 + block, k)
            z = protos.tile(xh, k0, k1, inv_temp, z_buf)
            p = targets(k0, k1, p_buf)
            mass += p.sum(1)
            cross += p.mul_(z).sum(1)
            new = torch.maximum(mx, z.amax(1))
            total = total * torch.exp(mx - new) + z.sub_(new.unsqueeze(1)).exp_().sum(1)
            mx = new
        lse = mx + total.log()
        ctx.save_for_backward(x, w, lse, mass)
        ctx.targets, ctx.inv_temp, ctx.block, ctx.normalize = targets, inv_temp, block, normalize
        return mass * lse - cross  # in the compute dtype (float32 for half-precision inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError("the prototypes' cross-entropy does not compute second derivatives")
        x, w, lse, mass = ctx.saved_tensors
        dtype = compute_dtype(x.dtype)
        xh, inv_x = unit_rows(x.detach().to(dtype), ctx.normalize)
        protos = Prototypes(w.detach().to(dtype), ctx.normalize)
        b, k, s = xh.shape[0], protos.k, ctx.inv_temp
        g = grad.to(dtype)
        dxh = torch.zeros_like(xh) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(protos.w) if ctx.needs_input_grad[1] else None
        z_buf, p_buf = xh.new_empty(b, min(ctx.block, k)), xh.new_empty(b, min(ctx.block, k))
        for k0 in _blocks(k, ctx.block):
            k1 = min(k0 + ctx.block, k)
            # d loss_b / d z_bk = mass_b softmax_bk - p_bk, times the upstream gradient and 1 / tau
            gz = protos.tile(xh, k0, k1, s, z_buf).sub_(lse.unsqueeze(1)).exp_().mul_(mass.unsqueeze(1))
            gz.sub_(ctx.targets(k0, k1, p_buf)).mul_(g.unsqueeze(1) * s)
            inv = protos.inv[k0:k1]
            if dw is not None:  # d w^_k = gz_k^T x^, then through w^ = w / |w|
                dwh = gz.T @ xh
                if ctx.normalize:
                    unit = protos.w[k0:k1] * inv.unsqueeze(1)
                    dwh.sub_(unit * (unit * dwh).sum(1, keepdim=True)).mul_(inv.unsqueeze(1))
                dw[k0:k1] = dwh
            if dxh is not None:  # d x^ += gz w^_k = (gz scaled by 1 / |w_k|) w_k
                dxh.addmm_(gz.mul_(inv.unsqueeze(0)), protos.w[k0:k1])
        dx = None
        if dxh is not None:
            dx = dxh
            if ctx.normalize:  # through x^ = x / |x|
                dx = (dxh - xh * (xh * dxh).sum(1, keepdim=True)).mul_(inv_x.unsqueeze(1))
            dx = dx.to(x.dtype)
        return dx, None if dw is None else dw.to(w.dtype), None, None, None, None


def nearest_neighbours(x: Tensor, rows: int = 512, cols: int = 8192) -> Tensor:
    """Each row's nearest other row by the largest dot product (KoLeo's neighbour: for
    unit rows, the smallest distance), the first column on a tie, as ``argmax`` of the
    B x B products with the diagonal at -1 (DINOv2's ``pairwise_NNs_inner``) finds it;
    in tiles of ``rows x cols`` products (16 MB in float32 by default), O(B) memory
    beyond one tile. (B,) int64; a single row is its own neighbour."""
    xd = x.detach()
    b = xd.shape[0]
    where = torch.zeros(b, dtype=torch.long, device=xd.device)
    for r0 in range(0, b, rows):
        r1 = min(r0 + rows, b)
        top = xd.new_full((r1 - r0,), float("-inf"))
        at = torch.zeros(r1 - r0, dtype=torch.long, device=xd.device)
        for c0 in range(0, b, cols):
            c1 = min(c0 + cols, b)
            dots = xd[r0:r1] @ xd[c0:c1].T
            own = torch.arange(r0, r1, device=xd.device) - c0
            inside = (own >= 0) & (own < c1 - c0)
            dots[inside.nonzero().flatten(), own[inside]] = -1.0  # as DINOv2: the diagonal at -1
            v, i = dots.max(1)
            take = v > top  # strictly larger: an earlier column keeps a tie
            top = torch.where(take, v, top)
            at = torch.where(take, i + c0, at)
        where[r0:r1] = at
    return where
