"""Block sparsity: the tiles of a score matrix where some pair contributes to the loss.

A head may declare :attr:`~flashcl.engine.heads.Head.sparsity`: a :class:`BlockSparsity`
whose ``keep[I, J]`` is False for the tiles (rows ``I*block:(I+1)*block``, columns
``J*block:(J+1)*block``) where every pair is out of every set, so that they contribute
nothing to the loss or its gradient. The row-block driver (:mod:`flashcl.engine.tiled`)
skips those tiles in the forward and the backward; a driver that visits them anyway
computes the same loss (they contribute nothing), only more slowly.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

__all__ = ["BlockSparsity"]


class BlockSparsity:
    """``keep`` ((ceil(M / block), ceil(N / block)) bool): the tiles to visit, of ``block``
    rows and columns each, over an (M, N) score matrix."""

    def __init__(self, keep: Tensor, block: int, m: int, n: int) -> None:
        rows, cols = -(-m // block), -(-n // block)
        if keep.shape != (rows, cols):
            raise ValueError(
                f"the block mask is {tuple(keep.shape)} blocks; a ({m}, {n}) score matrix in blocks of "
                f"{block} is ({rows}, {cols})"
            )
        self.keep, self.block, self.m, self.n = keep, block, m, n
        flags = keep.detach().to("cpu", torch.bool)
        self._runs: List[List[Tuple[int, int]]] = [self._row_runs(flags[i]) for i in range(rows)]
        #: the most column runs of one row block (1: each row block's kept tiles are contiguous)
        self.max_runs = max((len(r) for r in self._runs), default=0)

    def _row_runs(self, flags: Tensor) -> List[Tuple[int, int]]:
        """The column ranges ``(c0, c1)`` of the runs of kept tiles in one row block."""
        runs: List[Tuple[int, int]] = []
        start = None
        for j, kept in enumerate(flags.tolist() + [False]):
            if kept and start is None:
                start = j
            elif not kept and start is not None:
                runs.append((start * self.block, min(j * self.block, self.n)))
                start = None
        return runs

    def runs(self, r0: int) -> List[Tuple[int, int]]:
        """The column ranges to visit for the row block starting at row ``r0``."""
        return self._runs[r0 // self.block]

    def transposed(self) -> BlockSparsity:
        """The same tiles seen from the columns (the (N, M) matrix)."""
        return BlockSparsity(self.keep.T, self.block, self.n, self.m)
