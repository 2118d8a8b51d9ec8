"""The reference backend: per-anchor loops, as a loss is first written by hand.

Slow (a Python loop over anchors and over their positives) and obviously
correct: it is the oracle that every other backend is tested against, and the
"naive" line of the benchmarks. It counts each anchor's positives itself rather
than trusting :mod:`flashcl.engine.positives`'s weights, so that it checks that code too;
it imports nothing of the engine, its heads or its preparation (a mistake there
would otherwise be made twice and agree).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..core import CoreSpec, Tile, compute_dtype


def prepare(q: Tensor, k: Optional[Tensor], normalize: bool) -> Tuple[Tensor, Tensor]:
    """The oracle's own preparation: cast to the compute dtype and L2-normalise rows
    with torch's ``F.normalize`` (``k=None``: ``k = q``)."""
    dtype = compute_dtype(q.dtype)
    q = q.to(dtype)
    same = k is None
    k = q if k is None else k.to(dtype)
    if normalize:
        q = torch.nn.functional.normalize(q, dim=1)
        k = q if same else torch.nn.functional.normalize(k, dim=1)
    return q, k


def _excluded(spec: CoreSpec, i: int, n: int, device: torch.device) -> List[bool]:
    """Row ``i``'s entries that ``spec.exclude`` leaves out (all False without it)."""
    if spec.exclude is None:
        return [False] * n
    row = [False] * n
    index = spec.exclude.index
    if index is not None:  # per-row excluded columns, -1 for none
        for j in (index[i].reshape(-1) if index.dim() > 1 else index[i].reshape(1)).tolist():
            if j >= 0:
                row[j] = True
    if spec.exclude.fn is not None:  # the mask the loss computes from its data, asked for this row
        row = [a or bool(b) for a, b in zip(row, spec.exclude.fn(Tile(i, i + 1, 0, n, spec.offset))[0].tolist())]
    return row


def _row_loss(sims: Tensor, i: int, spec: CoreSpec) -> Tensor:
    """Loss of anchor ``i`` from its row of scores ``sims`` (N,)."""
    n = sims.shape[0]
    own = int(spec.self_index[i]) if spec.self_index is not None else i + spec.offset
    out = _excluded(spec, i, n, sims.device)
    den: List[int] = [j for j in range(n) if not (spec.exclude_self and j == own) and not out[j]]
    lse = torch.logsumexp(sims[den], dim=0)
    pos_sum = sims.new_zeros(())
    count = 0
    if spec.index is not None:
        for j in spec.index[i].tolist():
            pos_sum = pos_sum + sims[j]
            count += 1
    else:
        assert spec.row_labels is not None and spec.col_labels is not None
        yi = int(spec.row_labels[i])
        for j in range(n):
            if int(spec.col_labels[j]) == yi and not (spec.self_pairs and j == own):
                pos_sum = pos_sum + sims[j]
                count += 1
    if spec.positive_weight is not None:
        pos_sum = pos_sum * spec.positive_weight[i]
    if spec.pos_mode == "mean":
        if count == 0:
            return 0.0 * lse  # undefined term: 0, but still part of the graph
        return lse - pos_sum / count
    if spec.pos_mode == "pairs":
        return count * lse - pos_sum
    return lse - pos_sum


def _column_loss(sims: Tensor, j: int, spec: CoreSpec) -> Tensor:
    """Loss of column ``j`` in the column direction (CLIP's text-to-image) from its
    column of scores ``sims`` (M,): the LSE over every row, less the positives seen
    from the column: the rows whose positive columns hold ``j``, or with labels the
    rows of ``j``'s label."""
    lse = torch.logsumexp(sims, dim=0)
    if spec.index is not None:
        pos = [i for i in range(sims.shape[0]) for c in spec.index[i].tolist() if c == j]
    else:
        assert spec.row_labels is not None and spec.col_labels is not None
        pos = [i for i in range(sims.shape[0]) if int(spec.row_labels[i]) == int(spec.col_labels[j])]
    pos_sum = sum((sims[i] for i in pos), sims.new_zeros(()))
    if spec.pos_mode == "mean":
        return lse - pos_sum / len(pos) if pos else 0.0 * lse
    if spec.pos_mode == "pairs":
        return len(pos) * lse - pos_sum
    return lse - pos_sum


def core_loss(q: Tensor, k: Optional[Tensor], scale: Tensor, spec: CoreSpec) -> Tuple[Tensor, Optional[Tensor]]:
    """Row losses (M,) and, for ``spec.both_directions``, column losses (N,); ``k=None`` means ``k = q``."""
    q, k = prepare(q, k, spec.normalize)
    scale = scale.to(q.dtype)
    rows = []
    for i in range(q.shape[0]):
        sims = (k @ q[i]) * scale
        rows.append(_row_loss(sims, i, spec))
    row_loss = torch.stack(rows)
    col_loss = None
    if spec.both_directions:
        col_loss = torch.stack([_column_loss((q @ k[j]) * scale, j, spec) for j in range(k.shape[0])])
    return row_loss, col_loss


def scores_loss(scores: Tensor, spec: CoreSpec) -> Tensor:
    """Row losses (n,) of the core on a given score matrix, one row at a time."""
    scores = scores.to(compute_dtype(scores.dtype))
    return torch.stack([_row_loss(scores[i], i, spec) for i in range(scores.shape[0])])


def siglip_loss(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    bias: Tensor,
    labels: Optional[Tensor],
    normalize: bool,
    offset: int = 0,
    col_labels: Optional[Tensor] = None,
) -> Tensor:
    """Per-image SigLIP losses (B,), one image at a time: ``sum_j -log sigmoid(z_ij
    (scale q_i . k_j + bias))`` with ``z_ij = +1`` for the matching pairs (the
    diagonal: text ``i + offset``, or the same label; ``col_labels``: the texts'
    labels, default ``labels``), -1 elsewhere."""
    q, k = prepare(q, k, normalize)
    cols = labels if col_labels is None else col_labels
    rows = []
    for i in range(q.shape[0]):
        logits = (k @ q[i]) * scale.to(q.dtype) + bias.to(q.dtype)
        if labels is None or cols is None:
            z = -torch.ones_like(logits)
            z[i + offset] = 1.0
        else:
            z = torch.where(cols == labels[i], 1.0, -1.0).to(q.dtype)
        rows.append(-torch.nn.functional.logsigmoid(z * logits).sum())
    return torch.stack(rows)


def nt_xent_estimator(
    z: Tensor,
    partner: Tensor,
    scale: Tensor,
    tau_plus: float,
    beta: float,
    normalize: bool,
    keys: Optional[Tensor] = None,
    offset: int = 0,
) -> Tensor:
    """The debiased / hard-negative NT-Xent of each anchor, one anchor at a time, in
    exp space as published (Robinson et al.'s criterion with its clamp). ``keys``:
    every view of the batch when the anchors ``z`` are a slice of them starting at
    column ``offset`` (``partner``: columns of ``keys``)."""
    zz, kk = prepare(z, keys, normalize)
    scale = scale.to(zz.dtype)
    n_neg = kk.shape[0] - 2
    rows = []
    for i in range(zz.shape[0]):
        sims = (kk @ zz[i]) * scale
        p = int(partner[i])
        me = i + offset
        neg = torch.exp(torch.stack([sims[j] for j in range(kk.shape[0]) if j != me and j != p]))
        pos = torch.exp(sims[p])
        imp = neg**beta
        reweight = (imp * neg).sum() / imp.mean()
        ng = (-tau_plus * n_neg * pos + reweight) / (1 - tau_plus)
        ng = torch.clamp(ng, min=n_neg * float(torch.exp(-scale.detach())))  # the bound: a constant
        rows.append(-torch.log(pos / (pos + ng)))
    return torch.stack(rows)


def gist_rows(
    anchor: Tensor,
    positive: Tensor,
    negative: Optional[Tensor],
    guides: List[Tensor],
    scale: Tensor,
    margin: float,
    relative: bool,
    contrast_anchors: bool,
    contrast_positives: bool,
    every: Optional[Tuple[List[Optional[Tensor]], List[Optional[Tensor]], int]] = None,
) -> Tensor:
    """GIST's per-anchor losses, one anchor at a time: each candidate set (anchor to
    positives, anchors, negatives; positive to positives) loses the candidates whose
    guide similarity exceeds the anchor's guided positive similarity minus the margin
    (the positive itself kept; an anchor among the anchors and a positive among the
    positives is never its own negative); cosine similarities. ``every``: the candidates of the
    whole batch when these rows are a slice of it (``[anchors, positives, negatives]``,
    their guides' embeddings, the rows' first column): the anchors' own positive is
    column ``i + offset``."""
    a, p = prepare(anchor, positive, True)
    ga, gp = prepare(guides[0], guides[1], True)
    if every is None:
        cands = [anchor, positive, negative]
        g_cands: List[Optional[Tensor]] = [guides[0], guides[1], guides[2] if negative is not None else None]
        offset = 0
    else:
        cands, g_cands, offset = every
    keys = [None if x is None else prepare(x, None, True)[0] for x in cands]
    g_keys = [None if x is None else prepare(x, None, True)[0] for x in g_cands]
    scale = scale.to(a.dtype)
    # (rows, candidates, their guides, the positive kept, the row itself dropped)
    sets = [(a, keys[1], ga, g_keys[1], True, False)]
    if contrast_anchors:
        sets.append((a, keys[0], ga, g_keys[0], False, True))
    if contrast_positives:
        sets.append((p, keys[1], gp, g_keys[1], False, True))
    if keys[2] is not None and g_keys[2] is not None:
        sets.append((a, keys[2], ga, g_keys[2], False, False))
    rows = []
    for i in range(a.shape[0]):
        g_pos = ga[i] @ gp[i]
        threshold = g_pos - (g_pos.abs() * margin if relative else margin)
        den = []
        for q, k, gq, gk, keep_positive, drop_self in sets:
            assert k is not None and gk is not None
            for j in range(k.shape[0]):
                if drop_self and j == i + offset:  # the row itself: never its own negative
                    continue
                if (gq[i] @ gk[j]) > threshold and not (keep_positive and j == i + offset):
                    continue
                den.append((q[i] @ k[j]) * scale)
        rows.append(torch.logsumexp(torch.stack(den), dim=0) - (a[i] @ p[i]) * scale)
    return torch.stack(rows)


def maxsim_scores(query: Tensor, docs: Tensor, qmask: Tensor, dmask: Tensor, smooth: Optional[float]) -> Tensor:
    """Late interaction's scores, one query, document and token at a time: ``s_ij =
    sum_{real t} max_{real u} <q_it, d_ju>`` (``smooth``: ``tau * logsumexp_u(. /
    tau)``); ``docs`` (N, Ld, D): (B, N), or (B, n, Ld, D), each query's own: (B, n)."""
    out = []
    for i in range(query.shape[0]):
        tokens = [t for t in range(query.shape[1]) if bool(qmask[i, t])]
        own = docs[i] if docs.dim() == 4 else docs
        own_mask = dmask[i] if docs.dim() == 4 else dmask
        scores = []
        for j in range(own.shape[0]):
            real = own[j][own_mask[j]]
            total = query.new_zeros(())
            for t in tokens:
                dots = real @ query[i, t]
                total = total + (dots.max() if smooth is None else smooth * torch.logsumexp(dots / smooth, dim=0))
            scores.append(total)
        out.append(torch.stack(scores))
    return torch.stack(out)


def maxsim_rows(
    query: Tensor,
    docs: Tensor,
    qmask: Tensor,
    dmask: Tensor,
    scale: Tensor,
    normalize_scores: bool,
    smooth: Optional[float],
    index: Tensor,
) -> Tensor:
    """Late interaction's cross-entropy of each query (its positive: document
    ``index[i]``) on :func:`maxsim_scores` (``normalize_scores``: over the query's real
    tokens): ``LSE_j scale s_ij - scale s_i index[i]``, one query at a time."""
    s = maxsim_scores(query, docs, qmask, dmask, smooth)
    rows = []
    for i in range(query.shape[0]):
        z = s[i] / int(qmask[i].sum()) if normalize_scores else s[i]
        z = z * scale.to(query.dtype)
        rows.append(torch.logsumexp(z, dim=0) - z[int(index[i])])
    return torch.stack(rows)
