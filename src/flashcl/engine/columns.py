"""The tiled backend's driver for many columns: blocks of columns against every row.

Where the columns far outnumber the rows (a margin softmax over 10^5 .. 10^6 class
proxies against a batch of a few thousand embeddings), a block of complete rows
(:mod:`flashcl.engine.tiled`) would read every column once per block. Here the
columns are visited in blocks of ``block`` against every row: each pass reads every
column once and the rows stay in cache. A tile holds part of each row, so the head
reduces the rows across the blocks (its :attr:`~flashcl.engine.heads.Head.passes`,
then :meth:`~flashcl.engine.heads.Head.finish`, where the slices of the columns
held by other processes may join), and the gradient takes a second visit: four GEMMs
(S, then S again, ``G K``, ``G^T Q``).

The normalised columns are never copied as a whole (lazy rows: a table of class
proxies is as large as many tiles): each block's are formed for its GEMMs.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Tuple

import torch
from torch import Tensor

from . import threads
from .engine import Driver, Operands
from .heads import Head, Tile

__all__ = ["ColumnBlocks"]


class ColumnBlocks(Driver):
    """See the module docstring. One block buffer per call, shared by its passes."""

    lazy = True
    applies_row_factor = True

    def __init__(self, device_type: str = "cpu") -> None:
        self._s: Optional[Tensor] = None
        self._rows: Optional[Tensor] = None
        self._device_type = device_type

    def _blocks(self, ops: Operands, head: Head, kind: str) -> Iterator[int]:
        """The column blocks' starts, the thread count chosen by :func:`flashcl.engine.threads.blocks`."""
        m, n = ops.q.shape[0], ops.k.shape[0]
        kind = f"columns.{kind}.{type(head).__name__}.{ops.q.shape[1]}"  # blocks that cost alike per entry
        return threads.blocks(kind, range(0, n, ops.block), lambda c0: m * min(ops.block, n - c0), self._device_type)

    def release(self) -> None:
        self._s = self._rows = None

    def _tile(self, ops: Operands, c0: int, c1: int) -> Tuple[Tensor, Tensor, Tile]:
        """The scores of every row against columns ``c0:c1`` (in the block buffer), the
        block's normalised columns and the tile."""
        if self._rows is None:
            self._rows = ops.q[0 : ops.q.shape[0]]  # the normalised rows, once per call (M x D)
        if self._s is None:
            self._s = self._rows.new_empty(self._rows.shape[0] * min(ops.block, ops.k.shape[0]))
        cols = ops.k[c0:c1]
        out = self._s[: self._rows.shape[0] * (c1 - c0)].view(-1, c1 - c0)
        s = torch.mm(self._rows, cols.T, out=out).mul_(ops.scale)
        return s, cols, Tile(0, self._rows.shape[0], c0, c1, ops.offset)

    def reduce(self, ops: Operands, head: Head, st: Any, p: int) -> None:
        # no rows_fused: a block's gradient needs every block's reductions
        if ops.same:
            raise ValueError("column blocks take two sets of rows (k is not q)")
        n = ops.k.shape[0]
        for c0 in self._blocks(ops, head, f"reduce{p}"):
            s, _, tile = self._tile(ops, c0, min(c0 + ops.block, n))
            head.reduce(s, tile, st, p)

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        n = ops.k.shape[0]
        # every tile holds every row: one factor per row for the whole visit (None: the tiles carry it)
        factor = head.row_factor(st, Tile(0, ops.q.shape[0], 0, n, ops.offset))
        gk: Optional[Tensor] = None
        scaled: Optional[Tensor] = None  # the rows times their factor
        for c0 in self._blocks(ops, head, "backward"):
            c1 = min(c0 + ops.block, n)
            s, cols, tile = self._tile(ops, c0, c1)
            g = head.grad(s, tile, st)
            assert self._rows is not None
            if scaled is None:
                scaled = self._rows if factor is None else self._rows * factor.unsqueeze(1)
            gk = torch.mm(g, cols) if gk is None else gk.addmm_(g, cols)
            torch.mm(g.T, scaled, out=dk[c0:c1]).mul_(ops.scale)
        if gk is None:
            return dq.new_zeros(())
        assert self._rows is not None
        if factor is not None:
            gk.mul_(factor.unsqueeze(1))
        dq.add_(gk, alpha=ops.scale)
        return torch.dot(gk.reshape(-1), self._rows.reshape(-1))
