"""A flex head on a given score matrix: the scaled scores ``scale * scores`` read a block of
complete rows at a time (never a second matrix of their size but the gradient), each
block handed to the head as the tiled driver hands it a block of computed scores."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype
from ..engine.engine import FusedFunction
from ..engine.heads import Tile
from .flex_head import FlexHead

__all__ = ["FlexScores"]


class FlexScores(FusedFunction):
    """``apply(scores, scale, head, reduce_weights, block, *params) -> (losses, valid)``:
    the flex head's per-row losses (M,) of ``s = scale * scores`` (M, N), or, with
    ``reduce_weights`` (M,), ``sum r * rows`` with every gradient formed in the same
    visit; and each row's validity (:meth:`~flashcl.losses.flex_head.FlexHead.report`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        scores: Tensor,
        scale: Tensor,
        head: FlexHead,
        reduce_weights: Optional[Tensor],
        block: int,
        *params: Tensor,
    ) -> Tuple[Tensor, Tensor]:
        dtype = compute_dtype(scores.dtype)
        m, n = scores.shape
        sc = float(scale)
        needs_grad = any(ctx.needs_input_grad[:2]) or any(ctx.needs_input_grad[5:])
        fused = reduce_weights is not None and needs_grad
        buf = scores.new_empty(max(1, min(block, m)), n, dtype=dtype)
        st = head.state(m, n, buf, None)
        grad = torch.empty(m, n, dtype=dtype, device=scores.device) if fused else None
        dscale = buf.new_zeros(())
        for r0 in range(0, m, block):
            r1 = min(r0 + block, m)
            s = torch.mul(scores[r0:r1].detach().to(dtype), sc, out=buf[: r1 - r0])
            g = head.rows_fused(s, Tile(r0, r1, 0, n, 0), st, reduce_weights if fused else None)
            if g is not None and grad is not None:
                dscale += _into(grad, g, scores, r0, sc)
        rows, _ = head.values(st)
        ctx.head, ctx.st, ctx.block, ctx.reduce_weights = head, st, block, reduce_weights
        grads = None
        if grad is not None:
            grads = (grad, dscale, *head.param_grads(st, len(params)))
        inputs = (scores, scale, *params) if needs_grad else (None,) * (2 + len(params))
        FusedFunction.setup(ctx, inputs, grads=grads, slots=(0, 1, *range(5, 5 + len(params))))
        (valid,) = head.report(st)
        ctx.mark_non_differentiable(valid)
        return (rows if reduce_weights is None else (reduce_weights * rows).sum()), valid

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        scores, scale, *params = inputs
        dtype = compute_dtype(scores.dtype)
        m, n = scores.shape
        rows, _ = ctx.head.dense(scale.to(dtype) * scores.to(dtype), Tile(0, m, 0, n, 0), tuple(params))
        return rows if ctx.reduce_weights is None else (ctx.reduce_weights * rows).sum()

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        scores, scale = saved[:2]
        head, st, block = ctx.head, ctx.st, ctx.block
        dtype = compute_dtype(scores.dtype)
        m, n = scores.shape
        sc = float(scale)
        g_row = ctx.reduce_weights * grad_out if ctx.reduce_weights is not None else grad_out.to(dtype)
        head.begin_grad(st, g_row, None)
        grad = torch.empty(m, n, dtype=dtype, device=scores.device)
        buf = scores.new_empty(max(1, min(block, m)), n, dtype=dtype)
        dscale = buf.new_zeros(())
        for r0 in range(0, m, block):
            r1 = min(r0 + block, m)
            s = torch.mul(scores[r0:r1].to(dtype), sc, out=buf[: r1 - r0])
            dscale += _into(grad, head.grad(s, Tile(r0, r1, 0, n, 0), st), scores, r0, sc)
        return (grad, dscale, *head.param_grads(st, ctx.n_inputs - 2))


def _into(grad: Tensor, g: Tensor, scores: Tensor, r0: int, scale: float) -> Tensor:
    """A block's ``dL/ds`` into the scores' gradient (``ds/dscores = scale``); returns its
    share of ``dL/dscale`` (``ds/dscale = scores``)."""
    r1 = r0 + g.shape[0]
    dscale = (g * scores[r0:r1].detach().to(g.dtype)).sum()
    torch.mul(g, scale, out=grad[r0:r1])
    return dscale
