"""sentence-transformers' pairwise ranking, batch triplet and supervised contrastive losses, computed by
flashcl (``pip install sentence-transformers``); also importable from
:mod:`flashcl.integrations.sentence_transformers`.

* :class:`CoSENTLoss` and :class:`AnglELoss`: subclasses of sentence-transformers'
  classes (plus ``backend``), the pairwise ranking of scored pairs by
  :func:`flashcl.cosent_loss` (a running log-sum-exp over the pairs sorted by
  label); another ``similarity_fct`` is computed by sentence-transformers' code,
  with a warning.
* :class:`BatchAllTripletLoss`, :class:`BatchHardTripletLoss`,
  :class:`BatchSemiHardTripletLoss`, :class:`BatchHardSoftMarginTripletLoss`:
  subclasses of sentence-transformers' classes (plus ``backend`` and
  ``block_size``), computed by :func:`flashcl.triplet_loss` in row blocks of
  distances; another ``distance_metric`` is computed by sentence-transformers'
  code, with a warning.
* :class:`SupConLoss`: supervised contrastive loss over a labelled text column
  (:func:`flashcl.supcon_loss`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional

from torch import Tensor, nn

from ..base import peer_import_error
from ..losses.supcon import supcon_loss
from .options import FlashclOptions

try:
    try:  # sentence-transformers >= 6 (the top-level ``losses`` is a deprecated alias there)
        from sentence_transformers.sentence_transformer import losses as _st_losses
    except ImportError:
        from sentence_transformers import losses as _st_losses  # type: ignore[attr-defined,no-redef]
    from sentence_transformers.util import pairwise_angle_sim, pairwise_cos_sim
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise peer_import_error("sentence_transformers", "sentence-transformers", "sentence_transformers", e) from e

__all__ = [
    "CoSENTLoss",
    "AnglELoss",
    "BatchAllTripletLoss",
    "BatchHardTripletLoss",
    "BatchSemiHardTripletLoss",
    "BatchHardSoftMarginTripletLoss",
    "SupConLoss",
]


_COSENT_SIMILARITIES = {pairwise_cos_sim: "cosine", pairwise_angle_sim: "angle"}


class _CoSENT(FlashclOptions, _st_losses.CoSENTLoss):
    """The CoSENT computation of :class:`CoSENTLoss` and :class:`AnglELoss`; flashcl's
    ``backend`` (:class:`FlashclOptions`)."""

    _warned = False
    backends = ("auto", "reference", "dense", "tiled")
    config_keys = ("backend",)

    def compute_loss_from_embeddings(self, embeddings: List[Tensor], labels: Tensor) -> Tensor:
        similarity = _COSENT_SIMILARITIES.get(self.similarity_fct)
        if similarity is None or len(embeddings) != 2:
            if not self._warned:
                why = f"similarity_fct={getattr(self.similarity_fct, '__name__', self.similarity_fct)!r}"
                warnings.warn(
                    f"flashcl does not compute {type(self).__name__} with "
                    f"{why if similarity is None else f'{len(embeddings)} columns'}; sentence-transformers' "
                    "own implementation is used (same value)",
                    stacklevel=2,
                )
                self._warned = True
            return super().compute_loss_from_embeddings(embeddings, labels)
        from ..losses.cosent import cosent_loss

        if labels.numel() != embeddings[0].shape[0]:
            raise ValueError(
                f"{type(self).__name__} expects {embeddings[0].shape[0]} labels (one per example), "
                f"but got {labels.numel()} labels with shape {tuple(labels.shape)}."
            )
        return cosent_loss(
            embeddings[0],
            embeddings[1],
            labels.reshape(-1),
            scale=self.scale,
            similarity=similarity,
            backend=self.backend,
        )


class CoSENTLoss(_CoSENT):
    """sentence-transformers' ``CoSENTLoss``, computed by :func:`flashcl.cosent_loss`
    (the same value and gradients, including for ``pairwise_angle_sim``).

    Args:
        model: the SentenceTransformer being trained.
        scale: the inverse temperature. Default 20.
        similarity_fct: ``pairwise_cos_sim`` (default) or ``pairwise_angle_sim``;
            another function is computed by sentence-transformers' code.
        backend: ``"auto"`` | ``"tiled"`` | ``"dense"`` | ``"reference"``.

    Shape:
        Input columns (sentence1, sentence2) and a float score per pair; the loss is
        a scalar.

    Examples::

        >>> from flashcl.integrations.sentence_transformers import CoSENTLoss
        >>> # loss = CoSENTLoss(model)   # model: a SentenceTransformer
        >>> # SentenceTransformerTrainer(model=model, train_dataset=scored_pairs, loss=loss).train()
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = pairwise_cos_sim,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__(model, scale=scale, similarity_fct=similarity_fct)  # type: ignore[arg-type]
        self.set_flashcl_options(backend)


class AnglELoss(_st_losses.AnglELoss, _CoSENT):
    """sentence-transformers' ``AnglELoss`` (CoSENT on ``pairwise_angle_sim``),
    computed by :func:`flashcl.cosent_loss` with ``similarity="angle"``; its
    (anchor, positive, negative, ...) columns are turned into pairs by
    sentence-transformers' own code first.

    Args:
        model: the SentenceTransformer being trained.
        scale: the inverse temperature. Default 20.
        backend: ``"auto"`` | ``"tiled"`` | ``"dense"`` | ``"reference"``.

    Examples::

        >>> from flashcl.integrations.sentence_transformers import AnglELoss
        >>> # loss = AnglELoss(model)
    """

    def __init__(self, model: nn.Module, scale: float = 20.0, *, backend: str = "auto") -> None:
        super().__init__(model, scale=scale)  # type: ignore[arg-type]
        self.set_flashcl_options(backend)


def _triplet_distances() -> Dict[Any, str]:
    from sentence_transformers.sentence_transformer.losses.batch_hard_triplet import (
        BatchHardTripletLossDistanceFunction as functions,
    )

    return {functions.euclidean_distance: "euclidean", functions.cosine_distance: "cosine"}


class _Triplet(FlashclOptions):
    """The batch triplet losses' computation by :func:`flashcl.triplet_loss`, and
    their constructor: sentence-transformers' arguments (``margin`` where the loss
    has one) plus ``backend`` and ``block_size``."""

    _warned = False
    backends = ("auto", "reference", "dense", "tiled")
    _mining = "all"
    _soft = False

    def __init__(
        self,
        model: nn.Module,
        distance_metric: Any = None,
        margin: float = 5,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        kw: Dict[str, Any] = {} if distance_metric is None else {"distance_metric": distance_metric}
        if not self._soft:
            kw["margin"] = margin
        super().__init__(model, **kw)  # type: ignore[call-arg]
        self.set_flashcl_options(backend, block_size)

    def _flashcl_triplet(self, labels: Tensor, embeddings: Tensor, fallback: Callable[..., Tensor]) -> Tensor:
        from ..losses.triplet import triplet_loss

        metric = self.distance_metric  # type: ignore[attr-defined]
        distance = _triplet_distances().get(metric)
        if distance is None:
            if not self._warned:
                warnings.warn(
                    f"flashcl does not compute {type(self).__name__} with distance_metric="
                    f"{getattr(metric, '__name__', metric)!r}; sentence-transformers' own implementation is "
                    "used (same value, its B^2 memory)",
                    stacklevel=3,
                )
                self._warned = True
            return fallback(labels, embeddings)
        margin = 0.0 if self._soft else float(getattr(self, "triplet_margin", getattr(self, "margin", 0.0)))
        return triplet_loss(
            embeddings,
            labels.reshape(-1),
            margin=margin,
            mining=self._mining,
            soft_margin=self._soft,
            distance=distance,
            backend=self.backend,
            block_size=self.block_size,
        )


_TRIPLET_ARGS = """
    Args:
        model: the SentenceTransformer being trained.
        distance_metric: sentence-transformers' euclidean (default) or cosine
            distance; another is computed by sentence-transformers' code.
        margin: Default 5 (the soft-margin loss has none: passing one is a
            TypeError, as in sentence-transformers).
        backend, block_size: :func:`flashcl.triplet_loss`'s.
"""


class BatchAllTripletLoss(_Triplet, _st_losses.BatchAllTripletLoss):
    __doc__ = (
        """sentence-transformers' ``BatchAllTripletLoss`` (every valid triplet; the mean
    over those with a positive loss), computed by :func:`flashcl.triplet_loss`
    without the triplets: the same value and gradients in O(block x B) memory.
"""
        + _TRIPLET_ARGS
        + """
    Examples::

        >>> from flashcl.integrations.sentence_transformers import BatchAllTripletLoss
        >>> # loss = BatchAllTripletLoss(model)   # a SentenceTransformer; texts with integer labels
    """
    )

    _mining = "all"

    def batch_all_triplet_loss(self, labels: Tensor, embeddings: Tensor) -> Tensor:
        return self._flashcl_triplet(labels, embeddings, super().batch_all_triplet_loss)


class BatchHardTripletLoss(_Triplet, _st_losses.BatchHardTripletLoss):
    __doc__ = (
        """sentence-transformers' ``BatchHardTripletLoss`` (each anchor's hardest
    positive and negative), computed by :func:`flashcl.triplet_loss`.
"""
        + _TRIPLET_ARGS
        + """
    Examples::

        >>> from flashcl.integrations.sentence_transformers import BatchHardTripletLoss
        >>> # loss = BatchHardTripletLoss(model, margin=1.0)
    """
    )

    _mining = "hard"

    def batch_hard_triplet_loss(self, labels: Tensor, embeddings: Tensor) -> Tensor:
        return self._flashcl_triplet(labels, embeddings, super().batch_hard_triplet_loss)


class BatchSemiHardTripletLoss(_Triplet, _st_losses.BatchSemiHardTripletLoss):
    __doc__ = (
        """sentence-transformers' ``BatchSemiHardTripletLoss`` (per positive pair, the
    closest negative farther than the positive), computed by :func:`flashcl.triplet_loss`.
"""
        + _TRIPLET_ARGS
        + """
    Examples::

        >>> from flashcl.integrations.sentence_transformers import BatchSemiHardTripletLoss
        >>> # loss = BatchSemiHardTripletLoss(model)
    """
    )

    _mining = "semi-hard"

    def batch_semi_hard_triplet_loss(self, labels: Tensor, embeddings: Tensor) -> Tensor:
        return self._flashcl_triplet(labels, embeddings, super().batch_semi_hard_triplet_loss)


class BatchHardSoftMarginTripletLoss(_Triplet, _st_losses.BatchHardSoftMarginTripletLoss):
    __doc__ = (
        """sentence-transformers' ``BatchHardSoftMarginTripletLoss`` (``softplus`` of the
    hardest positive's distance minus the hardest negative's), computed by
    :func:`flashcl.triplet_loss` (``mining="hard", soft_margin=True, margin=0``).
"""
        + _TRIPLET_ARGS
        + """
    Examples::

        >>> from flashcl.integrations.sentence_transformers import BatchHardSoftMarginTripletLoss
        >>> # loss = BatchHardSoftMarginTripletLoss(model)
    """
    )

    _mining = "hard"
    _soft = True

    def __init__(
        self,
        model: nn.Module,
        distance_metric: Any = None,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:  # sentence-transformers' signature: no margin (a soft margin has none)
        super().__init__(model, distance_metric, backend=backend, block_size=block_size)

    def batch_hard_triplet_soft_margin_loss(self, labels: Tensor, embeddings: Tensor) -> Tensor:
        return self._flashcl_triplet(labels, embeddings, super().batch_hard_triplet_soft_margin_loss)


class SupConLoss(FlashclOptions, nn.Module):
    """Supervised contrastive loss for sentence-transformers: one text column
    and one integer label per text; texts with the same label are positives.

    Args:
        model: the SentenceTransformer being trained.
        temperature: softmax temperature. Default 0.1.
        positives: ``"mean"`` (Khosla et al. L_out, default) or ``"sum"`` (the
            supervised-SimCSE form: one softmax over all positives).
        include_self: keep each text's own column in its denominator.
        backend, block_size: as in :func:`flashcl.supcon_loss`.

    Shape:
        Input: one column of B texts; labels (B,) integers. Output: scalar.

    Examples::

        >>> from flashcl.integrations.sentence_transformers import SupConLoss
        >>> # dataset columns: "text", "label"; loss = SupConLoss(model, temperature=0.05)
        >>> # SentenceTransformerTrainer(model=model, train_dataset=dataset, loss=loss).train()
    """

    def __init__(
        self,
        model: nn.Module,
        temperature: float = 0.1,
        positives: str = "mean",
        include_self: bool = False,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.temperature, self.positives, self.include_self = temperature, positives, include_self
        self.set_flashcl_options(backend, block_size)

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Tensor) -> Tensor:
        features = list(sentence_features)
        if len(features) != 1:
            raise ValueError(f"SupConLoss takes one text column and a label column, got {len(features)} text columns")
        embeddings = self.model(features[0])["sentence_embedding"]
        return self.compute_loss_from_embeddings(embeddings, labels)

    def compute_loss_from_embeddings(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        return supcon_loss(
            embeddings,
            labels,
            temperature=self.temperature,
            positives=self.positives,
            include_self=self.include_self,
            backend=self.backend,
            block_size=self.block_size,
        )

    def get_config_dict(self) -> Dict[str, Any]:
        options = {"temperature": self.temperature, "positives": self.positives, "include_self": self.include_self}
        return {**options, "backend": self.backend, "block_size": self.block_size}
