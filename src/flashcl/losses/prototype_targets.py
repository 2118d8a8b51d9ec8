"""Self-distillation over prototypes (DINO, iBOT, SwAV) without the rows x K logits:
the prototypes, the teacher's target distributions over them and Sinkhorn-Knopp, every
logit formed a block at a time; the cross-entropy against the student's softmax that
takes them is :mod:`flashcl.losses.prototype_loss`'s, a head on the engine's row blocks.
The targets are formed by blocks of images, every prototype's (each distinct sum of
teacher views' targets once per block); Sinkhorn-Knopp's scalings visit blocks of
prototypes against every row.

For student rows ``x`` (B, D) and prototypes ``W`` (K, D), teacher rows ``y`` and the
teacher's prototypes ``W_t``, with ``s = x^ W^T`` and ``t = y^ W_t^T`` (rows and
prototypes L2-normalised with ``normalize``, as a weight-normalised last layer)::

    loss_b = -sum_k p_bk log_softmax_k(s_b / tau_s)

with the teacher's targets ``p`` either ``softmax_k((t_bk - c_k) / tau_t)`` (a given
center ``c``) or DINOv2's Sinkhorn-Knopp on ``exp(t / tau_t)``, kept in the log domain
as scalings of its rows and columns, ``log p_bk = t_bk / tau_t + u_k + v_b``, so that
the state is O(B + K): each iteration is one pass over the prototypes' blocks (the
prototypes' sums over the rows are complete in a block of all rows; the rows' sums
over the prototypes accumulate across blocks).

The sums over the rows meet the other ranks' through a :class:`RowsJoin`
(:func:`rows_join`); the public losses (:mod:`flashcl.losses.self_distill`) and the
drop-ins build on this module.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import parallel

__all__ = [
    "rows_join",
    "Prototypes",
    "RowsJoin",
    "unit_rows",
    "sinkhorn_scalings",
    "softmax_targets",
    "sinkhorn_targets",
    "logit_sums",
    "scaled_targets",
    "Blocks",
    "paired_targets",
    "auto_prototype_block",
    "EXP_RANGE",
    "inverse_norms",
    "Group",
]


def auto_prototype_block(b: int, k: int) -> int:
    """Prototypes per block: a B x block tile of about 2M entries (8 MB in float32; a
    pass holds two)."""
    return max(1, min(k, (1 << 21) // max(1, b)))


def unit_rows(x: Tensor, normalize: bool) -> Tuple[Tensor, Tensor]:
    """``x``'s rows divided by their norms (with ``normalize``; else as given) and the
    inverse norms (ones without ``normalize``)."""
    if not normalize:
        return x, torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    inv = inverse_norms(x)
    return x * inv.unsqueeze(1), inv


def inverse_norms(x: Tensor) -> Tensor:
    return 1.0 / torch.linalg.vector_norm(x, dim=1).clamp_min(1e-12)


class Prototypes:
    """Prototypes ``w`` (K, D) as given and their inverse norms (with ``normalize``):
    tiles of logits ``rows . w^_k scale``, never all unit prototypes at once (a second
    K x D tensor)."""

    def __init__(self, w: Tensor, normalize: bool) -> None:
        self.w, self.normalized = w, normalize
        self.inv = inverse_norms(w) if normalize else torch.ones(w.shape[0], dtype=w.dtype, device=w.device)
        self.k = w.shape[0]

    def tile(self, rows: Tensor, k0: int, k1: int, scale: float, out: Tensor) -> Tensor:
        """``rows . w^_k scale`` for the block of prototypes ``k0 .. k1`` (their unit rows
        formed for the GEMM, block x D)."""
        unit = self.w[k0:k1] * (self.inv[k0:k1] * scale).unsqueeze(1)
        return torch.mm(rows, unit.T, out=out[:, : k1 - k0])

    def rows_tile(self, rows: Tensor, scale: float, out: Tensor, shift: Optional[Tensor] = None) -> Tensor:
        """``rows . w^_k scale (+ shift_k)`` against every prototype (rows x K): one GEMM
        with the prototypes as given, their norms a scaling of the tile's columns
        (joined with ``shift``, a (K,) vector or a scalar tensor, in one pass)."""
        z = torch.mm(rows * scale, self.w.T, out=out)
        if self.normalized:
            return z.mul_(self.inv) if shift is None else torch.addcmul(shift, z, self.inv, out=z)
        return z if shift is None else z.add_(shift)


def _blocks(k: int, block: int) -> range:
    return range(0, k, block)


class RowsJoin:
    """How one rank's rows meet the other ranks' in Sinkhorn-Knopp (the sums over the
    rows are over the global batch): ``lse(x)``, elementwise logsumexps of this rank's
    rows joined over the ranks; ``total_rows(b)``, the global number of rows. One process:
    as they are."""

    #: whether joining is a collective (then made once per pass, over every prototype)
    collective = False

    def lse(self, x: Tensor) -> Tensor:
        return x

    def total_rows(self, b: int) -> int:
        return b

    def sum(self, x: Tensor) -> Tensor:
        """``x`` (sums over this rank's rows) summed over the ranks."""
        return x


class _GroupRows(RowsJoin):
    """The sums over the rows of Sinkhorn-Knopp (and the center's) over every rank of
    a process group: each an all-reduce of a vector, as DINOv2's ``dist.all_reduce``
    of ``sum_Q`` and of the prototypes' sums; uneven batches count their rows."""

    collective = True

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group, self.device = group, device

    def lse(self, x: Tensor) -> Tensor:
        return parallel.logsumexp_across(x, self.group)

    def total_rows(self, b: int) -> int:
        return sum(parallel.row_counts(b, self.device, self.group))

    def sum(self, x: Tensor) -> Tensor:
        return parallel.sum_across(x, self.group)


def rows_join(group: Any, device: torch.device) -> RowsJoin:
    """How one rank's rows meet the other ranks' in the prototype losses' sums over the
    rows (:class:`RowsJoin`): over ``group``'s ranks (their
    collectives on ``device``), or one process for None."""
    return RowsJoin() if group is None else _GroupRows(group, device)


def sinkhorn_scalings(
    rows: Tensor, w_t: Prototypes, inv_temp: float, iterations: int, block: int, join: Optional[RowsJoin] = None
) -> Tuple[Tensor, Tensor]:
    """DINOv2's Sinkhorn-Knopp on ``exp(t / tau_t)`` (``t`` the teacher's rows against
    its prototypes) as log scalings ``(u (K,), v (B,))``: the targets are
    ``p_bk = exp(t_bk / tau_t + u_k + v_b)``, each row summing to 1. In its order: the
    whole matrix divided by its sum, then ``iterations`` times each prototype's sum
    over the rows set to 1/K and each row's sum over the prototypes to 1/B; the rows
    then multiplied by B. ``join``: the sums over the rows (the whole matrix's, each
    prototype's) over every rank's rows, B the global count (as DINOv2 all-reduces
    them; uneven batches count their rows)."""
    join = join or RowsJoin()
    bound = _bound(rows, w_t, inv_temp)
    if 2 * bound <= EXP_RANGE.get(rows.dtype, 0.0) - 10.0:
        return _sinkhorn_exp(rows, w_t, inv_temp, iterations, block, join)
    b, k = rows.shape[0], w_t.k
    n = join.total_rows(b)
    v = rows.new_zeros(b)
    u = rows.new_zeros(k)
    buf = rows.new_empty(b, min(block, k))
    total = rows.new_full((), float("-inf"))  # the whole matrix's sum: one pass
    for k0 in _blocks(k, block):
        logits = w_t.tile(rows, k0, min(k0 + block, k), inv_temp, buf)
        total = torch.logaddexp(total, torch.logsumexp(logits.flatten(), 0))
    v -= join.lse(total.reshape(1))[0]
    for _ in range(iterations):
        sums = rows.new_full((b,), float("-inf"))
        if join.collective:
            # across processes: each prototype's sum over every rank's rows in one all-reduce of K values
            # per iteration (as DINOv2), not one per block; the rows' sums in a second pass
            for k0 in _blocks(k, block):
                k1 = min(k0 + block, k)
                u[k0:k1] = torch.logsumexp(w_t.tile(rows, k0, k1, inv_temp, buf).add_(v.unsqueeze(1)), 0)
            u = -join.lse(u) - math.log(k)
        for k0 in _blocks(k, block):
            k1 = min(k0 + block, k)
            logits = w_t.tile(rows, k0, k1, inv_temp, buf).add_(v.unsqueeze(1))
            if not join.collective:
                # each prototype's sum over every row (this rank's rows are all in the block): to 1/K
                u[k0:k1] = -join.lse(torch.logsumexp(logits, 0)) - math.log(k)
            sums = torch.logaddexp(sums, torch.logsumexp(logits.add_(u[k0:k1].unsqueeze(0)), 1))
        v -= sums + math.log(n)  # each row's sum over the prototypes: to 1/B
    return u, v + math.log(n)


def _sinkhorn_exp(
    rows: Tensor, w_t: Prototypes, inv_temp: float, iterations: int, block: int, join: RowsJoin
) -> Tuple[Tensor, Tensor]:
    """:func:`sinkhorn_scalings` where every logit ``t / tau`` lies within ``[-bound,
    bound]`` and ``2 bound`` is at most the exponent range less 10: the sums in the
    exponential domain, as DINOv2 computes them, each tile ``exp(t / tau)`` and its sums
    over the rows and over the prototypes two matrix-vector products with the other
    side's scalings, shifted by their maximum (a term that underflows is below
    ``e^(2 bound - 87)`` of its sum in float32: under its rounding)."""
    b, k = rows.shape[0], w_t.k
    n = join.total_rows(b)
    buf = rows.new_empty(b, min(block, k))

    def tile(k0: int) -> Tuple[Tensor, int, int]:
        k1 = min(k0 + block, k)
        return w_t.tile(rows, k0, k1, inv_temp, buf).exp_(), k0, k1

    def rows_sum(sums: Tensor, e: Tensor, uk: Tensor) -> Tensor:  # each row's log-sum of E exp(u), so far
        top = uk.max()
        return torch.logaddexp(sums, torch.mv(e, (uk - top).exp_()).log_().add_(top))

    def rows_pass(u: Tensor) -> Tensor:  # across processes: the rows' sums once every prototype's is joined
        sums = rows.new_full((b,), float("-inf"))
        for e, k0, k1 in map(tile, _blocks(k, block)):
            sums = rows_sum(sums, e, u[k0:k1])
        return sums

    # the first pass: each prototype's log-sum over the rows (the whole matrix's sum is theirs); the
    # first iteration's prototype scalings need no pass of their own, the rows' scaling being then one
    # constant, so that in one process the first iteration's sums over the prototypes join this pass
    first = iterations > 0 and not join.collective
    logcol = rows.new_empty(k)
    sums = rows.new_full((b,), float("-inf"))
    for e, k0, k1 in map(tile, _blocks(k, block)):
        logcol[k0:k1] = e.sum(0).log_()
        if first:  # joined block by block where joining is no collective
            logcol[k0:k1] = join.lse(logcol[k0:k1])
            sums = rows_sum(sums, e, -logcol[k0:k1])
    if not first:
        logcol = join.lse(logcol)
    log_total = torch.logsumexp(logcol, 0)
    v = rows.new_zeros(b) - log_total
    u = rows.new_zeros(k)
    if iterations == 0:
        return u, v + math.log(n)
    u = log_total - logcol - math.log(k)  # each prototype's sum to 1/K
    sums = sums + (log_total - math.log(k)) if first else rows_pass(u)
    v = -sums - math.log(n)  # each row's sum over the prototypes: to 1/B
    for _ in range(iterations - 1):
        top = v.max() if b else v.new_zeros(())
        ev = (v - top).exp_()
        sums = rows.new_full((b,), float("-inf"))
        for e, k0, k1 in map(tile, _blocks(k, block)):
            # each prototype's log-sum over this rank's rows of exp(t / tau + v)
            u[k0:k1] = torch.mv(e.T, ev).log_().add_(top)
            if not join.collective:  # this rank's rows are every row: to 1/K, then the rows' sums
                u[k0:k1] = -join.lse(u[k0:k1]) - math.log(k)
                sums = rows_sum(sums, e, u[k0:k1])
        if join.collective:  # one all-reduce of K values per iteration (as DINOv2), the rows' sums in a second pass
            u = -join.lse(u) - math.log(k)
            sums = rows_pass(u)
        v = -sums - math.log(n)  # each row's sum over the prototypes: to 1/B
    return u, v + math.log(n)


def logit_sums(rows: Tensor, w_t: Prototypes) -> Tensor:
    """The sum over the rows of the teacher's logits, (K,) (DINO's center is their
    mean over the global batch): ``sum_b t_bk = (sum_b rows_b) . w^_k``, no rows x K
    tensor."""
    return (w_t.w @ rows.sum(0)) * w_t.inv


Targets = Callable[[int, int, Tensor], Tensor]


#: a tile of targets of a block of images against every prototype, and the student views that take it
#: (None: no teacher view, targets of zero)
Group = Tuple[List[int], Optional[Tensor]]


class Blocks:
    """A teacher's target probabilities, never all of them at once: ``blocks.rows(r0,
    r1, out)`` (one teacher view's) writes those of rows ``r0 .. r1`` against every
    prototype into ``out`` and returns it. For ``views`` stacked student views of ``b =
    count / views`` images each (view ``s``: rows ``s b .. (s + 1) b``), ``groups(i0,
    i1, scratch)`` gives the targets of images ``i0 .. i1`` of every view at once: each
    distinct tile with the views that take it, its tiles in ``scratch`` (``tiles`` of
    them, each at least ``i1 - i0`` rows x K); ``mass``: each row's sum over the
    prototypes where it is known before any pass (1 for a softmax, and for
    Sinkhorn-Knopp after an iteration), else None."""

    def __init__(
        self,
        mass: Optional[Tensor],
        rows: Optional[Targets],
        count: int,
        tiles: int = 1,
        views: int = 1,
        groups: Optional[Callable[[int, int, Tensor], List[Group]]] = None,
    ) -> None:
        self.mass, self.count, self.tiles, self.views = mass, count, tiles, views
        self._rows, self._groups = rows, groups

    def rows(self, r0: int, r1: int, out: Tensor) -> Tensor:
        if self._rows is None:
            raise TypeError("the targets of stacked views are given by blocks of images (groups)")
        return self._rows(r0, r1, out)

    def groups(self, i0: int, i1: int, scratch: Tensor) -> List[Group]:
        if self._groups is not None:
            return self._groups(i0, i1, scratch)
        return [([0], self.rows(i0, i1, scratch[0, : i1 - i0]))]


def softmax_targets(rows: Tensor, w_t: Prototypes, center: Optional[Tensor], inv_temp: float, block: int) -> Blocks:
    """The centred, sharpened softmax ``softmax_k((t_bk - c_k) / tau_t)`` by blocks of
    rows (each row's softmax whole): a fixed shift where the logits' range allows it
    (no pass for each row's maximum)."""
    b, k = rows.shape[0], w_t.k
    c = rows.new_zeros(k) if center is None else center.to(rows.dtype).reshape(k) * inv_temp
    bound = _bound(rows, w_t, inv_temp)
    hi, lo = bound - float(c.min()) if k else 0.0, -bound - float(c.max()) if k else 0.0
    fixed = hi - lo <= EXP_RANGE.get(rows.dtype, 0.0)
    shift = -c - hi if fixed else (None if center is None else -c)

    def row_targets(r0: int, r1: int, out: Tensor) -> Tensor:
        t = w_t.rows_tile(rows[r0:r1], inv_temp, out, shift)
        e = (t if fixed else t.sub_(t.amax(1, keepdim=True))).exp_()
        return e.div_(e.sum(1, keepdim=True))

    return Blocks(rows.new_ones(b), row_targets, b)


def scaled_targets(
    rows: Tensor, w_t: Prototypes, inv_temp: float, u: Tensor, v: Tensor, mass: Optional[Tensor] = None
) -> Blocks:
    """Sinkhorn-Knopp's targets ``exp(t_bk / tau_t + u_k + v_b)`` from its log scalings
    (:func:`sinkhorn_scalings`; ``v``: these rows'), by blocks of rows; ``mass``: the
    rows' sums where known (1 after an iteration)."""
    u, v = u.to(rows.dtype), v.to(rows.dtype)

    def row_targets(r0: int, r1: int, out: Tensor) -> Tensor:
        return w_t.rows_tile(rows[r0:r1], inv_temp, out, u).add_(v[r0:r1].unsqueeze(1)).exp_()

    return Blocks(mass, row_targets, rows.shape[0])


def sinkhorn_targets(
    rows: Tensor, w_t: Prototypes, inv_temp: float, iterations: int, block: int, join: Optional[RowsJoin] = None
) -> Blocks:
    """DINOv2's Sinkhorn-Knopp targets (:func:`sinkhorn_scalings`) as a function of a
    block of rows written into a buffer."""
    u, v = sinkhorn_scalings(rows, w_t, inv_temp, iterations, block, join)
    return scaled_targets(rows, w_t, inv_temp, u, v, rows.new_ones(rows.shape[0]) if iterations > 0 else None)


def paired_targets(views: Sequence[Blocks], pairs: Sequence[Sequence[int]], b: int) -> Blocks:
    """The targets of stacked student views (view ``s``: rows ``s b .. (s + 1) b``): the
    sum of the teacher views ``pairs[s]``' targets (the cross-entropy is linear in its
    targets, so a student view against several teacher views, DINO's crop pairs, is one
    pass with their sum); each teacher view's tile formed once per block of images
    (``views``: each teacher view's targets, ``b`` rows each), each distinct sum once
    for every student view that takes it."""
    used = sorted({t for ts in pairs for t in ts})
    # the distinct sets of teacher views, each with the student views that take it; a set of two or
    # more has a tile of its own (after the teacher views')
    sets: Dict[Tuple[int, ...], List[int]] = {}
    for s, ts in enumerate(pairs):
        sets.setdefault(tuple(ts), []).append(s)
    slot = {ts: len(used) + j for j, ts in enumerate(ts for ts in sets if len(ts) > 1)}

    if len(pairs) == 1 and len(pairs[0]) == 1:  # one student view, one teacher view: its targets as they are
        return views[pairs[0][0]]

    def summed(ts: Sequence[int], tiles: Dict[int, Tensor], dst: Tensor) -> Tensor:
        if not ts:
            return dst.zero_()
        if len(ts) == 1:  # read only by the pass: the teacher view's tile itself
            return tiles[ts[0]]
        torch.add(tiles[ts[0]], tiles[ts[1]], out=dst)
        for t in ts[2:]:
            dst.add_(tiles[t])
        return dst

    def groups(i0: int, i1: int, scratch: Tensor) -> List[Group]:
        m = i1 - i0
        tiles = {t: views[t].rows(i0, i1, scratch[j, :m]) for j, t in enumerate(used)}
        out: List[Group] = []
        for ts, ss in sets.items():
            if not ts:
                out.append((ss, None))
            elif len(ts) == 1:
                out.append((ss, tiles[ts[0]]))
            else:
                out.append((ss, summed(ts, tiles, scratch[slot[ts], :m])))
        return out

    known = [m for m in (views[t].mass for t in used) if m is not None]
    mass = None
    if known and len(known) == len(used):
        rows = {t: m for t, m in zip(used, known)}
        mass = torch.cat([sum((rows[t] for t in ts), torch.zeros_like(known[0])) for ts in pairs])
    return Blocks(mass, None, len(pairs) * b, len(used) + len(slot), len(pairs), groups)


#: per dtype, the widest range of logits whose exponentials, shifted by their bound, stay normal
#: numbers (wider: every sum a logsumexp; a dtype not named: always logsumexps)
EXP_RANGE = {torch.float32: 80.0, torch.float64: 700.0}


def _bound(rows: Tensor, protos: Prototypes, scale: float) -> float:
    """The largest ``|rows_b . w^_k| scale``: the norms' product (1 x scale for unit ones)."""
    r = float(torch.linalg.vector_norm(rows, dim=1).max()) if rows.numel() else 0.0
    p = float((torch.linalg.vector_norm(protos.w, dim=1) * protos.inv).max()) if protos.k else 0.0
    return r * p * scale
