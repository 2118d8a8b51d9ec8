"""pytorch-metric-learning's NT-Xent with labels: every positive pair's own softmax
against its anchor's negatives, as a head of the tile engine (:class:`PairNTXentHead`)
and its one call (:func:`pair_nt_xent`), for
:class:`flashcl.integrations.pytorch_metric_learning.NTXentLoss`."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends, checks
from ..core import Tile, compute_dtype
from ..engine.engine import Problem
from ..engine.heads import Head, mask_columns_

__all__ = ["PairNTXentHead", "pair_nt_xent"]

#: ``(row class ids (M,), column class ids (N,), the diagonal (or ``self_index``) out of
#: the positives, each anchor's own column in a queue (M,) or None)``
Pairs = Tuple[Tensor, Tensor, bool, Optional[Tensor]]


class _PairState:
    def __init__(self, m: int, like: Tensor) -> None:
        self.lse_neg = like.new_full((m,), float("-inf"))  # pass 0: LSE over each anchor's negatives
        self.loss = like.new_zeros(m)  # pass 1: sum_p softplus(L_a - s_ap)
        self.sig = like.new_zeros(m)  # pass 1: sum_p sigmoid(L_a - s_ap)
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None


class PairNTXentHead(Head):
    """PML's NT-Xent as a head of the tile engine: per anchor ``a``,
    ``sum_{p in Pos(a)} softplus(L_a - s_ap)`` with ``L_a = LSE_{n: y_n != y_a} s_an``.

    Two reduction passes (``L_a``, then the softplus and sigmoid sums), or one
    visit of a tile of complete rows. ``dL/ds_ap = -sigmoid(L_a - s_ap)`` on the
    positives and ``sigma_a * softmax_neg(a)_n`` on the negatives, ``sigma_a`` the
    sum of the positives' sigmoids. Written out: autograd through :meth:`dense` on
    each block of complete rows took about as long (0.97-1.08x at B = 8,192, D = 256)
    but peaked at 1,182-1,245 MB against 297-387 MB at B = 16,384 (2-core CPU;
    ``scripts/written_out.py``); self-contrast visits the symmetric panels."""

    passes = 2
    fuses_rows = True

    def __init__(self, pairs: Pairs) -> None:
        self.row_ids, self.col_ids, self.self_pairs, self.self_index = pairs
        # labels on both sides, pairs symmetric in (a, p): the self-contrast driver may take it
        self.symmetric_tiles = self.self_pairs and self.self_index is None

    def _masks(self, tile: Tile) -> Tuple[Tensor, Tensor]:
        same = self.row_ids[tile.r0 : tile.r1].unsqueeze(1) == self.col_ids[tile.c0 : tile.c1].unsqueeze(0)
        pos = same.clone()
        if self.self_index is not None:
            mask_columns_(pos, tile, self.self_index, False)
        elif self.self_pairs:
            tile.self_diagonal(pos).fill_(False)
        return pos, ~same

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _PairState:
        return _PairState(m, like)

    def _pass1(self, s: Tensor, pos: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """(softplus sum, sigmoid sum, z) over the tile's positives, given its rows' L_a."""
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        z = torch.where(pos, lse.unsqueeze(1) - s, zero)
        return torch.where(pos, F.softplus(z), zero).sum(1), torch.where(pos, torch.sigmoid(z), zero).sum(1), z

    def reduce(self, s: Tensor, tile: Tile, st: _PairState, p: int = 0) -> None:
        pos, neg = self._masks(tile)
        rows = slice(tile.r0, tile.r1)
        if p == 0:
            part = torch.logsumexp(s.masked_fill(~neg, float("-inf")), dim=1)
            torch.logaddexp(st.lse_neg[rows], part, out=st.lse_neg[rows])
            return
        loss, sig, _ = self._pass1(s, pos, st.lse_neg[rows])
        st.loss[rows] += loss
        st.sig[rows] += sig

    def values(self, st: _PairState) -> Tuple[Tensor, Optional[Tensor]]:
        return st.loss, None

    def _grad(self, s: Tensor, pos: Tensor, neg: Tensor, lse: Tensor, sig: Tensor, g: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        z = torch.where(pos, lse.unsqueeze(1) - s, zero)
        finite = torch.isfinite(lse).unsqueeze(1)  # an anchor without negatives: no softmax over them
        soft = torch.where(neg & finite, torch.exp(s - torch.where(finite, lse.unsqueeze(1), zero)), zero)
        return (soft * sig.unsqueeze(1) - torch.where(pos, torch.sigmoid(z), zero)) * g.unsqueeze(1)

    def grad(self, s: Tensor, tile: Tile, st: _PairState, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        pos, neg = self._masks(tile)
        rows = slice(tile.r0, tile.r1)
        return self._grad(s, pos, neg, st.lse_neg[rows], st.sig[rows], st.g_row[rows])

    def rows_fused(self, s: Tensor, tile: Tile, st: _PairState, g_row: Optional[Tensor]) -> Optional[Tensor]:
        pos, neg = self._masks(tile)
        rows = slice(tile.r0, tile.r1)
        st.lse_neg[rows] = torch.logsumexp(s.masked_fill(~neg, float("-inf")), dim=1)
        st.loss[rows], st.sig[rows], _ = self._pass1(s, pos, st.lse_neg[rows])
        if g_row is None:
            return None
        return self._grad(s, pos, neg, st.lse_neg[rows], st.sig[rows], g_row[rows])

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        pos, neg = self._masks(tile)
        lse = torch.logsumexp(s.masked_fill(~neg, float("-inf")), dim=1)
        return self._pass1(s, pos, lse)[0], None


def pair_nt_xent(
    q: Tensor,
    keys: Optional[Tensor],
    pairs: Pairs,
    *,
    temperature: Any,
    normalize: bool,
    weight: float,
    backend: str = "auto",
    block_size: Optional[int] = None,
) -> Tensor:
    """``weight * sum_a sum_{p in Pos(a)} softplus(LSE_{n: y_n != y_a} s_an - s_ap)``, ``s =
    q k^T / temperature`` (rows normalised with ``normalize``): each positive pair's
    cross-entropy against its anchor's negatives, on the engine's dense or tiled backend
    (no Triton kernel).

    Args:
        q: (M, D) anchors. keys: (N, D), or None (the anchors themselves).
        pairs: the class ids and the self pairs (:data:`Pairs`).
        temperature: a positive float or 0-dim tensor.
        normalize: L2-normalise the rows first.
        weight: the factor of the sum (PML's mean: 1 over the positive pairs).
        backend: ``"auto"`` | ``"dense"`` | ``"tiled"``. block_size: rows per block (None: picked).

    Shape:
        - q: (M, D); keys: (N, D)
        - output: scalar

    Examples::

        >>> ids = torch.tensor([0, 0, 1, 1])
        >>> loss = pair_nt_xent(torch.randn(4, 8), None, (ids, ids, True, None), temperature=0.1,
        ...                     normalize=True, weight=0.25)
    """
    dtype = compute_dtype(q.dtype)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", q.device, dtype)
    entries = q.shape[0] * (q.shape[0] if keys is None else keys.shape[0])
    name = backends.pick_name(backend, ("dense", "tiled"), entries, q, "NTXentLoss", kernel=None)
    weights = (torch.full((q.shape[0],), float(weight), dtype=dtype, device=q.device), None)
    problem = Problem(PairNTXentHead(pairs), normalize=normalize)
    return backends.run_problem(q, keys, scale, problem, name, weights, block_size)[0]
