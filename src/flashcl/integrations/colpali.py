"""colpali-engine's late-interaction losses with its constructors and calls, computed
by flashcl: replacing ``from colpali_engine.loss import ColbertLoss, ...`` by
``from flashcl.integrations.colpali import ...`` is the whole change. The B x N x Lq x
Ld token scores are never formed (:func:`flashcl.maxsim_scores`, ``backend="tiled"``
from 2^22 token scores); colpali-engine itself need not be installed.

Each class takes colpali-engine's arguments (``temperature``, ``normalize_scores``,
``use_smooth_max``, ``pos_aware_negative_filtering``, ``in_batch_term_weight``,
``max_batch_size``, ``tau``, ``norm_tol``, ``filter_threshold``, ``filter_factor``) and
its call (``loss(query_embeddings, doc_embeddings[, neg_doc_embeddings], offset=0)``),
plus flashcl's ``backend`` and ``block_size`` (keyword-only), and returns its values
and gradients in its dtype (the inputs': a bfloat16 loss for bfloat16 embeddings,
computed in float32 and rounded once; ``ColbertSigmoidLoss`` float32 at least, as its
float32 sign mask promotes it there). colpali-engine's conventions are kept, not the
exact masked maximum of :func:`flashcl.maxsim_loss`:

* Padding is zero vectors, not a mask (its models multiply the token embeddings by
  the attention mask). A padding document token scores 0 and takes part in the max
  (and in the smooth max); a padding query token adds its max over the document, 0
  (with ``use_smooth_max``: ``tau * log(Ld)``, every token of the document scoring 0).
* ``normalize_scores`` divides by the query's length counted as its tokens whose
  first coordinate is non-zero; a score outside ``[-norm_tol, 1 + norm_tol]`` after
  it is reported (colpali-engine prints it; here a ``UserWarning``).
* ``offset``: this process's first document in gathered documents (the positive of
  query ``i`` is document ``offset + i``). ``ColbertSigmoidLoss`` takes a square
  score matrix in colpali-engine (its flattened positions assume ``offset = 0``);
  here the positive of query ``i`` is document ``offset + i`` for any N >= offset + B.

For the exact masked loss with in-batch and hard negatives in one softmax, use
:func:`flashcl.maxsim_loss` with ``query_mask`` / ``doc_mask``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..losses.maxsim import maxsim_scores
from .options import FlashclOptions

__all__ = [
    "ColbertLoss",
    "ColbertNegativeCELoss",
    "ColbertPairwiseCELoss",
    "ColbertPairwiseNegativeCELoss",
    "ColbertSigmoidLoss",
]


class ColbertModule(FlashclOptions, nn.Module):
    """What colpali-engine's losses share: the smooth max's ``tau``, the bounds of the
    normalised scores (``norm_tol``), the filtering of high negatives
    (``filter_threshold``, ``filter_factor``); ``max_batch_size`` is kept for the
    signature (no index buffer is needed); flashcl's options (:class:`FlashclOptions`)."""

    backends = ("auto", "reference", "dense", "tiled")

    def __init__(
        self,
        max_batch_size: int = 1024,
        tau: float = 0.1,
        norm_tol: float = 1e-3,
        filter_threshold: float = 0.95,
        filter_factor: float = 0.5,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not (isinstance(tau, (int, float)) and 0 < tau < float("inf")):
            raise ValueError(f"tau must be a positive float, got {tau!r}")
        self.max_batch_size = max_batch_size
        self.tau = tau
        self.norm_tol = norm_tol
        self.filter_threshold = filter_threshold
        self.filter_factor = filter_factor
        self.set_flashcl_options(backend, block_size)
        self.use_smooth_max = False
        self.normalize_scores = False

    def _scores(self, query: Tensor, docs: Tensor) -> Tensor:
        """MaxSim of zero-padded tokens: (B, N) for docs (N, Ld, D), (B, n) for each
        query's own documents (B, n, Ld, D)."""
        smooth = float(self.tau) if self.use_smooth_max else None
        return maxsim_scores(query, docs, smooth_max=smooth, backend=self.backend, block_size=self.block_size)

    def _normalized(self, scores: Tensor, query: Tensor) -> Tensor:
        if not self.normalize_scores:
            return scores
        lengths = (query[:, :, 0] != 0).sum(dim=1)
        out = scores / (lengths.unsqueeze(1) if scores.dim() == 2 else lengths).to(scores.dtype)
        lo, hi = torch.aminmax(out.detach())
        if lo < -self.norm_tol or hi > 1 + self.norm_tol:
            warnings.warn(
                f"Scores out of bounds after normalization: min={lo.item():.4f}, max={hi.item():.4f}, "
                f"tol={self.norm_tol}",
                stacklevel=3,
            )
        return out

    def _inbatch_scores(self, query: Tensor, docs: Tensor) -> Tensor:
        return self._normalized(self._scores(query, docs), query)

    def _filtered(self, scores: Tensor, pos_idx: Tensor) -> Tensor:
        """Negatives scoring above ``filter_threshold`` times the positive, times
        ``filter_factor`` (out of place)."""
        if not getattr(self, "pos_aware_negative_filtering", False):
            return scores
        rows = torch.arange(scores.shape[0], device=scores.device)
        pos = scores[rows, pos_idx]
        high = scores > self.filter_threshold * pos.unsqueeze(1)
        high[rows, pos_idx] = False
        return torch.where(high, scores * self.filter_factor, scores)

    def _positives(self, query: Tensor, docs: Tensor, offset: int) -> Tensor:
        """Each query's score with its own positive ``docs[offset + i]``, (B,)."""
        own = docs[offset : offset + query.shape[0]]
        return self._normalized(self._scores(query, own.unsqueeze(1))[:, 0], query)

    def _in_batch(self, query: Tensor, docs: Tensor, offset: int) -> Tuple[Tensor, Tensor]:
        scores = self._inbatch_scores(query, docs)
        pos_idx = torch.arange(scores.shape[0], device=scores.device) + offset
        return self._filtered(scores, pos_idx), pos_idx


def _as_peer(loss: Tensor, query: Tensor) -> Tensor:
    """The loss, computed in float32 for half-precision inputs, returned in the inputs'
    dtype as colpali-engine returns it (its bfloat16 loss for bfloat16 embeddings)."""
    return loss.to(query.dtype)


def _check_weight(weight: float) -> None:
    if not 0 <= weight <= 1:
        raise ValueError(f"in_batch_term_weight must be in [0, 1], got {weight!r}")


class _InBatch(ColbertModule):
    """colpali-engine's constructor of its in-batch losses."""

    def __init__(
        self,
        temperature: float = 0.02,
        normalize_scores: bool = True,
        use_smooth_max: bool = False,
        pos_aware_negative_filtering: bool = False,
        max_batch_size: int = 1024,
        tau: float = 0.1,
        norm_tol: float = 1e-3,
        filter_threshold: float = 0.95,
        filter_factor: float = 0.5,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(
            max_batch_size, tau, norm_tol, filter_threshold, filter_factor, backend=backend, block_size=block_size
        )
        self.temperature = temperature
        self.normalize_scores = normalize_scores
        self.use_smooth_max = use_smooth_max
        self.pos_aware_negative_filtering = pos_aware_negative_filtering


class ColbertLoss(_InBatch):
    """colpali-engine's ``ColbertLoss``: InfoNCE over in-batch MaxSim scores,
    ``cross_entropy(scores / temperature, offset + arange(B))``.

    Takes colpali-engine's arguments (``temperature``, ``normalize_scores``,
    ``use_smooth_max``, ``pos_aware_negative_filtering``, ``max_batch_size``, ``tau``,
    ``norm_tol``, ``filter_threshold``, ``filter_factor``), and:

    Args:
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (flashcl's).
        block_size: queries per tile of the tiled backend (flashcl's); None picks one.

    Shape:
        - query_embeddings: (B, Lq, D) zero-padded; doc_embeddings: (N, Ld, D), N >= offset + B
        - output: scalar

    Examples::

        >>> from flashcl.integrations.colpali import ColbertLoss
        >>> loss = ColbertLoss()(torch.randn(4, 8, 16), torch.randn(4, 20, 16))
    """

    def forward(self, query_embeddings: Tensor, doc_embeddings: Tensor, offset: int = 0) -> Tensor:
        scores, pos_idx = self._in_batch(query_embeddings, doc_embeddings, offset)
        return _as_peer(F.cross_entropy(scores / self.temperature, pos_idx), query_embeddings)


def _hardest_negative(scores: Tensor, offset: int) -> Tuple[Tensor, Tensor]:
    """colpali-engine's pairwise pick: the positive (the ``offset`` diagonal) and the
    highest other score of each row (the second highest when the positive is the
    highest)."""
    pos = scores.diagonal(offset=offset)
    top2 = scores.topk(2, dim=1).values
    return pos, torch.where(top2[:, 0] == pos, top2[:, 1], top2[:, 0])


class ColbertPairwiseCELoss(_InBatch):
    """colpali-engine's ``ColbertPairwiseCELoss``: ``softplus((hardest in-batch
    negative - positive) / temperature)``, the mean over the queries; its default
    temperature is 1.

    Takes colpali-engine's arguments (those of :class:`ColbertLoss`), and:

    Args:
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (flashcl's).
        block_size: queries per tile of the tiled backend (flashcl's); None picks one.

    Shape:
        - query_embeddings: (B, Lq, D); doc_embeddings: (N, Ld, D), N >= 2
        - output: scalar

    Examples::

        >>> from flashcl.integrations.colpali import ColbertPairwiseCELoss
        >>> loss = ColbertPairwiseCELoss()(torch.randn(4, 8, 16), torch.randn(4, 20, 16))
    """

    def __init__(
        self,
        temperature: float = 1.0,
        normalize_scores: bool = True,
        use_smooth_max: bool = False,
        pos_aware_negative_filtering: bool = False,
        max_batch_size: int = 1024,
        tau: float = 0.1,
        norm_tol: float = 1e-3,
        filter_threshold: float = 0.95,
        filter_factor: float = 0.5,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        options = (temperature, normalize_scores, use_smooth_max, pos_aware_negative_filtering, max_batch_size, tau)
        super().__init__(*options, norm_tol, filter_threshold, filter_factor, backend=backend, block_size=block_size)

    def forward(self, query_embeddings: Tensor, doc_embeddings: Tensor, offset: int = 0) -> Tensor:
        scores, _ = self._in_batch(query_embeddings, doc_embeddings, offset)
        pos, neg = _hardest_negative(scores, offset)
        return _as_peer(F.softplus((neg - pos) / self.temperature).mean(), query_embeddings)


class ColbertSigmoidLoss(_InBatch):
    """colpali-engine's ``ColbertSigmoidLoss``: ``softplus(-sign_ij s_ij /
    temperature)`` averaged over the in-batch score matrix, ``sign`` +1 for each
    query's positive and -1 elsewhere.

    Takes colpali-engine's arguments (those of :class:`ColbertLoss`), and:

    Args:
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (flashcl's).
        block_size: queries per tile of the tiled backend (flashcl's); None picks one.

    Shape:
        - query_embeddings: (B, Lq, D); doc_embeddings: (N, Ld, D), N >= offset + B
        - output: scalar

    Examples::

        >>> from flashcl.integrations.colpali import ColbertSigmoidLoss
        >>> loss = ColbertSigmoidLoss()(torch.randn(4, 8, 16), torch.randn(4, 20, 16))
    """

    def forward(self, query_embeddings: Tensor, doc_embeddings: Tensor, offset: int = 0) -> Tensor:
        scores, pos_idx = self._in_batch(query_embeddings, doc_embeddings, offset)
        sign = -torch.ones_like(scores)
        sign[torch.arange(scores.shape[0], device=scores.device), pos_idx] = 1.0
        loss = F.softplus(-(scores / self.temperature) * sign).mean()
        # colpali-engine's float32 sign mask promotes its loss to float32 at least
        return loss.to(torch.promote_types(query_embeddings.dtype, torch.float32))


class _WithNegatives(_InBatch):
    """colpali-engine's losses with explicit negatives: ``softplus((neg - pos) /
    temperature)`` over each query's own negatives, mixed with an in-batch term
    (``_inner``: its class, ``_inner_name``: the attribute colpali-engine keeps it in)
    by ``in_batch_term_weight``."""

    _inner: Any = ColbertLoss
    _inner_name = "inner_loss"

    def __init__(
        self,
        temperature: float = 0.02,
        normalize_scores: bool = True,
        use_smooth_max: bool = False,
        pos_aware_negative_filtering: bool = False,
        in_batch_term_weight: float = 0.5,
        max_batch_size: int = 1024,
        tau: float = 0.1,
        norm_tol: float = 1e-3,
        filter_threshold: float = 0.95,
        filter_factor: float = 0.5,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        # colpali-engine's in-batch constructor's arguments, in its order (no in_batch_term_weight)
        options: Tuple[Any, ...] = (temperature, normalize_scores, use_smooth_max, pos_aware_negative_filtering)
        options += (max_batch_size, tau, norm_tol, filter_threshold, filter_factor)
        super().__init__(*options, backend=backend, block_size=block_size)
        _check_weight(in_batch_term_weight)
        self.in_batch_term_weight = in_batch_term_weight
        setattr(self, self._inner_name, self._inner(*options, backend=backend, block_size=block_size))

    def forward(
        self, query_embeddings: Tensor, doc_embeddings: Tensor, neg_doc_embeddings: Tensor, offset: int = 0
    ) -> Tensor:
        pos = self._positives(query_embeddings, doc_embeddings, offset)
        neg = self._normalized(self._scores(query_embeddings, neg_doc_embeddings), query_embeddings)
        loss = F.softplus((neg - pos.unsqueeze(1)) / self.temperature).mean()
        if self.in_batch_term_weight > 0:
            loss_ib = getattr(self, self._inner_name)(query_embeddings, doc_embeddings, offset)
            loss = loss * (1 - self.in_batch_term_weight) + loss_ib.to(loss.dtype) * self.in_batch_term_weight
        return _as_peer(loss, query_embeddings)


class ColbertNegativeCELoss(_WithNegatives):
    """colpali-engine's ``ColbertNegativeCELoss``: ``softplus((neg - pos) /
    temperature)`` averaged over each query's explicit negatives, mixed with
    :class:`ColbertLoss`'s in-batch term by ``in_batch_term_weight``.

    Takes colpali-engine's arguments (``temperature``, ``normalize_scores``,
    ``use_smooth_max``, ``pos_aware_negative_filtering``, ``in_batch_term_weight``,
    ``max_batch_size``, ``tau``, ``norm_tol``, ``filter_threshold``, ``filter_factor``),
    and:

    Args:
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (flashcl's).
        block_size: queries per tile of the tiled backend (flashcl's); None picks one.

    Shape:
        - query_embeddings: (B, Lq, D); doc_embeddings: (N, Ld, D);
          neg_doc_embeddings: (B, n, Ln, D), each query's own negatives
        - output: scalar

    Examples::

        >>> from flashcl.integrations.colpali import ColbertNegativeCELoss
        >>> q, d, neg = torch.randn(4, 8, 16), torch.randn(4, 20, 16), torch.randn(4, 2, 20, 16)
        >>> loss = ColbertNegativeCELoss()(q, d, neg)
    """


class ColbertPairwiseNegativeCELoss(_WithNegatives):
    """colpali-engine's ``ColbertPairwiseNegativeCELoss``: ``softplus((neg - pos) /
    temperature)`` over each query's explicit negatives, mixed with
    :class:`ColbertPairwiseCELoss`'s in-batch term by ``in_batch_term_weight``.

    Takes colpali-engine's arguments (those of :class:`ColbertNegativeCELoss`), and:

    Args:
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (flashcl's).
        block_size: queries per tile of the tiled backend (flashcl's); None picks one.

    Shape:
        - query_embeddings: (B, Lq, D); doc_embeddings: (N, Ld, D);
          neg_doc_embeddings: (B, n, Ln, D)
        - output: scalar

    Examples::

        >>> from flashcl.integrations.colpali import ColbertPairwiseNegativeCELoss
        >>> q, d, neg = torch.randn(4, 8, 16), torch.randn(4, 20, 16), torch.randn(4, 2, 20, 16)
        >>> loss = ColbertPairwiseNegativeCELoss()(q, d, neg)
    """

    _inner = ColbertPairwiseCELoss
    _inner_name = "inner_pairwise"
