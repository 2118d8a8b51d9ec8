"""The tiled backend's driver for float16/bfloat16 on CUDA: stripes of rows,
tensor-core GEMMs with float32 output.

For each stripe of ``block`` rows (as Liger-Kernel's fused linear cross-entropy
does for its logits):

* scores ``S = scale * diag(iq) X_blk Y^T diag(ik)`` by one GEMM of the raw
  half-precision embeddings with float32 output (``iq``, ``ik``: float32 inverse
  row norms, so that the normalised rows are never rounded to half precision);
* the head reduces the stripe (complete rows) and turns it into ``G = dL/dS`` in
  the same visit (float32);
* ``dQ^_blk = scale (G diag(ik)) Y`` and ``dK^ += scale (diag(iq_blk) G)^T X_blk``
  by two GEMMs, ``G`` rounded once to the inputs' dtype, float32 output.

Three GEMMs for a row-only loss (four for CLIP, whose column reductions need a
second pass), no atomics: the same inputs give bitwise the same result. Memory:
the gradients' float32 accumulators and one stripe's buffers, ``block x N`` x
(4 + 2 + 2) bytes; ``block_size`` sets it (default: :func:`flashcl.runner.auto_block`,
256 MB on CUDA). On a CPU (tests) the half GEMMs are emulated by float32 GEMMs of
the same half values, which is what tensor cores compute.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .engine import Driver, Operands
from .heads import Head, Tile
from .positives import raw_rows

__all__ = ["Stripes", "mm_f32"]


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with float32 output from half-precision inputs: tensor cores with
    float32 accumulation on CUDA (``torch.mm(out_dtype=...)``); on other devices
    the same half values multiplied in float32 (exact products, float32 sums).
    Other dtypes: a plain ``torch.mm``."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class Stripes(Driver):
    """See the module docstring."""

    lazy = True

    @staticmethod
    def _inputs(ops: Operands) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """(X, Y in their own dtype, float32 row scales iq, ik: 1/|row| or 1)."""
        assert ops.q_in is not None
        x = ops.q_in.contiguous()
        y = x if ops.same else ops.k_in.contiguous()  # type: ignore[union-attr]
        dtype = raw_rows(ops.q)[0].dtype  # float32 for half inputs
        iq = (1.0 / ops.q_norms).to(dtype) if ops.q_norms is not None else x.new_ones(x.shape[0], dtype=dtype)
        if ops.same:
            ik = iq
        else:
            ik = (1.0 / ops.k_norms).to(dtype) if ops.k_norms is not None else y.new_ones(y.shape[0], dtype=dtype)
        return x, y, iq, ik

    @staticmethod
    def _scores(ops: Operands, x: Tensor, y: Tensor, iq: Tensor, ik: Tensor, r0: int, r1: int) -> Tensor:
        s = mm_f32(x[r0:r1], y.T)
        return s.mul_((iq[r0:r1] * ops.scale).unsqueeze(1)).mul_(ik.unsqueeze(0))

    @staticmethod
    def _accumulate(
        g: Tensor, r0: int, ops: Operands, x: Tensor, y: Tensor, iq: Tensor, ik: Tensor, dq: Tensor, dk: Tensor
    ) -> Tensor:
        """dq^_blk += scale G k^, dk^ += scale G^T q^_blk; returns sum_ij G_ij q^_i.k^_j."""
        b = g.shape[0]
        xb = x[r0 : r0 + b]
        gk = mm_f32((g * ik.unsqueeze(0)).to(x.dtype), y)  # G k^ (float32)
        qb = xb.to(gk.dtype) * iq[r0 : r0 + b].unsqueeze(1)  # q^ rows (never in place: xb may be the input)
        dscale = torch.dot(gk.reshape(-1), qb.reshape(-1))
        dq[r0 : r0 + b].add_(gk, alpha=ops.scale)
        gq = (g * iq[r0 : r0 + b].unsqueeze(1)).to(x.dtype)  # diag(iq) G, rounded once
        dk.add_(mm_f32(gq.T.contiguous(), xb), alpha=ops.scale)
        return dscale

    def forward(
        self, ops: Operands, head: Head, st: Any, g_row: Optional[Tensor], dq: Optional[Tensor], dk: Optional[Tensor]
    ) -> Optional[Tensor]:
        x, y, iq, ik = self._inputs(ops)
        m, n = x.shape[0], y.shape[0]
        if head.fuses_rows:
            dscale = None if g_row is None else dq.new_zeros(())  # type: ignore[union-attr]
            for r0 in range(0, m, ops.block):
                r1 = min(r0 + ops.block, m)
                g = head.rows_fused(self._scores(ops, x, y, iq, ik, r0, r1), Tile(r0, r1, 0, n, ops.offset), st, g_row)
                if g is not None and dscale is not None:
                    assert dq is not None and dk is not None
                    dscale += self._accumulate(g, r0, ops, x, y, iq, ik, dq, dk)
            return dscale
        for p in range(head.passes):
            for r0 in range(0, m, ops.block):
                r1 = min(r0 + ops.block, m)
                head.reduce(self._scores(ops, x, y, iq, ik, r0, r1), Tile(r0, r1, 0, n, ops.offset), st, p)
            head.finish(st, p)
        return None

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        x, y, iq, ik = self._inputs(ops)
        m, n = x.shape[0], y.shape[0]
        dscale = dq.new_zeros(())
        for r0 in range(0, m, ops.block):
            r1 = min(r0 + ops.block, m)
            g = head.grad(self._scores(ops, x, y, iq, ik, r0, r1), Tile(r0, r1, 0, n, ops.offset), st)
            dscale += self._accumulate(g, r0, ops, x, y, iq, ik, dq, dk)
        return dscale
