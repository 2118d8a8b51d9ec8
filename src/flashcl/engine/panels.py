"""The tiled backend's self-contrast driver (SupCon, NT-Xent): upper panels only.

When the candidates are the anchors (``k is q``, the self mask on the diagonal)
``S = scale E E^T`` is symmetric, and so are the heads' tile values
(:attr:`~flashcl.engine.heads.Head.symmetric_tiles`): only the panels ``S[I, I:]`` on and
above the diagonal are computed. Each gives its rows' reductions and, through
``s_ji = s_ij``, those of the rows right of its diagonal block
(:func:`~flashcl.engine.heads.reduce_panel`). The reduction costs half a GEMM.

The gradient ``d loss / dE = scale (G + G^T) E``: ``H = G + G^T`` is symmetric
and each upper panel gives both ``H[I, I:]`` and ``H[I:, I]``
(:func:`~flashcl.engine.heads.grad_panel`), so the whole gradient costs one
recomputation of half the matrix and two GEMMs over half of it: one GEMM of
B^2 D in all, where the unsymmetric path needs two.

The normalised embeddings are never copied: panels are scaled by ``1/|e|`` on
the fly (lazy rows), the GEMMs use the raw rows ``x`` and
``diag(inv) H diag(inv)``, and the gradient is accumulated as ``diag(inv) dE``
and rescaled at the end.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Tuple

import torch
from torch import Tensor

from . import threads
from .engine import Driver, Operands
from .heads import Head, Tile, grad_panel, reduce_panel
from .positives import raw_rows

__all__ = ["UpperPanels"]


def _panel(buf: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous (rows, cols) view at the start of a flat buffer."""
    return buf[: rows * cols].view(rows, cols)


class UpperPanels(Driver):
    """See the module docstring. Two flat panel buffers per call, shared by its passes."""

    lazy = True
    uses_grad_operands = True

    def __init__(self, device_type: str = "cpu") -> None:
        self._bufs: Optional[Tuple[Tensor, Tensor]] = None
        self._device_type = device_type

    def _blocks(self, ops: Operands, head: Head, kind: str) -> Iterator[int]:
        """The panels' starts, the thread count chosen by :func:`flashcl.engine.threads.blocks`."""
        m = ops.q.shape[0]
        kind = f"panels.{kind}.{type(head).__name__}.{ops.q.shape[1]}"  # blocks that cost alike per entry
        return threads.blocks(
            kind, range(0, m, ops.block), lambda r0: min(ops.block, m - r0) * (m - r0), self._device_type
        )

    def _buffers(self, ops: Operands) -> Tuple[Tensor, Tensor]:
        if self._bufs is None:
            m = ops.q.shape[0]
            size = min(ops.block, m) * m
            raw = raw_rows(ops.q)[0]
            self._bufs = (raw.new_empty(size), raw.new_empty(size))
        return self._bufs

    def release(self) -> None:
        self._bufs = None

    @staticmethod
    def _scores(ops: Operands, r0: int, r1: int, buf: Tensor) -> Tensor:
        """S[r0:r1, r0:] = scale * inv_i inv_j e_i . e_j into buf (no inv: plain rows)."""
        raw, inv = raw_rows(ops.q)
        m = raw.shape[0]
        left = raw[r0:r1] * (ops.scale if inv is None else (inv[r0:r1] * ops.scale).unsqueeze(1))
        s = torch.mm(left, raw[r0:].T, out=_panel(buf, r1 - r0, m - r0))
        if inv is not None:
            s.mul_(inv[r0:].unsqueeze(0))
        return s

    def reduce(self, ops: Operands, head: Head, st: Any, p: int) -> None:
        # no rows_fused: a panel's gradient needs the reductions of rows not yet visited
        buf, buf2 = self._buffers(ops)
        m = ops.q.shape[0]
        for r0 in self._blocks(ops, head, f"reduce{p}"):
            r1 = min(r0 + ops.block, m)
            reduce_panel(head, self._scores(ops, r0, r1, buf), Tile(r0, r1, r0, m), st, p, buf2)

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        buf, buf2 = self._buffers(ops)
        raw, inv = raw_rows(ops.q_grad)  # for the GEMMs (the scores are recomputed from ops.q)
        m = raw.shape[0]
        gk = raw.new_empty(min(ops.block, m), raw.shape[1])
        dscale = raw.new_zeros(())
        de = dq
        for r0 in self._blocks(ops, head, "backward"):
            r1 = min(r0 + ops.block, m)
            b = r1 - r0
            er = raw[r0:r1]
            h = grad_panel(head, self._scores(ops, r0, r1, buf), Tile(r0, r1, r0, m), st, buf2)
            if inv is not None:
                h.mul_(inv[r0:r1].unsqueeze(1)).mul_(inv[r0:].unsqueeze(0))
            # diagonal block: H_II = G_II + G_II^T, counted once
            part = torch.mm(h[:, :b], er, out=gk[:b])
            dscale += 0.5 * torch.dot(part.reshape(-1), er.reshape(-1))
            de[r0:r1].add_(part, alpha=ops.scale)
            if r1 < m:
                rest = h[:, b:]
                part = torch.mm(rest, raw[r1:], out=gk[:b])
                dscale += torch.dot(part.reshape(-1), er.reshape(-1))
                de[r0:r1].add_(part, alpha=ops.scale)
                de[r1:].addmm_(rest.T, er, alpha=ops.scale)
        if inv is not None:
            assert ops.q_norms is not None
            de.mul_(ops.q_norms.unsqueeze(1))  # diag(inv) dE -> dE
        return dscale
