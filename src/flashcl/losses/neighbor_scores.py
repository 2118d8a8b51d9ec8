"""The core on a given score matrix (the sampled-neighbours loss): its dense form
(:func:`dense_rows`, :func:`dense_output`) and its tiled form (:class:`TiledScores`).

``neighbor_loss`` gets an n x n matrix that already exists and whose gradient
is n x n too: rows are processed in blocks, and each block's gradient is formed
straight into the one n x n tensor that becomes ``scores.grad`` (during the
forward pass when the loss is reduced to a scalar): nothing else of that size
is allocated. Its create-graph path (second derivatives) is the dense formula
(:func:`dense_output`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import CoreSpec, Tile, compute_dtype
from ..engine.engine import FusedFunction
from ..engine.heads import mask_self_
from ..engine.positives import row_weights, self_mask

__all__ = ["TiledScores", "auto_scores_block", "dense_rows", "dense_output"]


def auto_scores_block(n: int) -> int:
    """Rows per block for a given score matrix: about 4M entries (16 MB of
    float32). Few large elementwise ops measured faster on the 2-core CPU than
    L2-sized blocks, whose per-op overhead dominates (n = 2000: one 2000-row
    block 5.1 ms, 131-row blocks 7.1 ms)."""
    return max(1, min(n, (1 << 22) // max(1, n)))


class TiledScores(FusedFunction):
    """Core losses of a given score matrix (the neighbour loss), in row blocks.

    ``apply(scores, spec, reduce_weights, block)``: ``reduce_weights=None`` returns
    the per-row losses (n,); a weight vector ``r`` returns ``sum r * row_loss`` and
    computes the gradient during the forward pass, straight into the one n x n
    tensor that becomes ``scores.grad``. Its backward's rules are
    :class:`~flashcl.engine.FusedFunction`'s.
    """

    @staticmethod
    def forward(ctx: Any, scores: Tensor, spec: CoreSpec, reduce_weights: Optional[Tensor], block: int) -> Tensor:
        assert spec.index is not None
        dtype = compute_dtype(scores.dtype)
        n, ncol = scores.shape
        c, a = row_weights(spec, n, dtype)
        pos = scores.detach().gather(1, spec.index).to(dtype).sum(1)
        needs_grad = ctx.needs_input_grad[0]
        fused = reduce_weights is not None and needs_grad
        grad = torch.empty_like(scores) if fused else None
        # The block is worked on in the gradient itself where dtypes allow: no
        # second buffer, and each row is read from the input once.
        direct = grad is not None and grad.dtype == dtype
        buf = None if direct else scores.new_empty(min(block, n), ncol, dtype=dtype)
        lse = scores.new_empty(n, dtype=dtype)
        for r0 in range(0, n, block):
            r1 = min(r0 + block, n)
            blk = grad[r0:r1] if direct else buf[: r1 - r0]  # type: ignore[index]
            lse[r0:r1], total = _masked_exp_into(blk, scores[r0:r1].detach(), r0, spec)
            if grad is not None:
                assert reduce_weights is not None
                _scores_grad_block(
                    blk,
                    r0,
                    spec,
                    (reduce_weights[r0:r1] * c[r0:r1]).unsqueeze(1) / total,
                    reduce_weights[r0:r1] * a[r0:r1],
                )
                if not direct:
                    grad[r0:r1].copy_(blk)
        row_loss = c * lse - a * pos
        ctx.spec, ctx.block, ctx.reduce_weights = spec, block, reduce_weights
        if needs_grad:
            FusedFunction.setup(ctx, (scores,), (lse,), grads=None if grad is None else (grad,))
        if reduce_weights is None:
            return row_loss
        return (reduce_weights * row_loss).sum()

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        return dense_output(inputs[0], ctx.spec, ctx.reduce_weights)

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        scores, lse = saved
        spec, block = ctx.spec, ctx.block
        dtype = compute_dtype(scores.dtype)
        n = scores.shape[0]
        g = ctx.reduce_weights * grad_out if ctx.reduce_weights is not None else grad_out.to(dtype)
        c, a = row_weights(spec, n, dtype)
        grad = torch.empty_like(scores)
        buf = scores.new_empty(min(block, n), scores.shape[1], dtype=dtype)
        for r0 in range(0, n, block):
            r1 = min(r0 + block, n)
            blk = torch.sub(scores[r0:r1], lse[r0:r1].unsqueeze(1), out=buf[: r1 - r0])
            if spec.exclude_self:
                mask_self_(blk, Tile(r0, r0 + blk.shape[0], 0, blk.shape[1], spec.offset), float("-inf"))
            blk.exp_()
            _scores_grad_block(blk, r0, spec, (g[r0:r1] * c[r0:r1]).unsqueeze(1), g[r0:r1] * a[r0:r1])
            grad[r0:r1].copy_(blk)
        return (grad,)


def _masked_exp_into(dst: Tensor, src: Tensor, r0: int, spec: CoreSpec) -> Tuple[Tensor, Tensor]:
    """``dst <- exp(src - c)`` with the self column masked (0), and the rows'
    (logsumexp, sum) over the unmasked columns.

    The shift ``c`` is the row maximum of ``src`` including the self column, so
    the shift and the copy out of the input are one pass. ``c`` is at least the
    masked maximum, so nothing overflows; a row whose unmasked terms all lie far
    below its self score (sum under ``finfo.tiny ** 0.75``, where the largest
    term would near the subnormals), or whose self score is NaN or infinite, is
    redone with its masked maximum."""
    mx = src.amax(1, keepdim=True).to(dst.dtype)
    torch.sub(src, mx, out=dst)
    if spec.exclude_self:
        mask_self_(dst, Tile(r0, r0 + dst.shape[0], 0, dst.shape[1], spec.offset), float("-inf"))
    total = dst.exp_().sum(1, keepdim=True)
    if spec.exclude_self:
        # ``not >=``: a NaN or inf in the excluded entry makes the shift (and the
        # sum) NaN; the masked redo keeps it out of the loss and the gradient
        redo = (~(total.squeeze(1) >= torch.finfo(dst.dtype).tiny ** 0.75)).nonzero().squeeze(1)
        if redo.numel():
            rows = src[redo].to(dst.dtype)
            cols = redo + (r0 + spec.offset)
            inside = (cols >= 0) & (cols < src.shape[1])
            rows[inside.nonzero().squeeze(1), cols[inside]] = float("-inf")
            mx[redo] = rows.amax(1, keepdim=True)
            rows = (rows - mx[redo]).exp_()
            dst[redo] = rows
            total[redo] = rows.sum(1, keepdim=True)
    return (mx + total.log()).squeeze(1), total


def _scores_grad_block(blk: Tensor, r0: int, spec: CoreSpec, lse_coef: Tensor, pos_coef: Tensor) -> None:
    """In place: ``blk`` (the block's masked exp) becomes ``lse_coef * blk - pos_coef * m``."""
    assert spec.index is not None
    idx = spec.index[r0 : r0 + blk.shape[0]]
    blk.mul_(lse_coef)
    blk.scatter_add_(1, idx, (-pos_coef).unsqueeze(1).expand_as(idx).to(blk.dtype))


def dense_rows(scores: Tensor, spec: CoreSpec) -> Tensor:
    """Row losses (M,) of the core on the score matrix ``scores`` (M, N), by
    differentiable torch ops on the whole matrix (the dense backend)."""
    scores = scores.to(compute_dtype(scores.dtype))
    m, n = scores.shape
    lse_in = scores
    if spec.exclude_self:
        lse_in = scores.masked_fill(self_mask(spec, m, n, scores.device), float("-inf"))
    lse = torch.logsumexp(lse_in, dim=1)
    if spec.index is not None:
        pos_sum = scores.gather(1, spec.index).sum(1)
    else:
        assert spec.row_labels is not None and spec.col_labels is not None
        pos = spec.row_labels.unsqueeze(1) == spec.col_labels.unsqueeze(0)
        if spec.self_pairs:
            pos &= ~self_mask(spec, m, n, scores.device)
        # where(), not scores * pos: a masked -inf or NaN must not leak into
        # rows that do not select it.
        pos_sum = torch.where(pos, scores, torch.zeros((), dtype=scores.dtype, device=scores.device)).sum(1)
    c, a = row_weights(spec, m, scores.dtype)
    return c * lse - a * pos_sum


def dense_output(scores: Tensor, spec: CoreSpec, reduce_weights: Optional[Tensor]) -> Tensor:
    """:func:`dense_rows`, reduced with weights ``r`` when given."""
    row = dense_rows(scores, spec)
    return row if reduce_weights is None else (reduce_weights * row).sum()
