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

With ``lazy=True`` the normalised rows are never copied (a K x D table of
prototypes is as large as the scores of many blocks): each block's scores are the
GEMM of the raw rows, its columns then scaled by their inverse norms, and the
gradient's tile is scaled so before its GEMMs, ``dk`` accumulated as
``diag(1/|k|) dK`` and rescaled at the end.

Self-contrast (SupCon, NT-Xent) takes :mod:`flashcl.engine.panels` instead; a given
score matrix (the neighbour loss) :mod:`flashcl.engine.given`.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from . import threads
from .engine import Driver, Operands
from .heads import Head, Tile
from .positives import raw_rows

__all__ = ["RowBlocks"]


class RowBlocks(Driver):
    """Blocks of complete rows against every column (see the module docstring).
    The block buffers are made once per call and shared by its passes. ``lazy``: the
    normalised rows are not copied (two sets of rows: ``k`` is not ``q``)."""

    uses_grad_operands = True
    applies_row_factor = True

    def __init__(self, device_type: str = "cpu", lazy: bool = False) -> None:
        self._s: Optional[Tensor] = None
        self._s2: Optional[Tensor] = None
        self._gk: Optional[Tensor] = None
        self._device_type = device_type
        self.lazy = lazy
        # the columns as stored and their inverse norms (lazy), for the scores and for the gradient's GEMMs
        self._k: Optional[Tuple[Tensor, Optional[Tensor]]] = None
        self._k_grad: Optional[Tuple[Tensor, Optional[Tensor]]] = None

    def _blocks(self, ops: Operands, head: Head, kind: str) -> Iterator[int]:
        """The row blocks' starts, the thread count chosen by :func:`flashcl.engine.threads.blocks`."""
        m, n = ops.q.shape[0], ops.k.shape[0]
        kind = f"rows.{kind}.{type(head).__name__}.{ops.q.shape[1]}"  # blocks that cost alike per entry
        return threads.blocks(kind, range(0, m, ops.block), lambda r0: min(ops.block, m - r0) * n, self._device_type)

    def _buffers(self, ops: Operands, second: bool) -> None:
        if self.lazy and ops.same:
            raise ValueError("lazy row blocks take two sets of rows (k is not q)")
        q, n = raw_rows(ops.q)[0], ops.k.shape[0]
        b = min(ops.block, q.shape[0])
        if self._s is None:
            self._s = q.new_empty(b, n)
            self._gk = q.new_empty(b, q.shape[1])
            self._k = raw_rows(ops.k)
        if second and self._s2 is None:
            self._s2 = q.new_empty(b, n)

    def release(self) -> None:
        self._s = self._s2 = self._gk = self._k = self._k_grad = None

    def _scores(self, ops: Operands, r0: int, r1: int, cols: Optional[Tuple[int, int]] = None) -> Tensor:
        """The scores of rows ``r0:r1`` against every column, or against ``cols`` (a run
        of kept tiles), in the block buffer."""
        assert self._s is not None and self._k is not None
        c0, c1 = (0, ops.k.shape[0]) if cols is None else cols
        out = self._s.view(-1)[: (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
        k, inv = self._k
        s = torch.mm(ops.q[r0:r1] * ops.scale, k[c0:c1].T, out=out)
        return s if inv is None else s.mul_(inv[c0:c1])

    def _accumulate(
        self,
        g: Tensor,
        r0: int,
        ops: Operands,
        dq: Tensor,
        dk: Tensor,
        cols: Optional[Tuple[int, int]] = None,
        factor: Optional[Tensor] = None,
    ) -> Tensor:
        """dq_blk += scale G K, dk += scale G^T Q_blk (K: the columns ``cols``, default
        all; ``G = diag(factor) g``, the factor applied to the block's rows); returns
        sum_ij G_ij q_i.k_j. Lazy ``k``: ``g`` scaled by its inverse norms in place, dk's
        rows accumulated as ``dK / |k|`` (:meth:`_rescale`)."""
        assert self._gk is not None
        b = g.shape[0]
        qb = ops.q_grad[r0 : r0 + b]
        c0, c1 = (0, ops.k.shape[0]) if cols is None else cols
        if self._k_grad is None:
            self._k_grad = raw_rows(ops.k_grad)
        k, inv = self._k_grad
        if inv is not None:
            g.mul_(inv[c0:c1])
        gk = torch.mm(g, k[c0:c1], out=self._gk[:b])
        if factor is not None:
            gk.mul_(factor.unsqueeze(1))
        dscale = torch.dot(gk.reshape(-1), qb.reshape(-1))
        dq[r0 : r0 + b].add_(gk, alpha=ops.scale)
        dk[c0:c1].addmm_(g.T, qb if factor is None else qb * factor.unsqueeze(1), alpha=ops.scale)
        return dscale

    @staticmethod
    def _rescale(ops: Operands, dk: Tensor) -> None:
        """Lazy ``k``: dk's rows, accumulated as ``dK / |k|``, times ``|k|``."""
        if raw_rows(ops.k)[1] is not None:
            assert ops.k_norms is not None
            dk.mul_(ops.k_norms.unsqueeze(1))

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

    def fuses(self, ops: Operands, head: Head) -> bool:
        # a row block's kept tiles in one run: its rows complete there (the rest contributes nothing)
        return head.sparsity is None or head.sparsity.max_runs <= 1

    def rows_fused(
        self, ops: Operands, head: Head, st: Any, g_row: Optional[Tensor], dq: Any, dk: Optional[Tensor]
    ) -> Optional[Tensor]:
        self._buffers(ops, second=False)
        m, n = ops.q.shape[0], ops.k.shape[0]
        dscale = None if g_row is None else dq.new_zeros(())
        for r0 in self._blocks(ops, head, "fused"):
            r1 = min(r0 + ops.block, m)
            for cols in self._runs(ops, head, r0):
                c0, c1 = (0, n) if cols is None else cols
                tile = Tile(r0, r1, c0, c1, ops.offset)
                g = head.rows_fused(self._scores(ops, r0, r1, cols), tile, st, g_row)
                if g is not None and dscale is not None:
                    assert dk is not None
                    factor = head.row_factor(st, tile)
                    dscale += self._accumulate(g, r0, ops, dq, dk, cols, factor)
        if dscale is not None:
            assert dk is not None
            self._rescale(ops, dk)
        return dscale

    def reduce(self, ops: Operands, head: Head, st: Any, p: int) -> None:
        self._buffers(ops, second=False)
        m, n = ops.q.shape[0], ops.k.shape[0]
        for r0 in self._blocks(ops, head, f"reduce{p}"):
            r1 = min(r0 + ops.block, m)
            for cols in self._runs(ops, head, r0):
                c0, c1 = (0, n) if cols is None else cols
                head.reduce(self._scores(ops, r0, r1, cols), Tile(r0, r1, c0, c1, ops.offset), st, p)

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        self._buffers(ops, second=head.has_columns)
        m, n = ops.q.shape[0], ops.k.shape[0]
        dscale = dq.new_zeros(())
        for r0 in self._blocks(ops, head, "backward"):
            r1 = min(r0 + ops.block, m)
            for cols in self._runs(ops, head, r0):
                c0, c1 = (0, n) if cols is None else cols
                tile = Tile(r0, r1, c0, c1, ops.offset)
                g = head.grad(self._scores(ops, r0, r1, cols), tile, st, self._s2)
                factor = head.row_factor(st, tile)
                dscale += self._accumulate(g, r0, ops, dq, dk, cols, factor)
        self._rescale(ops, dk)
        return dscale
