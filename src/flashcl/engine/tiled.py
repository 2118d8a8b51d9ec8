"""The tiled backend's block driver: the loss without ever holding the M x N matrix.

The anchors are processed in blocks of ``block`` rows. Each block's scores
``S = scale * Q_blk K^T`` (block x N) live in one buffer that is reused for
every block: a fresh allocation per block would cost page faults that on a
CPU take longer than the block's arithmetic. A block holds complete rows, so a
head that can (:attr:`~flashcl.engine.heads.Head.fuses_rows`) reduces them and turns
them into their gradient in the same visit: with a scalar loss that needs a
gradient, the gradient is formed during the forward pass (as Liger-Kernel's
fused linear cross-entropy does), three GEMMs (S, G K, G^T Q) instead of four.
Measured on the 2-core CPU (InfoNCE, B = 8192, D = 768, alternating with the
three-GEMM bound): 1.19x fused against 1.57x unfused. Heads with a column
direction (CLIP) need every column's reduction before any gradient: a second
pass, four GEMMs (the floor).

Self-contrast (SupCon, NT-Xent) takes :mod:`flashcl.engine.panels` instead; a given
score matrix (the neighbour loss) :mod:`flashcl.engine.scores`.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from . import threads
from .engine import Driver, Operands
from .heads import Head, Tile

__all__ = ["RowBlocks"]


class RowBlocks(Driver):
    """Blocks of complete rows against every column (see the module docstring).
    The block buffers are made once per call and shared by its passes."""

    uses_grad_operands = True

    def __init__(self, device_type: str = "cpu") -> None:
        self._s: Optional[Tensor] = None
        self._s2: Optional[Tensor] = None
        self._gk: Optional[Tensor] = None
        self._device_type = device_type

    def _blocks(self, ops: Operands, head: Head, kind: str) -> Iterator[int]:
        """The row blocks' starts, the thread count chosen by :func:`flashcl.engine.threads.blocks`."""
        m, n = ops.q.shape[0], ops.k.shape[0]
        kind = f"rows.{kind}.{type(head).__name__}.{ops.q.shape[1]}"  # blocks that cost alike per entry
        return threads.blocks(kind, range(0, m, ops.block), lambda r0: min(ops.block, m - r0) * n, self._device_type)

    def _buffers(self, ops: Operands, second: bool) -> None:
        q, k = ops.q, ops.k
        b = min(ops.block, q.shape[0])
        if self._s is None:
            self._s = q.new_empty(b, k.shape[0])
            self._gk = q.new_empty(b, q.shape[1])
        if second and self._s2 is None:
            self._s2 = q.new_empty(b, k.shape[0])

    def release(self) -> None:
        self._s = self._s2 = self._gk = None

    def _scores(self, ops: Operands, r0: int, r1: int, cols: Optional[Tuple[int, int]] = None) -> Tensor:
        """The scores of rows ``r0:r1`` against every column, or against ``cols`` (a run
        of kept tiles), in the block buffer."""
        assert self._s is not None
        if cols is None:
            return torch.mm(ops.q[r0:r1] * ops.scale, ops.k.T, out=self._s[: r1 - r0])
        c0, c1 = cols
        out = self._s.view(-1)[: (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
        return torch.mm(ops.q[r0:r1] * ops.scale, ops.k[c0:c1].T, out=out)

    def _accumulate(
        self, g: Tensor, r0: int, ops: Operands, dq: Tensor, dk: Tensor, cols: Optional[Tuple[int, int]] = None
    ) -> Tensor:
        """dq_blk += scale G K, dk += scale G^T Q_blk (K: the columns ``cols``, default
        all); returns sum_ij G_ij q_i.k_j."""
        assert self._gk is not None
        b = g.shape[0]
        qb = ops.q_grad[r0 : r0 + b]
        c0, c1 = (0, ops.k.shape[0]) if cols is None else cols
        gk = torch.mm(g, ops.k_grad[c0:c1], out=self._gk[:b])
        dscale = torch.dot(gk.reshape(-1), qb.reshape(-1))
        dq[r0 : r0 + b].add_(gk, alpha=ops.scale)
        dk[c0:c1].addmm_(g.T, qb, alpha=ops.scale)
        return dscale

    @staticmethod
    def _runs(ops: Operands, head: Head, r0: int) -> List[Optional[Tuple[int, int]]]:
        """The column runs to visit for the row block at ``r0``: every column (None), or
        the runs of the tiles the head's :attr:`~flashcl.engine.heads.Head.sparsity` keeps."""
        sparsity = head.sparsity
        if sparsity is None:
            return [None]
        if sparsity.block != ops.block:
            raise ValueError(f"the block mask's blocks are {sparsity.block} rows; the driver's {ops.block}")
        return list(sparsity.runs(r0))

    def forward(
        self, ops: Operands, head: Head, st: Any, g_row: Optional[Tensor], dq: Optional[Tensor], dk: Optional[Tensor]
    ) -> Optional[Tensor]:
        self._buffers(ops, second=False)
        m, n = ops.q.shape[0], ops.k.shape[0]
        sparsity = head.sparsity
        if head.fuses_rows and (sparsity is None or sparsity.max_runs <= 1):
            # a row block's kept tiles in one run: its rows complete there (the rest contributes nothing)
            dscale = None if g_row is None else ops.q.new_zeros(())
            for r0 in self._blocks(ops, head, "fused"):
                r1 = min(r0 + ops.block, m)
                for cols in self._runs(ops, head, r0):
                    c0, c1 = (0, n) if cols is None else cols
                    g = head.rows_fused(self._scores(ops, r0, r1, cols), Tile(r0, r1, c0, c1, ops.offset), st, g_row)
                    if g is not None and dscale is not None:
                        assert dq is not None and dk is not None
                        dscale += self._accumulate(g, r0, ops, dq, dk, cols)
            return dscale
        for p in range(head.passes):
            for r0 in self._blocks(ops, head, f"reduce{p}"):
                r1 = min(r0 + ops.block, m)
                for cols in self._runs(ops, head, r0):
                    c0, c1 = (0, n) if cols is None else cols
                    head.reduce(self._scores(ops, r0, r1, cols), Tile(r0, r1, c0, c1, ops.offset), st, p)
            head.finish(st, p)
        return None

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        self._buffers(ops, second=head.has_columns)
        m, n = ops.q.shape[0], ops.k.shape[0]
        dscale = ops.q.new_zeros(())
        for r0 in self._blocks(ops, head, "backward"):
            r1 = min(r0 + ops.block, m)
            for cols in self._runs(ops, head, r0):
                c0, c1 = (0, n) if cols is None else cols
                g = head.grad(self._scores(ops, r0, r1, cols), Tile(r0, r1, c0, c1, ops.offset), st, self._s2)
                dscale += self._accumulate(g, r0, ops, dq, dk, cols)
        return dscale
