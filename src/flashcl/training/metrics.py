"""Metrics a user logs every step, from the same tiles as the losses, in O(B) memory:
:func:`alignment`, :func:`uniformity` (Wang & Isola, 2020) and :func:`retrieval`
(top-k accuracy and mean reciprocal rank)."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..backends import auto_block
from ..base import DOCS, shared_docs
from ..checks import check_keys
from ..compiled import compiles
from ..core import compute_dtype
from ..runner import unit_rows

__all__ = ["alignment", "uniformity", "retrieval"]


DOCS["metric_process_group"] = """process_group: None, or a group of ``torch.distributed``: the value over
    every rank's rows, the same on every rank; each rank's rows get
    ``world_size x`` their gradient of it (DistributedDataParallel's averaging
    then gives the global value's gradient)."""


@shared_docs
@compiles()
def alignment(x: Tensor, y: Tensor, alpha: float = 2.0, *, process_group: Any = None) -> Tensor:
    """Alignment of positive pairs (Wang & Isola, 2020): ``mean_i |x_i - y_i|^alpha``,
    their ``align_loss``; differentiable, usable as a loss. Pass L2-normalised
    features, as their code assumes.

    Args:
        x, y: (B, D) the two sides of each pair.
        alpha: the exponent. Default: 2.
        @metric_process_group@

    Shape:
        - x, y: (B, D); output: scalar

    Examples::

        >>> x = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> y = torch.nn.functional.normalize(x + 0.1 * torch.randn(8, 16), dim=1)
        >>> float(flashcl.metrics.alignment(x, y)) < float(flashcl.metrics.alignment(x, x.flip(0)))
        True
    """
    x, y = checks.validate_pair(x, y, "x", "y")
    _positive_float(alpha, "alpha")
    terms = (x - y).norm(p=2, dim=1).pow(alpha)
    if process_group is None:
        return terms.mean()
    sums, _ = parallel.all_gather_with_grad(terms.sum().reshape(1), process_group)
    return sums.sum() / sum(parallel.row_counts(x.shape[0], x.device, process_group))


@shared_docs
@compiles()
def uniformity(x: Tensor, t: float = 2.0, *, block_size: Optional[int] = None, process_group: Any = None) -> Tensor:
    """Uniformity (Wang & Isola, 2020): ``log mean_{i<j} exp(-t |x_i - x_j|^2)``, their
    ``uniform_loss``, without the B(B-1)/2 distances ``torch.pdist`` holds: a
    logsumexp over tiles of ``2t x_i . x_j - t |x_i|^2 - t |x_j|^2``; differentiable,
    usable as a loss, O(B D) memory.

    Args:
        x: (B, D) features (L2-normalised, as their code assumes; any rows are taken).
        t: the scale. Default: 2.
        block_size: rows per tile; None picks one.
        @metric_process_group@

    Shape:
        - x: (B, D), B >= 2; output: scalar

    Examples::

        >>> x = torch.nn.functional.normalize(torch.randn(64, 16), dim=1)
        >>> u = flashcl.metrics.uniformity(x)
        >>> bool(torch.isclose(u, torch.pdist(x).pow(2).mul(-2).exp().mean().log(), atol=1e-5))
        True
    """
    x = checks.check_float_tensor(x, "x", (2,))
    _positive_float(t, "t")
    checks.check_block(block_size)
    b = x.shape[0]
    total = b if process_group is None else sum(parallel.row_counts(b, x.device, process_group))
    if total < 2:
        raise ValueError(f"uniformity needs at least 2 rows (one pair), got {total}")
    xc = x.to(compute_dtype(x.dtype))
    sq = (xc * xc).sum(1, keepdim=True)
    ones = torch.ones_like(sq)
    # q'_i . k'_j = 2t x_i . x_j - t |x_i|^2 - t |x_j|^2 = -t |x_i - x_j|^2
    q = torch.cat([2.0 * t * xc, -t * sq, ones], dim=1)
    k = torch.cat([xc, ones, -t * sq], dim=1)
    offset = 0
    if process_group is not None:
        k, offset = parallel.all_gather_with_grad(k, process_group)
    scale = torch.ones((), dtype=xc.dtype, device=x.device)
    lse = runner.row_lse(
        q, backends.Source(k, offset, [k.shape[0]]), scale, False, "tiled", block_size, exclude_self=True
    )
    if process_group is not None:
        lse, _ = parallel.all_gather_with_grad(lse, process_group)
    # every pair twice (i != j): the mean over i < j is the same mean
    return torch.logsumexp(lse, dim=0) - math.log(total * (total - 1))


@torch.no_grad()
def retrieval(
    query: Tensor,
    keys: Tensor,
    positive_index: Optional[Tensor] = None,
    *,
    labels: Optional[Tensor] = None,
    key_labels: Optional[Tensor] = None,
    topk: Sequence[int] = (1, 5, 10),
    normalize: bool = True,
    block_size: Optional[int] = None,
    process_group: Any = None,
) -> Dict[str, float]:
    """Retrieval metrics of queries against keys by cosine score (dot product with
    ``normalize=False``): ``top{k}``, the fraction of queries whose relevant key is
    among the k highest scores, and ``mrr``, the mean reciprocal rank of the first
    relevant key. Ties are broken in favour of the relevant key. Row blocks of
    scores: O(B D) memory. A NaN score of a counted query (a NaN in it or in any
    key but itself) makes every metric NaN: a model that diverged gets no score.

    Relevant keys: ``keys[positive_index[i]]`` (default ``i``), or with ``labels``
    and ``key_labels`` every key of the query's label, the query itself left out
    when ``keys is query``; with labels, queries without any relevant key are left
    out of the means.

    Args:
        query: (B, D).
        keys: (N, D).
        positive_index: (B,) the column of each query's relevant key.
        labels, key_labels: (B,) and (N,) integer labels, both or neither.
        topk: the k of each ``top{k}``; each at most N.
        normalize: score by cosine. Default: True.
        block_size: rows per block; None picks one.
        process_group: None, or a group of ``torch.distributed``: the metrics of the
            queries of every rank against the keys of every rank (``positive_index``
            into this rank's keys), the same dict on every rank.

    Returns:
        ``{"top1": ..., "top5": ..., "mrr": ..., "queries": count}`` (floats).

    Shape:
        - query: (B, D); keys: (N, D); positive_index, labels: (B,); key_labels: (N,)

    Examples::

        >>> q = torch.randn(32, 16)
        >>> m = flashcl.metrics.retrieval(q, q + 0.01 * torch.randn(32, 16), topk=(1, 5))
        >>> m["top1"] == 1.0 and m["mrr"] == 1.0
        True
    """
    self_keys = keys is query
    query = checks.check_float_tensor(query, "query", (2,))
    keys = check_keys(keys, "keys", query)
    checks.check_bool(normalize, "normalize")
    checks.check_block(block_size)
    if (labels is None) != (key_labels is None):
        raise ValueError("labels and key_labels go together: pass both or neither")
    if labels is not None:
        if positive_index is not None:
            raise ValueError("pass positive_index or labels, not both")
        _, labels = checks.validate_labelled(query, labels, names=("query", "labels"))
        _, key_labels = checks.validate_labelled(keys, key_labels, names=("keys", "key_labels"))
        index = None
    else:
        index = checks.validate_info_nce(query, keys, positive_index).long()
    ks = _check_topk(topk)
    b = query.shape[0]
    q, k = unit_rows(query.detach(), normalize), unit_rows(keys.detach(), normalize)
    offset, self_offset = 0, 0
    if process_group is not None:
        sizes = parallel.row_counts(k.shape[0], k.device, process_group)
        rank = parallel.rank_of(process_group)
        offset = sum(sizes[:rank])
        self_offset = sum(parallel.row_counts(b, q.device, process_group)[:rank])
        k = parallel.gather_plain(k, process_group)
        if key_labels is not None:
            key_labels = parallel.gather_plain(key_labels.long(), process_group)
    if max(ks) > k.shape[0]:
        raise ValueError(f"topk {max(ks)} is larger than the number of keys ({k.shape[0]})")
    block = block_size or auto_block(b, k.shape[0], q.dtype)
    ranks, found, nan = _first_relevant_ranks(q, k, index, offset, labels, key_labels, self_keys, self_offset, block)
    sums = torch.stack(
        [((ranks <= kk) & found).sum().to(torch.float64) for kk in ks]
        + [torch.where(found, 1.0 / ranks.to(torch.float64), 0.0).sum()]
        + [(nan & found).sum().to(torch.float64), found.sum().to(torch.float64)]
    )
    if process_group is not None:
        sums = parallel.sum_across(sums, process_group)
    count = float(sums[-1])
    # no comparison with NaN is true: a NaN query would rank its key first
    if float(sums[-2]) > 0:
        sums[:-2] = float("nan")
    out = {f"top{kk}": float(sums[i]) / max(count, 1.0) for i, kk in enumerate(ks)}
    out["mrr"] = float(sums[len(ks)]) / max(count, 1.0)
    out["queries"] = count
    return out


def _first_relevant_ranks(
    q: Tensor,
    k: Tensor,
    index: Optional[Tensor],
    offset: int,
    labels: Optional[Tensor],
    key_labels: Optional[Tensor],
    self_keys: bool,
    self_offset: int,
    block: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Per query, 1 + the number of irrelevant keys scored above its best relevant
    key, whether it has one, and whether any of its scores is NaN; row blocks of
    scores."""
    b = q.shape[0]
    ranks = torch.zeros(b, dtype=torch.long, device=q.device)
    found = torch.zeros(b, dtype=torch.bool, device=q.device)
    nan = torch.zeros(b, dtype=torch.bool, device=q.device)
    cols = torch.arange(k.shape[0], device=q.device)
    rows = min(block, b)
    # one score buffer, one for the relevant keys' scores, two masks: reused by every block
    buf, work = q.new_empty(rows, k.shape[0]), q.new_empty(rows, k.shape[0])
    rel_buf = torch.empty(rows, k.shape[0], dtype=torch.bool, device=q.device)
    above_buf = torch.empty_like(rel_buf)
    for r0 in range(0, b, block):
        r1 = min(r0 + block, b)
        s = torch.mm(q[r0:r1], k.T, out=buf[: r1 - r0])
        relevant = rel_buf[: r1 - r0]
        if index is None:
            assert labels is not None and key_labels is not None
            torch.eq(labels[r0:r1].long().unsqueeze(1), key_labels.long().unsqueeze(0), out=relevant)
        else:
            torch.eq(cols.unsqueeze(0), (index[r0:r1] + offset).unsqueeze(1), out=relevant)
        if self_keys:  # the query itself is no answer
            own = (torch.arange(r0, r1, device=q.device) + self_offset).unsqueeze(1)
            inside = (own >= 0) & (own < k.shape[0])
            at = own.clamp(0, k.shape[0] - 1)
            relevant.scatter_(1, at, relevant.gather(1, at) & ~inside)
            s.scatter_(1, at, torch.where(inside, torch.full_like(s[:, :1], float("-inf")), s.gather(1, at)))
        nan[r0:r1] = s.isnan().any(1)
        best = torch.where(
            relevant, s, torch.tensor(float("-inf"), dtype=s.dtype, device=s.device), out=work[: r1 - r0]
        )
        best = best.amax(1, keepdim=True)
        found[r0:r1] = relevant.any(1)
        above = torch.gt(s, best, out=above_buf[: r1 - r0])
        ranks[r0:r1] = 1 + above.logical_and_(relevant.logical_not_()).sum(1)
    return ranks, found, nan


def _check_topk(topk: object) -> Tuple[int, ...]:
    if isinstance(topk, int) and not isinstance(topk, bool):
        topk = (topk,)
    if (
        not isinstance(topk, (tuple, list))
        or not topk
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in topk)
    ):
        raise ValueError(f"topk must be a positive int or a sequence of them, got {topk!r}")
    return tuple(topk)


def _positive_float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)
