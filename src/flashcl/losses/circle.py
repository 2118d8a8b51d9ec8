"""Circle loss (Sun et al., CVPR 2020) over labels, exact at any batch: :func:`circle_loss`
and :class:`CircleLoss`, a head on the engine's tiles (:class:`CircleHead`), with the
per-anchor oracle beside it.

For cosine scores ``s`` of L2-normalised rows and labels, each anchor's positives ``P_i``
(same label, itself left out) and negatives ``N_i`` (another label)::

    L_i = softplus( LSE_{P_i} -gamma a_p (s - (1 - m))  +  LSE_{N_i} gamma a_n (s - m) )

with the weights ``a_p = relu(1 + m - s)`` and ``a_n = relu(s + m)`` taken as constants
(detached), as the paper and pytorch-metric-learning. A row's two log-sums complete in one
visit of its tiles (online log-sum-exps); a block of complete rows forms its gradient on
the scores it holds.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_labels, example_rows
from ..compiled import compiles
from ..core import Tile, compute_dtype
from ..engine.engine import Problem, autocast_off
from ..engine.heads import Head, scattered_lse, softplus
from ..reference.families import circle_rows as _reference_rows
from .multi_similarity import Pairs, split_pairs_

__all__ = ["circle_loss", "CircleLoss", "CircleHead"]

_INF = float("inf")


class _State:
    def __init__(self, m: int, like: Tensor) -> None:
        self.lse_pos = like.new_full((m,), -_INF)
        self.lse_neg = like.new_full((m,), -_INF)
        self.coef: Optional[Tensor] = None


class CircleHead(Head):
    """The Circle loss as an engine head (see the module docstring). Its gradient is
    written out: autograd through :meth:`dense` on each block of complete rows took
    1.8-2.1x as long (B = 8,192, D = 256, 2-core CPU; ``scripts/written_out.py``).

    Args:
        row_ids, col_ids: the rows' and the columns' class ids (int64, global columns).
        own: self-contrast: the pair ``(i, i + offset)`` is the anchor itself.
        offset: the column of anchor 0.
        m, gamma: the relaxation and the scale.
    """

    fuses_rows = True

    def __init__(self, row_ids: Tensor, col_ids: Tensor, own: bool, offset: int, m: float, gamma: float) -> None:
        self.row_ids, self.col_ids, self.own, self.offset = row_ids, col_ids, own, offset
        self.m, self.gamma = m, gamma

    def _positives(self, pairs: Pairs) -> Tuple[Tensor, Tensor]:
        """The positives' exponents ``-gamma a_p (s - (1 - m))`` and their slopes ``-gamma a_p``."""
        slope = (1.0 + self.m - pairs.sp).clamp_min_(0.0).mul_(-self.gamma)
        return slope * (pairs.sp - (1.0 - self.m)), slope

    def _negatives_(self, s: Tensor, pairs: Pairs, tile: Tile) -> Tensor:
        """In place: the negatives' tile (:func:`split_pairs_`) into their exponents
        ``gamma a_n (s - m)``, -inf at the positives and the self pair; returns the slopes
        ``gamma a_n`` (a tile)."""
        slope = torch.add(s, self.m).clamp_min_(0.0).mul_(self.gamma)
        s.sub_(self.m).mul_(slope)  # -inf x 0 at the positives and the self pair: NaN, set back below
        s.index_put_((pairs.ri, pairs.ci), s.new_tensor(-_INF))
        if self.own:
            tile.self_diagonal(s).fill_(-_INF)
        return slope

    def _reduce(self, s: Tensor, tile: Tile, st: _State) -> Tuple[Pairs, Tensor]:
        rows = slice(tile.r0, tile.r1)
        pairs = split_pairs_(s, tile, self.row_ids, self.col_ids, self.own)
        xp, _ = self._positives(pairs)
        torch.logaddexp(st.lse_pos[rows], scattered_lse(xp, pairs.ri, s.shape[0]), out=st.lse_pos[rows])
        slope = self._negatives_(s, pairs, tile)
        if s.shape[1]:
            torch.logaddexp(st.lse_neg[rows], torch.logsumexp(s, 1), out=st.lse_neg[rows])
        return pairs, slope

    def _grad_(self, s: Tensor, pairs: Pairs, slope: Tensor, rows: slice, st: _State) -> Tensor:
        """``s`` (the negatives' exponents) into the tile's gradient."""
        assert st.coef is not None
        c = st.coef[rows]
        lp, ln = st.lse_pos[rows], st.lse_neg[rows]
        # a row without one of its sets has c = 0; its other set's exponents are taken from 0, not -inf
        ln = torch.where(torch.isfinite(ln), ln, torch.zeros_like(ln))
        lp = torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))
        g = s.sub_(ln.unsqueeze(1)).exp_().mul_(slope).mul_(c.unsqueeze(1))
        xp, sp_slope = self._positives(pairs)
        g.index_put_((pairs.ri, pairs.ci), (xp - lp[pairs.ri]).exp_().mul_(sp_slope).mul_(c[pairs.ri]))
        return g

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _State:
        return _State(m, like)

    def reduce(self, s: Tensor, tile: Tile, st: _State, p: int = 0) -> None:
        self._reduce(s, tile, st)

    def values(self, st: _State) -> Tuple[Tensor, Optional[Tensor]]:
        return softplus(st.lse_pos + st.lse_neg), None  # a row without one of its sets: softplus(-inf) = 0

    def begin_grad(self, st: _State, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.coef = g_row * torch.sigmoid(st.lse_pos + st.lse_neg)

    def grad(self, s: Tensor, tile: Tile, st: _State, buf: Optional[Tensor] = None) -> Tensor:
        pairs = split_pairs_(s, tile, self.row_ids, self.col_ids, self.own)
        slope = self._negatives_(s, pairs, tile)
        return self._grad_(s, pairs, slope, slice(tile.r0, tile.r1), st)

    def rows_fused(self, s: Tensor, tile: Tile, st: _State, g_row: Optional[Tensor]) -> Optional[Tensor]:
        pairs, slope = self._reduce(s, tile, st)  # complete rows: their log-sums final here
        if g_row is None:
            return None
        rows = slice(tile.r0, tile.r1)
        if st.coef is None:
            st.coef = torch.zeros_like(st.lse_pos)
        st.coef[rows] = g_row[rows] * torch.sigmoid(st.lse_pos[rows] + st.lse_neg[rows])
        return self._grad_(s, pairs, slope, rows, st)

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        """The rows by differentiable torch ops on the whole matrix (the dense backend and
        second derivatives), the weights detached."""
        pos = self.row_ids[tile.r0 : tile.r1].unsqueeze(1) == self.col_ids[tile.c0 : tile.c1].unsqueeze(0)
        others = torch.ones_like(pos)
        if self.own:
            tile.self_diagonal(pos).fill_(False)
            tile.self_diagonal(others).fill_(False)
        neg = others & ~pos
        d = s.detach()
        xp = -self.gamma * (1.0 + self.m - d).clamp_min(0.0) * (s - (1.0 - self.m))
        xn = self.gamma * (d + self.m).clamp_min(0.0) * (s - self.m)
        lp = torch.logsumexp(xp.masked_fill(~pos, -_INF), 1)
        ln = torch.logsumexp(xn.masked_fill(~neg, -_INF), 1)
        both = pos.any(1) & neg.any(1)
        total = torch.where(both, lp + ln, torch.zeros_like(lp))  # no -inf on the graph (its gradient: NaN)
        return torch.where(both, softplus(total), torch.zeros_like(total)), None


@shared_docs
@compiles()
def circle_loss(
    embeddings: Tensor,
    labels: Tensor,
    *,
    m: float = 0.4,
    gamma: float = 80.0,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Circle loss (Sun et al. 2020) over class labels, exact over the whole batch
    without the B x B matrix: pytorch-metric-learning's ``CircleLoss(m, gamma)``, on
    cosine scores of L2-normalised rows,

    $$
    L_i = \operatorname{softplus}\Big(\log \sum_{j \in P_i} e^{-\gamma a^p_{ij} (s_{ij} - \Delta_p)}
        + \log \sum_{j \in N_i} e^{\gamma a^n_{ij} (s_{ij} - \Delta_n)}\Big)
    $$

    with ``P_i`` the anchor's positives (same label, itself left out), ``N_i`` its
    negatives, ``a^p = relu(1 + m - s)``, ``a^n = relu(s + m)`` (constants: no gradient
    through them), ``Delta_p = 1 - m``, ``Delta_n = m``. An anchor without a positive or
    a negative has no loss; ``"mean"`` is over the anchors with both (as PML's
    ``AvgNonZeroReducer``), and, as PML, a batch with at most one positive and at most
    one negative pair gives 0.

    Args:
        embeddings: (B, D) rows (L2-normalised here).
        labels: (B,) integer class labels.
        m: the relaxation (the margins and optima follow from it). Default: 0.4.
        gamma: the scale (> 0). Default: 80.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        @backend@
        @process_group@

    Shape:
        - embeddings: (B, D); labels: (B,); output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        >>> loss = flashcl.circle_loss(x, y)
    """
    embeddings, labels = checks.validate_labelled(embeddings, labels, empty=process_group is not None)
    relax = checks.number(m, "m")
    scale = checks.number(gamma, "gamma", positive=True)
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    with autocast_off(embeddings.device.type):
        return _circle(embeddings, labels.long(), relax, scale, opts)


def _circle(embeddings: Tensor, labels: Tensor, m: float, gamma: float, opts: checks.Options) -> Tensor:
    """The one body: this rank's rows against every rank's (one process: its own)."""
    cols = parallel.columns(embeddings, opts.strategy, opts.process_group, own=True)
    ids, num_classes = cols.class_ids(labels)
    rows = embeddings.shape[0]
    row_ids = ids[cols.offset : cols.offset + rows]
    dtype = compute_dtype(embeddings.dtype)
    sizes = torch.bincount(ids, minlength=num_classes).to(dtype)
    # the anchors with a positive and a negative (the mean's), and PML's rule for a batch of at most one pair
    # of each kind: their numbers follow from the labels alone
    mine = sizes[row_ids]
    valid = ((mine >= 2) & (mine < cols.total)).to(dtype)
    pos_pairs = float((sizes * (sizes - 1)).sum())
    neg_pairs = float(cols.total) ** 2 - float((sizes * sizes).sum())
    weights = runner.share(opts.reduction, opts.grad_scale, cols, valid)
    problem = Problem(CircleHead(row_ids, ids, True, cols.offset, m, gamma), (), True, cols.offset)
    one = torch.ones((), dtype=dtype, device=embeddings.device)

    def oracle() -> Tuple[Tensor, Tuple[Tensor, ...]]:
        return _reference_rows(embeddings.to(dtype), cols.keys.to(dtype), row_ids, ids, cols.offset, m, gamma), ()

    pair = None if weights is None else (weights, None)
    out, _ = backends.solve(embeddings, cols, one, problem, pair, opts, "circle_loss", oracle)
    return out * float(pos_pairs > 1 or neg_pairs > 1)


class CircleLoss(LossModule):
    """Module form of :func:`circle_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.CircleLoss(m=0.25, gamma=256.0)
        >>> loss = loss_fn(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    """

    def __init__(
        self,
        m: float = 0.4,
        gamma: float = 80.0,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        return circle_loss(embeddings, labels, **self.loss_options())


def _example_circle(g: torch.Generator) -> Example:
    return Example((example_rows(g, 37, 24), example_labels(g, 37, 5)), {"gamma": 16.0})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {"circle_loss": _example_circle}
