"""The engine on a score matrix that already exists: :func:`run_given` (a
:class:`GivenScores` Function).

A loss whose scores are given (a sampled-neighbours loss over an n x n matrix, a flex
loss's ``scores=``) has no embeddings to multiply: its tiles are blocks of complete rows
of ``s = scale * scores``, read from the matrix, handed to the head as the row-block
driver hands it computed ones, and each block's ``dL/ds`` goes straight into the one
(M, N) tensor that becomes ``scores.grad`` (during the forward pass when the loss is
reduced to a scalar, by a head that reduces complete rows at once,
:attr:`~flashcl.engine.heads.Head.fuses_rows`): nothing else of that size is allocated.
Any head runs on it: a head without that visit has its passes, then its gradient's.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype
from .engine import FusedFunction, autocast_off
from .heads import Head, ReportingHead, Tile

__all__ = ["GivenScores", "run_given"]


class _GivenRows:
    """The blocks of complete rows of ``s = scale * scores`` (in the compute dtype), and,
    with ``grad``, their gradients gathered into one tensor of the scores' shape and
    dtype. A block is formed in that gradient's own rows where the dtypes allow (no
    second buffer); ``dscale``: ``dL/dscale`` accumulated too."""

    def __init__(self, scores: Tensor, scale: float, block: int, offset: int, grad: bool, dscale: bool) -> None:
        self.scores, self.scale, self.offset = scores.detach(), scale, offset
        dtype = compute_dtype(scores.dtype)
        m, n = scores.shape
        self.block = max(1, min(block, m))
        self.grad = torch.empty(scores.shape, dtype=scores.dtype, device=scores.device) if grad else None
        direct = self.grad is not None and self.grad.dtype == dtype
        self.buf = None if direct else scores.new_empty(self.block, n, dtype=dtype)
        self.dscale = scores.new_zeros((), dtype=dtype) if grad and dscale else None

    def __iter__(self) -> Iterator[Tuple[Tile, Tensor]]:
        m, n = self.scores.shape
        for r0 in range(0, m, self.block):
            r1 = min(r0 + self.block, m)
            s = self.grad[r0:r1] if self.buf is None else self.buf[: r1 - r0]  # type: ignore[index]
            src = self.scores[r0:r1]
            if self.scale == 1.0:
                s.copy_(src)
            elif src.dtype == s.dtype:
                torch.mul(src, self.scale, out=s)
            else:  # the product in the compute dtype, not in the scores' (half precision)
                s.copy_(src).mul_(self.scale)
            yield Tile(r0, r1, 0, n, self.offset), s

    def take(self, g: Tensor, tile: Tile, head: Head, st: Any) -> None:
        """A block's ``dL/ds`` (the head's, possibly the block itself; times its rows'
        :meth:`~flashcl.engine.heads.Head.row_factor` where the head leaves it out) into
        the scores' gradient (``ds/dscores = scale``), and its share of ``dL/dscale``
        (``ds/dscale = scores``)."""
        assert self.grad is not None
        factor = head.row_factor(st, tile) if head.factored_rows else None
        if factor is not None:
            g = g.mul_(factor.to(g.dtype).unsqueeze(1))
        if self.dscale is not None:
            self.dscale += (g * self.scores[tile.r0 : tile.r1].to(g.dtype)).sum()
        dst = self.grad[tile.r0 : tile.r1]
        if self.scale != 1.0:
            g = g.mul_(self.scale)
        if g.data_ptr() != dst.data_ptr():
            dst.copy_(g)


class GivenScores(FusedFunction):
    """``apply(scores, scale, head, reduce_weights, block, offset, *params)``: the head's
    per-row losses (M,) of ``s = scale * scores`` (M, N), ``block`` rows at a time (row
    ``i``'s own column ``i + offset``, as the tiles say), or, with
    ``reduce_weights`` (M,), the scalar ``sum r * rows`` with every gradient formed in the
    same visit; then what a :class:`~flashcl.engine.heads.ReportingHead` reports
    (non-differentiable). ``params``: the head's learnable tensors. Its backward's rules
    are :class:`~flashcl.engine.FusedFunction`'s; second derivatives come from the head's
    dense form."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        scores: Tensor,
        scale: Tensor,
        head: Head,
        reduce_weights: Optional[Tensor],
        block: int,
        offset: int,
        *params: Tensor,
    ) -> Any:
        m, n = scores.shape
        needs_grad = any(ctx.needs_input_grad[:2]) or any(ctx.needs_input_grad[6:])
        fused = reduce_weights is not None and needs_grad
        sc, dscale = float(scale), ctx.needs_input_grad[1]
        st = head.state(m, n, scores.new_empty(0, dtype=compute_dtype(scores.dtype)), None)
        grads: Optional[_GivenRows] = None
        if head.fuses_rows:  # each block's reductions and, with a gradient to come, its gradient at once
            blocks = grads = _GivenRows(scores, sc, block, offset, fused, dscale)
            for tile, s in blocks:
                g = head.rows_fused(s, tile, st, reduce_weights if fused else None)
                if fused:
                    assert g is not None
                    blocks.take(g, tile, head, st)
        else:
            for p in range(head.passes):
                for tile, s in _GivenRows(scores, sc, block, offset, False, False):
                    head.reduce(s, tile, st, p)
                head.finish(st, p)
            if fused:
                assert reduce_weights is not None
                grads = _grad_visit(_GivenRows(scores, sc, block, offset, True, dscale), head, st, reduce_weights)
        head.release(st)
        rows, _ = head.values(st)
        ctx.head, ctx.st, ctx.block, ctx.offset, ctx.reduce_weights = head, st, block, offset, reduce_weights
        done = (grads.grad, grads.dscale, *head.param_grads(st, len(params))) if fused and grads is not None else None
        inputs = (scores, scale, *params) if needs_grad else (None,) * (2 + len(params))
        FusedFunction.setup(ctx, inputs, grads=done, slots=(0, 1, *range(6, 6 + len(params))))
        out = rows if reduce_weights is None else (reduce_weights * rows).sum()
        found = tuple(head.report(st)) if isinstance(head, ReportingHead) else ()
        if found:
            ctx.mark_non_differentiable(*found)
            return (out, *found)
        return out

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        scores, scale, *params = inputs
        dtype = compute_dtype(scores.dtype)
        m, n = scores.shape
        rows, _ = ctx.head.dense(scale.to(dtype) * scores.to(dtype), Tile(0, m, 0, n, ctx.offset), tuple(params))
        return rows if ctx.reduce_weights is None else (ctx.reduce_weights * rows).sum()

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        scores, scale = saved[:2]
        head, st = ctx.head, ctx.st
        dtype = compute_dtype(scores.dtype)
        g_row = ctx.reduce_weights * grad_out if ctx.reduce_weights is not None else grad_out.to(dtype)
        blocks = _GivenRows(scores, float(scale), ctx.block, ctx.offset, True, ctx.needs_input_grad[1])
        _grad_visit(blocks, head, st, g_row)
        head.release(st)
        return (blocks.grad, blocks.dscale, *head.param_grads(st, ctx.n_inputs - 2))


def _grad_visit(blocks: _GivenRows, head: Head, st: Any, g_row: Tensor) -> _GivenRows:
    """The gradient's visit (after the reductions): every block's ``head.grad`` for the
    upstream gradients ``g_row``, gathered in ``blocks``' :attr:`_GivenRows.grad`."""
    head.begin_grad(st, g_row, None)
    for tile, s in blocks:
        blocks.take(head.grad(s, tile, st), tile, head, st)
    return blocks


def run_given(
    scores: Tensor,
    scale: Tensor,
    head: Head,
    reduce_weights: Optional[Tensor],
    block: int,
    params: Sequence[Tensor] = (),
    offset: int = 0,
) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """``head``'s losses on the given ``scores`` (M, N) scaled by ``scale`` (a 0-d tensor):
    per row (M,), or ``sum r * rows`` for ``reduce_weights=r``; and what a
    :class:`~flashcl.engine.heads.ReportingHead` reports beside them (none for another
    head). ``offset``: the column of row 0's own entry (its rows' slice of a wider matrix
    across processes). Autocast off."""
    with autocast_off(scores.device.type):
        out = GivenScores.apply(scores, scale, head, reduce_weights, block, offset, *params)
    return (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())
