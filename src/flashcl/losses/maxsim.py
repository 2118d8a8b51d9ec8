"""Late interaction (ColBERT, ColPali): contrastive training of multi-vector
retrievers on MaxSim scores without the B x N x Lq x Ld token-score tensor:
:func:`maxsim_loss` and :class:`MaxSimLoss`."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, reference, runner
from ..base import LossModule, shared_docs
from ..checks import Example, Scalar, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import autocast_off
from ..parallel.ring import RingScores
from .maxsim_scores import (
    MaxSimScores,
    PairedMaxSimScores,
    auto_blocks,
    cross_entropy_rows,
    dense_scores,
    paired_block,
    paired_scores,
)

__all__ = ["maxsim_scores", "maxsim_loss", "MaxSimLoss", "maxsim_distill_loss", "MaxSimDistillLoss"]

#: ``backend="auto"`` takes the tiled scores from this many token scores (B Lq N Ld)
AUTO_TILED_MIN_TOKEN_SCORES = 1 << 22


def _mask(mask: Optional[Tensor], x: Tensor, name: str, like: str) -> Tensor:
    """``mask`` (``x``'s shape without its width) as bool (True: a real token), every
    query or document with one."""
    shape = x.shape[:-1]
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=x.device)
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} ({like}'s tokens), got {tuple(mask.shape)}")
    checks.same_device(mask, x, name, like)
    if mask.is_floating_point() or mask.is_complex():
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{name} must be bool (True for a real token) or 0/1")
    mask = mask != 0
    empty = (~mask.any(-1)).nonzero()
    if empty.numel():
        raise ValueError(
            f"{name}: {tuple(int(i) for i in empty[0])} has no real token (its MaxSim score is undefined); "
            f"{empty.shape[0]} such"
        )
    return mask


def _tokens(
    query: Tensor,
    docs: Tensor,
    query_mask: Optional[Tensor],
    doc_mask: Optional[Tensor],
    smooth_max: Optional[float],
    doc_dims: Tuple[int, ...] = (3,),
    empty: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[float]]:
    """The checked token embeddings, their masks (bool) and the smooth max's ``tau``
    (``empty``: no queries and no documents, a rank with nothing of its own across
    processes)."""
    query = checks.check_float_tensor(query, "query", (3,), empty)
    docs = checks.check_float_tensor(docs, "docs", doc_dims, empty)
    if docs.shape[-1] != query.shape[2]:
        raise ValueError(f"docs must be {query.shape[2]} wide (the query tokens' width), got {docs.shape[-1]}")
    if docs.dtype != query.dtype:
        raise TypeError(f"docs must have the query's dtype {query.dtype}, got {docs.dtype}")
    checks.same_device(docs, query, "docs", "query")
    if (query.shape[0] == 0 and not empty) or query.shape[1] == 0 or docs.shape[-2] == 0 or docs.shape[1] == 0:
        raise ValueError(
            f"MaxSim needs queries and documents with tokens, got query {tuple(query.shape)}, docs {tuple(docs.shape)}"
        )
    if docs.dim() == 4 and docs.shape[0] != query.shape[0]:
        raise ValueError(
            f"docs (B, n, Ld, D) must hold each query's own documents: B = {query.shape[0]}, got {docs.shape[0]}"
        )
    qmask = _mask(query_mask, query, "query_mask", "query")
    dmask = _mask(doc_mask, docs, "doc_mask", "docs")
    if smooth_max is None:
        return query, docs, qmask, dmask, None
    if isinstance(smooth_max, bool) or not isinstance(smooth_max, (int, float)) or not 0 < smooth_max < float("inf"):
        raise ValueError(f"smooth_max must be a positive float (the smooth max's temperature), got {smooth_max!r}")
    return query, docs, qmask, dmask, float(smooth_max)


def _pick(backend: str, entries: int) -> str:
    """The backend ``backend`` stands for at this many token scores (the runner's
    choice among MaxSim's: no Triton kernel)."""
    names = ("reference", "dense", "tiled")
    return backends.pick_name(backend, names, entries, None, "MaxSim", min_tiled=AUTO_TILED_MIN_TOKEN_SCORES)


def _scores(
    query: Tensor,
    docs: Tensor,
    qmask: Tensor,
    dmask: Tensor,
    smooth: Optional[float],
    backend: str,
    block_size: Optional[int],
) -> Tensor:
    """The MaxSim scores in the compute dtype: (B, N) for docs (N, Ld, D), (B, n) for
    each query's own documents (B, n, Ld, D); autocast off."""
    dtype = compute_dtype(query.dtype)
    paired = docs.dim() == 4
    entries = query.shape[1] * docs.shape[:-1].numel() * (1 if paired else query.shape[0])
    qm = qmask.to(dtype)

    def formula() -> Tensor:
        return reference.maxsim_scores(query.to(dtype), docs.to(dtype), qmask, dmask, smooth)

    def dense() -> Tensor:
        return paired_scores(query, docs, qm, dmask, smooth) if paired else dense_scores(query, docs, qm, dmask, smooth)

    def tiled() -> Tensor:
        if paired:
            lq, (n, ld) = query.shape[1], docs.shape[1:3]
            return PairedMaxSimScores.apply(query, docs, qm, dmask, smooth, block_size or paired_block(n, lq, ld))
        bq, bd = auto_blocks(query.shape[1], docs.shape[1], docs.shape[0])
        return MaxSimScores.apply(query, docs, qm, dmask, smooth, (block_size or bq, bd))

    impls = {"reference": formula, "dense": dense, "tiled": tiled}
    with autocast_off(query.device.type):
        return backends.pick(backend, impls, entries, query, "MaxSim", min_tiled=AUTO_TILED_MIN_TOKEN_SCORES)()


def maxsim_scores(
    query: Tensor,
    docs: Tensor,
    *,
    query_mask: Optional[Tensor] = None,
    doc_mask: Optional[Tensor] = None,
    smooth_max: Optional[float] = None,
    backend: str = "auto",
    block_size: Optional[int] = None,
) -> Tensor:
    r"""MaxSim scores of late-interaction retrievers (ColBERT, ColPali), differentiable,
    without the token-score tensor: the building block of :func:`maxsim_loss` and
    :func:`maxsim_distill_loss`, for losses of one's own on the scores::

        s_ij = sum_{t real in i} max_{u real in j} <query[i, t], docs[j, u]>

    ``docs`` (N, Ld, D): every query against every document, (B, N). ``docs`` (B, n,
    Ld, D): each query against its own ``n`` documents (re-ranking candidates,
    distillation), (B, n). The tiled backend keeps one tile of token scores at a
    time. Ties in the max: the (N, Ld, D) form's tiled backend gives the gradient to
    the first tied token, the dense forms (and the tiled (B, n, Ld, D) form) spread
    it equally over them. Eager: under ``torch.compile`` the losses enter the graph
    as one operator; this building block is traced by dynamo (graph breaks).

    Args:
        query: (B, Lq, D) query token embeddings.
        docs: (N, Ld, D) documents, or (B, n, Ld, D) each query's own documents.
        query_mask: (B, Lq) bool (or 0/1), True for a real token. Default: all real.
        doc_mask: ``docs``' shape without D, True for a real token (a padding token
            never wins the max). Default: all real.
        smooth_max: ``tau``: ``tau * logsumexp(. / tau)`` over a document's real
            tokens instead of the max. Default: None.
        backend: ``"auto"`` (``"tiled"`` from 2^22 token scores) | ``"reference"``
            (loops) | ``"dense"`` (the token-score tensor) | ``"tiled"``.
        block_size: queries per tile of the tiled backend; None picks one.

    Shape:
        - query: (B, Lq, D); docs: (N, Ld, D) or (B, n, Ld, D)
        - output: (B, N) or (B, n), float32 for float16 / bfloat16 inputs

    Examples::

        >>> q, d = torch.randn(4, 8, 16), torch.randn(6, 20, 16)
        >>> flashcl.maxsim_scores(q, d).shape
        torch.Size([4, 6])
        >>> flashcl.maxsim_scores(q, torch.randn(4, 3, 20, 16)).shape  # 3 candidates per query
        torch.Size([4, 3])
    """
    query, docs, qmask, dmask, smooth = _tokens(query, docs, query_mask, doc_mask, smooth_max, (3, 4))
    checks.check_block(block_size)
    return _scores(query, docs, qmask, dmask, smooth, backend, block_size)


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
    query, docs, qmask, dmask, smooth = _tokens(
        query, docs, query_mask, doc_mask, smooth_max, empty=process_group is not None
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
    checks.check_bool(normalize_scores, "normalize_scores")
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    _pick(opts.backend, 0)
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
    cols = parallel.columns(docs, opts.strategy, opts.process_group)
    all_dmask = cols.gather(dmask.to(torch.uint8)).bool()
    index = index + cols.offset
    with autocast_off(query.device.type):
        if opts.strategy == "ring" and opts.process_group is not None:

            def score(q: Tensor, block: Tensor, block_mask: Tensor) -> Tensor:
                return _scores(q, block, qmask, block_mask, smooth, opts.backend, opts.block_size)

            s = RingScores.apply(query, docs, dmask, score, cols.sizes, opts.process_group)
            rows = _cross_entropy(s, scale, qmask, normalize_scores, index)
        else:

            def formula() -> Tensor:
                dtype = compute_dtype(query.dtype)
                q, keys = query.to(dtype), cols.keys.to(dtype)
                return reference.maxsim_rows(q, keys, qmask, all_dmask, scale, normalize_scores, smooth, index)

            def scored() -> Tensor:  # the scores on the backend _scores picks, then their cross-entropy
                s = _scores(query, cols.keys, qmask, all_dmask, smooth, opts.backend, opts.block_size)
                return _cross_entropy(s, scale, qmask, normalize_scores, index)

            impls = {"reference": formula, "dense": scored, "tiled": scored}
            rows = backends.pick(opts.backend, impls, 0, query, "MaxSim")()
    return runner.reduce(rows, torch.ones_like(rows), opts.reduction, opts.grad_scale, cols)


def _cross_entropy(s: Tensor, scale: Tensor, qmask: Tensor, normalize_scores: bool, index: Tensor) -> Tensor:
    """Each query's cross-entropy over its MaxSim scores ``s`` (scaled; normalised by its
    real tokens with ``normalize_scores``) with document ``index``."""
    f = scale.to(s.dtype).expand(s.shape[0])
    return cross_entropy_rows(s, f / qmask.sum(1) if normalize_scores else f, index)


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


@compiles(rows=lambda query: (query.shape[0],))
def maxsim_distill_loss(
    query: Tensor,
    docs: Tensor,
    teacher_scores: Tensor,
    *,
    query_mask: Optional[Tensor] = None,
    doc_mask: Optional[Tensor] = None,
    temperature: Scalar = 1.0,
    teacher_temperature: Scalar = 1.0,
    normalize_scores: bool = False,
    smooth_max: Optional[float] = None,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Distillation of a late-interaction student (ColBERT, ColPali) from a teacher's
    scores of each query's own candidate documents: the KL divergence from the
    teacher's softmax to the student's MaxSim softmax, per query::

        KL( softmax_j(teacher_scores[i] / teacher_temperature)
          || softmax_j(s_ij / temperature) ),   s_ij = MaxSim(query[i], docs[i, j])

    as ``pylate.losses.Distillation`` computes it (with its ``normalize_scores=False``;
    its min-max scaling is in :mod:`flashcl.integrations.pylate`), the (B, n, Lq, Ld)
    token scores formed a block of queries at a time (see :func:`maxsim_scores`).

    Args:
        query: (B, Lq, D) the student's query token embeddings.
        docs: (B, n, Ld, D) the student's token embeddings of each query's n documents.
        teacher_scores: (B, n) the teacher's scores (logits) of those documents; a
            tensor that requires grad gets its gradient. ``-inf`` rules a candidate
            out (target probability 0, ``0 log 0 = 0``: a padded or excluded
            candidate); a row of ``-inf`` only is a ValueError.
        query_mask: (B, Lq) bool (or 0/1), True for a real token. Default: all real.
        doc_mask: (B, n, Ld) bool (or 0/1), True for a real token. Default: all real.
        temperature: the student's (float or 0-dim tensor; a learnable one gets its
            gradient). Default: 1.
        teacher_temperature: divides the teacher's scores. Default: 1.
        normalize_scores: divide each student score by the query's real token count.
        smooth_max: ``tau``: a smooth max over the document's tokens (see
            :func:`maxsim_loss`). Default: None.
        reduction: ``"mean"`` (over the queries: KL's ``batchmean``) | ``"sum"`` | ``"none"``.
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"``.
        block_size: queries per block of the tiled backend; None picks one.
        process_group: each rank passes its own queries; the mean is over every rank's
            queries (no document crosses ranks: each query has its own).
        grad_scale: ``"ddp"`` (DDP's averaging of the gradients then gives the global
            batch's) | ``"sum"``.

    Shape:
        - query: (B, Lq, D); docs: (B, n, Ld, D); teacher_scores: (B, n);
          query_mask: (B, Lq); doc_mask: (B, n, Ld)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> q, d = torch.randn(4, 8, 16), torch.randn(4, 5, 20, 16)  # 5 candidates per query
        >>> teacher = torch.randn(4, 5)
        >>> loss = flashcl.maxsim_distill_loss(q, d, teacher, temperature=0.5)
    """
    query, docs, qmask, dmask, smooth = _tokens(
        query, docs, query_mask, doc_mask, smooth_max, (4,), process_group is not None
    )
    teacher = checks.check_float_tensor(teacher_scores, "teacher_scores", (2,), process_group is not None)
    if teacher.shape != docs.shape[:2]:
        raise ValueError(f"teacher_scores must have shape {tuple(docs.shape[:2])} (B, n), got {tuple(teacher.shape)}")
    checks.same_device(teacher, query, "teacher_scores", "query")
    _check_teacher(teacher)
    checks.check_bool(normalize_scores, "normalize_scores")
    opts = checks.Options(True, reduction, backend, block_size, process_group, "all_gather", grad_scale)
    _pick(opts.backend, 0)
    dtype = compute_dtype(query.dtype)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", query.device, dtype)
    t_scale = 1.0 / checks.check_positive_scalar(teacher_temperature, "teacher_temperature", query.device, dtype)
    s = _scores(query, docs, qmask, dmask, smooth, opts.backend, opts.block_size)
    if normalize_scores:
        s = s / qmask.sum(1, keepdim=True).to(s.dtype)
    with autocast_off(query.device.type):
        student = torch.log_softmax(s * scale.to(s.dtype), dim=1)
        ruled_out = teacher == float("-inf")  # probability 0 (never -inf times a learnable scale)
        logits = (teacher.masked_fill(ruled_out, 0.0).to(s.dtype) * t_scale.to(s.dtype)).masked_fill(
            ruled_out, float("-inf")
        )
        rows = _kl_terms(torch.log_softmax(logits, dim=1), student).sum(1)
    source = parallel.reduction_over(opts.process_group)
    return runner.reduce(rows, torch.ones_like(rows), opts.reduction, opts.grad_scale, source)


def _check_teacher(teacher: Tensor) -> None:
    """A teacher score of ``-inf`` rules its candidate out (probability 0); a row whose
    every candidate is ruled out has no distribution to distil."""
    ruled_out = (teacher == float("-inf")).all(1).nonzero()
    if ruled_out.numel():
        raise ValueError(
            f"teacher_scores: row {int(ruled_out[0])} is -inf for every candidate (no target distribution); "
            f"{ruled_out.shape[0]} such"
        )


def _kl_terms(target: Tensor, student: Tensor) -> Tensor:
    """The terms ``p_j (log p_j - log q_j)`` of ``KL(p || q)`` from ``log p`` (``target``)
    and ``log q`` (``student``), with ``0 log 0 = 0``: a target probability of 0
    (``log p = -inf``) adds nothing and gets a zero gradient, as torch's ``kl_div``
    with a target in probabilities; NaN in ``target`` stays NaN."""
    p = target.exp()
    kept = torch.where(p > 0, target, torch.zeros_like(target))  # no -inf - x, whose gradient is NaN
    return p * (kept - student)


class MaxSimDistillLoss(LossModule):
    """Module form of :func:`maxsim_distill_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.MaxSimDistillLoss(temperature=0.5)
        >>> loss = loss_fn(torch.randn(4, 8, 16), torch.randn(4, 5, 20, 16), torch.randn(4, 5))
    """

    def __init__(
        self,
        temperature: Scalar = 1.0,
        teacher_temperature: Scalar = 1.0,
        normalize_scores: bool = False,
        smooth_max: Optional[float] = None,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self,
        query: Tensor,
        docs: Tensor,
        teacher_scores: Tensor,
        query_mask: Optional[Tensor] = None,
        doc_mask: Optional[Tensor] = None,
    ) -> Tensor:
        return maxsim_distill_loss(
            query, docs, teacher_scores, query_mask=query_mask, doc_mask=doc_mask, **self.loss_options()
        )


def _example_maxsim(g: torch.Generator) -> Example:
    return Example((example_rows(g, 6, 5, 16), example_rows(g, 9, 7, 16)), {"temperature": 0.5})


def _example_maxsim_distill(g: torch.Generator) -> Example:
    return Example((example_rows(g, 5, 4, 16), example_rows(g, 5, 3, 6, 16), example_rows(g, 5, 3)), {}, leaves=(0, 1))


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "maxsim_loss": _example_maxsim,
    "maxsim_distill_loss": _example_maxsim_distill,
}
