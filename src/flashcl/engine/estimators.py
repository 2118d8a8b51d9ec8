"""The debiased and hard-negative estimators of NT-Xent (Chuang et al. 2020;
Robinson et al. 2021) as a head of the tile engine: :class:`DebiasedHead`."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..core import Tile
from .heads import Head, mask_columns_, mask_self_

__all__ = ["DebiasedHead"]


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
    loss. Finite where the same formula in exp space overflows.

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

    def dense(self, s: Tensor, tile: Tile, param: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
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
