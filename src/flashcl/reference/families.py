"""The families' oracles: each loss one anchor (or one proxy, one pair) at a time, from the
published formula, in plain torch.

Every other backend of these losses is tested against them; like the core oracle
(:mod:`flashcl.reference`), they import nothing of the engine, the runner or the loss
modules, and write their own helpers (the Jaccard similarity, softplus, unit rows), so that a
mistake there is not made twice and agree.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype

__all__ = [
    "circle_rows",
    "cosent_sum",
    "koleo_rows",
    "margin_rows",
    "multi_similarity_rows",
    "multilabel_rows",
    "proxy_anchor_rows",
    "rank_n_contrast_rows",
    "self_distill_rows",
    "triplet_rows",
]

_INF = float("inf")


def _softplus(t: Tensor) -> Tensor:
    return t.clamp_min(0) + torch.log1p(torch.exp(-t.abs()))


def _unit(x: Tensor) -> Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)


def circle_rows(q: Tensor, keys: Tensor, yq: Tensor, yk: Tensor, offset: int, m: float, gamma: float) -> Tensor:
    """Circle loss (Sun et al. 2020), one anchor at a time as the paper writes it (the
    weights detached); the anchors are ``keys``' rows from ``offset`` (their own pair out)."""
    qn, kn = _unit(q), _unit(keys)
    out = []
    for i in range(q.shape[0]):
        s = kn @ qn[i]
        others = [j for j in range(keys.shape[0]) if j != i + offset]
        pos = [j for j in others if int(yk[j]) == int(yq[i])]
        neg = [j for j in others if int(yk[j]) != int(yq[i])]
        if not pos or not neg:
            out.append(s.sum() * 0.0)
            continue
        sp, sn = s[pos], s[neg]
        xp = -gamma * (1.0 + m - sp.detach()).clamp_min(0.0) * (sp - (1.0 - m))
        xn = gamma * (sn.detach() + m).clamp_min(0.0) * (sn - m)
        out.append(_softplus(torch.logsumexp(xp, 0) + torch.logsumexp(xn, 0)))
    return torch.stack(out) if out else (q @ keys.T).sum(1)


def cosent_sum(z: Tensor, labels: Tensor) -> Tensor:
    """CoSENT's ``log(1 + sum_{y_i < y_j} exp(z_i - z_j))``, pair by pair."""
    terms = [z[:0].sum()]  # the 1 of log(1 + ...): a zero on the graph of z
    for i in range(z.shape[0]):
        for j in range(z.shape[0]):
            if bool(labels[i] < labels[j]):
                terms.append(z[i] - z[j])
    return torch.logsumexp(torch.stack(terms), dim=0)


def koleo_rows(q: Tensor, keys: Tensor, offset: int, eps: float, self_score: float = -1.0) -> Tensor:
    """KoLeo (Sablayrolles et al. 2019, DINOv2's form) one row at a time: the nearest other
    row by the largest cosine (first on a tie; the row itself at ``self_score``),
    ``-log(|x^_i - x^_j + eps| + eps)``."""

    def unit(v: Tensor) -> Tensor:
        return v / v.norm().clamp_min(eps)

    kh = [unit(k) for k in keys]
    out = []
    for i, row in enumerate(q):
        qh = unit(row)
        best, at = -math.inf, 0
        for j, k in enumerate(kh):
            dot = self_score if j == i + offset else float((qh @ k).detach())
            if dot > best:
                best, at = dot, j
        out.append(-torch.log(torch.linalg.vector_norm(qh - kh[at] + eps) + eps))
    # no rows (a rank's empty part): (0,), on the graph of the rows and of the gathered keys
    return torch.stack(out) if out else (q @ keys.T).sum(1)


def _margin_target(kind: str, c: Tensor, sin: Tensor, margin: float, easy: bool) -> Tensor:
    """The target class's logit before the scale: CosFace (Wang et al. 2018) ``cos - m``;
    ArcFace (Deng et al. 2019, insightface's code) ``cos(theta + m)`` from the angle's
    cosine and sine, past ``theta > pi - m`` ``cos - m sin(m)``, with ``easy``: ``cos``
    itself where ``cos <= 0``."""
    if kind == "cosface":
        return c - margin
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    phi = c * cos_m - sin * sin_m
    if easy:
        return torch.where(c > 0, phi, c)
    return torch.where(c >= -cos_m, phi, c - margin * sin_m)


def margin_rows(
    e: Tensor, w: Tensor, labels: Tensor, kind: str, margin: float, scale: Tensor, easy: bool, k: int = 1
) -> Tensor:
    """The margin softmax over class proxies one row at a time:
    ``-log(exp(s f(cos_y)) / (exp(s f(cos_y)) + sum_{j != y} exp(s cos_j)))``, a class's
    cosine its closest proxy's (``k`` per class, the sub-centers). The angle's sine is the
    norm of the class direction's part orthogonal to the embedding (exact near 0 and pi,
    where ``acos`` is not); below 64 ulps, the angle's direction rounding's alone, no
    gradient flows through it (0, the subgradient at the tip of the cone)."""
    wn = _unit(w)
    out = []
    for i in range(e.shape[0]):
        eh = _unit(e[i])
        per = (wn @ eh).view(-1, k)
        y = int(labels[i])
        best = int(per[y].argmax())
        cos = torch.stack([row.max() for row in per])
        sin = torch.linalg.vector_norm(wn[y * k + best] - cos[y] * eh).reshape(1)
        sin = torch.where(sin > 64 * torch.finfo(sin.dtype).eps, sin, sin.detach())
        top = _margin_target(kind, cos[y : y + 1], sin, margin, easy)[0] * scale
        others = torch.cat([cos[:y], cos[y + 1 :]]) * scale
        out.append(torch.logsumexp(torch.cat([top.reshape(1), others]), dim=0) - top)
    return torch.stack(out)


def multi_similarity_rows(
    q: Tensor, keys: Tensor, yq: Tensor, yk: Tensor, offset: int, own: bool, opts: Tuple[float, ...]
) -> Tuple[Tensor, Tensor, Tensor]:
    """Multi-Similarity (Wang et al. 2019) one anchor at a time: the cosines of its pairs,
    its mined sets (``opts``: alpha, beta, base, epsilon or NaN for no mining) and its
    loss; (rows, mined positives, mined negatives)."""
    alpha, beta, base, epsilon = opts
    qn, kn = _unit(q), _unit(keys)
    out, n_pos, n_neg = [], 0, 0
    for i in range(q.shape[0]):
        s = kn @ qn[i]
        others = [j for j in range(keys.shape[0]) if not (own and j == i + offset)]
        pos = [j for j in others if int(yk[j]) == int(yq[i])]
        neg = [j for j in others if int(yk[j]) != int(yq[i])]
        if not math.isnan(epsilon):
            d = s.detach()
            # as the miner's sorts: a NaN positive is never the hardest, a NaN negative is
            negs = [float(d[j]) for j in neg]
            hard_neg = math.nan if any(math.isnan(v) for v in negs) else max(negs, default=-_INF)
            hard_pos = min((float(d[j]) for j in pos if not math.isnan(float(d[j]))), default=_INF)
            pos = [j for j in pos if float(d[j]) < hard_neg + epsilon]
            neg = [j for j in neg if float(d[j]) > hard_pos - epsilon]
        n_pos, n_neg = n_pos + len(pos), n_neg + len(neg)
        one = s.new_zeros(1)
        lp = torch.logsumexp(torch.cat([-alpha * (s[pos] - base), one]), 0) / alpha
        out.append(lp + torch.logsumexp(torch.cat([beta * (s[neg] - base), one]), 0) / beta)
    rows = torch.stack(out) if out else (q @ keys.T).sum(1)
    return rows, q.new_tensor(float(n_pos)), q.new_tensor(float(n_neg))


def multilabel_rows(
    q: Tensor,
    k: Tensor,
    yq: Tensor,
    yk: Tensor,
    scale: Tensor,
    threshold: float,
    positives: str,
    include_self: bool,
    normalize: bool,
    offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Multi-label SupCon's per-anchor losses on the whole matrices: each positive (its
    label sets' Jaccard similarity above ``threshold``) weighted by that similarity; the
    self column at ``i + offset``. (rows, whether each row has a positive)."""
    dtype = compute_dtype(q.dtype)
    q, k = q.to(dtype), k.to(dtype)
    if normalize:
        q, k = _unit(q), _unit(k)
    s = scale.to(dtype) * q @ k.T
    a, b = yq.to(dtype), yk.to(dtype)
    inter = torch.stack([(a[i] * b).sum(1) for i in range(a.shape[0])]) if a.shape[0] else s.new_zeros(0, b.shape[0])
    union = a.sum(1, keepdim=True) + b.sum(1).unsqueeze(0) - inter
    j = torch.where(union > 0, inter / union.clamp_min(1), torch.zeros_like(inter))
    own = torch.zeros_like(s, dtype=torch.bool)
    own[torch.arange(q.shape[0]), torch.arange(q.shape[0]) + offset] = True
    pos = (j > threshold) & ~own
    den = s.masked_fill(own, float("-inf")) if not include_self else s
    log_prob = s - torch.logsumexp(den, dim=1, keepdim=True)
    terms = torch.where(pos, j * log_prob, torch.zeros_like(s)).sum(1)
    count = pos.sum(1).to(dtype)
    rows = -terms / count.clamp_min(1) if positives == "mean" else -terms
    return torch.where(count > 0, rows, torch.zeros_like(rows)), (count > 0).to(dtype)


def proxy_anchor_rows(w: Tensor, x: Tensor, labels: Tensor, classes: Tensor, margin: float, alpha: float) -> Tensor:
    """Proxy-Anchor (Kim et al. 2020) one proxy at a time, ``w_pos log(1 + sum_pos) +
    log(1 + sum_neg)`` with ``w_pos = C / |P+|`` (the per-proxy terms whose mean over the
    C proxies is the loss)."""
    wn, xn = _unit(w), _unit(x)
    present = int(torch.unique(labels).numel())
    out = []
    for row, k in enumerate(classes.tolist()):
        s = xn @ wn[row]
        pos, neg = s[labels == k], s[labels != k]
        one = s.new_zeros(1)
        term = torch.logsumexp(torch.cat([-alpha * (pos - margin), one]), 0) * (float(w.shape[0]) / max(present, 1))
        out.append(term + torch.logsumexp(torch.cat([alpha * (neg + margin), one]), 0))
    return torch.stack(out) if out else (w @ x.T).sum(1)


def rank_n_contrast_rows(q: Tensor, k: Tensor, yq: Tensor, yk: Tensor, t: float, offset: int) -> Tensor:
    """Rank-N-Contrast's (Zha et al. 2023) ``sum_j l_ij`` of each anchor as the published
    code forms it: the scores ``-||z_i - z_j|| / t`` of direct differences, and for each
    positive in turn the mask of the denominators at least as far in label space."""
    m, n = q.shape[0], k.shape[0]
    logits = -(q[:, None, :] - k[None, :, :]).norm(2, dim=-1) / t
    diffs = (yq[:, None, :] - yk[None, :, :]).abs().sum(-1)
    out = []
    for i in range(m):
        others = [j for j in range(n) if j != i + offset]
        total = logits.new_zeros(())
        for j in others:
            den = [kk for kk in others if diffs[i, kk] >= diffs[i, j]]
            total = total + torch.logsumexp(logits[i, den], 0) - logits[i, j]
        out.append(total)
    return torch.stack(out) if out else logits.sum(1)


def self_distill_rows(
    x: Tensor, w: Tensor, inv_temp: float, targets: List[Tensor], pairs: List[List[int]], normalize: bool
) -> Tensor:
    """The prototype losses' (DINO, iBOT, SwAV) per-row cross-entropies one row at a time:
    ``sum_{t in pairs[s]} -sum_k p_t(k) log softmax_k(x^ . w^_k / tau_s)``."""

    def unit(row: Tensor) -> Tensor:
        return row / row.norm().clamp_min(1e-12) if normalize else row

    protos = torch.stack([unit(row) for row in w])
    out = []
    for s, view in enumerate(x):
        rows = []
        for b, row in enumerate(view):
            lsm = torch.log_softmax((protos @ unit(row)) * inv_temp, 0)
            terms = [-(targets[t][b] * lsm).sum() for t in pairs[s]]
            rows.append(torch.stack(terms).sum() if terms else lsm.new_zeros(()))
        # no rows (a rank's empty part): (0,), on the graph
        out.append(torch.stack(rows) if rows else (view @ protos.T).sum(-1))
    return torch.stack(out)


def triplet_rows(
    x: Tensor,
    y: Tensor,
    mining: str,
    margin: float,
    soft: bool,
    distance: str,
    k: Optional[Tensor] = None,
    yk: Optional[Tensor] = None,
    offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """The batch triplet losses' per-anchor losses and counts by loops over the anchors,
    positives and negatives, each distance formed on its own. ``k``, ``yk``: every sample
    of the batch and its label when the anchors ``x`` are its rows from ``offset``
    (default: the anchors themselves)."""
    k = x if k is None else k
    yk = y if yk is None else yk

    def value(t: Tensor) -> float:
        return float(t.detach())

    def dist(i: int, j: int) -> Tensor:
        if j == i + offset:
            return x[i, :0].sum()
        if distance == "cosine":
            return 1.0 - (x[i] * k[j]).sum()
        sq = (k[j] * k[j]).sum() - 2.0 * (x[i] * k[j]).sum() + (x[i] * x[i]).sum()
        sq = sq.clamp_min(0.0)
        return sq if distance == "squared" or bool(sq == 0) else sq.sqrt()

    def hinge(v: Tensor) -> Tensor:
        return _softplus(v) if soft else v.clamp_min(0.0)

    b, n = x.shape[0], k.shape[0]
    rows: List[Tensor] = []
    counts: List[int] = []
    for i in range(b):
        ps = [j for j in range(n) if j != i + offset and bool(yk[j] == y[i])]
        ns = [j for j in range(n) if bool(yk[j] != y[i])]
        if mining == "all":
            terms: Sequence[Tensor] = [hinge(dist(i, p) - dist(i, q) + margin) for p in ps for q in ns]
            rows.append(sum(terms, x[i, :0].sum()))
            counts.append(sum(int(value(t) > 0) for t in terms))
        elif mining == "hard":
            every = [dist(i, j) for j in range(n)]
            hp = max([every[p] for p in ps], key=value) if ps else x[i, :0].sum()
            hn = min([every[q] for q in ns], key=value) if ns else max(every, key=value) + min(every, key=value)
            rows.append(hinge(hp - hn + margin))
            counts.append(1)
        else:
            every = [dist(i, j) for j in range(n)]
            total = x[i, :0].sum()
            for p in ps:
                farther = [every[q] for q in ns if value(every[q]) > value(every[p])]
                if farther:
                    semi = min(farther, key=value)
                elif ns:
                    semi = max([every[q] for q in ns], key=value)
                else:
                    semi = min(every, key=value)
                total = total + hinge(every[p] - semi + margin)
            rows.append(total)
            counts.append(len(ps))
    return torch.stack(rows), torch.tensor(counts, device=x.device)
