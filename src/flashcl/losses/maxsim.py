"""Late interaction (ColBERT, ColPali): contrastive training of multi-vector
retrievers on MaxSim scores without the B x N x Lq x Ld token-score tensor:
:func:`maxsim_loss` and :class:`MaxSimLoss`."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import checks, parallel, reference, registry, runner
from ..base import LossModule, shared_docs
from ..checks import Scalar
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import autocast_off
from ..engine.maxsim import CrossEntropyRows, MaxSimScores, auto_blocks, dense_scores

__all__ = ["maxsim_loss", "MaxSimLoss"]

#: ``backend="auto"`` takes the tiled scores from this many token scores (B Lq N Ld)
AUTO_TILED_MIN_TOKEN_SCORES = 1 << 22


def _mask(mask: Optional[Tensor], x: Tensor, name: str, like: str) -> Tensor:
    """``mask`` (rows, tokens) as bool (True: a real token), every row with one."""
    if mask is None:
        return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(mask).__name__}")
    if mask.shape != x.shape[:2]:
        raise ValueError(
            f"{name} must have shape {tuple(x.shape[:2])} ({like}'s rows and tokens), got {tuple(mask.shape)}"
        )
    checks.same_device(mask, x, name, like)
    if mask.is_floating_point() or mask.is_complex():
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{name} must be bool (True for a real token) or 0/1")
    mask = mask != 0
    empty = (~mask.any(1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(
            f"{name}: row {int(empty[0])} has no real token (its MaxSim score is undefined); "
            f"{empty.numel()} such row(s)"
        )
    return mask


@registry.loss
@shared_docs
@compiles(rows=lambda query: (query.shape[0],))
def maxsim_loss(
    query: Tensor,
    docs: Tensor,
    positive_index: Optional[Tensor] = None,
    *,
    query_mask: Optional[Tensor] = None,
    doc_mask: Optional[Tensor] = None,
    temperature: Scalar = 1.0,
    normalize_scores: bool = False,
    smooth_max: Optional[float] = None,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Contrastive loss of late-interaction retrievers (ColBERT, ColPali) on MaxSim
    scores, with in-batch and hard negatives, in memory that grows with B x N, not
    with the B x N x Lq x Ld token scores.

    Query ``i`` scores document ``j`` by MaxSim: for each real token of the query,
    the best-matching real token of the document, summed::

        s_ij = sum_{t real in i} max_{u real in j} <query[i, t], docs[j, u]>

    and the loss of query ``i`` is the cross-entropy of ``s_i. / temperature`` with
    its positive document ``positive_index[i]`` (default ``i``; the other documents,
    rows past B included, are its negatives), as ``pylate.losses.Contrastive`` and
    colpali-engine's ``ColbertLoss`` compute it with the whole token-score tensor.
    The embeddings are used as given (the models normalise their token embeddings).

    ``backend="tiled"`` forms the scores from one GEMM of a block of query tokens
    against a block of document tokens at a time and keeps only the (B, N) scores;
    its backward recomputes each tile and sends each (query token, document) pair's
    gradient to the document token that wins the max. Ties in the max: the tiled
    backend gives the whole gradient to one of the tied tokens (the first, as
    ``torch.argmax``), the dense backend spreads it equally over them (``amax``);
    both are valid subgradients and give the same loss.

    Args:
        query: (B, Lq, D) query token embeddings.
        docs: (N, Ld, D) document token embeddings, N >= B.
        positive_index: (B,) each query's positive document; default ``arange(B)``.
        query_mask: (B, Lq) bool (or 0/1), True for a real token; padding tokens add
            nothing. Default: every token is real.
        doc_mask: (N, Ld) bool (or 0/1), True for a real token; a padding token never
            wins the max. Default: every token is real.
        temperature: float or 0-dim tensor (a learnable one gets its gradient). Default: 1.
        normalize_scores: divide each ``s_ij`` by query ``i``'s number of real tokens
            (colpali-engine's ``normalize_scores``). Default: False.
        smooth_max: ``tau``: replace the max over a document's real tokens by
            ``tau * logsumexp(. / tau)`` (colpali-engine's ``use_smooth_max``). Default: None.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        backend: ``"auto"`` (``"tiled"`` from 2^22 token scores B Lq N Ld, ``"dense"``
            below) | ``"reference"`` (loops) | ``"dense"`` (the B x Lq x N x Ld token
            scores, as the peers write it) | ``"tiled"``.
        block_size: queries per tile of the tiled backend; None picks one (tiles of
            about 32 MB of token scores).
        @process_group@

    Shape:
        - query: (B, Lq, D); docs: (N, Ld, D); positive_index: (B,);
          query_mask: (B, Lq); doc_mask: (N, Ld)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> q, d = torch.randn(4, 8, 16), torch.randn(6, 20, 16)  # 2 hard negatives
        >>> loss = flashcl.maxsim_loss(q, d, temperature=0.05, normalize_scores=True)
        >>> mask = torch.ones(6, 20, dtype=torch.bool); mask[:, 15:] = False  # padding
        >>> loss = flashcl.maxsim_loss(q, d, doc_mask=mask)
    """
    query = checks.check_float_tensor(query, "query", (3,))
    docs = checks.check_float_tensor(docs, "docs", (3,))
    if docs.shape[2] != query.shape[2]:
        raise ValueError(f"docs must be {query.shape[2]} wide (the query tokens' width), got {docs.shape[2]}")
    if docs.dtype != query.dtype:
        raise TypeError(f"docs must have the query's dtype {query.dtype}, got {docs.dtype}")
    checks.same_device(docs, query, "docs", "query")
    if query.shape[0] == 0 or query.shape[1] == 0 or docs.shape[1] == 0:
        raise ValueError(
            f"maxsim_loss needs queries and documents with tokens, got query {tuple(query.shape)}, docs "
            f"{tuple(docs.shape)}"
        )
    if positive_index is None:
        if docs.shape[0] < query.shape[0]:
            raise ValueError(f"docs must hold at least B = {query.shape[0]} documents (one positive per query)")
        index = torch.arange(query.shape[0], device=query.device)
    else:
        index = checks.check_index_tensor(positive_index, "positive_index").long()
        if index.shape != (query.shape[0],):
            raise ValueError(f"positive_index must have shape ({query.shape[0]},), got {tuple(index.shape)}")
        checks.same_device(index, query, "positive_index", "query")
        if bool(((index < 0) | (index >= docs.shape[0])).any()):
            raise ValueError(f"positive_index values must be documents in [0, {docs.shape[0]})")
    qmask = _mask(query_mask, query, "query_mask", "query")
    dmask = _mask(doc_mask, docs, "doc_mask", "docs")
    checks.check_bool(normalize_scores, "normalize_scores")
    smooth = None
    if smooth_max is not None:
        if (
            isinstance(smooth_max, bool)
            or not isinstance(smooth_max, (int, float))
            or not 0 < smooth_max < float("inf")
        ):
            raise ValueError(f"smooth_max must be a positive float (the smooth max's temperature), got {smooth_max!r}")
        smooth = float(smooth_max)
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    if opts.backend == "triton":
        raise ValueError("maxsim_loss has no Triton kernel yet: use backend='tiled' (or 'auto')")
    if opts.strategy == "ring":
        raise ValueError("maxsim_loss takes strategy='all_gather' across processes (the documents gathered)")
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", query.device, compute_dtype(query.dtype))
    return _maxsim(query, docs, index, qmask, dmask, scale, normalize_scores, smooth, opts)


def _maxsim(
    query: Tensor,
    docs: Tensor,
    index: Tensor,
    qmask: Tensor,
    dmask: Tensor,
    scale: Tensor,
    normalize_scores: bool,
    smooth: Optional[float],
    opts: checks.Options,
) -> Tensor:
    """:func:`maxsim_loss`'s body, one process being a world of one: this rank's queries
    against every rank's documents (gathered with their gradient)."""
    cols = parallel.columns(docs, "all_gather", opts.process_group)
    all_dmask = cols.gather(dmask.to(torch.uint8)).bool()
    index = index + cols.offset
    dtype = compute_dtype(query.dtype)
    b, lq = query.shape[:2]
    entries = b * lq * cols.total * docs.shape[1]
    name = "tiled" if opts.backend == "auto" and entries >= AUTO_TILED_MIN_TOKEN_SCORES else opts.backend
    name = "dense" if name == "auto" else name
    with autocast_off(query.device.type):
        if name == "reference":
            rows = reference.maxsim_rows(
                query.to(dtype), cols.keys.to(dtype), qmask, all_dmask, scale, normalize_scores, smooth, index
            )
        else:
            qm = qmask.to(dtype)
            if name == "dense":
                s = dense_scores(query, cols.keys, qm, all_dmask, smooth)
            else:
                bq, bd = auto_blocks(lq, docs.shape[1], cols.total)
                s = MaxSimScores.apply(query, cols.keys, qm, all_dmask, smooth, (opts.block_size or bq, bd))
            f = scale.to(dtype).expand(b)
            if normalize_scores:
                f = f / qm.sum(1)
            rows = CrossEntropyRows.apply(s, f, index)
    return runner.reduce(rows, torch.ones_like(rows), opts.reduction, opts.grad_scale, cols)


@registry.module
class MaxSimLoss(LossModule):
    """Module form of :func:`maxsim_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.MaxSimLoss(temperature=0.05)
        >>> loss = loss_fn(torch.randn(4, 8, 16), torch.randn(4, 20, 16))
    """

    def __init__(
        self,
        temperature: Scalar = 1.0,
        normalize_scores: bool = False,
        smooth_max: Optional[float] = None,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self,
        query: Tensor,
        docs: Tensor,
        query_mask: Optional[Tensor] = None,
        doc_mask: Optional[Tensor] = None,
        positive_index: Optional[Tensor] = None,
    ) -> Tensor:
        return maxsim_loss(query, docs, positive_index, query_mask=query_mask, doc_mask=doc_mask, **self.loss_options())
