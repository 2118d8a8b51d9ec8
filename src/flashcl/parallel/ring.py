"""The ring strategy of :mod:`flashcl.distributed`: a driver of the tile engine that
passes the candidates' blocks around the ranks with ``batch_isend_irecv`` and sends
their gradients back around (as Inf-CL does), so that no rank holds the global
batch: :class:`RingDriver`."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..engine.engine import Driver, FusedFunction, Operands, Problem
from ..engine.heads import Head, Tile
from ..engine.positives import Positives, PositiveTerm, Rows, class_sums, raw_rows

__all__ = ["RingDriver", "RingScores", "ring_pass"]


def _peer(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def ring_pass(tensors: List[Tensor], shapes: List[Tuple[int, ...]], group: Any) -> List[Tensor]:
    """Send ``tensors`` to the next rank, receive tensors of ``shapes`` from the previous."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group))
    if world == 1:  # the ring is this rank alone
        return list(tensors)
    nxt, prv = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    incoming = [tensors[0].new_empty(shape) for shape in shapes]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in incoming]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return incoming


class RingDriver(Driver):
    """The engine's driver with the candidates spread over the ranks: this rank's
    anchors against every rank's candidate block, the blocks passed around the
    ring (as Inf-CL does), so that no rank holds more than its own rows and one
    visiting block. Backward passes each block again, with its gradient
    accumulator travelling along and arriving back at its owner. The positive
    terms use class sums added over the ranks, and index positives of this
    rank's own block."""

    no_second_derivatives = (
        "flashcl.distributed does not compute second derivatives (backward with create_graph=True, as a "
        "gradient penalty or a Hessian-vector product needs): its collectives' gradients have no graph. "
        "The single-process losses (flashcl.supcon_loss, ...) compute them on every backend."
    )

    def __init__(self, sizes: List[int], group: Any) -> None:
        self.sizes, self.group = sizes, group
        self.rank, self.world = (dist.get_rank(group), dist.get_world_size(group))
        self.starts = [sum(sizes[:i]) for i in range(self.world)]

    def local_problem(self, problem: Problem) -> Problem:
        """The problem's positive terms in this rank's own columns (the head keeps
        the global ones: its tiles carry global column indices). Index positives
        must lie in this rank's block, as every distributed loss makes them."""
        offset = self.starts[self.rank]
        n_local = self.sizes[self.rank]
        linears = []
        for lin in problem.linears:
            pos = lin.positives
            if pos.index is not None:
                local = Positives(index=pos.index - offset)
            else:
                assert pos.col_labels is not None
                local = Positives(
                    row_labels=pos.row_labels,
                    col_labels=pos.col_labels[offset : offset + n_local],
                    num_classes=pos.num_classes,
                    self_pairs=pos.self_pairs,
                    offset=0,
                )
            linears.append(PositiveTerm(local, lin.weight, lin.target))
        return Problem(problem.head, tuple(linears), problem.normalize, problem.offset)

    def class_sums(
        self,
        x: Rows,
        ids: Tensor,
        num_classes: int,
        block: int,  # type: ignore[override]
        weight: Optional[Tensor] = None,
    ) -> Tensor:
        out = class_sums(x, ids, num_classes, block, weight)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def num_columns(self, ops: Operands) -> int:
        return sum(self.sizes)

    def bound(self, ops: Operands) -> Optional[float]:
        # every rank's candidates visit: the largest bound over the ranks
        b = torch.tensor([ops.bound], dtype=torch.float64, device=raw_rows(ops.q)[0].device)
        dist.all_reduce(b, op=dist.ReduceOp.MAX, group=self.group)
        return float(b)

    def _blocks(self, ops: Operands, step: int) -> Tuple[int, int]:
        owner = (self.rank - step) % self.world
        return self.starts[owner], self.sizes[(owner - 1) % self.world]

    def _scores(self, ops: Operands, kb: Tensor, r0: int, r1: int, buf: Tensor) -> Tensor:
        return torch.mm(ops.q[r0:r1] * ops.scale, kb.T, out=buf[: (r1 - r0) * kb.shape[0]].view(r1 - r0, -1))

    def reduce(self, ops: Operands, head: Head, st: Any, p: int) -> None:
        m, d = ops.q.shape
        buf = ops.q.new_empty(min(ops.block, m) * max(self.sizes))  # one score buffer for every block
        current = ops.k
        for step in range(self.world):
            col0, next_size = self._blocks(ops, step)
            # a rank with no rows of its own passes an empty block: no tile to visit
            for r0 in range(0, m if current.shape[0] else 0, ops.block):
                r1 = min(r0 + ops.block, m)
                head.reduce(
                    self._scores(ops, current, r0, r1, buf),
                    Tile(r0, r1, col0, col0 + current.shape[0], ops.offset),
                    st,
                    p,
                )
            if step < self.world - 1:
                (current,) = ring_pass([current], [(next_size, d)], self.group)

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        m, d = ops.q.shape
        buf = ops.q.new_empty(min(ops.block, m) * max(self.sizes))
        buf2 = ops.q.new_empty(min(ops.block, m) * max(self.sizes))
        current, dk_travel = ops.k, torch.zeros_like(ops.k)
        dscale = ops.q.new_zeros(())
        for step in range(self.world):
            col0, next_size = self._blocks(ops, step)
            for r0 in range(0, m if current.shape[0] else 0, ops.block):
                r1 = min(r0 + ops.block, m)
                tile = Tile(r0, r1, col0, col0 + current.shape[0], ops.offset)
                g = head.grad(self._scores(ops, current, r0, r1, buf), tile, st, buf2)
                gk = g @ current
                dscale += (gk * ops.q[r0:r1]).sum()
                dq[r0:r1].add_(gk, alpha=ops.scale)
                dk_travel.addmm_(g.T, ops.q[r0:r1], alpha=ops.scale)
            # the block goes on; after the last step its gradient arrives home
            shape = (next_size, d)
            current, dk_travel = ring_pass([current, dk_travel], [shape, shape], self.group)
        dk.add_(dk_travel)
        return dscale


ScoreFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class RingScores(FusedFunction):
    """``apply(q, k, mask, score, sizes, group) -> s``: ``score(q, block, block_mask)``
    (a differentiable (B, n) score of this rank's rows against one block of candidates,
    late interaction's MaxSim) against every rank's block, the blocks (and their masks)
    passed round the ring so that no rank holds more than its own block and one
    visitor: the (B, N) scores. Backward passes the blocks again, each block's
    gradient travelling with it back to its owner; each block's scores are recomputed
    with their graph."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, mask: Tensor, score: ScoreFn, sizes: List[int], group: Any
    ) -> Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        starts = [sum(sizes[:i]) for i in range(world)]
        out: Optional[Tensor] = None
        block, block_mask = k, mask.to(k.dtype)
        for step in range(world):
            owner = (rank - step) % world
            s = score(q, block, block_mask != 0) if sizes[owner] else None
            if out is None and s is not None:
                out = s.new_zeros(q.shape[0], sum(sizes))
            if s is not None and out is not None:
                out[:, starts[owner] : starts[owner] + sizes[owner]] = s
            if step < world - 1:
                shape = (sizes[(owner - 1) % world], *k.shape[1:])
                block, block_mask = ring_pass([block, block_mask], [shape, shape[:-1]], group)
        FusedFunction.setup(ctx, (q, k), (mask,))
        ctx.score, ctx.sizes, ctx.group, ctx.starts = score, sizes, group, starts
        assert out is not None, "every rank's block is empty"
        return out

    @classmethod
    def no_second_derivatives(cls, ctx: Any) -> Optional[str]:
        return RingDriver.no_second_derivatives

    @classmethod
    def recompute(cls, ctx: Any, grad: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        q, k, mask = saved
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        dq = torch.zeros_like(q)
        block, block_mask, travel = k, mask.to(k.dtype), torch.zeros_like(k)
        for step in range(world):
            owner = (rank - step) % world
            n, c0 = ctx.sizes[owner], ctx.starts[owner]
            if n:
                with torch.enable_grad():
                    qq, bb = q.detach().requires_grad_(), block.detach().requires_grad_()
                    s = ctx.score(qq, bb, block_mask != 0)
                    gq, gb = torch.autograd.grad(s, (qq, bb), grad[:, c0 : c0 + n].to(s.dtype))
                dq += gq
                travel += gb
            # the block goes on; after the last step its gradient arrives home
            shape = (ctx.sizes[(owner - 1) % world], *k.shape[1:])
            block, block_mask, travel = ring_pass([block, block_mask, travel], [shape, shape[:-1], shape], ctx.group)
        return dq, travel
