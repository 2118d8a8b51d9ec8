"""Multi-Similarity loss (Wang et al., CVPR 2019) with its miner, exact at any batch:
:func:`multi_similarity_loss` and :class:`MultiSimilarityLoss`, a head on the engine's
tiles (:class:`MultiSimilarityHead`), with the per-anchor oracle beside it.

For cosine scores ``s`` of L2-normalised rows and labels, each anchor's positives ``P_i``
(same label, itself left out) and negatives ``N_i`` (another label), mined as
pytorch-metric-learning's ``MultiSimilarityMiner`` mines them (a positive kept when
``s_ij < max_{N_i} s + epsilon``, a negative when ``s_ij > min_{P_i} s - epsilon``)::

    L_i = 1/alpha log(1 + sum_{P_i} exp(-alpha (s_ij - base)))
        + 1/beta  log(1 + sum_{N_i} exp( beta (s_ij - base)))

The mining needs each row's hardest positive and hardest negative before its sums: a
first pass over the row's tiles, then the sums; a block of complete rows does both on
the scores it holds (three matrix products in all, as the softmax losses).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_labels, example_rows
from ..compiled import compiles
from ..core import Tile, compute_dtype
from ..engine.engine import Problem, autocast_off
from ..engine.heads import ReportingHead, softplus
from ..reference.families import multi_similarity_rows as _reference_rows

__all__ = [
    "multi_similarity_loss",
    "MultiSimilarityLoss",
    "MultiSimilarityHead",
    "Pairs",
    "split_pairs_",
    "row_counts",
]

_INF = float("inf")


class _State:
    """Per row: the hardest positive's and negative's scores (the first pass), the sums of
    the mined pairs' exponentials shifted by them and the mined sets' sizes (the second);
    the gradient's per-row factors once the upstream gradient is known."""

    def __init__(self, m: int, like: Tensor) -> None:
        self.hard_pos = like.new_full((m,), _INF)
        self.hard_neg = like.new_full((m,), -_INF)
        self.top_neg = like.new_full((m,), -_INF)  # the largest negative that is a number: the sums' shift
        self.sum_pos, self.sum_neg = like.new_zeros(m), like.new_zeros(m)
        self.n_pos, self.n_neg = like.new_zeros(m), like.new_zeros(m)
        self.factors: Optional[Tuple[Tensor, Tensor]] = None
        self.rows = slice(None)  # the head's rows this state holds (a block's sub-state: its slice)


class Pairs:
    """A tile's positive pairs as positions (``ri``, ``ci``: few, labels) with their scores
    ``sp`` (:func:`split_pairs_`)."""

    __slots__ = ("ri", "ci", "sp")

    def __init__(self, ri: Tensor, ci: Tensor, sp: Tensor) -> None:
        self.ri, self.ci, self.sp = ri, ci, sp


def split_pairs_(s: Tensor, tile: Tile, row_ids: Tensor, col_ids: Tensor, own: bool) -> Pairs:
    """A tile of scores split by labels: its positives (same id, the self pair left out
    when ``own``) as positions and scores; ``s`` left holding the negatives' scores, -inf
    at the positives and the self pair."""
    pos = row_ids[tile.r0 : tile.r1].unsqueeze(1) == col_ids[tile.c0 : tile.c1].unsqueeze(0)
    if own:
        tile.self_diagonal(pos).fill_(False)
        tile.self_diagonal(s).fill_(-_INF)
    ri, ci = pos.nonzero(as_tuple=True)
    pairs = Pairs(ri, ci, s[ri, ci])
    s.index_put_((ri, ci), s.new_tensor(-_INF))
    return pairs


def row_counts(mask: Tensor, chunk: int = 4096) -> Tensor:
    """Each row's number of True entries, a chunk of columns at a time (a bool tile's sum
    casts it whole to an integer tile first: eight times its memory)."""
    out = torch.zeros(mask.shape[0], dtype=torch.int32, device=mask.device)
    for c0 in range(0, mask.shape[1], chunk):
        out += mask[:, c0 : c0 + chunk].sum(1, dtype=torch.int32)
    return out


class MultiSimilarityHead(ReportingHead):
    """The Multi-Similarity loss as an engine head (see the module docstring).

    Each row's sums are shifted by its hardest pairs (the largest exponents of its mined
    sets: ``-alpha (s - base)`` is largest at the hardest positive, ``beta (s - base)`` at
    the hardest negative), known after the first pass: the second pass is plain sums, and
    a negative's gradient is its exponential times one factor per row. The positives
    (labels: few) are kept as positions; the negatives are the tile with the positives
    and the self pair set to -inf. Written out: autograd through :meth:`dense_reported`
    on each block of complete rows took 2.0-2.5x as long (B = 8,192, D = 256, 2-core CPU;
    ``scripts/written_out.py``).

    Args:
        row_ids, col_ids: the rows' and the columns' class ids (int64, global columns).
        own: self-contrast: the pair ``(i, i + offset)`` is the anchor itself.
        offset: the column of anchor 0.
        alpha, beta, base: the exponents' scales and the positives' shift.
        epsilon: the miner's margin, or None (every pair).
        neg_base: the negatives' shift (default: ``base``).
        weights: the factors of each row's two terms, ``L_i = w_p softplus(LSE_P) + w_n
            softplus(LSE_N)``: numbers, or (M,) tensors of this call's rows (default:
            ``1 / alpha``, ``1 / beta``).
    """

    fuses_rows = True
    passes = 2  # each row's hardest pairs, then its sums

    def __init__(
        self,
        row_ids: Tensor,
        col_ids: Tensor,
        own: bool,
        offset: int,
        alpha: float,
        beta: float,
        base: float,
        epsilon: Optional[float],
        neg_base: Optional[float] = None,
        weights: Optional[Tuple[Any, Any]] = None,
    ) -> None:
        self.row_ids, self.col_ids, self.own, self.offset = row_ids, col_ids, own, offset
        self.alpha, self.beta, self.base, self.epsilon = alpha, beta, base, epsilon
        self.neg_base = base if neg_base is None else neg_base
        #: each row's factors of its two terms (numbers or (M,) tensors): 1 / alpha, 1 / beta by default
        self.weights = (1.0 / alpha, 1.0 / beta) if weights is None else weights

    # ------------------------------------------------------------------ a tile's pairs
    def _hardest(self, pairs: Pairs, neg: Tensor, rows: slice, st: _State) -> None:
        # as the miner's sorts: a NaN positive is never the hardest, a NaN negative is (then no positive is kept)
        st.hard_pos[rows].scatter_reduce_(0, pairs.ri, pairs.sp.nan_to_num(nan=_INF, posinf=_INF), "amin")
        if neg.shape[1]:
            top = neg.amax(1)
            torch.maximum(st.hard_neg[rows], top, out=st.hard_neg[rows])
            bad = torch.isnan(top)
            if bool(bad.any()):
                top[bad] = neg[bad].nan_to_num(nan=-_INF, neginf=-_INF).amax(1)
            torch.maximum(st.top_neg[rows], top, out=st.top_neg[rows])

    def _mined_positives(self, pairs: Pairs, rows: slice, st: _State) -> Tuple[Tensor, Tensor, Tensor]:
        """The kept positives' rows, columns and ``exp(-alpha (s - hardest positive))``."""
        ri, ci, sp = pairs.ri, pairs.ci, pairs.sp
        if self.epsilon is not None:
            keep = sp < st.hard_neg[rows][ri] + self.epsilon
            ri, ci, sp = ri[keep], ci[keep], sp[keep]
        return ri, ci, (sp - st.hard_pos[rows][ri]).mul_(-self.alpha).exp_()

    def _mined_negatives_(self, neg: Tensor, rows: slice, st: _State) -> Tensor:
        """In place: the negatives' tile into ``exp(beta (s - largest negative))`` where mined,
        0 elsewhere; returns each row's number of mined negatives."""
        kept = neg > (-_INF if self.epsilon is None else (st.hard_pos[rows] - self.epsilon).unsqueeze(1))
        count = row_counts(kept)
        if self.epsilon is not None:
            neg.masked_fill_(kept.logical_not_(), -_INF)
        top = st.top_neg[rows]
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).mul_(-self.beta).unsqueeze(1)
        torch.addcmul(shift, neg, neg.new_ones(()), value=self.beta, out=neg)  # beta (s - top), one pass
        neg.exp_()
        return count

    def _sums(self, pairs: Pairs, neg: Tensor, rows: slice, st: _State) -> Tuple[Tensor, Tensor, Tensor]:
        ri, ci, ep = self._mined_positives(pairs, rows, st)
        st.sum_pos[rows].index_add_(0, ri, ep)
        st.n_pos[rows] += torch.bincount(ri, minlength=neg.shape[0]).to(neg.dtype)
        st.n_neg[rows] += self._mined_negatives_(neg, rows, st)
        st.sum_neg[rows] += neg.sum(1)
        return ri, ci, ep

    def _grad_(self, neg: Tensor, mined: Tuple[Tensor, Tensor, Tensor], rows: slice, st: _State) -> Tensor:
        """``neg`` (the mined negatives' exponentials) into the tile's gradient."""
        assert st.factors is not None
        fp, fn = st.factors
        ri, ci, ep = mined
        neg.mul_(fn[rows].unsqueeze(1))
        neg.index_put_((ri, ci), ep.mul_(fp[rows][ri]))
        return neg

    # ------------------------------------------------------------------ the protocol
    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _State:
        return _State(m, like)

    def reduce(self, s: Tensor, tile: Tile, st: _State, p: int = 0) -> None:
        rows = slice(tile.r0, tile.r1)
        pairs = split_pairs_(s, tile, self.row_ids, self.col_ids, self.own)
        if p == 0:
            self._hardest(pairs, s, rows, st)
        else:
            self._sums(pairs, s, rows, st)

    def _logsums(self, st: _State) -> Tuple[Tensor, Tensor]:
        """``log(sum_P exp(-alpha (s - base)))`` and ``log(sum_N exp(beta (s - base)))`` per row
        (-inf for an empty set)."""
        lp = torch.log(st.sum_pos).add_(torch.where(st.sum_pos > 0, -self.alpha * (st.hard_pos - self.base), 0.0))
        ln = torch.log(st.sum_neg).add_(torch.where(st.sum_neg > 0, self.beta * (st.top_neg - self.neg_base), 0.0))
        return lp, ln

    def values(self, st: _State) -> Tuple[Tensor, Optional[Tensor]]:
        lp, ln = self._logsums(st)
        wp, wn = self.weights
        return wp * softplus(lp) + wn * softplus(ln), None

    def begin_grad(self, st: _State, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        # dL_i/ds_ij: -sigmoid(lp_i) exp(-alpha (s_ij - hp_i)) / sum_pos_i on a mined positive,
        # sigmoid(ln_i) exp(beta (s_ij - hn_i)) / sum_neg_i on a mined negative
        lp, ln = self._logsums(st)
        wp, wn = self._row_weights(st)
        fp = torch.where(st.sum_pos > 0, -g_row * wp * self.alpha * torch.sigmoid(lp) / st.sum_pos, 0.0)
        fn = torch.where(st.sum_neg > 0, g_row * wn * self.beta * torch.sigmoid(ln) / st.sum_neg, 0.0)
        st.factors = (fp, fn)

    def _row_weights(self, st: _State) -> Tuple[Any, Any]:
        """The term factors of the rows ``st`` holds (a sub-state's rows: :attr:`rows`)."""
        rows = st.rows
        return tuple(w[rows] if isinstance(w, Tensor) else w for w in self.weights)  # type: ignore[return-value]

    def grad(self, s: Tensor, tile: Tile, st: _State, buf: Optional[Tensor] = None) -> Tensor:
        rows = slice(tile.r0, tile.r1)
        pairs = split_pairs_(s, tile, self.row_ids, self.col_ids, self.own)
        ri, ci, ep = self._mined_positives(pairs, rows, st)
        self._mined_negatives_(s, rows, st)
        return self._grad_(s, (ri, ci, ep), rows, st)

    def rows_fused(self, s: Tensor, tile: Tile, st: _State, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        pairs = split_pairs_(s, tile, self.row_ids, self.col_ids, self.own)
        self._hardest(pairs, s, rows, st)  # complete rows: final here
        mined = self._sums(pairs, s, rows, st)  # s: the mined negatives' exponentials
        if g_row is None:
            return None
        sub = _State(0, s)
        sub.rows = rows
        sub.hard_pos, sub.top_neg, sub.sum_pos, sub.sum_neg = (
            st.hard_pos[rows],
            st.top_neg[rows],
            st.sum_pos[rows],
            st.sum_neg[rows],
        )
        self.begin_grad(sub, g_row[rows], None)
        assert sub.factors is not None
        if st.factors is None:
            st.factors = (torch.zeros_like(st.sum_pos), torch.zeros_like(st.sum_neg))
        st.factors[0][rows], st.factors[1][rows] = sub.factors
        return self._grad_(s, mined, rows, st)

    def report(self, st: _State) -> Tuple[Tensor, ...]:
        """The mined pairs' numbers (positive, negative) over this call's rows."""
        return st.n_pos.sum(), st.n_neg.sum()

    def dense_reported(
        self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()
    ) -> Tuple[Tuple[Tensor, Optional[Tensor]], Tuple[Tensor, ...]]:
        """The rows by differentiable torch ops on the whole matrix (the dense backend and
        second derivatives), the sets mined without gradient; the mined pairs' numbers
        (:meth:`report`)."""
        with torch.no_grad():
            pos = self.row_ids[tile.r0 : tile.r1].unsqueeze(1) == self.col_ids[tile.c0 : tile.c1].unsqueeze(0)
            others = torch.ones_like(pos)
            if self.own:
                tile.self_diagonal(pos).fill_(False)
                tile.self_diagonal(others).fill_(False)
            neg = others & ~pos
            if self.epsilon is not None:
                d = s.detach()
                # as the miner's sorts: a NaN positive is never the hardest, a NaN negative is
                hard_pos = (
                    d.masked_fill(~pos, _INF).nan_to_num(nan=_INF, posinf=_INF).amin(1, keepdim=True)
                    if d.shape[1]
                    else d[:, :0]
                )
                hard_neg = d.masked_fill(~neg, -_INF).amax(1, keepdim=True) if d.shape[1] else d[:, :0]
                pos &= d < hard_neg + self.epsilon
                neg &= d > hard_pos - self.epsilon
        counts = (pos.sum().to(s.dtype), neg.sum().to(s.dtype))
        xp = ((s - self.base) * -self.alpha).masked_fill(~pos, -_INF)
        xn = ((s - self.neg_base) * self.beta).masked_fill(~neg, -_INF)
        zero = s.new_zeros(s.shape[0], 1)  # log(1 + sum): a row without the set gives 0 (and no NaN gradient)
        wp, wn = self.weights
        rows = wp * torch.logsumexp(torch.cat([xp, zero], 1), 1)
        return (rows + wn * torch.logsumexp(torch.cat([xn, zero], 1), 1), None), counts


@shared_docs
@compiles()
def multi_similarity_loss(
    embeddings: Tensor,
    labels: Tensor,
    *,
    alpha: float = 2.0,
    beta: float = 50.0,
    base: float = 0.5,
    epsilon: Optional[float] = 0.1,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Multi-Similarity loss (Wang et al. 2019) with its miner built in, exact over the
    whole batch without the B x B matrix: pytorch-metric-learning's
    ``MultiSimilarityLoss(alpha, beta, base)`` called with the indices of
    ``MultiSimilarityMiner(epsilon)``, on cosine scores of L2-normalised rows,

    $$
    L_i = \frac{1}{\alpha} \log\Big(1 + \sum_{j \in P_i} e^{-\alpha (s_{ij} - \lambda)}\Big)
        + \frac{1}{\beta} \log\Big(1 + \sum_{j \in N_i} e^{\beta (s_{ij} - \lambda)}\Big)
    $$

    with ``P_i`` the anchor's positives (same label, itself left out) and ``N_i`` its
    negatives, each mined as the miner mines them: a positive kept when
    ``s_ij < max_{N_i} s + epsilon``, a negative when ``s_ij > min_{P_i} s - epsilon``
    (strict); ``epsilon=None`` keeps every pair (the loss without a miner). As
    pytorch-metric-learning, a batch where at most one positive and at most one negative
    pair remain gives 0, and ``"mean"`` is over every anchor.

    Args:
        embeddings: (B, D) rows (L2-normalised here).
        labels: (B,) integer class labels.
        alpha: the positives' weight (> 0). Default: 2.
        beta: the negatives' weight (> 0). Default: 50.
        base: the shift ``lambda`` of the scores. Default: 0.5.
        epsilon: the miner's margin, or None for no mining. Default: 0.1.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        @backend@
        @process_group@

    Shape:
        - embeddings: (B, D); labels: (B,); output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        >>> loss = flashcl.multi_similarity_loss(x, y)
    """
    embeddings, labels = checks.validate_labelled(embeddings, labels, empty=process_group is not None)
    a = checks.number(alpha, "alpha", positive=True)
    b = checks.number(beta, "beta", positive=True)
    c = checks.number(base, "base")
    eps = checks.optional_number(epsilon, "epsilon")
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    with autocast_off(embeddings.device.type):
        return _multi_similarity(embeddings, labels.long(), (a, b, c, eps), opts)


def _multi_similarity(
    embeddings: Tensor, labels: Tensor, hyper: Tuple[float, float, float, Optional[float]], opts: checks.Options
) -> Tensor:
    """The one body: this rank's rows against every rank's (one process: its own)."""
    alpha, beta, base, eps = hyper
    cols = parallel.columns(embeddings, opts.strategy, opts.process_group, own=True)
    ids, _ = cols.class_ids(labels)
    m = embeddings.shape[0]
    row_ids = ids[cols.offset : cols.offset + m]
    dtype = compute_dtype(embeddings.dtype)
    valid = torch.ones(m, dtype=dtype, device=embeddings.device)
    weights = runner.share(opts.reduction, opts.grad_scale, cols, valid)
    head = MultiSimilarityHead(row_ids, ids, True, cols.offset, alpha, beta, base, eps)
    scale = torch.ones((), dtype=dtype, device=embeddings.device)

    def oracle() -> Tuple[Tensor, Tuple[Tensor, ...]]:
        hyper_ = (alpha, beta, base, math.nan if eps is None else eps)
        rows, n_pos, n_neg = _reference_rows(
            embeddings.to(dtype), cols.keys.to(dtype), row_ids, ids, cols.offset, True, hyper_
        )
        return rows, (n_pos, n_neg)

    pair = None if weights is None else (weights, None)
    problem = Problem(head, (), True, cols.offset)
    out, (n_pos, n_neg) = backends.solve(embeddings, cols, scale, problem, pair, opts, "multi_similarity_loss", oracle)
    # as pytorch-metric-learning: at most one mined pair of each kind in the global batch gives 0
    counts = torch.stack([n_pos, n_neg]).to(dtype)
    if cols.group is not None:
        counts = parallel.sum_across(counts, cols.group)
    return out * ((counts[0] > 1) | (counts[1] > 1)).to(out.dtype)


class MultiSimilarityLoss(LossModule):
    """Module form of :func:`multi_similarity_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.MultiSimilarityLoss(epsilon=0.1)
        >>> loss = loss_fn(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    """

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        base: float = 0.5,
        epsilon: Optional[float] = 0.1,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        return multi_similarity_loss(embeddings, labels, **self.loss_options())


def _example_multi_similarity(g: torch.Generator) -> Example:
    return Example((example_rows(g, 37, 24), example_labels(g, 37, 5)), {"base": 0.1})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {"multi_similarity_loss": _example_multi_similarity}
