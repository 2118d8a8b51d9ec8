"""The flex losses' oracle: each anchor's loss one anchor at a time, from the formulas,
its row of scores against every key and the user's functions called on that row.

It reads a call as :class:`FlexSpec` (the loss's options: the functions, the kind, the
data, the self pair's place), never a head, and decides itself which rows a "mean"
counts; it shares with the engine only the functions' calling convention
(:class:`flashcl.core.View`, :func:`flashcl.core.tile_result`) and imports nothing of the
engine, the runner or the loss modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..core import STATISTICS, View, compute_dtype, tile_result

__all__ = ["FlexSpec", "flex_rows", "flex_statistics"]


@dataclass
class FlexSpec:
    """What the oracle reads of a flex call.

    Attributes:
        fns: the user's functions (``positive``, ``exclude`` and ``exclude_scores``,
            ``score_mod``, ``weight``, ``pos_mod``, ``neg_mod``), as attributes.
        kind: ``"softmax"``, ``"sigmoid"``, ``"pair_sum"`` or ``"sets"``.
        sets: a two-set kind's formula object (``loss(p, n)``, ``counted(p, n)``), or None.
        positives: the softmax kind's positives mode.
        set_means: the pair sum's reduction of each set (None, ``"mean"``, ``"mean_nonzero"``).
        rows, cols: the anchors' and the keys' per-sample data.
        row_base: the anchors' first global position.
        own: self-contrast (anchor ``i``'s self pair is key ``i + offset``).
        exclude_self: that pair out of every set.
        offset: the anchors' position among the keys.
        swapped: the rows are keys (a column direction): each pair seen as (anchor, key).
        join: a sum over every rank (the pair sum's counts); identity on one process.
    """

    fns: Any
    kind: str
    sets: Any
    positives: str
    set_means: Optional[str]
    rows: Dict[str, Tensor]
    cols: Dict[str, Tensor]
    row_base: int
    own: bool
    exclude_self: bool
    offset: int
    swapped: bool
    join: Callable[[Tensor], Tensor]


def _softplus(t: Tensor) -> Tensor:
    return t.clamp_min(0) + torch.log1p(torch.exp(-t.abs()))


def _views(spec: FlexSpec, i: int, n: int) -> Tuple[View, View]:
    """The views of anchor ``i``'s row against the ``n`` keys."""
    if spec.swapped:  # the rows are keys: each pair seen as (anchor, key)
        a = View(spec.cols, 0, n, 0, "b", "the anchors' data (rows=)", "a")
        b = View(spec.rows, i, i + 1, spec.row_base, "a", "the keys' data (cols=)", "b")
    else:
        a = View(spec.rows, i, i + 1, spec.row_base, "a", "the anchors' data (rows=)", "a")
        b = View(spec.cols, 0, n, 0, "b", "the keys' data (cols=)", "b")
    return a, b


def _own_pair(spec: FlexSpec, i: int, n: int, device: torch.device) -> Tensor:
    """(1, n) bool: anchor ``i``'s self pair (self-contrast), False elsewhere."""
    own = torch.zeros(1, n, dtype=torch.bool, device=device)
    if spec.own and 0 <= i + spec.offset < n:
        own[0, i + spec.offset] = True
    return own


def _guarded(fn: Callable[..., Any], name: str, s: Tensor, left: Tensor, a: View, b: View) -> Tensor:
    """``fn(s, a, b)`` on a row, checked, with the pairs out of every set (``left``) entering
    as constants and leaving as 0: nothing of theirs (a NaN, an infinite slope) reaches the
    scores' gradient."""
    out = tile_result(fn(torch.where(left, s.detach(), s), a, b), name, 1, s.shape[1], s, "float")
    return torch.where(left, 0.0, out)


def _pair_scales(spec: FlexSpec, pos_cnt: Tensor, neg_cnt: Tensor) -> Tuple[Any, Any]:
    """Each set's factor: 1 (the terms summed), or 1 / its count over every rank (0 when empty)."""
    if spec.set_means is None:
        return 1.0, 1.0
    counts = spec.join(torch.stack([pos_cnt.sum(), neg_cnt.sum()]))
    scales = torch.where(counts > 0, 1.0 / counts.clamp_min(1.0), torch.zeros_like(counts))
    return scales[0], scales[1]


def flex_rows(
    score_row: Callable[[int], Tensor], anchors: int, n: int, spec: FlexSpec, bias: Optional[Tensor], like: Tensor
) -> Tuple[Tensor, Tensor]:
    """Each anchor's loss and whether a "mean" counts it, ``score_row(i)`` giving anchor
    ``i``'s scaled scores (1, N)."""
    fns = spec.fns
    out_rows: List[Tensor] = []
    valid: List[bool] = []
    pair_sums: List[Tuple[Tensor, ...]] = []  # the pair sum's (positives' sum, negatives', their counts)
    if anchors == 0 and spec.kind == "pair_sum":  # the sets' counts are joined over the ranks: take part
        _pair_scales(spec, like.new_zeros(0), like.new_zeros(0))
    for i in range(anchors):
        a, b = _views(spec, i, n)
        s = score_row(i)  # (1, N)
        own = _own_pair(spec, i, n, like.device)
        left = own if spec.exclude_self else torch.zeros_like(own)
        if fns.exclude is not None:
            excluded = fns.exclude(a, b, s.detach()) if fns.exclude_scores else fns.exclude(a, b)
            left = left | tile_result(excluded, "exclude", 1, n, s, "bool")
        m = tile_result(fns.positive(a, b), "positive", 1, n, s, "weight") if fns.positive is not None else None
        m = (a.index == b.index).expand(1, n) if m is None else m
        m = torch.where(left | own, 0.0, m.to(s.dtype))
        if fns.weight is None:
            w = torch.ones_like(s)
        else:  # a pair out of every set takes no part, whatever its weight (NaN included)
            w = torch.where(left, 1.0, tile_result(fns.weight(a, b), "weight", 1, n, s, "weight").to(s.dtype))
        keep = (~left)[0]
        if spec.kind == "pair_sum":  # each pair's own term, summed per set
            pos, neg = keep & (m[0] != 0), keep & (m[0] == 0)
            tp = w[0] * _guarded(fns.pos_mod, "pos_mod", s, left, a, b)[0]
            tn = w[0] * _guarded(fns.neg_mod, "neg_mod", s, left, a, b)[0]
            if spec.set_means == "mean_nonzero":  # the terms above 0 alone, and NaN ones (NaN propagates)
                pos = pos & ((tp.detach() > 0) | tp.detach().isnan())
                neg = neg & ((tn.detach() > 0) | tn.detach().isnan())
            pair_sums.append((tp[pos].sum(), tn[neg].sum(), w[0][pos].sum(), w[0][neg].sum()))
            continue
        if spec.kind == "sets":  # the two sets' log-sum-exps, each set's modified scores
            pos, neg = keep & (m[0] != 0), keep & (m[0] == 0)
            lw = torch.log(w[0]) + 0.0 * m[0]  # a NaN membership weight makes its set NaN
            p = torch.logsumexp((_guarded(fns.pos_mod, "pos_mod", s, left, a, b)[0] + lw)[pos], 0)
            q_ = torch.logsumexp((_guarded(fns.neg_mod, "neg_mod", s, left, a, b)[0] + lw)[neg], 0)
            counted = bool(spec.sets.counted(p.detach().view(1), q_.detach().view(1)))
            out_rows.append(spec.sets.loss(p, q_) if counted else s.sum() * 0)
            valid.append(counted)
            continue
        sp = s if fns.score_mod is None else _guarded(fns.score_mod, "score_mod", s, left, a, b)
        if spec.kind == "sigmoid":
            t = sp[0] + (bias if bias is not None else 0.0)
            terms = w[0] * (m[0] * _softplus(-t) + (1 - m[0]) * _softplus(t))
            out_rows.append(terms[keep].sum())
            valid.append(True)
            continue
        den = keep & (w[0] != 0) & ~torch.isneginf(sp[0])  # a NaN weight is in it (and the row NaN)
        if not bool(den.any()):
            out_rows.append(s.sum() * 0)
            valid.append(False)
            continue
        lse = torch.logsumexp(sp[0][den] + torch.log(w[0][den]), 0)
        pos = m[0] != 0
        npos, msum = int(pos.sum()), m[0].sum()
        terms = m[0][pos] * (lse - sp[0][pos])  # each positive's cross-entropy, weighted
        if spec.positives == "sum":
            out_rows.append(lse - (m[0][pos] * sp[0][pos]).sum())
            valid.append(True)
        elif npos == 0 or (spec.positives == "weighted_mean" and bool(msum == 0)):
            out_rows.append(s.sum() * 0)
            valid.append(False)
        elif spec.positives == "mean":
            out_rows.append(terms.sum() / npos)
            valid.append(True)
        elif spec.positives == "weighted_mean":
            out_rows.append(terms.sum() / msum)
            valid.append(True)
        else:  # "pairs"
            out_rows.append(terms.sum())
            valid.append(True)
    if spec.kind == "pair_sum":
        counted_rows = torch.ones(anchors, dtype=torch.bool, device=like.device)
        if not pair_sums:
            return like.sum(-1)[:0], counted_rows
        sp_, sn, cp, cn = (torch.stack(x) for x in zip(*pair_sums))
        a_, b_ = _pair_scales(spec, cp, cn)
        return a_ * sp_ + b_ * sn, counted_rows
    rows = torch.stack(out_rows) if out_rows else like.sum(-1)[:0]
    return rows, torch.tensor(valid, dtype=torch.bool, device=like.device)


@torch.no_grad()
def flex_statistics(
    score_row: Callable[[int], Tensor], anchors: int, n: int, spec: FlexSpec, like: Tensor
) -> Dict[str, Tensor]:
    """The row statistics one anchor at a time, from their definitions: the hardest
    positive (lowest score), the hardest negative (highest) and the positives' weighted
    mean score, the self pair in neither set."""
    inf = float("inf")
    out: Dict[str, list] = {name: [] for name in STATISTICS}
    for i in range(anchors):
        a, b = _views(spec, i, n)
        s = score_row(i)[0]
        fn = spec.fns.positive
        m = (fn(a, b) if fn is not None else a.index == b.index).expand(1, n)[0].to(s.dtype)
        own = _own_pair(spec, i, n, like.device)[0]
        pos = (m > 0) & ~own
        neg = ~pos & ~own
        out["hardest_positive"].append(s[pos].min() if bool(pos.any()) else s.new_tensor(inf))
        out["hardest_negative"].append(s[neg].max() if bool(neg.any()) else s.new_tensor(-inf))
        mean = (m[pos] * s[pos]).sum() / m[pos].sum() if bool(pos.any()) else s.new_tensor(inf)
        out["positive_score"].append(mean)
    empty = like.new_zeros(0, dtype=compute_dtype(like.dtype))
    return {k: torch.stack(v) if v else empty for k, v in out.items()}
