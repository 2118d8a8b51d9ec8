"""pytorch-metric-learning's ``SupConLoss`` and ``NTXentLoss``, computed by flashcl
(``pip install pytorch-metric-learning``; imported only when this module is).

Both are subclasses of PML's classes: the same constructor (``temperature``,
``distance``, ``reducer``, ``embedding_regularizer``, ...) plus ``backend`` /
``block_size``, the same call ``loss(embeddings, labels, indices_tuple=None,
ref_emb=None, ref_labels=None)``, so that PML's wrappers (``SelfSupervisedLoss``,
``CrossBatchMemory``) take them. flashcl computes the loss whenever the
similarity is a dot product (PML's ``CosineSimilarity`` or
``DotProductSimilarity``, ``p=2``, ``power=1``) and no ``indices_tuple`` (miner
output) is given; ``ref_emb`` / ``ref_labels`` are supported. Anything else is
computed by PML's own code, with a warning that says why (the same value, PML's
memory). Exactly as PML, the loss is 0 (with a zero gradient) when the batch
has no positive pair or no negative pair: a batch of one sample, or one whose
labels are all equal.

* :class:`SupConLoss`: SupCon L_out (:func:`flashcl.supcon_loss`): flashcl's
  per-anchor losses go through PML's reducer (its default ``AvgNonZeroReducer``
  averages the anchors whose loss is > 0: not those without a positive, nor
  those whose loss PML's arithmetic rounds to 0).
* :class:`CosFaceLoss` and :class:`ArcFaceLoss`: PML's margin softmax over its
  class weights ``W`` (D, C), computed by :func:`flashcl.cosface_loss` /
  :func:`flashcl.arcface_loss` over blocks of classes (never the B x C logits);
  the per-sample losses go through PML's reducer, miner weights and weight
  regularizer as in PML.
* :class:`TripletMarginLoss`: every triplet of the batch (PML's default
  ``triplets_per_anchor="all"``), computed by :func:`flashcl.triplet_loss` from each
  row's sorted distances (never the B^3 triplets nor, with the tiled backend, the
  B x B matrix); PML's reducer for the mean over the triplets with a positive loss
  (its default), over all triplets, or their sum; PML's embedding regularizers.
* :class:`MultiSimilarityLoss` (with :class:`MultiSimilarityMiner`) and
  :class:`CircleLoss`: :func:`flashcl.multi_similarity_loss` / :func:`flashcl.circle_loss`
  (each row's mined sets and log-sums on tiles, never the B x B matrix); the miner's
  output is a :class:`MinedPairs` that the loss mines itself with (PML's pair lists are
  formed only where something reads them); PML's reducer and regularizers. Pairs from
  another miner (PML's own ``indices_tuple``: pairs or triplets; for ``CircleLoss`` the
  miner's pairs too) are the positives and negatives of a two-set
  :func:`flashcl.flex_loss` (:class:`PairLists`), read tile by tile, and so are the pairs of
  the rows and ``ref_emb`` (with ``ref_labels`` or a miner's pairs); another distance, or
  lists pairing a sample with itself, are computed by PML's code.
* :class:`ProxyAnchorLoss`: :func:`flashcl.proxy_anchor_loss` over the module's
  ``proxies`` (initialised and cast as PML's), never the B x C matrix; PML's default
  ``DivisorReducer`` and its regularizers; a miner's ``indices_tuple`` as PML's row
  weights (a two-set :func:`flashcl.flex_loss` of the proxies against the rows).
* :class:`NTXentLoss`: PML's formula, which differs from
  :func:`flashcl.nt_xent_loss` when an anchor has several positives: every
  positive pair ``(a, p)`` is its own softmax against ``a``'s negatives::

      loss = mean_{(a, p): y_a = y_p, a != p} softplus( LSE_{n: y_n != y_a} s_an - s_ap )

  PML builds a (positive pairs x negative pairs) matrix for it (654 GB at B = 1024
  with 5 classes); here rows are processed in blocks, memory O(B D + block x B).
  Other reducers than PML's default ``MeanReducer`` run PML's code.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import checks, runner
from ..base import peer_import_error
from ..core import CoreSpec, compute_dtype
from ..losses.circle import circle_loss
from ..losses.contrastive import contrastive_loss
from ..losses.flex import FlexCircle, FlexMultiSimilarity, FlexPairSum, flex_loss
from ..losses.multi_similarity import multi_similarity_loss
from ..losses.pair_nt_xent import pair_nt_xent
from ..losses.proxy_anchor import ProxyAnchorSets, proxy_anchor_loss
from .options import FlashclOptions

try:
    from pytorch_metric_learning import distances as _pml_distances
    from pytorch_metric_learning import losses as _pml_losses
    from pytorch_metric_learning import miners as _pml_miners
    from pytorch_metric_learning import reducers as _pml_reducers
    from pytorch_metric_learning.utils import loss_and_miner_utils as _pml_lmu
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise peer_import_error("pytorch_metric_learning", "pytorch-metric-learning", "pytorch_metric_learning", e) from e

__all__ = [
    "MultiSimilarityLoss",
    "MultiSimilarityMiner",
    "MinedPairs",
    "CircleLoss",
    "ProxyAnchorLoss",
    "SupConLoss",
    "NTXentLoss",
    "CrossBatchMemory",
    "CosFaceLoss",
    "ArcFaceLoss",
    "SubCenterArcFaceLoss",
    "TripletMarginLoss",
    "ContrastiveLoss",
]


def _dot_similarity(distance: Any) -> Optional[bool]:
    """``normalize`` for a PML distance that is a (cosine) dot product; None otherwise."""
    if type(distance) not in (_pml_distances.CosineSimilarity, _pml_distances.DotProductSimilarity):
        return None
    if distance.p != 2 or distance.power != 1:
        return None
    return bool(distance.normalize_embeddings)


def _loss_reducer(loss: Any) -> Any:
    """The reducer PML applies to the loss itself (an embedding regularizer makes
    PML wrap one reducer per term in ``MultipleReducers``)."""
    reducer = loss.reducer
    if isinstance(reducer, _pml_reducers.MultipleReducers):
        return reducer.reducers["loss"]
    return reducer


def _why_not(
    loss: Any, labels: Optional[Tensor], indices_tuple: Any, ref_emb: Optional[Tensor], ref_labels: Optional[Tensor]
) -> Optional[str]:
    """Why flashcl cannot compute this call, or None."""
    if indices_tuple is not None:
        return (
            "indices_tuple (a miner's pairs, or PML's CrossBatchMemory's; flashcl's CrossBatchMemory "
            "computes the queue without them) is given"
        )
    if labels is None:
        return "labels is None"
    if ref_emb is not None and ref_labels is None:
        return "ref_emb is given without ref_labels"
    if _dot_similarity(loss.distance) is None:
        return f"distance={type(loss.distance).__name__} (p={loss.distance.p}, power={loss.distance.power})"
    return None


class _Pairs:
    """The all-pairs structure PML builds from labels, without the M x N masks:
    class ids on both sides, whether the diagonal is removed from the positives
    (PML does so when ``ref_labels is labels``), and the pair counts."""

    def __init__(
        self, labels: Tensor, ref_labels: Tensor, self_pairs: bool, self_index: Optional[Tensor] = None
    ) -> None:
        uniq, ids = torch.unique(torch.cat([labels.reshape(-1), ref_labels.reshape(-1)]), return_inverse=True)
        m = labels.shape[0]
        self.row_ids, self.col_ids = ids[:m], ids[m:]
        self.num_classes = int(uniq.numel())
        self.self_pairs = self_pairs or self_index is not None
        self.self_index = self_index  # each anchor's own slot in a queue (CrossBatchMemory), not the diagonal
        per_class = torch.bincount(self.col_ids, minlength=self.num_classes)
        same = int(per_class[self.row_ids].sum())
        if self_index is not None:  # the anchors whose own slot holds their label
            own = self.col_ids[self_index.clamp_min(0)] == self.row_ids
            removed = int((own & (self_index >= 0)).sum())
        else:
            removed = min(m, ref_labels.shape[0]) if self_pairs else 0
        self.positive_pairs = same - removed
        self.negative_pairs = m * ref_labels.shape[0] - same

    def pml_returns_zero(self) -> bool:
        """PML's loss is 0 without a positive or without a negative pair (and when
        each of its four index lists has at most one element)."""
        if self.positive_pairs <= 1 and self.negative_pairs <= 1:
            return True
        return self.positive_pairs == 0 or self.negative_pairs == 0


def _prepare_call(
    loss: Any, embeddings: Tensor, labels: Tensor, ref_emb: Optional[Tensor], ref_labels: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """(embeddings, labels, ref_emb, ref_labels, self_contrast) checked, as PML pairs them."""
    embeddings, labels = checks.validate_labelled(embeddings, labels)
    if ref_emb is None:
        return embeddings, labels, embeddings, labels, True
    ref_emb, ref_labels = checks.validate_labelled(ref_emb, ref_labels, names=("ref_emb", "ref_labels"))
    if ref_emb.shape[1] != embeddings.shape[1] or ref_emb.dtype != embeddings.dtype:
        raise ValueError(
            f"ref_emb must match embeddings in width and dtype, got {tuple(ref_emb.shape)} "
            f"{ref_emb.dtype} and {tuple(embeddings.shape)} {embeddings.dtype}"
        )
    return embeddings, labels, ref_emb, ref_labels, ref_labels is labels


class _Adapter(FlashclOptions):
    """The call shared by the adapters (flashcl's options: :class:`FlashclOptions`):
    PML's own code (with a warning) where flashcl does not compute the call, else the
    checks, PML's stats and :meth:`compute`.
    A subclass gives ``_memory`` (what PML's code holds), ``_loss_dict`` and, where
    it computes fewer settings, ``_why_not``."""

    _memory = ""

    def _why_not(
        self, labels: Optional[Tensor], indices_tuple: Any, ref_emb: Optional[Tensor], ref_labels: Optional[Tensor]
    ) -> Optional[str]:
        return _why_not(self, labels, indices_tuple, ref_emb, ref_labels)

    def forward(
        self,
        embeddings: Tensor,
        labels: Optional[Tensor] = None,
        indices_tuple: Any = None,
        ref_emb: Optional[Tensor] = None,
        ref_labels: Optional[Tensor] = None,
    ) -> Tensor:
        why = self._why_not(labels, indices_tuple, ref_emb, ref_labels)
        if why is not None:
            warnings.warn(
                f"flashcl {type(self).__name__}: {why}; computed by pytorch-metric-learning's own code "
                f"({self._memory})",
                stacklevel=2,
            )
            return super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)  # type: ignore[misc]
        assert labels is not None
        self.reset_stats()  # type: ignore[attr-defined]
        emb, labels, ref, ref_labels, self_contrast = _prepare_call(self, embeddings, labels, ref_emb, ref_labels)
        return self.compute(emb, labels, ref, ref_labels, _Pairs(labels, ref_labels, self_contrast))

    def compute(self, emb: Tensor, labels: Tensor, ref: Tensor, ref_labels: Tensor, pairs: _Pairs) -> Tensor:
        """PML's loss for checked inputs and their pair structure (the queue's, for
        :class:`CrossBatchMemory`), with PML's reducer and regularizers."""
        if pairs.pml_returns_zero():
            loss_dict = self.zero_losses()  # type: ignore[attr-defined]
        else:
            loss_dict = self._loss_dict(emb, ref, pairs)
        self.add_embedding_regularization_to_loss_dict(loss_dict, emb)  # type: ignore[attr-defined]
        return self.reducer(loss_dict, emb, labels)  # type: ignore[attr-defined]

    def _loss_dict(self, emb: Tensor, ref: Tensor, pairs: _Pairs) -> Dict[str, Any]:
        raise NotImplementedError


class SupConLoss(_Adapter, _pml_losses.SupConLoss):
    """PML's ``SupConLoss``, computed by :func:`flashcl.supcon_loss`'s core in
    O(B D) memory; see the module docstring for what falls back to PML.

    Args:
        temperature: as PML's. Default: 0.1.
        backend: flashcl's backend (``"auto"`` | ``"reference"`` | ``"dense"`` |
            ``"tiled"`` | ``"triton"``).
        block_size: rows per block of the tiled backend; None picks one.
        **kwargs: PML's (``distance``, ``reducer``, ``embedding_regularizer``, ...).

    Shape:
        - embeddings: (B, D); labels: (B,); ref_emb: (N, D); ref_labels: (N,)
        - output: scalar

    Examples::

        >>> loss = SupConLoss(temperature=0.1)(torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    """

    def __init__(
        self, temperature: float = 0.1, backend: str = "auto", block_size: Optional[int] = None, **kwargs: Any
    ) -> None:
        super().__init__(temperature=temperature, **kwargs)
        self.set_flashcl_options(backend, block_size)

    _memory = "B x B memory"

    def _loss_dict(self, emb: Tensor, ref: Tensor, pairs: _Pairs) -> Dict[str, Any]:
        # computed with float32 accumulation; returned in the embeddings' dtype, as PML's
        losses = self._flashcl(emb, ref, pairs, "none").to(emb.dtype)
        return {
            "loss": {
                "losses": self._as_pml_near_zero(emb, ref, pairs, losses),
                "indices": torch.arange(emb.shape[0], device=emb.device),
                "reduction_type": "element",
            }
        }

    def _as_pml_near_zero(self, emb: Tensor, ref: Tensor, pairs: _Pairs, losses: Tensor) -> Tensor:
        """The losses, those within rounding of 0 replaced by PML's own.

        PML's default reducer (``AvgNonZeroReducer``) averages the losses that are
        > 0, and whether a loss within rounding of 0 is 0 depends on the arithmetic
        that formed it: where an anchor's positive outweighs the rest of its row by
        more than the dtype resolves, PML's log of a sum that rounds to 1 is exactly
        0, and another order of operations may leave a few ulps (the mean then
        counts one anchor more or less). Those rows, usually none, go through
        PML's own ``_compute_loss`` (their rows of the matrix only)."""
        # |s_ij| <= |e_i| |r_j| / t: rounding error of a few ulps of that bound
        norms = 1.0 if bool(self.distance.normalize_embeddings) else torch.linalg.vector_norm(emb.detach(), dim=1)
        ref_max = (
            1.0
            if bool(self.distance.normalize_embeddings)
            else float(torch.linalg.vector_norm(ref.detach(), dim=1).max())
        )
        bound = norms * ref_max / float(self.temperature)
        near = losses.detach() <= 16 * torch.finfo(emb.dtype).eps * bound
        if not bool(near.any()):
            return losses
        rows = near.nonzero().squeeze(1)
        same = pairs.row_ids[rows].unsqueeze(1) == pairs.col_ids.unsqueeze(0)
        pos = same.clone()
        if pairs.self_index is not None:
            own = pairs.self_index[rows]
            mine = own >= 0
            pos[mine.nonzero().squeeze(1), own[mine]] = False
        elif pairs.self_pairs:
            pos[torch.arange(rows.numel(), device=rows.device), rows] = False
        neg = ~same
        if not (bool(pos.any()) and bool(neg.any())):
            return losses  # PML's code would return zeros for a subset; flashcl's values stand
        mat = self.distance(emb[rows], ref)
        pml = super()._compute_loss(mat, pos.to(mat.dtype), neg.to(mat.dtype))["loss"]["losses"]
        return losses.index_put((rows,), pml)

    def _flashcl(self, emb: Tensor, ref: Tensor, pairs: _Pairs, reduction: str) -> Tensor:
        normalize = _dot_similarity(self.distance)
        assert normalize is not None
        temperature = checks.check_positive_scalar(
            self.temperature, "temperature", emb.device, compute_dtype(emb.dtype)
        )
        spec = CoreSpec(
            exclude_self=pairs.self_pairs,
            self_pairs=pairs.self_pairs,
            row_labels=pairs.row_ids,
            col_labels=pairs.col_ids,
            num_classes=pairs.num_classes,
            pos_mode="mean",
            normalize=normalize,
            self_index=pairs.self_index,
        )
        return runner.run_core(
            emb, None if ref is emb else ref, 1.0 / temperature, spec, reduction, self.backend, self.block_size
        )


class NTXentLoss(_Adapter, _pml_losses.NTXentLoss):
    """PML's ``NTXentLoss`` exactly (see the module docstring), in O(B D + block x B)
    memory.

    Args:
        temperature: as PML's. Default: 0.07.
        backend: flashcl's backend (``"auto"`` | ``"dense"`` | ``"tiled"``: every
            positive pair's softmax is a head of the tile engine, without a Triton kernel).
        block_size: rows per block of the tiled backend; None picks one.
        **kwargs: PML's (``distance``, ``reducer``, ``embedding_regularizer``, ...).

    Shape:
        - embeddings: (B, D); labels: (B,); ref_emb: (N, D); ref_labels: (N,)
        - output: scalar (the mean over positive pairs; 0 if there are none)

    Examples::

        >>> loss = NTXentLoss(temperature=0.1)(torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    """

    backends = ("auto", "dense", "tiled")

    def __init__(
        self, temperature: float = 0.07, backend: str = "auto", block_size: Optional[int] = None, **kwargs: Any
    ) -> None:
        super().__init__(temperature=temperature, **kwargs)
        self.set_flashcl_options(backend, block_size)

    _memory = "positive pairs x negative pairs memory"

    def _why_not(
        self, labels: Optional[Tensor], indices_tuple: Any, ref_emb: Optional[Tensor], ref_labels: Optional[Tensor]
    ) -> Optional[str]:
        why = _why_not(self, labels, indices_tuple, ref_emb, ref_labels)
        if why is None and type(_loss_reducer(self)) is not _pml_reducers.MeanReducer:
            why = f"reducer={type(_loss_reducer(self)).__name__} needs every pair's loss"
        return why

    def _loss_dict(self, emb: Tensor, ref: Tensor, pairs: _Pairs) -> Dict[str, Any]:
        value = pair_nt_xent(
            emb,
            None if ref is emb else ref,
            (pairs.row_ids, pairs.col_ids, pairs.self_pairs, pairs.self_index),
            temperature=self.temperature,
            normalize=bool(self.distance.normalize_embeddings),
            weight=1.0 / pairs.positive_pairs,  # the mean over the positive pairs
            backend=self.backend,
            block_size=self.block_size,
        ).to(emb.dtype)
        return {"loss": {"losses": value, "indices": None, "reduction_type": "already_reduced"}}


class CrossBatchMemory(_pml_losses.CrossBatchMemory):
    """PML's ``CrossBatchMemory`` (a queue of past embeddings as extra keys), the
    same constructor and call. Around flashcl's :class:`SupConLoss` or
    :class:`NTXentLoss`, with no miner, ``indices_tuple`` or ``enqueue_mask``, the
    loss over the queue is computed by flashcl: each anchor against every queue
    entry but its own, in O(B D) memory beyond the queue, where PML builds index
    lists of every (anchor, entry) pair and B x memory_size masks. Otherwise PML's
    own code runs (with a warning if a flashcl adapter then falls back).

    Shape:
        - embeddings: (B, embedding_size); labels: (B,)
        - output: scalar

    Examples::

        >>> loss_fn = CrossBatchMemory(SupConLoss(temperature=0.1), embedding_size=4, memory_size=16)
        >>> loss = loss_fn(torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    """

    embedding_memory: Tensor
    label_memory: Tensor

    def forward(
        self, embeddings: Tensor, labels: Tensor, indices_tuple: Any = None, enqueue_mask: Optional[Tensor] = None
    ) -> Tensor:
        ours = isinstance(self.loss, (SupConLoss, NTXentLoss))
        if not ours or self.miner is not None or indices_tuple is not None or enqueue_mask is not None:
            return super().forward(embeddings, labels, indices_tuple, enqueue_mask)
        embeddings, labels = checks.validate_labelled(embeddings, labels)
        if embeddings.shape[0] > len(self.embedding_memory):
            raise ValueError(
                f"a batch of {embeddings.shape[0]} rows does not fit memory_size {len(self.embedding_memory)}"
            )
        self.reset_stats()
        device = embeddings.device
        self.embedding_memory = self.embedding_memory.to(device=device, dtype=embeddings.dtype)
        self.label_memory = self.label_memory.to(device=device, dtype=labels.dtype)
        self.add_to_memory(embeddings, labels, embeddings.shape[0])
        n = self.memory_size if self.has_been_filled else self.queue_idx
        keys, key_labels = self.embedding_memory[:n], self.label_memory[:n]
        # PML drops the pairs of each anchor with its own entry (curr_batch_idx)
        pairs = _Pairs(labels, key_labels, False, self_index=self.curr_batch_idx.to(device))
        # a snapshot of the queue (as PML's normalised copy of it): the next step writes into the buffer
        # before this step's backward may run
        return self.loss.compute(embeddings, labels, keys.detach().clone(), key_labels.clone(), pairs)


class _MarginAdapter(FlashclOptions):
    """PML's ``compute_loss`` for its large-margin softmax losses, with the logits'
    cross-entropy computed by flashcl over blocks of classes (``_loss``: the
    flashcl function's name); PML's constructor plus ``backend`` and ``block_size``."""

    backends = ("auto", "reference", "dense", "tiled")
    _loss = ""

    def __init__(self, *args: Any, backend: str = "auto", block_size: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_flashcl_options(backend, block_size)

    def compute_loss(
        self, embeddings: Tensor, labels: Tensor, indices_tuple: Any, ref_emb: Any, ref_labels: Any
    ) -> Dict[str, Any]:
        from pytorch_metric_learning.utils import common_functions as c_f
        from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

        from ..losses import margin

        c_f.labels_required(labels)
        c_f.ref_not_supported(embeddings, labels, ref_emb, ref_labels)
        self.cast_types(embeddings.dtype, embeddings.device)  # type: ignore[attr-defined]
        miner_weights = lmu.convert_to_weights(indices_tuple, labels, dtype=embeddings.dtype)
        w = self.W.t()  # type: ignore[attr-defined]
        losses = getattr(margin, self._loss)(
            embeddings,
            labels.long(),
            w,
            margin=float(self.margin),  # type: ignore[attr-defined]
            scale=float(self.scale),  # type: ignore[attr-defined]
            reduction="none",
            backend=self.backend,
            block_size=self.block_size,
            subcenters=int(getattr(self, "sub_centers", 1)),
        ).to(embeddings.dtype)  # computed in float32 for half inputs; returned in theirs, as PML returns it
        loss_dict = {
            "loss": {
                "losses": losses * miner_weights,
                "indices": c_f.torch_arange_from_size(embeddings),
                "reduction_type": "element",
            }
        }
        self.add_weight_regularization_to_loss_dict(loss_dict, w)  # type: ignore[attr-defined]
        return loss_dict


class CosFaceLoss(_MarginAdapter, _pml_losses.CosFaceLoss):
    """PML's ``CosFaceLoss`` (its constructor: ``num_classes``, ``embedding_size``,
    ``margin=0.35``, ``scale=64`` and PML's keyword arguments, plus ``backend`` and
    ``block_size``), the loss computed by :func:`flashcl.cosface_loss`.

    Examples::

        >>> from flashcl.integrations.pytorch_metric_learning import CosFaceLoss
        >>> loss_fn = CosFaceLoss(num_classes=1000, embedding_size=64)
        >>> loss = loss_fn(torch.randn(8, 64), torch.randint(0, 1000, (8,)))
    """

    _loss = "cosface_loss"


class ArcFaceLoss(_MarginAdapter, _pml_losses.ArcFaceLoss):
    """PML's ``ArcFaceLoss`` (its constructor: ``num_classes``, ``embedding_size``,
    ``margin=28.6`` degrees, ``scale=64``, plus ``backend`` and ``block_size``), the
    loss computed by :func:`flashcl.arcface_loss` (PML keeps the margin in radians
    after construction, as flashcl takes it).

    Examples::

        >>> from flashcl.integrations.pytorch_metric_learning import ArcFaceLoss
        >>> loss_fn = ArcFaceLoss(num_classes=1000, embedding_size=64)
        >>> loss = loss_fn(torch.randn(8, 64), torch.randint(0, 1000, (8,)))
    """

    _loss = "arcface_loss"


class SubCenterArcFaceLoss(_MarginAdapter, _pml_losses.SubCenterArcFaceLoss):
    """PML's ``SubCenterArcFaceLoss`` (its constructor: ``num_classes``,
    ``embedding_size``, ``margin=28.6`` degrees, ``scale=64``, ``sub_centers=3``, plus
    ``backend`` and ``block_size``), the loss computed by :func:`flashcl.arcface_loss`
    with ``subcenters`` (PML's ``W`` columns ``c k .. c k + k - 1`` are class ``c``'s
    proxies; its ``get_outliers`` is PML's own).

    Examples::

        >>> from flashcl.integrations.pytorch_metric_learning import SubCenterArcFaceLoss
        >>> loss_fn = SubCenterArcFaceLoss(num_classes=100, embedding_size=64, sub_centers=3)
        >>> loss = loss_fn(torch.randn(8, 64), torch.randint(0, 100, (8,)))
    """

    _loss = "arcface_loss"


def _triplet_distance(distance: Any) -> Optional[Tuple[str, bool]]:
    """flashcl's ``(distance, normalize)`` for a PML distance, or None: ``LpDistance``
    with ``p=2`` (``power`` 1: euclidean, 2: squared) and ``CosineSimilarity``
    (``s_an - s_ap`` is ``(1 - s_ap) - (1 - s_an)``)."""
    if type(distance) is _pml_distances.LpDistance and distance.p == 2 and distance.power in (1, 2):
        return ("euclidean" if distance.power == 1 else "squared"), bool(distance.normalize_embeddings)
    if type(distance) is _pml_distances.CosineSimilarity and distance.p == 2 and distance.power == 1:
        return ("cosine", True) if distance.normalize_embeddings else None
    return None


#: PML's reducers of triplet losses, as flashcl's reductions ("all" mining: "mean"
#: over the triplets with a positive loss; "every": the mean over every triplet)
_TRIPLET_REDUCERS = {"AvgNonZeroReducer": "mean", "MeanReducer": "every", "SumReducer": "sum"}


class TripletMarginLoss(FlashclOptions, _pml_losses.TripletMarginLoss):
    """PML's ``TripletMarginLoss`` (its constructor: ``margin=0.05``, ``swap``,
    ``smooth_loss``, ``triplets_per_anchor``, ``distance``, ``reducer``,
    ``embedding_regularizer``, plus ``backend`` and ``block_size``), computed by
    :func:`flashcl.triplet_loss` over every triplet of the batch without forming them.

    flashcl computes it with PML's default and ``LpDistance(p=2)`` (``power`` 1 or 2,
    normalised or not) or ``CosineSimilarity``, the reducers ``AvgNonZeroReducer``
    (the default), ``MeanReducer`` and ``SumReducer``, labels and no ``indices_tuple``
    nor ``ref_emb``; ``swap=True``, ``smooth_loss=True`` (a softplus per triplet),
    ``triplets_per_anchor`` other than ``"all"`` (PML samples them at random), a
    miner's ``indices_tuple``, ``ref_emb``, another distance or reducer are computed by
    PML's own code, with a warning that names the case.

    Examples::

        >>> from flashcl.integrations.pytorch_metric_learning import TripletMarginLoss
        >>> loss_fn = TripletMarginLoss(margin=0.1)
        >>> loss = loss_fn(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    """

    backends = ("auto", "reference", "dense", "tiled")

    def __init__(self, *args: Any, backend: str = "auto", block_size: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_flashcl_options(backend, block_size)

    def _why_not(self, labels: Optional[Tensor], indices_tuple: Any, ref_emb: Optional[Tensor]) -> Optional[str]:
        if indices_tuple is not None:
            return "indices_tuple (a miner's triplets or pairs) is given"
        if labels is None:
            return "labels is None"
        if ref_emb is not None:
            return "ref_emb is given"
        if self.swap:
            return "swap=True"
        if self.smooth_loss:
            return "smooth_loss=True (a softplus per triplet)"
        if self.triplets_per_anchor != "all":
            return f"triplets_per_anchor={self.triplets_per_anchor!r} (PML samples them at random)"
        d = self.distance
        if _triplet_distance(d) is None:
            return (
                f"distance={type(d).__name__} (p={d.p}, power={d.power}, normalize_embeddings={d.normalize_embeddings})"
            )
        reducer = _loss_reducer(self)
        if type(reducer).__name__ not in _TRIPLET_REDUCERS or getattr(reducer, "collect_stats", False):
            return f"reducer={type(reducer).__name__}"
        return None

    def compute_loss(
        self, embeddings: Tensor, labels: Tensor, indices_tuple: Any, ref_emb: Any, ref_labels: Any
    ) -> Dict[str, Any]:
        # PML's forward sets ref_emb to the embeddings themselves when none is given
        own_ref = ref_emb is embeddings and (ref_labels is labels)
        why = self._why_not(labels, indices_tuple, None if own_ref else ref_emb)
        if why is not None:
            warnings.warn(
                f"flashcl TripletMarginLoss: {why}; computed by pytorch-metric-learning's own code "
                "(its B x B distances and B^3 triplet indices)",
                stacklevel=3,
            )
            return super().compute_loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        from ..losses.triplet import triplet_loss

        distance = _triplet_distance(self.distance)
        assert distance is not None
        reduction = _TRIPLET_REDUCERS[type(_loss_reducer(self)).__name__]
        value = triplet_loss(
            embeddings,
            labels.reshape(-1),
            margin=float(self.margin),
            mining="all",
            distance=distance[0],
            normalize=distance[1],
            reduction="sum" if reduction == "every" else reduction,
            backend=self.backend,
            block_size=self.block_size,
        )
        if reduction == "every":  # PML's MeanReducer: over every triplet, zeros included
            counts = torch.bincount(torch.unique(labels.reshape(-1), return_inverse=True)[1])
            triplets = float((counts * (counts - 1) * (labels.numel() - counts)).sum())
            value = value / max(triplets, 1.0)
        # accumulated in float32 for half inputs; returned in their dtype, as PML returns it
        value = value.to(embeddings.dtype)
        return {"loss": {"losses": value, "indices": None, "reduction_type": "already_reduced"}}


def _pair_distance(distance: Any) -> Optional[Tuple[str, bool]]:
    """flashcl's ``(distance, normalize)`` of :func:`flashcl.contrastive_loss` for a PML
    distance, or None: ``LpDistance(p=2)`` (``power`` 1: euclidean, 2: squared; of the
    normalised rows or of the rows as given), ``CosineSimilarity`` and
    ``DotProductSimilarity`` (``power`` 1)."""
    d = distance
    if type(d) is _pml_distances.LpDistance and d.p == 2 and d.power in (1, 2):
        return ("euclidean" if d.power == 1 else "squared"), bool(d.normalize_embeddings)
    normalize = _dot_similarity(d)
    return None if normalize is None else ("similarity", normalize)


#: PML's reducers of pair losses, as flashcl's pair-sum reductions (each set reduced, the sets added)
_PAIR_REDUCERS = {"AvgNonZeroReducer": "mean_nonzero", "MeanReducer": "mean", "SumReducer": "sum"}


class ContrastiveLoss(FlashclOptions, _pml_losses.ContrastiveLoss):
    """PML's ``ContrastiveLoss`` (its constructor: ``pos_margin=0``, ``neg_margin=1``,
    ``distance``, ``reducer``, ``embedding_regularizer``, plus ``backend`` and
    ``block_size``), computed by :func:`flashcl.contrastive_loss` over every pair of the
    batch (or against ``ref_emb``) without the B x B distance matrix, or, over a miner's
    pairs or triplets (``indices_tuple``), a pair-sum flex loss over exactly those pairs.

    flashcl computes it with ``LpDistance(p=2)`` (the default; ``power`` 1 or 2, normalised
    rows or not), ``CosineSimilarity`` or ``DotProductSimilarity``, and the reducers
    ``AvgNonZeroReducer`` (the default), ``MeanReducer`` and ``SumReducer`` (the same for
    both sets); another distance or reducer, or a miner's pairs that pair a sample with
    itself or put a pair in both sets, are computed by PML's own code, with a warning that
    names the case. A NaN term (a NaN embedding) makes the loss NaN, where PML's
    ``AvgNonZeroReducer`` leaves it out (``NaN > 0`` is False) and returns a number.

    Examples::

        >>> from flashcl.integrations.pytorch_metric_learning import ContrastiveLoss
        >>> loss_fn = ContrastiveLoss(pos_margin=0.0, neg_margin=0.8)
        >>> loss = loss_fn(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    """

    backends = ("auto", "reference", "dense", "tiled")

    def __init__(self, *args: Any, backend: str = "auto", block_size: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_flashcl_options(backend, block_size)

    def _set_reducers(self) -> List[Any]:
        """PML's reducer of each set (and of a regularizer's term, which PML reduces apart)."""
        reducer = self.reducer
        if isinstance(reducer, _pml_reducers.MultipleReducers):  # one per set (and per regularizer)
            return [r for name, r in reducer.reducers.items() if name in ("pos_loss", "neg_loss")]
        return [reducer]

    def _reduction(self) -> Optional[str]:
        """The reduction both sets take, or None where PML's reducers are not flashcl's."""
        parts = self._set_reducers()
        names = {type(r).__name__ for r in parts}
        if len(names) != 1 or any(getattr(r, "collect_stats", False) for r in parts):
            return None
        reducer_type = type(parts[0])
        if reducer_type is _pml_reducers.AvgNonZeroReducer and (parts[0].low != 0 or parts[0].high is not None):
            return None
        return _PAIR_REDUCERS.get(names.pop())

    def _why_not(self, labels: Optional[Tensor], indices_tuple: Any, ref_emb: Optional[Tensor]) -> Optional[str]:
        if isinstance(indices_tuple, PairLists) and indices_tuple.why_not is not None:
            return indices_tuple.why_not
        if labels is None and indices_tuple is None:
            return "labels is None"
        d = self.distance
        if _pair_distance(d) is None:
            return (
                f"distance={type(d).__name__} (p={d.p}, power={d.power}, normalize_embeddings={d.normalize_embeddings})"
            )
        if self._reduction() is None:
            return "reducer=" + ", ".join(sorted({type(r).__name__ for r in self._set_reducers()}))
        return None

    def compute_loss(
        self, embeddings: Tensor, labels: Tensor, indices_tuple: Any, ref_emb: Any, ref_labels: Any
    ) -> Dict[str, Any]:
        own_ref = ref_emb is embeddings  # PML's forward sets ref_emb to the embeddings when none is given
        keys = None if own_ref else ref_emb
        given = indices_tuple
        if indices_tuple is not None and isinstance(embeddings, Tensor) and embeddings.dim() == 2:
            n = embeddings.shape[0] if keys is None else keys.shape[0]
            indices_tuple = PairLists(tuple(indices_tuple), n, own=keys is None)
        why = self._why_not(labels, indices_tuple, keys)
        if why is not None:
            warnings.warn(
                f"flashcl ContrastiveLoss: {why}; computed by pytorch-metric-learning's own code (its B x B "
                "distance matrix)",
                stacklevel=3,
            )
            return super().compute_loss(embeddings, labels, given, ref_emb, ref_labels)
        distance, normalize = _pair_distance(self.distance)  # type: ignore[misc]
        reduction = self._reduction()
        assert reduction is not None
        m_pos, m_neg = float(self.pos_margin), float(self.neg_margin)
        if isinstance(indices_tuple, PairLists):  # exactly the miner's pairs: a pair-sum flex loss
            if distance == "similarity":
                kind = FlexPairSum()
                pos_mod, neg_mod = (lambda x, a, b: (m_pos - x).relu()), (lambda x, a, b: (x - m_neg).relu())
            else:
                kind = FlexPairSum(distance=distance)
                pos_mod, neg_mod = (lambda x, a, b: (x - m_pos).relu()), (lambda x, a, b: (m_neg - x).relu())
            value = flex_loss(
                embeddings, keys, positive=indices_tuple.positive, exclude=indices_tuple.exclude, kind=kind,
                weight=indices_tuple.multiplicity, pos_mod=pos_mod, neg_mod=neg_mod, temperature=1.0,
                normalize=normalize, reduction=reduction, backend=self.backend, block_size=self.block_size,
            )  # fmt: skip
            value = value * float(not all(length <= 1 for length in indices_tuple.lengths))
        else:
            value = contrastive_loss(
                embeddings, labels.reshape(-1), keys, None if keys is None else ref_labels.reshape(-1),
                pos_margin=m_pos, neg_margin=m_neg, distance=distance, normalize=normalize, reduction=reduction,
                backend=self.backend, block_size=self.block_size,
            )  # fmt: skip
        # accumulated in float32 for half inputs; returned in their dtype, as PML returns it
        value = value.to(embeddings.dtype)
        return {
            "pos_loss": {"losses": value, "indices": None, "reduction_type": "already_reduced"},
            "neg_loss": self.zero_loss(),
        }


class MinedPairs:
    """What :class:`MultiSimilarityMiner` returns: the miner's ``epsilon`` and its inputs,
    which :class:`MultiSimilarityLoss` mines with as it computes (no pair list). Read as
    PML's ``indices_tuple`` (``a1, p, a2, n = mined``, ``len``, indexing) by anything
    else, it forms PML's four index lists then, with PML's miner."""

    def __init__(self, miner: Any, embeddings: Tensor, labels: Tensor) -> None:
        self.epsilon, self._miner, self._inputs = float(miner.epsilon), miner, (embeddings, labels)
        self._pairs: Optional[Tuple[Tensor, ...]] = None

    def _tuple(self) -> Tuple[Tensor, ...]:
        if self._pairs is None:
            embeddings, labels = self._inputs
            with torch.no_grad():
                self._pairs = tuple(
                    _pml_miners.MultiSimilarityMiner.mine(self._miner, embeddings, labels, embeddings, labels)
                )
        return self._pairs

    def __len__(self) -> int:
        return 4

    def __iter__(self) -> Any:
        return iter(self._tuple())

    def __getitem__(self, i: Any) -> Any:
        return self._tuple()[i]


class MultiSimilarityMiner(_pml_miners.MultiSimilarityMiner):
    """PML's ``MultiSimilarityMiner(epsilon)``; its output (:class:`MinedPairs`) lets
    :class:`MultiSimilarityLoss` mine as it computes, without the B x B matrix.

    Examples::

        >>> miner = MultiSimilarityMiner(epsilon=0.1)
        >>> x, y = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = MultiSimilarityLoss()(x, y, miner(x, y))
    """

    def forward(  # type: ignore[override]
        self, embeddings: Tensor, labels: Tensor, ref_emb: Optional[Tensor] = None, ref_labels: Optional[Tensor] = None
    ) -> Any:
        if ref_emb is not None or _dot_similarity(self.distance) is not True:
            return super().forward(embeddings, labels, ref_emb, ref_labels)
        self.reset_stats()
        return MinedPairs(self, embeddings.detach(), labels)


class PairLists:
    """A miner's pairs as PML gives them (``(a1, p, a2, n)``, or triplets ``(a, p, n)``),
    read tile by tile: ``positive`` and ``exclude`` functions of a flex loss (the pairs
    ``(a1, p)`` its positives, ``(a2, n)`` its negatives, every other pair left out), from
    the pairs' sorted keys ``i * columns + j``; ``own``: the columns are the rows
    themselves (no ``ref_emb``)."""

    def __init__(self, indices_tuple: Any, columns: int, own: bool = True) -> None:
        a1, p, a2, n = (torch.as_tensor(x).long() for x in _pml_lmu.convert_to_pairs(indices_tuple, None))
        self.lengths = (len(a1), len(p), len(a2), len(n))
        self.batch = columns
        self.pos, self.pos_counts = torch.unique(a1 * columns + p, return_counts=True)
        self.neg, self.neg_counts = torch.unique(a2 * columns + n, return_counts=True)
        self.any = torch.unique(torch.cat([self.pos, a2 * columns + n]))
        #: why flashcl cannot compute them (a pair of a sample with itself, a pair in both sets), or None
        self.why_not: Optional[str] = None
        if own and (bool((a1 == p).any()) or bool((a2 == n).any())):
            self.why_not = "indices_tuple pairs a sample with itself"
        elif len(self.any) < len(self.pos) + len(torch.unique(a2 * columns + n)):
            self.why_not = "indices_tuple has a pair both positive and negative"

    def positive(self, a: Any, b: Any) -> Tensor:
        return torch.isin(a.index * self.batch + b.index, self.pos.to(a.index.device))

    def exclude(self, a: Any, b: Any) -> Tensor:
        return ~torch.isin(a.index * self.batch + b.index, self.any.to(a.index.device))

    def multiplicity(self, a: Any, b: Any) -> Tensor:
        """How many times each pair is in its list (a triplet miner repeats its pairs: PML's
        pair losses count each entry), 1 for the pairs in neither."""
        key = a.index * self.batch + b.index
        out = torch.ones(key.shape, dtype=torch.float64, device=key.device)
        for keys, counts in ((self.pos, self.pos_counts), (self.neg, self.neg_counts)):
            if keys.numel():
                keys, counts = keys.to(key.device), counts.to(key.device)
                at = torch.searchsorted(keys, key).clamp_max(keys.numel() - 1)
                out = torch.where(keys[at] == key, counts[at].to(out.dtype), out)
        return out

    def rows(self, emb: Tensor, keys: Optional[Tensor], kind: Any, backend: str, block_size: Optional[int]) -> Tensor:
        """Each anchor's loss of the two-set ``kind`` over these pairs of the rows ``emb``
        and ``keys`` (None: the rows themselves) (PML's rule: 0 when every list has at most
        one entry)."""
        rows = flex_loss(
            emb,
            keys,
            positive=self.positive,
            exclude=self.exclude,
            kind=kind,
            temperature=1.0,
            reduction="none",
            backend=backend,
            block_size=block_size,
        )
        return rows * float(not all(length <= 1 for length in self.lengths))


class _PairSets(FlashclOptions):
    """:class:`MultiSimilarityLoss` and :class:`CircleLoss`: flashcl's per-anchor losses
    (PML's rule for a batch of at most one pair of each kind inside them), then PML's
    reducer and embedding regularizers; PML's own code, with a warning, where flashcl
    does not compute the call."""

    backends = ("auto", "reference", "dense", "tiled")
    _memory = "B x B similarity and mask matrices"

    def _why_not(
        self, labels: Optional[Tensor], indices_tuple: Any, ref_emb: Optional[Tensor], ref_labels: Optional[Tensor]
    ) -> Optional[str]:
        if isinstance(indices_tuple, PairLists) and indices_tuple.why_not is not None:
            return indices_tuple.why_not
        if labels is None and not isinstance(indices_tuple, PairLists):
            return "labels is None"
        if ref_emb is not None and ref_labels is None and not isinstance(indices_tuple, PairLists):
            return "ref_emb is given without ref_labels"
        if _dot_similarity(self.distance) is not True:  # type: ignore[attr-defined]
            return f"distance={type(self.distance).__name__} (flashcl: cosine similarity)"  # type: ignore[attr-defined]
        return None

    def forward(
        self,
        embeddings: Tensor,
        labels: Optional[Tensor] = None,
        indices_tuple: Any = None,
        ref_emb: Optional[Tensor] = None,
        ref_labels: Optional[Tensor] = None,
    ) -> Tensor:
        given = indices_tuple
        keys = embeddings if ref_emb is None else ref_emb
        lists = self._pairs_as_lists(indices_tuple) or (ref_emb is not None and isinstance(indices_tuple, MinedPairs))
        if lists and isinstance(keys, Tensor) and keys.dim() == 2:
            indices_tuple = PairLists(tuple(indices_tuple), keys.shape[0], own=ref_emb is None)
        why = self._why_not(labels, indices_tuple, ref_emb, ref_labels)
        if why is not None:
            warnings.warn(
                f"flashcl {type(self).__name__}: {why}; computed by pytorch-metric-learning's own code "
                f"({self._memory})",
                stacklevel=2,
            )
            if isinstance(given, MinedPairs):
                given = tuple(given)
            return super().forward(embeddings, labels, given, ref_emb, ref_labels)  # type: ignore[misc]
        self.reset_stats()  # type: ignore[attr-defined]
        if labels is None:  # the pairs alone define the sets
            emb = checks.check_float_tensor(embeddings, "embeddings", (2,))
        else:
            emb, labels = checks.validate_labelled(embeddings, labels)
        ref = None
        if ref_emb is not None:
            ref = checks.check_keys(ref_emb, "ref_emb", emb)
            if ref_labels is not None:
                ref, ref_labels = checks.validate_labelled(ref, ref_labels)
        loss_dict = self._loss_dict(emb, labels, indices_tuple, ref, ref_labels)
        self.add_embedding_regularization_to_loss_dict(loss_dict, emb)  # type: ignore[attr-defined]
        return self.reducer(loss_dict, emb, labels)  # type: ignore[attr-defined]

    def _pairs_as_lists(self, indices_tuple: Any) -> bool:
        """Whether this call's ``indices_tuple`` is computed from its pair lists: any a miner
        gives but the lazy :class:`MinedPairs` this loss mines with itself."""
        return indices_tuple is not None and not isinstance(indices_tuple, MinedPairs)

    def _loss_dict(
        self, emb: Tensor, labels: Any, mined: Any, ref: Optional[Tensor] = None, ref_labels: Optional[Tensor] = None
    ) -> Dict[str, Any]:
        """PML's loss dictionary of the call: each anchor's loss (:meth:`_rows`; against
        ``ref`` and its labels, or over a miner's pairs, a two-set flex loss)."""
        if isinstance(mined, PairLists):
            rows = mined.rows(emb, ref, self._kind(), self.backend, self.block_size)
        elif ref is not None:
            assert ref_labels is not None
            rows = self._rows_against(emb, labels, ref, ref_labels)
        else:
            rows = self._rows(emb, labels, mined)
        index = torch.arange(emb.shape[0], device=emb.device)
        return {"loss": {"losses": rows.to(emb.dtype), "indices": index, "reduction_type": "element"}}

    def _kind(self) -> Any:
        """The two-set kind of :func:`flashcl.flex_loss` this loss is over explicit pairs."""
        raise NotImplementedError

    def _rows_against(self, emb: Tensor, labels: Tensor, ref: Tensor, ref_labels: Tensor) -> Tensor:
        """Each row's loss against the rows ``ref`` (PML's ``ref_emb``: every pair of a row
        and a reference, none of them the row itself), PML's rule from the pairs' numbers."""
        rows = flex_loss(
            emb,
            ref,
            rows={"y": labels},
            cols={"y": ref_labels},
            positive=lambda a, b: a.y == b.y,
            kind=self._kind(),
            temperature=1.0,
            reduction="none",
            backend=self.backend,
            block_size=self.block_size,
        )
        ids = torch.unique(torch.cat([labels, ref_labels]), return_inverse=True)[1]
        counts = torch.bincount(ids[: len(labels)], minlength=int(ids.max()) + 1 if len(ids) else 0)
        ref_counts = torch.bincount(ids[len(labels) :], minlength=counts.numel())
        pos = int((counts * ref_counts).sum())
        neg = len(labels) * len(ref_labels) - pos
        return rows * float(pos > 1 or neg > 1)

    def _rows(self, emb: Tensor, labels: Tensor, mined: Optional[MinedPairs]) -> Tensor:
        raise NotImplementedError


class MultiSimilarityLoss(_PairSets, _pml_losses.MultiSimilarityLoss):
    """PML's ``MultiSimilarityLoss(alpha, beta, base)``, computed by
    :func:`flashcl.multi_similarity_loss` in O(B D) memory: without ``indices_tuple``
    over every pair, with the output of :class:`MultiSimilarityMiner` over the pairs it
    mines, with any other miner's ``indices_tuple`` over its pairs (a two-set
    :func:`flashcl.flex_loss`), with ``ref_emb`` against the references (see the module
    docstring for what falls back to PML).

    Args:
        alpha, beta, base: as PML's. Defaults: 2, 50, 0.5.
        backend: flashcl's backend (``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"``).
        block_size: rows per block of the tiled backend; None picks one.
        **kwargs: PML's (``distance``, ``reducer``, ``embedding_regularizer``, ...).

    Shape:
        - embeddings: (B, D); labels: (B,); output: scalar

    Examples::

        >>> loss = MultiSimilarityLoss()(torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    """

    def __init__(
        self,
        alpha: float = 2,
        beta: float = 50,
        base: float = 0.5,
        backend: str = "auto",
        block_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(alpha=alpha, beta=beta, base=base, **kwargs)
        self.set_flashcl_options(backend, block_size)

    def _kind(self) -> Any:
        return FlexMultiSimilarity(float(self.alpha), float(self.beta), float(self.base))

    def _rows(self, emb: Tensor, labels: Tensor, mined: Optional[MinedPairs]) -> Tensor:
        return multi_similarity_loss(
            emb,
            labels,
            alpha=self.alpha,
            beta=self.beta,
            base=self.base,
            epsilon=None if mined is None else mined.epsilon,
            reduction="none",
            backend=self.backend,
            block_size=self.block_size,
        )


class CircleLoss(_PairSets, _pml_losses.CircleLoss):
    """PML's ``CircleLoss(m, gamma)``, computed by :func:`flashcl.circle_loss` in O(B D)
    memory; a miner's ``indices_tuple`` (flashcl's :class:`MultiSimilarityMiner`'s too) and
    ``ref_emb`` by a two-set :func:`flashcl.flex_loss` (see the module docstring for what
    falls back to PML).

    Args:
        m, gamma: as PML's. Defaults: 0.4, 80.
        backend: flashcl's backend (``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"``).
        block_size: rows per block of the tiled backend; None picks one.
        **kwargs: PML's (``distance``, ``reducer``, ``embedding_regularizer``, ...).

    Shape:
        - embeddings: (B, D); labels: (B,); output: scalar

    Examples::

        >>> loss = CircleLoss()(torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    """

    def __init__(
        self, m: float = 0.4, gamma: float = 80, backend: str = "auto", block_size: Optional[int] = None, **kwargs: Any
    ) -> None:
        super().__init__(m=m, gamma=gamma, **kwargs)
        self.set_flashcl_options(backend, block_size)

    def _pairs_as_lists(self, indices_tuple: Any) -> bool:
        return indices_tuple is not None  # flashcl's MultiSimilarityMiner's pairs too, formed as PML's lists

    def _kind(self) -> Any:
        return FlexCircle(float(self.m), float(self.gamma))

    def _rows(self, emb: Tensor, labels: Tensor, mined: Optional[MinedPairs]) -> Tensor:
        return circle_loss(
            emb, labels, m=self.m, gamma=self.gamma, reduction="none", backend=self.backend, block_size=self.block_size
        )


class ProxyAnchorLoss(_PairSets, _pml_losses.ProxyAnchorLoss):
    """PML's ``ProxyAnchorLoss(num_classes, embedding_size, margin, alpha)`` (its
    ``proxies`` parameter, initialised and cast as PML's), computed by
    :func:`flashcl.proxy_anchor_loss`: the gradient reaches the rows and the proxies. A
    miner's ``indices_tuple`` weighs each row's terms as PML weighs them (a two-set
    :func:`flashcl.flex_loss` of the proxies against the rows); another reducer than PML's
    default ``DivisorReducer``, ``ref_emb`` or another distance run PML's code, with a
    warning.

    Args:
        num_classes, embedding_size, margin, alpha: as PML's (defaults 0.1, 32).
        backend: flashcl's backend (``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"``).
        block_size: rows per block of the tiled backend; None picks one.
        **kwargs: PML's (``distance``, ``reducer``, ``weight_regularizer``, ...).

    Shape:
        - embeddings: (B, D); labels: (B,); output: scalar

    Examples::

        >>> loss_fn = ProxyAnchorLoss(num_classes=10, embedding_size=4)
        >>> loss = loss_fn(torch.randn(8, 4), torch.randint(0, 10, (8,)))
    """

    _memory = "B x C matrices"

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        margin: float = 0.1,
        alpha: float = 32,
        backend: str = "auto",
        block_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_classes, embedding_size, margin=margin, alpha=alpha, **kwargs)
        self.set_flashcl_options(backend, block_size)

    def _pairs_as_lists(self, indices_tuple: Any) -> bool:
        return False  # its indices_tuple weighs the rows: PML's code

    def _why_not(
        self, labels: Optional[Tensor], indices_tuple: Any, ref_emb: Optional[Tensor], ref_labels: Optional[Tensor]
    ) -> Optional[str]:
        if ref_emb is not None:
            return "ref_emb is given"
        why = super()._why_not(labels, indices_tuple, ref_emb, ref_labels)
        if why is not None:
            return why
        reducer = self.reducer
        if isinstance(reducer, _pml_reducers.MultipleReducers):  # with regularizers: one reducer per term
            reducer = reducer.reducers["pos_loss"] if "pos_loss" in reducer.reducers else reducer.default_reducer
        if type(reducer) is not _pml_reducers.DivisorReducer:
            return f"reducer={type(reducer).__name__} (flashcl: PML's default DivisorReducer)"
        return None

    def _loss_dict(
        self, emb: Tensor, labels: Any, mined: Any, ref: Optional[Tensor] = None, ref_labels: Optional[Tensor] = None
    ) -> Dict[str, Any]:
        self.cast_types(emb.dtype, emb.device)
        if mined is not None:
            terms = self._weighted_terms(emb, labels, tuple(mined)).to(emb.dtype)
        else:
            terms = proxy_anchor_loss(
                emb,
                labels,
                self.proxies,
                margin=self.margin,
                alpha=self.alpha,
                reduction="none",
                backend=self.backend,
                block_size=self.block_size,
            ).to(emb.dtype)
        # each proxy's two terms as one (their mean over the proxies is PML's pos and neg parts together)
        index = torch.arange(self.num_classes, device=emb.device)
        loss_dict = {
            "pos_loss": {"losses": terms, "indices": index, "reduction_type": "element", "divisor": self.num_classes},
            "neg_loss": {
                "losses": torch.zeros_like(terms),
                "indices": index,
                "reduction_type": "element",
                "divisor": self.num_classes,
            },
        }
        self.add_weight_regularization_to_loss_dict(loss_dict, self.proxies)
        return loss_dict

    def _weighted_terms(self, emb: Tensor, labels: Tensor, indices_tuple: Tuple[Tensor, ...]) -> Tensor:
        """Each proxy's two terms with a miner's weights, as PML weighs them (each sample's
        terms shifted by its weight - 1, the weight its share of the miner's indices): a
        flex loss of the proxies against the rows, the shift as a denominator weight."""
        shift = _pml_lmu.convert_to_weights(indices_tuple, labels, dtype=emb.dtype) - 1
        present = int(torch.unique(labels).numel())
        kind = ProxyAnchorSets(float(self.alpha), float(self.margin), self.num_classes / max(present, 1))
        return flex_loss(
            self.proxies,
            emb,
            rows={"c": torch.arange(self.num_classes, device=emb.device)},
            cols={"y": labels, "w": torch.exp(shift)},
            positive=lambda a, b: a.c == b.y,
            weight=lambda a, b: b.w,
            kind=kind,
            temperature=1.0,
            reduction="none",
            backend=self.backend,
            block_size=self.block_size,
        )
