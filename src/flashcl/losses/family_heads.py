"""The heads of the families beyond the masked softmax and the sigmoid: the
debiased and hard-negative estimators of NT-Xent (Chuang et al. 2020; Robinson et
al. 2021): :class:`DebiasedHead`; distillation's soft targets from a teacher's
similarities: :class:`SoftTargetHead`; multi-label SupCon's positives weighted by
the Jaccard similarity of label sets, formed tile by tile: :class:`JaccardHead`."""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..core import Tile
from ..engine.heads import Head, WorkBuffer, lse_inplace, mask_columns_, mask_self_, row_dot

__all__ = ["DebiasedHead", "SoftTargetHead", "JaccardHead", "jaccard_row_weights"]


class _DebiasedState:
    def __init__(self, m: int, like: Tensor) -> None:
        self.lse_tilted = like.new_full((m,), float("-inf"))  # LSE_n (beta + 1) s_in over the negatives
        self.lse_weight = like.new_full((m,), float("-inf"))  # LSE_n beta s_in
        self.pos = like.new_zeros(m)  # s_ip
        self.coef_neg: Optional[Tensor] = None
        self.coef_pos: Optional[Tensor] = None
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None


class DebiasedHead(Head):
    """The debiased (Chuang et al., 2020) and hard-negative (Robinson et al., 2021)
    estimators of the contrastive loss, in log space. Row ``i``'s negatives are every
    column but itself (``i + offset``) and its positive ``p(i)``, ``N`` of them::

        log R_i  = LSE_n((beta + 1) s_in) - LSE_n(beta s_in) + log N      # the reweighted sum
        log Ng_i = max(log(R_i - tau_plus N e^{s_ip}) - log(1 - tau_plus), log N - floor)
        loss_i   = softplus(log Ng_i - s_ip)        # = -log(e^{s_ip} / (e^{s_ip} + Ng_i))

    ``beta = 0`` is the debiased estimator, ``tau_plus = 0, beta = 0`` the standard
    loss. Finite where the same formula in exp space overflows. Written out: autograd
    through :meth:`dense` on each block of complete rows took 1.1-1.3x as long at B =
    8,192, D = 256 and peaked at 262-263 MB against 137-169 MB at B = 16,384 (2-core CPU;
    ``scripts/written_out.py``).

    Args:
        positive: (M,) each row's positive column.
        tau_plus: the class prior of a false negative, in [0, 1).
        beta: the hardness (importance weights ``e^{beta s}``), >= 0.
        n_neg: ``N``.
        floor: ``Ng >= N e^{-floor}`` (the scale: a cosine of -1). A constant: no
            gradient reaches a learnable temperature through the bound, as in the
            published code, whose temperature is fixed.
        offset: column of anchor 0.
    """

    passes = 1
    fuses_rows = True

    def __init__(
        self, positive: Tensor, tau_plus: float, beta: float, n_neg: int, floor: float, offset: int = 0
    ) -> None:
        self.positive, self.tau_plus, self.beta = positive, tau_plus, beta
        self.log_n = math.log(n_neg)
        self.floor = floor
        self.offset = offset

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _DebiasedState:
        return _DebiasedState(m, like)

    def _take_positive(self, s: Tensor, tile: Tile, st: _DebiasedState) -> None:
        idx = self.positive[tile.r0 : tile.r1] - tile.c0
        inside = (idx >= 0) & (idx < tile.c1 - tile.c0)
        rows = torch.arange(idx.shape[0], device=s.device)[inside]
        st.pos[tile.r0 + rows] = s[rows, idx[inside]]

    def _mask_(self, s: Tensor, tile: Tile, value: float) -> None:
        mask_self_(s, tile, value)
        mask_columns_(s, tile, self.positive, value)

    def reduce(self, s: Tensor, tile: Tile, st: _DebiasedState, p: int = 0) -> None:
        self._take_positive(s, tile, st)
        self._mask_(s, tile, float("-inf"))
        rows = slice(tile.r0, tile.r1)
        torch.logaddexp(st.lse_tilted[rows], torch.logsumexp(s * (self.beta + 1.0), dim=1), out=st.lse_tilted[rows])
        if self.beta != 0.0:  # beta = 0: LSE_n 0 = log N, set in finish
            torch.logaddexp(st.lse_weight[rows], torch.logsumexp(s * self.beta, dim=1), out=st.lse_weight[rows])

    def finish(self, st: _DebiasedState, p: int = 0) -> None:
        if self.beta == 0.0:
            st.lse_weight = torch.full_like(st.lse_weight, self.log_n)

    def _log_ng(self, st: _DebiasedState) -> Tuple[Tensor, Tensor, Tensor]:
        """(log Ng, whether the floor is taken, exp(B - A)) per row."""
        a = st.lse_tilted - st.lse_weight + self.log_n
        b = math.log(self.tau_plus * math.exp(self.log_n)) + st.pos if self.tau_plus > 0 else None
        floor = torch.full_like(a, self.log_n - self.floor)
        if b is None:
            r = torch.zeros_like(a)
            value = a - math.log1p(-self.tau_plus)
        else:
            r = torch.exp(b - a)
            value = a + torch.log(-torch.expm1((b - a).clamp_max(0.0))) - math.log1p(-self.tau_plus)
            value = torch.where(r < 1, value, torch.full_like(value, float("-inf")))
        clamped = value <= floor
        return torch.where(clamped, floor, value), clamped, r

    def values(self, st: _DebiasedState) -> Tuple[Tensor, Optional[Tensor]]:
        log_ng, _, _ = self._log_ng(st)
        u = log_ng - st.pos
        return u.clamp_min(0) + torch.log1p(torch.exp(-u.abs())), None

    def begin_grad(self, st: _DebiasedState, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.g_row, st.g_col = g_row, g_col
        log_ng, clamped, r = self._log_ng(st)
        sig = torch.sigmoid(log_ng - st.pos) * g_row
        d_a = torch.where(clamped, torch.zeros_like(r), 1.0 / (1.0 - r))
        d_b = torch.where(clamped, torch.zeros_like(r), -r / (1.0 - r))
        st.coef_neg = sig * d_a
        st.coef_pos = sig * (d_b - 1.0)

    def grad(self, s: Tensor, tile: Tile, st: _DebiasedState, buf: Optional[Tensor] = None) -> Tensor:
        assert st.coef_neg is not None and st.coef_pos is not None
        rows = slice(tile.r0, tile.r1)
        self._mask_(s, tile, float("-inf"))
        if self.beta != 0.0:
            low = torch.sub(s * self.beta, st.lse_weight[rows].unsqueeze(1)).exp_().mul_(self.beta)
            g = s.mul_(self.beta + 1.0).sub_(st.lse_tilted[rows].unsqueeze(1)).exp_().mul_(self.beta + 1.0).sub_(low)
        else:
            g = s.sub_(st.lse_tilted[rows].unsqueeze(1)).exp_()
        g.mul_(st.coef_neg[rows].unsqueeze(1))
        idx = self.positive[rows] - tile.c0
        inside = (idx >= 0) & (idx < tile.c1 - tile.c0)
        local = torch.arange(idx.shape[0], device=s.device)[inside]
        g[local, idx[inside]] = st.coef_pos[rows][inside]
        return g

    def rows_fused(self, s: Tensor, tile: Tile, st: _DebiasedState, g_row: Optional[Tensor]) -> Optional[Tensor]:
        work = s.clone() if g_row is not None else s  # the gradient needs the scores again
        self.reduce(work, tile, st)
        rows = slice(tile.r0, tile.r1)
        if self.beta == 0.0:  # what finish does, for rows complete in this tile
            st.lse_weight[rows] = self.log_n
        if g_row is None:
            return None
        sub = _DebiasedState(0, s)
        sub.lse_tilted, sub.lse_weight, sub.pos = st.lse_tilted[rows], st.lse_weight[rows], st.pos[rows]
        self.begin_grad(sub, g_row[rows], None)
        if st.coef_neg is None:
            st.coef_neg, st.coef_pos = torch.zeros_like(st.pos), torch.zeros_like(st.pos)
        assert st.coef_pos is not None and sub.coef_neg is not None and sub.coef_pos is not None
        st.coef_neg[rows], st.coef_pos[rows] = sub.coef_neg, sub.coef_pos
        return self.grad(s, tile, st)

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        rows = torch.arange(s.shape[0], device=s.device)
        pos = s[rows, self.positive[tile.r0 : tile.r1] - tile.c0]
        mask = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
        self._mask_(mask, tile, True)
        masked = s.masked_fill(mask, float("-inf"))
        lse_tilted = torch.logsumexp(masked * (self.beta + 1.0), dim=1)
        lse_weight = (
            torch.logsumexp(masked * self.beta, dim=1) if self.beta != 0.0 else torch.full_like(lse_tilted, self.log_n)
        )
        st = _DebiasedState(0, s)
        st.lse_tilted, st.lse_weight, st.pos = lse_tilted, lse_weight, pos
        return self.values(st)


class _SoftTargetState:
    def __init__(self, m: int, like: Tensor) -> None:
        self.lse = like.new_full((m,), float("-inf"))  # the teacher's row logsumexp
        self.own_lse = like.new_full((m,), float("-inf"))  # the student's (student side only)
        self.cross = like.new_zeros(m)  # A_i = sum_j p_ij S_ij
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None
        self.work = WorkBuffer()


class SoftTargetHead(Head):
    """Distillation's row loss with the teacher's ``p_ij = softmax_j(T_ij)``: the
    engine's tiles are one side's scores, the other side's tiles are formed here (in
    one work buffer) from ``other_q``, ``other_k`` (normalised, without gradient)
    times ``other_scale``. ``own_is_teacher=False``: the tiles are the student's
    ``S``, the loss ``LSE_j S_ij - sum_j p_ij S_ij`` and its gradient
    ``softmax_j(S_ij) - p_ij`` (the teacher held fixed). ``own_is_teacher=True``: the
    tiles are the teacher's ``T``, the loss the cross term ``-sum_j p_ij S_ij`` and its
    gradient ``-p_ij (S_ij - A_i)`` (the student's scores held fixed). On complete rows
    one visit (:meth:`rows_fused`); otherwise pass 0 the logsumexps, pass 1 the sum.
    Written out: autograd through :meth:`dense` on each block of complete rows took 1.15x
    as long at B = 8,192, D = 256 and peaked at 1,014 MB against 122 MB at B = 16,384
    (2-core CPU; ``scripts/written_out.py``)."""

    passes = 2
    fuses_rows = True

    def __init__(
        self, other_q: Tensor, other_k: Tensor, other_scale: float, own_is_teacher: bool, offset: int = 0
    ) -> None:
        self.other_q, self.other_k, self.other_scale = other_q, other_k, other_scale
        self.own_is_teacher = own_is_teacher
        self.offset = offset

    def _other(self, tile: Tile, like: Tensor, out: Optional[Tensor]) -> Tensor:
        oq = self.other_q[tile.r0 : tile.r1].to(like.dtype)
        return torch.mm(oq, self.other_k[tile.c0 : tile.c1].to(like.dtype).T, out=out).mul_(self.other_scale)

    def _pair(self, s: Tensor, tile: Tile, st: Any) -> Tuple[Tensor, Tensor]:
        """(teacher tile T, student tile S): ``s`` and the other side's in the work buffer."""
        other = self._other(tile, s, st.work.like(s))
        return (s, other) if self.own_is_teacher else (other, s)

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> Any:
        return _SoftTargetState(m, like)

    def reduce(self, s: Tensor, tile: Tile, st: Any, p: int = 0) -> None:
        rows = slice(tile.r0, tile.r1)
        t, sv = self._pair(s, tile, st)
        if p == 0:
            st.lse[rows] = torch.logaddexp(st.lse[rows], lse_inplace(t)[0])
            if not self.own_is_teacher:  # sv is s, which reduce may overwrite
                st.own_lse[rows] = torch.logaddexp(st.own_lse[rows], lse_inplace(sv)[0])
        else:
            st.cross[rows] += row_dot(t.sub_(st.lse[rows].unsqueeze(1)).exp_(), sv)

    def rows_fused(self, s: Tensor, tile: Tile, st: Any, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        t, sv = self._pair(s, tile, st)
        st.lse[rows], total = lse_inplace(t)  # t: the teacher's probabilities times total
        cross = row_dot(t, sv) / total.squeeze(1)
        st.cross[rows] = cross
        if self.own_is_teacher:  # s is t
            if g_row is None:
                return None
            return s.mul_(sv.sub_(cross.unsqueeze(1))).mul_(-g_row[rows].unsqueeze(1) / total)
        st.own_lse[rows], own_total = lse_inplace(s)
        if g_row is None:
            return None
        g = g_row[rows].unsqueeze(1)
        return s.mul_(g / own_total).sub_(t.mul_(g / total))

    def values(self, st: Any) -> Tuple[Tensor, Optional[Tensor]]:
        return (-st.cross if self.own_is_teacher else st.own_lse - st.cross), None

    def release(self, st: Any) -> None:
        st.work.buf = None  # the other side's tile: not kept with the state until the backward

    def grad(self, s: Tensor, tile: Tile, st: Any, buf: Optional[Tensor] = None) -> Tensor:
        rows = slice(tile.r0, tile.r1)
        g = st.g_row[rows].unsqueeze(1)
        if self.own_is_teacher:
            t, sv = self._pair(s, tile, st)  # s is t
            prob = t.sub_(st.lse[rows].unsqueeze(1)).exp_()
            return prob.mul_(sv.sub_(st.cross[rows].unsqueeze(1))).mul_(-g)
        prob = self._other(tile, s, st.work.like(s)).sub_(st.lse[rows].unsqueeze(1)).exp_()
        return s.sub_(st.own_lse[rows].unsqueeze(1)).exp_().sub_(prob).mul_(g)

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        other = self._other(tile, s, None)
        t, sv = (s, other) if self.own_is_teacher else (other, s)
        cross = (torch.softmax(t, dim=1) * sv).sum(1)
        return (-cross if self.own_is_teacher else torch.logsumexp(s, dim=1) - cross), None


def _weights(
    yq: Tensor,
    yk: Tensor,
    nq: Tensor,
    nk: Tensor,
    tile: Tile,
    threshold: float,
    out: Optional[Tensor] = None,
    work: Optional[Tensor] = None,
) -> Tensor:
    """The tile's positive weights ``J_ij [J_ij > threshold]`` with the anchor's own
    column 0, from the label rows and their sizes ``nq``, ``nk``; into ``out``, with
    ``work`` for the unions (free buffers of the tile's shape; made when None)."""
    rows, cols = slice(tile.r0, tile.r1), slice(tile.c0, tile.c1)
    inter = torch.mm(yq[rows], yk[cols].T, out=out)
    union = torch.add(nq[rows].unsqueeze(1), nk[cols].unsqueeze(0), out=work)
    # both sets empty: inter = 0 = union, and J = 0 / 1 = 0 (the Jaccard similarity's convention)
    w = inter.div_(union.sub_(inter).clamp_min_(1.0))
    w.masked_fill_(w <= threshold, 0.0)
    mask_self_(w, tile, 0.0)
    return w


class _JaccardState:
    def __init__(self, m: int, like: Tensor) -> None:
        self.lse = like.new_full((m,), float("-inf"))
        self.ws = like.new_zeros(m)  # sum_j w_ij s_ij
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None
        self.work = (WorkBuffer(), WorkBuffer())


class JaccardHead(Head):
    """Multi-label SupCon's row loss ``c_i LSE_{j in Den(i)} s_ij - a_i sum_j w_ij s_ij``
    with ``w_ij = J_ij [J_ij > threshold]`` (``j != i``) formed in each tile from the
    label rows, ``c_i = a_i sum_j w_ij`` and ``a_i = 1 / |P(i)|`` (``positives="mean"``)
    or 1 (``"sum"``): ``c``, ``a`` precomputed (:func:`row_weights`). On complete rows
    the loss and its gradient are formed in one visit (:meth:`rows_fused`), in the
    tile and two work buffers of its size."""

    fuses_rows = True

    def __init__(
        self, yq: Tensor, yk: Tensor, threshold: float, c: Tensor, a: Tensor, exclude_self: bool, offset: int = 0
    ) -> None:
        self.yq, self.yk, self.threshold = yq, yk, threshold
        self.nq = yq.sum(1)
        self.nk = self.nq if yk is yq else yk.sum(1)
        self.c, self.a = c, a
        self.exclude_self, self.offset = exclude_self, offset

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> Any:
        return _JaccardState(m, like)

    def _tile_weights(self, s: Tensor, tile: Tile, st: Any) -> Tensor:
        w = _weights(self.yq, self.yk, self.nq, self.nk, tile, self.threshold, st.work[0].like(s), st.work[1].like(s))
        return w if w.dtype == s.dtype else w.to(s.dtype)

    def _lse_(self, s: Tensor, tile: Tile) -> Tuple[Tensor, Tensor]:
        """The rows' LSE over the denominator; leaves ``exp(s - rowmax)`` in ``s``."""
        if self.exclude_self:
            mask_self_(s, tile, float("-inf"))
        return lse_inplace(s)

    def reduce(self, s: Tensor, tile: Tile, st: Any, p: int = 0) -> None:
        rows = slice(tile.r0, tile.r1)
        st.ws[rows] += row_dot(self._tile_weights(s, tile, st), s)
        st.lse[rows] = torch.logaddexp(st.lse[rows], self._lse_(s, tile)[0])

    def rows_fused(self, s: Tensor, tile: Tile, st: Any, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        w = self._tile_weights(s, tile, st)
        st.ws[rows] = row_dot(w, s)
        lse, total = self._lse_(s, tile)
        st.lse[rows] = lse
        if g_row is None:
            return None
        # g (c softmax - a w): s holds exp(s - rowmax), whose row sum is total
        coef = (g_row[rows] * self.c[rows]).unsqueeze(1) / total
        s.mul_(torch.where(total > 0, coef, torch.zeros_like(coef)))
        return s.sub_(w.mul_((g_row[rows] * self.a[rows]).unsqueeze(1)))

    def values(self, st: Any) -> Tuple[Tensor, Optional[Tensor]]:
        return torch.where(self.c > 0, self.c * st.lse, torch.zeros_like(st.lse)) - self.a * st.ws, None

    def grad(self, s: Tensor, tile: Tile, st: Any, buf: Optional[Tensor] = None) -> Tensor:
        rows = slice(tile.r0, tile.r1)
        g = st.g_row[rows]
        if self.exclude_self:
            mask_self_(s, tile, float("-inf"))
        lse = st.lse[rows]
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # an empty denominator: exp(-inf) = 0
        s.sub_(lse.unsqueeze(1)).exp_().mul_((g * self.c[rows]).unsqueeze(1))
        return s.sub_(self._tile_weights(s, tile, st).mul_((g * self.a[rows]).unsqueeze(1)))

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        w = _weights(self.yq, self.yk, self.nq, self.nk, tile, self.threshold).to(s.dtype)
        masked = s.clone()
        if self.exclude_self:
            mask_self_(masked, tile, float("-inf"))
        lse = torch.logsumexp(masked, dim=1)
        return torch.where(self.c > 0, self.c * lse, torch.zeros_like(lse)) - self.a * (w * s).sum(1), None


def jaccard_row_weights(
    yq: Tensor, yk: Tensor, threshold: float, positives: str, offset: int, block: int, dtype: torch.dtype
) -> Tuple[Tensor, Tensor, Tensor]:
    """(c, a, has a positive) per anchor, from the label rows by row blocks."""
    m, n = yq.shape[0], yk.shape[0]
    count = torch.zeros(m, dtype=dtype, device=yq.device)
    wsum = torch.zeros(m, dtype=dtype, device=yq.device)
    nq = yq.sum(1)
    nk = nq if yk is yq else yk.sum(1)
    out, work = yq.new_empty(min(block, m), n), yq.new_empty(min(block, m), n)
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        w = _weights(yq, yk, nq, nk, Tile(r0, r1, 0, n, offset), threshold, out[: r1 - r0], work[: r1 - r0])
        count[r0:r1] = (w > 0).sum(1).to(dtype)
        wsum[r0:r1] = w.sum(1).to(dtype)
    valid = count > 0
    a = 1.0 / count.clamp_min(1) if positives == "mean" else torch.ones_like(count)
    a = torch.where(valid, a, torch.zeros_like(a))
    return a * wsum, a, valid
