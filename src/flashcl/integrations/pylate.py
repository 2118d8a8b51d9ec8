"""pylate's losses (``Contrastive``, ``CachedContrastive``, ``Distillation``) with
pylate's constructors and calls, computed by flashcl: subclasses of pylate's own
classes, so replacing ``from pylate import losses`` by ``from flashcl.integrations
import pylate as losses`` is the whole change. The B x N x Lq x Ld token scores are
never formed (:func:`flashcl.maxsim_loss` and :func:`flashcl.maxsim_scores`,
``backend="tiled"`` from 2^22 token scores); pylate's ``score_mini_batch_size``
is not needed and is ignored.

pylate's conventions are kept, not the exact masked maximum of
:func:`flashcl.maxsim_loss`:

* the token embeddings are L2-normalised, the masks are the attention mask and (for
  documents) the model's skiplist;
* a masked score is multiplied by 0, not excluded: a masked document token scores 0
  and takes part in the max, a masked query token adds 0 (with the model's
  ``do_query_expansion`` no query token is masked);
* the documents of the columns are stacked per query (``scores[i, j * N + k]``:
  query ``i`` against column ``k`` of row ``j``; the positive of query ``i`` is
  column 0 of row ``i``);
* ``gather_across_devices=True``: this process's queries against every process's
  documents, gathered with their gradient, the loss times the world size;
* ``CachedContrastive``: the cached gradients are those of the sum of the queries'
  losses (times the world size when gathering) whatever ``size_average``, as pylate
  caches them; the value is the mean with ``size_average=True``.

A ``score_metric`` other than pylate's default (``ColBERTScores`` / ``colbert_kd_scores``),
a subclass of ``ColBERTScores`` that overrides its ``__call__`` included, is computed by
pylate itself, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .. import parallel
from ..base import peer_import_error
from ..losses.maxsim import maxsim_loss, maxsim_scores
from .options import FlashclOptions

try:
    from pylate import losses as _pl_losses
    from pylate.losses.contrastive import extract_skiplist_mask
    from pylate.scores import ColBERTScores, colbert_kd_scores
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise peer_import_error("pylate", "pylate", "pylate", e) from e

__all__ = ["Contrastive", "CachedContrastive", "Distillation"]


def _model_attr(model: Any, name: str) -> Any:
    """An attribute of the model, or of the module a (D)DP wrapper holds."""
    return getattr(model, name) if hasattr(model, name) else getattr(model.module, name)


def _zeroed(x: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``x`` with its masked tokens' embeddings multiplied by 0: their scores are 0,
    as pylate's multiplication of the scores by the mask makes them."""
    return x if mask is None else x * mask.unsqueeze(-1).to(x.dtype)


class _Flashcl(FlashclOptions):
    """flashcl's options (:class:`FlashclOptions`) and the fallback to pylate for a custom
    ``score_metric``."""

    backends = ("auto", "reference", "dense", "tiled")
    _warned = False

    def _own_metric(self, default: Any) -> bool:
        metric = self.score_metric  # type: ignore[attr-defined]
        # pylate's ColBERTScores, or a subclass that overrides nothing of it: flashcl's scores
        if metric is default or (isinstance(metric, ColBERTScores) and type(metric).__call__ is ColBERTScores.__call__):
            return True
        if not self._warned:
            warnings.warn(
                f"flashcl computes {type(self).__name__} with pylate's default score_metric only; pylate's own "
                "implementation is used for this one (same value, its token-score memory)",
                stacklevel=3,
            )
            self._warned = True
        return False

    def _contrastive(self, embeddings: List[Tensor], masks: List[Tensor], reduction: str) -> Tuple[Tensor, float]:
        """The cross-entropy of this process's queries against every stacked document
        (pylate's ``Contrastive``), reduced, and the factor pylate multiplies it by."""
        query, docs, dmasks = embeddings[0], embeddings[1:], masks[1:]
        b, n = query.shape[0], len(docs)
        offset, factor = 0, 1.0
        if getattr(self, "gather_across_devices", False) and dist.is_available() and dist.is_initialized():
            gathered = [parallel.all_gather_with_grad(x) for x in docs]
            offset = gathered[0][1]
            docs = [x for x, _ in gathered]
            dmasks = [parallel.gather_plain(m.to(torch.uint8), dist.group.WORLD).bool() for m in dmasks]
            factor = float(dist.get_world_size())
        stacked = torch.stack([_zeroed(x, m) for x, m in zip(docs, dmasks)], dim=1)
        qmask = None if _model_attr(self.model, "do_query_expansion") else masks[0]  # type: ignore[attr-defined]
        index = (torch.arange(b, device=query.device) + offset) * n
        loss = maxsim_loss(
            _zeroed(query, qmask),
            stacked.flatten(0, 1),
            index,
            temperature=float(self.temperature),  # type: ignore[attr-defined]
            reduction=reduction,
            backend=self.backend,
            block_size=self.block_size,
        )
        return loss, factor


class Contrastive(_Flashcl, _pl_losses.Contrastive):
    """pylate's ``Contrastive`` (cross-entropy over in-batch and hard negative
    documents of ColBERT MaxSim scores), computed by flashcl.

    Takes pylate's arguments (``model``, ``score_metric``, ``score_mini_batch_size``,
    ``size_average``, ``gather_across_devices``, ``temperature``)
    (``score_mini_batch_size`` is not needed: the scores are tiled), and:

    Args:
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (flashcl's).
        block_size: queries per tile of the tiled backend (flashcl's); None picks one.

    Examples::

        >>> from flashcl.integrations import pylate as losses
        >>> # loss = losses.Contrastive(model=colbert_model, temperature=0.05)
    """

    def __init__(
        self,
        model: Any,
        score_metric: Any = None,
        score_mini_batch_size: Optional[int] = None,
        size_average: bool = True,
        gather_across_devices: bool = False,
        temperature: float = 1.0,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(model, score_metric, score_mini_batch_size, size_average, gather_across_devices, temperature)
        self.set_flashcl_options(backend, block_size)

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Optional[Tensor] = None) -> Tensor:
        if not self._own_metric(None):
            return super().forward(sentence_features, labels)
        features = list(sentence_features)
        embeddings = [F.normalize(self.model(f)["token_embeddings"], p=2, dim=-1) for f in features]
        masks = extract_skiplist_mask(features, _model_attr(self.model, "skiplist"))
        loss, factor = self._contrastive(embeddings, masks, "mean" if self.size_average else "sum")
        return loss * factor


class CachedContrastive(_Flashcl, _pl_losses.CachedContrastive):
    """pylate's ``CachedContrastive`` (GradCache: the batch embedded in mini-batches
    without a graph, the loss's gradient w.r.t. the embeddings cached, then the
    mini-batches embedded again with their graph), the loss computed by flashcl in one
    tiled pass.

    Takes pylate's arguments (``model``, ``score_metric``, ``mini_batch_size``,
    ``score_mini_batch_size``, ``size_average``, ``gather_across_devices``,
    ``show_progress_bar``, ``temperature``), and:

    Args:
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (flashcl's).
        block_size: queries per tile of the tiled backend (flashcl's); None picks one.

    Examples::

        >>> from flashcl.integrations import pylate as losses
        >>> # loss = losses.CachedContrastive(model=colbert_model, mini_batch_size=32)
    """

    def __init__(
        self,
        model: Any,
        score_metric: Any = None,
        mini_batch_size: int = 32,
        score_mini_batch_size: Optional[int] = None,
        size_average: bool = True,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        temperature: float = 1.0,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(
            model,
            score_metric,
            mini_batch_size,
            score_mini_batch_size,
            size_average,
            gather_across_devices,
            show_progress_bar,
            temperature,
        )
        self.set_flashcl_options(backend, block_size)

    def calculate_loss(self, reps: List[List[Tensor]], masks: List[Tensor], with_backward: bool = False) -> Tensor:
        if not self._own_metric(None):
            return super().calculate_loss(reps, masks, with_backward)
        embeddings = [torch.cat(r) for r in reps]
        loss, factor = self._contrastive(embeddings, masks, "sum")
        loss = loss * factor
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss / embeddings[0].shape[0] if self.size_average else loss


class Distillation(_Flashcl, _pl_losses.Distillation):
    """pylate's ``Distillation`` (KL divergence from the teacher's softmax over each
    query's documents to the student's ColBERT MaxSim log-softmax, the scores
    min-max normalised per query with ``normalize_scores=True``), computed by flashcl
    a block of queries at a time.

    Takes pylate's arguments (``model``, ``score_metric``, ``size_average``,
    ``normalize_scores``), and:

    Args:
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (flashcl's).
        block_size: queries per tile of the tiled backend (flashcl's); None picks one.

    Examples::

        >>> from flashcl.integrations import pylate as losses
        >>> # loss = losses.Distillation(model=colbert_model)
    """

    def __init__(
        self,
        model: Any,
        score_metric: Any = colbert_kd_scores,
        size_average: bool = True,
        normalize_scores: bool = True,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(model, score_metric, size_average, normalize_scores)
        self.set_flashcl_options(backend, block_size)

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Tensor) -> Tensor:
        if not self._own_metric(colbert_kd_scores):
            return super().forward(sentence_features, labels)
        features = list(sentence_features)
        query = F.normalize(self.model(features[0])["token_embeddings"], p=2, dim=-1)
        docs = F.normalize(self.model(features[1])["token_embeddings"], p=2, dim=-1)
        docs = docs.view(query.shape[0], -1, *docs.shape[1:])
        masks = extract_skiplist_mask(features, _model_attr(self.model, "skiplist"))
        dmask = masks[1].view(query.shape[0], -1, *masks[1].shape[1:])
        qmask = None if _model_attr(self.model, "do_query_expansion") else masks[0]
        scores = maxsim_scores(
            _zeroed(query, qmask), _zeroed(docs, dmask), backend=self.backend, block_size=self.block_size
        )
        if self.normalize_scores:
            hi, lo = scores.max(dim=1, keepdim=True).values, scores.min(dim=1, keepdim=True).values
            scores = (scores - lo) / (hi - lo + 1e-8)
        # pylate's KLDivLoss(log_target=True), with 0 log 0 = 0 where a teacher score is -inf
        # (a ruled-out or padded candidate), where torch's exp(target) * (target - input) is NaN
        if bool((labels == float("-inf")).all(-1).any()):
            raise ValueError("labels: a query's teacher scores are all -inf (no target distribution)")
        target = F.log_softmax(labels, dim=-1)
        # pylate's KLDivLoss(log_target=True) forms exp(t) (t - input): NaN where a teacher score is
        # -inf (0 x -inf); a finite t whose exp is 0 there gives the formula's 0 log 0 = 0, no gradient
        target = target.masked_fill(target == float("-inf"), -1e4)
        return self.loss_function(F.log_softmax(scores, dim=-1), target)
