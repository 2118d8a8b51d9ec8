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
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype

__all__ = [
    "unit_rows",
    "sinkhorn_scalings",
    "softmax_targets",
    "sinkhorn_targets",
    "teacher_center",
    "PrototypeCrossEntropy",
    "auto_prototype_block",
    "nearest_neighbours",
]


def auto_prototype_block(b: int, k: int) -> int:
    """Prototypes per block: a B x block tile of about 4M entries (16 MB in float32)."""
    return max(1, min(k, (1 << 22) // max(1, b)))


def unit_rows(x: Tensor, normalize: bool) -> Tuple[Tensor, Tensor]:
    """``x``'s rows divided by their norms (with ``normalize``; else as given) and the
    inverse norms (ones without ``normalize``)."""
    if not normalize:
        return x, torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    inv = 1.0 / torch.linalg.vector_norm(x, dim=1).clamp_min(1e-12)
    return x * inv.unsqueeze(1), inv


def _blocks(k: int, block: int) -> range:
    return range(0, k, block)


def sinkhorn_scalings(
    t_rows: Tensor, w_t: Tensor, inv_temp: float, iterations: int, block: int
) -> Tuple[Tensor, Tensor]:
    """DINOv2's Sinkhorn-Knopp on ``exp(t / tau_t)`` (``t = t_rows w_t^T``, rows and
    prototypes as given) as log scalings ``(u (K,), v (B,))``: the targets are
    ``p_bk = exp(t_bk / tau_t + u_k + v_b)``, each row summing to 1. In its order: the
    whole matrix divided by its sum, then ``iterations`` times each prototype's sum
    over the rows set to 1/K and each row's sum over the prototypes to 1/B; the rows
    then multiplied by B."""
    b, k = t_rows.shape[0], w_t.shape[0]
    v = t_rows.new_zeros(b)
    u = t_rows.new_zeros(k)
    # the whole matrix's sum: one pass
    total = t_rows.new_full((), float("-inf"))
    for k0 in _blocks(k, block):
        logits = (t_rows @ w_t[k0 : k0 + block].T).mul_(inv_temp)
        total = torch.logaddexp(total, torch.logsumexp(logits.flatten(), 0))
    v -= total
    for _ in range(iterations):
        rows = t_rows.new_full((b,), float("-inf"))
        for k0 in _blocks(k, block):
            logits = (t_rows @ w_t[k0 : k0 + block].T).mul_(inv_temp).add_(v.unsqueeze(1))
            # each prototype's sum over every row (all rows are in the block): to 1/K
            u[k0 : k0 + block] = -torch.logsumexp(logits, 0) - math.log(k)
            rows = torch.logaddexp(rows, torch.logsumexp(logits.add_(u[k0 : k0 + block].unsqueeze(0)), 1))
        v -= rows + math.log(b)  # each row's sum over the prototypes: to 1/B
    return u, v + math.log(b)


def teacher_center(t_rows: Tensor, w_t: Tensor, block: int) -> Tensor:
    """The batch mean of the teacher's logits ``t = t_rows w_t^T`` over the rows, (K,)
    (DINO's center EMA takes it): ``mean_b t_bk = (mean_b t_rows_b) . w_t_k``."""
    return w_t @ t_rows.mean(0)


class PrototypeCrossEntropy(torch.autograd.Function):
    """``apply(x, w, targets, inv_temp, block) -> (B,)``: each row's cross-entropy
    between its targets and the softmax of ``x w^T * inv_temp`` over the prototypes
    (``x``, ``w`` as given: normalised by the caller, whose autograd then carries the
    normalisation's backward). ``targets(k0, k1) -> (B, k1 - k0)``: the target
    probabilities of a block of prototypes (no gradient). No B x K tensor beyond one
    block; the backward recomputes each block."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, w: Tensor, targets: Any, inv_temp: float, block: int
    ) -> Tensor:
        dtype = compute_dtype(x.dtype)
        xd, wd = x.detach().to(dtype), w.detach().to(dtype)
        b, k = xd.shape[0], wd.shape[0]
        mx = xd.new_full((b,), float("-inf"))
        total = xd.new_zeros(b)
        mass = xd.new_zeros(b)  # sum_k p_bk (1 up to rounding)
        cross = xd.new_zeros(b)  # sum_k p_bk s_bk / tau_s
        for k0 in _blocks(k, block):
            k1 = min(k0 + block, k)
            z = (xd @ wd[k0:k1].T).mul_(inv_temp)
            p = targets(k0, k1)
            mass += p.sum(1)
            cross += (p * z).sum(1)
            new = torch.maximum(mx, z.amax(1))
            total = total * torch.exp(mx - new) + torch.exp(z - new.unsqueeze(1)).sum(1)
            mx = new
        lse = mx + total.log()
        ctx.save_for_backward(x, w, lse, mass)
        ctx.targets, ctx.inv_temp, ctx.block = targets, inv_temp, block
        return mass * lse - cross  # in the compute dtype (float32 for half-precision inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError("the prototypes' cross-entropy does not compute second derivatives")
        x, w, lse, mass = ctx.saved_tensors
        dtype = compute_dtype(x.dtype)
        xd, wd = x.detach().to(dtype), w.detach().to(dtype)
        g = grad.to(dtype)
        dx = torch.zeros_like(xd) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(wd) if ctx.needs_input_grad[1] else None
        for k0 in _blocks(wd.shape[0], ctx.block):
            k1 = min(k0 + ctx.block, wd.shape[0])
            z = (xd @ wd[k0:k1].T).mul_(ctx.inv_temp)
            # d loss_b / d z_bk = mass_b softmax_bk - p_bk, times the upstream gradient
            gz = torch.exp(z - lse.unsqueeze(1)).mul_(mass.unsqueeze(1)).sub_(ctx.targets(k0, k1))
            gz.mul_(g.unsqueeze(1) * ctx.inv_temp)
            if dx is not None:
                dx.addmm_(gz, wd[k0:k1])
            if dw is not None:
                dw[k0:k1] = gz.T @ xd
        return (
            None if dx is None else dx.to(x.dtype),
            None if dw is None else dw.to(w.dtype),
            None,
            None,
            None,
        )


def softmax_targets(t_rows: Tensor, w_t: Tensor, center: Optional[Tensor], inv_temp: float, block: int) -> Any:
    """The centred, sharpened softmax ``softmax_k((t_bk - c_k) / tau_t)`` as a function of
    a block of prototypes (the rows' logsumexp formed in one pass first)."""
    b, k = t_rows.shape[0], w_t.shape[0]
    c = t_rows.new_zeros(k) if center is None else center.to(t_rows.dtype).reshape(k)
    mx = t_rows.new_full((b,), float("-inf"))
    total = t_rows.new_zeros(b)
    for k0 in _blocks(k, block):
        z = (t_rows @ w_t[k0 : k0 + block].T).sub_(c[k0 : k0 + block]).mul_(inv_temp)
        new = torch.maximum(mx, z.amax(1))
        total = total * torch.exp(mx - new) + torch.exp(z - new.unsqueeze(1)).sum(1)
        mx = new
    lse = mx + total.log()

    def targets(k0: int, k1: int) -> Tensor:
        z = (t_rows @ w_t[k0:k1].T).sub_(c[k0:k1]).mul_(inv_temp)
        return torch.exp(z - lse.unsqueeze(1))

    return targets


def sinkhorn_targets(t_rows: Tensor, w_t: Tensor, inv_temp: float, iterations: int, block: int) -> Any:
    """DINOv2's Sinkhorn-Knopp targets (:func:`sinkhorn_scalings`) as a function of a
    block of prototypes."""
    u, v = sinkhorn_scalings(t_rows, w_t, inv_temp, iterations, block)

    def targets(k0: int, k1: int) -> Tensor:
        z = (t_rows @ w_t[k0:k1].T).mul_(inv_temp).add_(u[k0:k1].unsqueeze(0)).add_(v.unsqueeze(1))
        return torch.exp(z)

    return targets


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
