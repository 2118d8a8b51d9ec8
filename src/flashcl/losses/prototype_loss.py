"""The cross-entropy between a teacher's soft targets over K prototypes and the
student's softmax over them (DINO, iBOT, SwAV), the rows x K logits formed a block at a
time: :func:`prototype_cross_entropy`, a :class:`SoftCrossEntropyHead` on the engine's row
blocks, on the targets of :mod:`flashcl.losses.prototype_targets`.

Each row's loss and its logits' gradient are formed without cancellation
(:func:`soft_cross_entropy`): with ``m`` the row's largest logit,
``loss = mass log1p(sum_{k != m} exp(z_k - z_m)) + sum_k p_k (z_m - z_k)``, two
non-negative terms, and the gradient at ``m`` from the targets' and the exponentials'
sums without ``m``; so a tiny loss (a student that agrees with a sharp teacher: 1e-7
against logits of 25) keeps its relative precision in float32, where ``LSE - sum p z``
leaves nothing of it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import backends
from ..core import compute_dtype
from ..engine.engine import Problem, run
from ..engine.heads import Head, Tile, row_dot, row_max
from .prototype_targets import Blocks, Group

__all__ = [
    "soft_cross_entropy",
    "soft_terms",
    "soft_gradient_rows_",
    "SoftCrossEntropyHead",
    "prototype_cross_entropy",
    "auto_rows_block",
]


def soft_cross_entropy(z: Tensor, p: Tensor, owned: bool = False) -> Tensor:
    """Each row's cross-entropy ``-sum_k p_k log_softmax_k(z)`` (rows over the last
    dimension) by differentiable torch ops, twice differentiable, with no cancellation:
    with ``m`` a row's largest logit ``z_m``,

        loss = (sum_k p_k) log1p(sum_{k != m} exp(z_k - z_m)) + sum_k p_k (z_m - z_k)

    two non-negative terms, so that a tiny loss (a student that agrees with a sharp
    teacher) keeps its relative precision in float32, where ``LSE(z) - sum_k p_k z_k``
    subtracts two numbers of the logits' size. The gradient at the largest logit comes
    out as ``sum_{k != m} p_k - mass rest / (1 + rest)``, both small there, not as the
    difference of two numbers near 1. A target of probability 0 takes no part
    (``0 log 0 = 0``: a ``-inf`` logit there is no NaN). ``owned``: ``z`` is the caller's
    temporary (the logits formed for this call), shifted in place: the rows x K tensors
    alive at once are then as many as ``log_softmax``'s form."""
    top, idx = z.max(-1, keepdim=True)  # its backward keeps the indices, not z
    # the largest logit's own entry a constant 0: its gradient comes through ``top`` alone (a subtraction and
    # a scatter keep nothing of their input for the backward: in place where the logits are ours)
    d = (z.sub_(top) if owned else z - top).scatter_(-1, idx, 0.0)
    rest = _OthersExpSum.apply(d, idx)
    if bool(torch.isinf(d).any()):  # a logit of -inf (probability 0): its target's term 0, not 0 x inf
        d = torch.where(p == 0, torch.zeros_like(d), d)  # a NaN target stays NaN
    return p.sum(-1) * torch.log1p(rest) - torch.linalg.vecdot(p, d, dim=-1)


class _OthersExpSum(torch.autograd.Function):
    """``apply(d, idx) -> sum_{k != idx} exp(d_k)`` over the last dimension, its backward
    recomputing ``exp(d)`` from ``d`` (which the caller keeps): no rows x K tensor saved
    of its own; differentiable again (second derivatives)."""

    @staticmethod
    def forward(ctx: Any, d: Tensor, idx: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(d, idx)
        return d.scatter(-1, idx, float("-inf")).exp_().sum(-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        d, idx = ctx.saved_tensors
        return d.scatter(-1, idx, float("-inf")).exp() * grad.unsqueeze(-1), None


class _RowStats:
    """Each row's statistics of its logits ``z`` against its targets ``p``, from which its
    loss and its logits' gradient follow without cancellation (:func:`soft_cross_entropy`'s
    form): the largest logit ``top`` and its prototype ``idx``, ``rest = sum_{k != idx}
    exp(z_k - top)``, ``mass = sum_k p_k`` and ``cross = sum_k p_k (top - z_k)``
    (:func:`soft_terms`); the gradient tiles' row factor and the targets' scratch tiles."""

    def __init__(self, n: int, like: Tensor) -> None:
        self.top = like.new_zeros(n)
        self.idx = torch.zeros(n, dtype=torch.long, device=like.device)
        self.rest, self.mass, self.cross = (like.new_zeros(n) for _ in range(3))
        self.factor: Optional[Tensor] = None
        self.scratch: Optional[Tensor] = None

    def rows(self) -> Tensor:
        """Each row's loss: ``mass log1p(rest) + cross``, both terms non-negative."""
        return self.mass * torch.log1p(self.rest) + self.cross


def soft_terms(d: Tensor, targets: Sequence[Tensor], known: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """For complete rows of logits shifted by their largest, ``d = z - top`` (``<= 0``,
    exactly 0 at the largest), and the targets whose sum is each row's target: ``(mass,
    cross)``, the targets' sum (``known``, where given) and ``sum_k p_k (top - z_k)``,
    a sum of non-negative terms."""
    mass = d.new_zeros(d.shape[0]) if known is None else known
    cross = d.new_zeros(d.shape[0])
    for p in targets:
        if known is None:
            mass += p.sum(1)
        cross -= _row_dots(p, d)
    return mass, cross


def soft_gradient_rows_(
    gz: Tensor, targets: Sequence[Tensor], top: Tensor, idx: Tensor, rest: Tensor, mass: Tensor
) -> Tensor:
    """In place, complete rows of logits ``gz`` into ``dL/dz = mass softmax - p`` (``p``:
    the sum of ``targets``): ``mass exp(z_k - top) / (1 + rest) - p_k``, and at each
    row's largest logit minus the sum of the others (the entries sum to ``mass - sum p =
    0``): small terms added, never the difference of two numbers near 1 (the target
    there, and its softmax, near collapse)."""
    gz.sub_(top.unsqueeze(1)).exp_().mul_((mass / (1.0 + rest)).unsqueeze(1))
    for p in targets:
        gz.sub_(p)
    _at_top_(gz, idx)
    return gz


class SoftCrossEntropyHead(Head):
    """Each row's cross-entropy ``-sum_k p_k log_softmax_k(s)`` against a teacher's
    targets (:class:`~flashcl.losses.prototype_targets.Blocks`, no gradient), formed as
    :func:`soft_cross_entropy` forms it (two non-negative terms; no cancellation near
    collapse), on tiles of complete rows (:class:`~flashcl.engine.tiled.RowBlocks`).
    The rows of ``targets.views`` stacked views come interleaved, image by image (row
    ``i views + v``: image ``i`` of view ``v``), and a block holds whole images, so
    that each distinct sum of teacher views' targets is formed once per block for
    every view that takes it. Its gradient tiles leave each row's upstream gradient
    to the driver (:attr:`~flashcl.engine.heads.Head.factored_rows`): the fused pass
    forms ``p - mass softmax`` (its factor minus the upstream gradient), the
    recomputing one ``mass softmax - p`` (:func:`soft_gradient_rows_`)."""

    fuses_rows = True
    factored_rows = True

    def __init__(self, targets: Blocks) -> None:
        self.targets = targets

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> Any:
        return _RowStats(m, like)

    def _groups(self, s: Tensor, tile: Tile, st: Any) -> Tuple[List[Group], slice]:
        """The targets of the tile's images (each distinct tile with the views that take
        it) in the state's scratch tiles, and the images."""
        views = self.targets.views
        i0, i1 = tile.r0 // views, tile.r1 // views
        if st.scratch is None:  # the first tile is the largest
            st.scratch = s.new_empty(self.targets.tiles, i1 - i0, s.shape[1])
        return self.targets.groups(i0, i1, st.scratch), slice(i0, i1)

    def _known(self, images: slice, view: int, like: Tensor) -> Optional[Tensor]:
        """The targets' sums of one view's rows of ``images`` where known, else None."""
        mass = self.targets.mass
        return None if mass is None else mass.to(like.dtype).view(self.targets.views, -1)[view, images]

    def rows_fused(self, s: Tensor, tile: Tile, st: Any, g_row: Optional[Tensor]) -> Optional[Tensor]:
        groups, images = self._groups(s, tile, st)
        r, views, m = slice(tile.r0, tile.r1), self.targets.views, images.stop - images.start
        top, idx = row_max(s)
        st.top[r], st.idx[r] = top, idx
        zs = s.sub_(top.unsqueeze(1)).view(m, views, -1)  # z - top <= 0, exactly 0 at idx
        mass, cross = st.mass[r].view(m, views), st.cross[r].view(m, views)
        for ss, p in groups:
            if p is None:  # no targets: mass and cross stay 0
                continue
            known = self._known(images, ss[0], s)  # the views of a group share their targets
            total = p.sum(1) if known is None else known
            for v in ss:
                mass[:, v] = total
                cross[:, v] = -_row_dots(p, zs[:, v])
        e = s.exp_()
        e.scatter_(1, idx.unsqueeze(1), 0.0)
        st.rest[r] = e.sum(1)
        if g_row is None:
            return None
        st.factor = -g_row
        rest, idxs = st.rest[r].view(m, views), idx.view(m, views)
        for ss, p in groups:  # the logits' gradient less its factor: p - mass softmax
            for v in ss:
                zv = zs[:, v]
                if p is None:  # no targets, a mass of 0: no gradient
                    zv.zero_()
                    continue
                torch.addcmul(p, zv, (mass[:, v] / (1.0 + rest[:, v])).unsqueeze(1), value=-1.0, out=zv)
                _at_top_(zv, idxs[:, v])
        return s

    def reduce(self, s: Tensor, tile: Tile, st: Any, p: int = 0) -> None:
        self.rows_fused(s, tile, st, None)

    def values(self, st: Any) -> Tuple[Tensor, Optional[Tensor]]:
        return st.rows(), None

    def begin_grad(self, st: Any, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.factor = g_row

    def grad(self, s: Tensor, tile: Tile, st: Any, buf: Optional[Tensor] = None) -> Tensor:
        groups, images = self._groups(s, tile, st)
        r, views, m = slice(tile.r0, tile.r1), self.targets.views, images.stop - images.start
        zs = s.view(m, views, -1)
        top, idx, rest, mass = (t[r].view(m, views) for t in (st.top, st.idx, st.rest, st.mass))
        for ss, p in groups:
            for v in ss:
                if p is None:  # no targets, a mass of 0: no gradient
                    zs[:, v].zero_()
                else:
                    soft_gradient_rows_(zs[:, v], [p], top[:, v], idx[:, v], rest[:, v], mass[:, v])
        return s

    def row_factor(self, st: Any, tile: Tile) -> Tensor:
        return st.factor[tile.r0 : tile.r1]

    def release(self, st: Any) -> None:
        st.scratch = None

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        views = self.targets.views
        m = s.shape[0] // views
        scratch = s.new_empty(self.targets.tiles, m, s.shape[1])
        p = s.new_zeros(m, views, s.shape[1])
        for ss, t in self.targets.groups(0, m, scratch.detach()):
            if t is not None:
                p[:, ss] = t.unsqueeze(1)
        return soft_cross_entropy(s, p.view_as(s).detach()), None


def _at_top_(g: Tensor, idx: Tensor) -> None:
    """In place, rows of ``p - mass softmax`` (each summing to ``sum p - mass = 0``): the
    entry at each row's largest logit set to minus the others' sum, small terms added,
    never the difference of two numbers near 1 (the target there, and its softmax, near
    collapse)."""
    at = idx.unsqueeze(1)
    g.scatter_(1, at, 0.0)
    g.scatter_(1, at, g.sum(1, keepdim=True).neg_())


def prototype_cross_entropy(
    x: Tensor,
    w: Tensor,
    targets: Blocks,
    inv_temp: float,
    normalize: bool,
    weights: Optional[Tensor] = None,
    rows_block: Optional[int] = None,
) -> Tensor:
    """Each row's cross-entropy between its targets and the softmax of ``x^ . w^_k *
    inv_temp`` over the prototypes (``^``: L2-normalised with ``normalize``), (B,) in the
    compute dtype; with ``weights`` (B,), the scalar ``sum_b weights_b loss_b``.
    ``targets``: :class:`~flashcl.losses.prototype_targets.Blocks` (no gradient), for
    ``targets.views`` stacked views of ``b`` images (view ``s``: rows ``s b .. (s + 1)
    b``).

    A :class:`SoftCrossEntropyHead` on the engine's row blocks
    (:class:`~flashcl.engine.tiled.RowBlocks`, the rows and prototypes normalised
    lazily: no copy of either): blocks of ``rows_block`` images (None:
    :func:`auto_rows_block`), every view's rows of them, against every prototype, each
    row's softmax complete in its block. A scalar forms its gradients in that pass (the
    three products with the targets' own); per row, the backward recomputes the
    block. Beyond the inputs and the gradients: the rows x K tiles (the student's
    logits, the targets and those they are formed from) and O(B + K). Second
    derivatives through :func:`soft_cross_entropy` on the rows x K logits (O(B K)
    memory on that path only)."""
    views = targets.views
    b, d = x.shape[0] // views, x.shape[1]
    n = max(1, min(b, rows_block or auto_rows_block(w.shape[0], views + targets.tiles)))
    # image by image: a block of whole images holds every view's rows of them
    rows = x if views == 1 else x.reshape(views, b, d).transpose(0, 1).reshape(b * views, d)
    reduce = None
    if weights is not None:
        r = weights if views == 1 else weights.reshape(views, b).T.reshape(-1)
        reduce = (r.to(compute_dtype(x.dtype)), None)
    scale = torch.tensor(inv_temp, dtype=compute_dtype(x.dtype), device=x.device)
    problem = Problem(SoftCrossEntropyHead(targets), normalize=normalize)
    out, _ = run(rows, w, scale, problem, backends.layout_driver("lazy rows", x.device.type), reduce, n * views)
    return out if weights is not None or views == 1 else out.view(b, views).T.reshape(-1)


def auto_rows_block(k: int, tiles: int) -> int:
    """Images per block of a pass over every prototype: its ``tiles`` rows x K tiles per
    image (the student views' logits, the teacher views' targets and their sums) of
    about 16M entries together (64 MB in float32), so that its GEMMs' inner and outer
    sizes stay wide."""
    return max(1, (1 << 24) // (max(1, tiles) * max(1, k)))


def _row_dots(p: Tensor, z: Tensor) -> Tensor:
    """Each row's ``sum_k p_bk z_bk`` (:func:`~flashcl.engine.heads.row_dot`: no copy of
    the tiles), an entry of ``p = 0`` taking no part (0 log 0 = 0: a ``-inf`` logit there
    is no NaN)."""
    out = row_dot(p, z)
    bad = torch.isnan(out)
    if bool(bad.any()):  # 0 x inf in a row: its terms again, those of p = 0 left out
        rows = bad.nonzero().squeeze(1)
        pr, zr = p[rows], z[rows]
        out[rows] = torch.where(pr == 0, torch.zeros_like(zr), pr * zr).sum(1)  # a NaN target stays NaN
    return out
