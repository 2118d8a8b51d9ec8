"""sentence-transformers' losses, computed by flashcl (``pip install
sentence-transformers``; imported only when this module is).

* :class:`MultipleNegativesRankingLoss` and
  :class:`CachedMultipleNegativesRankingLoss`: subclasses of sentence-transformers'
  classes with the same constructor arguments (plus ``backend`` and
  ``block_size``), usable wherever those are (``SentenceTransformerTrainer``,
  ``model.fit``). The loss on the embeddings is computed by flashcl: the same
  value and gradients in memory O(B D) instead of O(B^2). The cached variant
  (GradCache) then needs no mini-batch loop over the loss, since the loss no
  longer holds a B x (B + negatives) matrix; ``mini_batch_size`` still sets the
  size of the embedding passes.
* :class:`MatryoshkaLoss`: sentence-transformers' ``MatryoshkaLoss``; around the
  two classes above, every width in one pass.
* :class:`GISTEmbedLoss` and :class:`CachedGISTEmbedLoss`: a guide model's false
  negatives leave the denominator (:func:`flashcl.gist_loss`).
* :class:`CoSENTLoss` and :class:`AnglELoss`: subclasses of sentence-transformers'
  classes (plus ``backend``), the pairwise ranking of scored pairs by
  :func:`flashcl.cosent_loss` (a running log-sum-exp over the pairs sorted by
  label); another ``similarity_fct`` is computed by sentence-transformers' code,
  with a warning.
* :class:`BatchAllTripletLoss`, :class:`BatchHardTripletLoss`,
  :class:`BatchSemiHardTripletLoss`, :class:`BatchHardSoftMarginTripletLoss`:
  subclasses of sentence-transformers' classes (plus ``backend`` and
  ``block_size``), computed by :func:`flashcl.triplet_loss` in row blocks of
  distances; another ``distance_metric`` is computed by sentence-transformers' code,
  with a warning.
* :class:`SupConLoss`: the labelled loss sentence-transformers lacks: one text
  column and an integer label per text, :func:`flashcl.supcon_loss` on the
  embeddings (Khosla et al. L_out, or the supervised-SimCSE ``"sum"`` form).

Which MNRL configurations flashcl computes: every one whose ``similarity_fct`` is
``cos_sim`` or ``dot_score``: all four ``directions``, both partition modes,
the three hardness modes, ``gather_across_devices`` (through
:func:`flashcl.distributed.all_gather_with_grad`). Another similarity function is
computed by sentence-transformers' own code, with a warning saying why (the same
value; the B^2 memory of the original).

Formulas (s = scale * similarity; q queries, d_1 the positive documents,
d_all the positives and hard negatives; with ``gather_across_devices``, this
process's rows against every process's candidates)::

    query_to_doc:   LSE_j [s(q_i, d_all_j) + alpha stop_grad(sim(q_i, d_all_j)) on the hardness mode's negatives]
    query_to_query: LSE_{j != i} s(q_i, q_j)
    doc_to_query:   LSE_j s(d_1i, q_j)
    doc_to_doc:     LSE over d_all_j not of query i of s(d_1i, d_all_j)
    loss = mean_i (log Z_i - s(q_i, d_1i)),  log Z_i = the logsumexp of the selected
    directions' terms (joint) or their mean (per_direction)

With flashcl's ``false_negative_margin=m`` (Qwen3-Embedding's and NV-Retriever's mask of
likely false negatives), every direction's term of row i whose similarity exceeds
``sim(q_i, d_1i) + m`` is left out, the positive pair itself kept.
"""

from __future__ import annotations

import functools
import math
import random
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checks, parallel
from ..base import peer_import_error
from ..core import Exclusions, Tile, compute_dtype
from ..losses.flex import flex_loss
from ..losses.gist import gist_loss
from ..losses.info_nce import row_logsumexps
from .options import FlashclOptions

# the drop-ins over labels and scored pairs (SupCon, the batch triplets, CoSENT), importable from here too
from .sentence_transformers_ranking import (
    AnglELoss,
    BatchAllTripletLoss,
    BatchHardSoftMarginTripletLoss,
    BatchHardTripletLoss,
    BatchSemiHardTripletLoss,
    CoSENTLoss,
    SupConLoss,
)

try:
    try:  # sentence-transformers >= 6 (the top-level ``losses`` is a deprecated alias there)
        from sentence_transformers.sentence_transformer import losses as _st_losses
    except ImportError:
        from sentence_transformers import losses as _st_losses  # type: ignore[attr-defined,no-redef]
    from sentence_transformers.util import cos_sim, dot_score

    try:  # sentence-transformers >= 6: one forward pass over the columns
        from sentence_transformers.base.losses.merged_forward import embed_columns as _embed_columns
    except ImportError:
        _embed_columns = None  # type: ignore[assignment]
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise peer_import_error("sentence_transformers", "sentence-transformers", "sentence_transformers", e) from e

#: the backends each loss takes (the guide's masks have no Triton kernel)
_MNRL_BACKENDS = ("auto", "dense", "tiled", "triton")
_GIST_BACKENDS = ("auto", "reference", "dense", "tiled")
_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _unsupported(loss: Any) -> Optional[str]:
    """Why flashcl cannot compute this MNRL configuration, or None."""
    if loss.similarity_fct not in (cos_sim, dot_score):
        return f"similarity_fct={getattr(loss.similarity_fct, '__name__', loss.similarity_fct)!r}"
    if "query_to_doc" not in loss.directions or not set(loss.directions) <= set(_DIRECTIONS):
        return f"directions={tuple(loss.directions)!r}"
    return None


def _hardness_mask(mode: str, offset: int, world_batch: int, device: torch.device) -> Callable[[Tile], Tensor]:
    """The query-to-document logits that get the hardness penalty: in-batch negatives
    (every document of another query), the query's own hard negatives, or all
    negatives (every document but the query's own positive)."""

    def mask(tile: Tile) -> Tensor:
        rows = torch.arange(tile.r0, tile.r1, device=device).unsqueeze(1) + offset
        cols = torch.arange(tile.c0, tile.c1, device=device).unsqueeze(0)
        own = (cols % world_batch) == rows
        if mode == "in_batch_negatives":
            return ~own
        if mode == "hard_negatives":
            return own & (cols >= world_batch)
        return cols != rows  # all_negatives

    return mask


def _mnrl(
    loss: Any,
    queries: Tensor,
    docs: List[Tensor],
    backend: str,
    block_size: Optional[int],
    dims: Optional[Sequence[int]] = None,
    weights: Optional[Sequence[float]] = None,
) -> Tensor:
    """MNRL's value on embeddings, for a configuration :func:`_unsupported` accepts:
    each selected direction's row logsumexp (query to documents, with the hardness
    penalty; query to the other queries; document to queries; document to the
    documents of other queries), combined jointly or averaged, minus the positive.
    With ``dims``: ``sum_m w_m`` of that at every prefix width (each prefix
    normalised, as sentence-transformers' ``MatryoshkaLoss`` does), all widths in one
    pass over the tiles."""
    normalize = loss.similarity_fct is cos_sim or dims is not None
    b = queries.shape[0]
    q_all, docs_all_list, offset = queries, list(docs), 0
    if loss.gather_across_devices and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        q_all, offset = parallel.all_gather_with_grad(queries)
        docs_all_list = [parallel.all_gather_with_grad(d)[0] for d in docs]
    world_batch = q_all.shape[0]
    d_all = torch.cat(docs_all_list) if len(docs_all_list) > 1 else docs_all_list[0]
    local_docs = docs[0]
    dtype = compute_dtype(queries.dtype)
    scale = torch.tensor(float(loss.scale), dtype=dtype, device=queries.device)
    widths: List[int] = []
    width_weights = None
    if dims is not None:
        widths, ws = checks.check_dims(dims, weights, queries.shape[1])
        width_weights = torch.tensor(ws, dtype=dtype, device=queries.device)

    lse = functools.partial(
        row_logsumexps, scale=scale, normalize=normalize, backend=backend, block_size=block_size, widths=widths
    )

    boost = None
    if loss.hardness_mode is not None and loss.hardness_strength > 0:
        fn = _hardness_mask(loss.hardness_mode, offset, world_batch, queries.device)
        boost = (float(loss.hardness_strength) / float(loss.scale), fn)
    if getattr(loss, "false_negative_margin", None) is not None:
        sides = (queries, local_docs, q_all, d_all)
        parts = _filtered_parts(loss, sides, offset, world_batch, normalize, widths, backend, block_size)
    else:
        parts = [lse(queries, d_all, boost=boost)]
        if "query_to_query" in loss.directions:
            parts.append(lse(queries, q_all, exclude_self=True, offset=offset))
        if "doc_to_query" in loss.directions:
            parts.append(lse(local_docs, q_all))
        if "doc_to_doc" in loss.directions:
            own = (
                offset
                + torch.arange(b, device=queries.device).unsqueeze(1)
                + world_batch * torch.arange(len(docs_all_list), device=queries.device).unsqueeze(0)
            )
            parts.append(lse(local_docs, d_all, exclude=Exclusions(index=own)))
    stacked = torch.stack(parts)
    log_z = torch.logsumexp(stacked, 0) if loss.partition_mode == "joint" else stacked.mean(0)
    q_c, d_c = queries.to(dtype), local_docs.to(dtype)
    if widths:
        positive = torch.stack(
            [(F.normalize(q_c[:, :d], dim=1) * F.normalize(d_c[:, :d], dim=1)).sum(1) for d in widths]
        ) * float(loss.scale)
        assert width_weights is not None
        return ((log_z - positive).mean(1) * width_weights).sum()
    if normalize:
        q_c, d_c = F.normalize(q_c, dim=1), F.normalize(d_c, dim=1)
    positive = float(loss.scale) * (q_c * d_c).sum(1)
    return (log_z - positive).mean()


def _filtered_parts(
    loss: Any,
    sides: Tuple[Tensor, Tensor, Tensor, Tensor],
    offset: int,
    world_batch: int,
    normalize: bool,
    widths: Sequence[int],
    backend: str,
    block_size: Optional[int],
) -> List[Tensor]:
    """MNRL's directions with the false-negative margin (Qwen3-Embedding, NV-Retriever):
    each row's log-sum-exp over its direction's candidates less those whose scaled score
    tops the query's positive score by ``false_negative_margin * scale`` (the positive
    pair itself always kept), as flex calls (:func:`flashcl.flex_loss`, the log-sum-exps
    as the rows of ``positives="sum"`` with no positive); (B,) each, (W, B) with widths.
    ``sides``: this process's queries and positive documents, every process's queries
    and documents (positives, then each column of hard negatives)."""
    queries, local_docs, q_all, d_all = sides
    b, device = queries.shape[0], queries.device
    scale = float(loss.scale)
    bar = float(loss.false_negative_margin) * scale
    own = offset + torch.arange(b, device=device)  # each row's query, globally
    who = {"who": torch.arange(d_all.shape[0], device=device) % world_batch}  # each document's query
    rules = {  # each direction: (anchors, candidates, their data, the pairs left out)
        "query_to_doc": (queries, d_all, who, lambda a, b_, s: (b_.index != a.own) & (s > a.bar)),
        "query_to_query": (queries, q_all, {}, lambda a, b_, s: (b_.index == a.own) | (s > a.bar)),
        "doc_to_query": (local_docs, q_all, {}, lambda a, b_, s: (b_.index != a.own) & (s > a.bar)),
        "doc_to_doc": (local_docs, d_all, who, lambda a, b_, s: (b_.who == a.own) | (s > a.bar)),
    }
    nothing = torch.zeros((), dtype=torch.bool, device=device)
    out = []
    for direction in [d for d in _DIRECTIONS if d in loss.directions]:
        anchors, keys, cols, left_out = rules[direction]
        rows_w = []
        for width in widths or [queries.shape[1]]:
            qw, dw = queries[:, :width].detach(), local_docs[:, :width].detach()
            if normalize:
                qw, dw = F.normalize(qw, dim=1), F.normalize(dw, dim=1)
            positive = scale * (qw * dw).sum(1).to(compute_dtype(queries.dtype))
            rows_w.append(
                flex_loss(
                    anchors[:, :width],
                    keys[:, :width],
                    rows={"own": own, "bar": positive + bar},
                    cols=cols,
                    positive=lambda a, b_: nothing,
                    exclude=left_out,
                    positives="sum",
                    temperature=1.0 / scale,
                    normalize=normalize,
                    reduction="none",
                    backend=backend,
                    block_size=block_size,
                )
            )
        out.append(torch.stack(rows_w) if widths else rows_w[0])
    return out


class _Fallback(FlashclOptions):
    """Warns once per instance when sentence-transformers' own code computes the loss;
    flashcl's options (:class:`FlashclOptions`)."""

    _warned = False
    false_negative_margin: Optional[float] = None

    def _flashcl_or_none(self) -> Optional[str]:
        why = _unsupported(self)
        if why is not None and not self._warned:
            warnings.warn(
                f"flashcl does not compute {type(self).__name__} with {why}; sentence-transformers' "
                "own implementation is used (same value, its B^2 memory)",
                stacklevel=3,
            )
            self._warned = True
        return why


def _set_margin(loss: Any, margin: Optional[float]) -> None:
    """Checks and stores MNRL's ``false_negative_margin`` (a configuration flashcl computes,
    since sentence-transformers' own code has no such option)."""
    if margin is None:
        return
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"false_negative_margin must be a finite number or None, got {margin!r}")
    why = _unsupported(loss)
    if why is not None:
        raise ValueError(f"false_negative_margin is computed by flashcl, which does not compute {why}")
    if loss.hardness_mode is not None and loss.hardness_strength > 0:
        raise ValueError("false_negative_margin and hardness_mode are not computed together: choose one")
    if loss.backend == "triton":
        raise ValueError("false_negative_margin has no Triton kernel (its mask reads the scores): use backend='tiled'")
    loss.false_negative_margin = float(margin)


def _check_embeddings(embeddings: List[Tensor]) -> None:
    if len(embeddings) < 2:
        raise ValueError(f"Expected at least 2 embeddings (anchor, positive[, negatives...]), got {len(embeddings)}")


def _cached_loss(loss_fn: Callable[[List[Tensor]], Tensor], reps: List[List[Tensor]], with_backward: bool) -> Tensor:
    """A cached loss's ``calculate_loss``: the mini-batches' embeddings joined per
    column, the loss on them, and (``with_backward``) its gradient into them."""
    embeddings = [torch.cat(r) for r in reps]
    _check_embeddings(embeddings)
    loss = loss_fn(embeddings)
    if with_backward:
        loss.backward()
        loss = loss.detach()
    return loss


class MultipleNegativesRankingLoss(_Fallback, _st_losses.MultipleNegativesRankingLoss):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` (InfoNCE with
    in-batch and hard negatives), computed by flashcl.

    Args:
        model: the SentenceTransformer being trained.
        scale: similarity multiplier (1 / temperature). Default 20.
        similarity_fct: ``cos_sim`` (default) or ``dot_score``.
        others: ``gather_across_devices``, ``directions``, ``partition_mode``,
            ``hardness_mode``, ``hardness_strength`` as in sentence-transformers; see
            the module docstring for which configurations flashcl computes.
        false_negative_margin: leave out of every direction's candidates those whose
            similarity tops the query's positive similarity by more than this margin
            (likely false negatives: Qwen3-Embedding's mask with 0.1, NV-Retriever's);
            the positive pair itself is kept. None (default): none left out. Not with
            ``hardness_mode`` or the Triton backend.
        backend: flashcl backend ("auto", "dense", "tiled", "triton").
        block_size: rows per block of the tiled backend (None: automatic).

    Shape:
        Input columns (anchor, positive[, negative_1, ...]), B texts each; the
        loss is a scalar.

    Examples::

        >>> from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        >>> from flashcl.integrations.sentence_transformers import MultipleNegativesRankingLoss
        >>> # loss = MultipleNegativesRankingLoss(model, scale=20.0)
        >>> # SentenceTransformerTrainer(model=model, train_dataset=pairs, loss=loss).train()
    """

    backends = _MNRL_BACKENDS
    config_keys = (*FlashclOptions.config_keys, "false_negative_margin")

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        gather_across_devices: bool = False,
        directions: tuple = ("query_to_doc",),
        partition_mode: str = "joint",
        hardness_mode: Optional[str] = None,
        hardness_strength: float = 0.0,
        *,
        false_negative_margin: Optional[float] = None,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(
            model,  # type: ignore[arg-type]
            scale=scale,
            similarity_fct=similarity_fct,
            gather_across_devices=gather_across_devices,
            directions=directions,
            partition_mode=partition_mode,  # type: ignore[arg-type]
            hardness_mode=hardness_mode,  # type: ignore[arg-type]
            hardness_strength=hardness_strength,
        )
        self.set_flashcl_options(backend, block_size)
        _set_margin(self, false_negative_margin)

    def compute_loss_from_embeddings(self, embeddings: List[Tensor], labels: Optional[Tensor] = None) -> Tensor:
        _check_embeddings(embeddings)
        if self._flashcl_or_none() is not None:
            return super().compute_loss_from_embeddings(embeddings, labels)  # type: ignore[arg-type]
        return _mnrl(self, embeddings[0], list(embeddings[1:]), self.backend, self.block_size)


class CachedMultipleNegativesRankingLoss(_Fallback, _st_losses.CachedMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache:
    the batch is embedded in mini-batches, the loss's gradient w.r.t. the
    embeddings is cached, then the mini-batches are re-embedded with gradients),
    with the loss computed by flashcl over the whole batch at once.

    Args:
        others: ``model``, ``scale``, ``similarity_fct``, ``mini_batch_size``,
            ``mini_batch_num_tokens``, ``gather_across_devices``, ``directions``,
            ``partition_mode``, ``show_progress_bar``, ``hardness_mode``,
            ``hardness_strength`` as in sentence-transformers.
        false_negative_margin: as :class:`MultipleNegativesRankingLoss`'s.
        backend: flashcl backend. block_size: rows per block (None: automatic).

    Shape:
        As :class:`MultipleNegativesRankingLoss`.

    Examples::

        >>> from flashcl.integrations.sentence_transformers import CachedMultipleNegativesRankingLoss
        >>> # loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)
    """

    backends = _MNRL_BACKENDS
    config_keys = (*FlashclOptions.config_keys, "false_negative_margin")

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: Optional[int] = None,
        gather_across_devices: bool = False,
        directions: tuple = ("query_to_doc",),
        partition_mode: str = "joint",
        show_progress_bar: bool = False,
        hardness_mode: Optional[str] = None,
        hardness_strength: float = 0.0,
        *,
        false_negative_margin: Optional[float] = None,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(
            model,  # type: ignore[arg-type]
            scale=scale,
            similarity_fct=similarity_fct,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            gather_across_devices=gather_across_devices,
            directions=directions,
            partition_mode=partition_mode,  # type: ignore[arg-type]
            show_progress_bar=show_progress_bar,
            hardness_mode=hardness_mode,  # type: ignore[arg-type]
            hardness_strength=hardness_strength,
        )
        self.set_flashcl_options(backend, block_size)
        _set_margin(self, false_negative_margin)

    def calculate_loss(
        self, reps: List[List[Tensor]], labels: Optional[Tensor] = None, *, with_backward: bool = False
    ) -> Tensor:
        if self._flashcl_or_none() is not None:
            return super().calculate_loss(reps, labels, with_backward=with_backward)
        return _cached_loss(lambda e: _mnrl(self, e[0], e[1:], self.backend, self.block_size), reps, with_backward)


class _OnePassCached:
    """The cached MNRL's ``calculate_loss`` at every Matryoshka width in one pass."""

    def __init__(self, owner: MatryoshkaLoss, inner: CachedMultipleNegativesRankingLoss) -> None:
        self.owner, self.inner = owner, inner

    def __call__(
        self, reps: List[List[Tensor]], labels: Optional[Tensor] = None, *, with_backward: bool = False
    ) -> Tensor:
        dims, weights = self.owner.widths_this_step()
        inner = self.inner
        return _cached_loss(
            lambda e: _mnrl(inner, e[0], e[1:], inner.backend, inner.block_size, dims, weights), reps, with_backward
        )


class MatryoshkaLoss(_st_losses.MatryoshkaLoss):
    """sentence-transformers' ``MatryoshkaLoss`` (the inner loss at several prefix
    widths of the embeddings, each prefix normalised), with every width computed in
    one pass when the inner loss is flashcl's :class:`MultipleNegativesRankingLoss`
    or :class:`CachedMultipleNegativesRankingLoss`: one pass over the tiles for all
    widths instead of one loss per width. Any other inner loss runs as
    sentence-transformers runs it (flashcl's adapters then compute each width).

    Args:
        model, loss, matryoshka_dims, matryoshka_weights, n_dims_per_step: as in
            sentence-transformers (``n_dims_per_step`` draws the widths of each step
            with Python's ``random``, as sentence-transformers does).

    Shape:
        As the inner loss.

    Examples::

        >>> from flashcl.integrations.sentence_transformers import MatryoshkaLoss, MultipleNegativesRankingLoss
        >>> # loss = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [768, 512, 256, 128, 64])
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Optional[Sequence[float]] = None,
        n_dims_per_step: int = -1,
    ) -> None:
        super().__init__(model, loss, matryoshka_dims, matryoshka_weights, n_dims_per_step)  # type: ignore[arg-type]
        if isinstance(loss, CachedMultipleNegativesRankingLoss) and loss._flashcl_or_none() is None:
            loss.calculate_loss = _OnePassCached(self, loss)  # type: ignore[method-assign]

    def widths_this_step(self) -> Tuple[List[int], List[float]]:
        """The widths (and weights) of this step: all, or ``n_dims_per_step`` of them
        drawn as sentence-transformers draws them."""
        indices = list(range(len(self.matryoshka_dims)))
        if 0 < self.n_dims_per_step < len(indices):
            indices = random.sample(indices, self.n_dims_per_step)
            indices.sort()
        return [self.matryoshka_dims[i] for i in indices], [float(self.matryoshka_weights[i]) for i in indices]

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Optional[Tensor]) -> Tensor:
        inner = self.loss
        if isinstance(inner, MultipleNegativesRankingLoss) and inner._flashcl_or_none() is None:
            embeddings = _embed(self.model, list(sentence_features))
            _check_embeddings(embeddings)
            dims, weights = self.widths_this_step()
            return _mnrl(inner, embeddings[0], embeddings[1:], inner.backend, inner.block_size, dims, weights)
        return super().forward(sentence_features, labels)  # type: ignore[arg-type]


def _gathering(loss: Any) -> bool:
    """Whether sentence-transformers would gather the candidates across processes."""
    return bool(
        getattr(loss, "gather_across_devices", False)
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def _gist(loss: Any, embeddings: List[Tensor], guides: List[Tensor]) -> Tensor:
    """GIST's value on embeddings (anchor, positive, negatives...) and the guide's."""
    negative = torch.cat(embeddings[2:]) if len(embeddings) > 2 else None
    guide = tuple(guides[:2]) + ((torch.cat(guides[2:]),) if len(guides) > 2 else ())
    if _gathering(loss):
        return _gist_gathered(loss, embeddings, guides, negative, list(guide))
    return gist_loss(
        embeddings[0],
        embeddings[1],
        negative,
        guide=guide,
        temperature=loss.temperature,
        margin=loss.margin,
        margin_strategy=loss.margin_strategy,
        contrast_anchors=loss.contrast_anchors,
        contrast_positives=loss.contrast_positives,
        backend=loss.backend,
        block_size=loss.block_size,
    )


def _gist_gathered(
    loss: Any, embeddings: List[Tensor], guides: List[Tensor], negative: Optional[Tensor], guide: List[Tensor]
) -> Tensor:
    """sentence-transformers' ``gather_across_devices=True``: this process's anchors
    against every process's positives and negatives (gathered with their gradient,
    each negative column on its own as sentence-transformers gathers them), the
    anchor-anchor candidates this process's only; the mean over this process's
    anchors. DDP's averaging of the gradients then gives the global batch's."""
    from ..checks import scale_dtype
    from ..losses.gist import Gathered, gist_rows

    anchor, positive = embeddings[0], embeddings[1]
    p_all, offset = parallel.all_gather_with_grad(positive)
    gp_all = parallel.all_gather_with_grad(guides[1].detach())[0]
    n_all = gn_all = None
    if len(embeddings) > 2:
        n_all = torch.cat([parallel.all_gather_with_grad(n)[0] for n in embeddings[2:]])
        gn_all = torch.cat([parallel.all_gather_with_grad(g.detach())[0] for g in guides[2:]])
    if not (0.0 < float(loss.temperature) < float("inf")):
        raise ValueError(f"temperature must be a positive finite float, got {loss.temperature!r}")
    scale = torch.tensor(1.0 / float(loss.temperature), dtype=scale_dtype(anchor), device=anchor.device)
    rows = gist_rows(
        anchor,
        positive,
        negative,
        [g.detach() for g in guide],
        scale,
        float(loss.margin),
        loss.margin_strategy == "relative",
        bool(loss.contrast_anchors),
        bool(loss.contrast_positives),
        "dense" if loss.backend == "reference" else loss.backend,  # the per-row oracle has no gathered form
        loss.block_size,
        gathered=Gathered(p_all, n_all, gp_all, gn_all, offset),
    )
    return rows.mean()


def _embed(model: Any, features: List[Dict[str, Tensor]]) -> List[Tensor]:
    """Each column's sentence embeddings, as sentence-transformers' losses compute them."""
    if _embed_columns is not None:
        return list(_embed_columns(model, features))
    return [model(f)["sentence_embedding"] for f in features]


class GISTEmbedLoss(_Fallback, _st_losses.GISTEmbedLoss):
    """sentence-transformers' ``GISTEmbedLoss`` (a guide model removes in-batch
    false negatives), computed by flashcl (:func:`flashcl.gist_loss`): the same
    value and gradients without the B x B x D broadcast and the B x B matrices.

    Args:
        model: the SentenceTransformer being trained.
        guide: the SentenceTransformer that scores the candidates.
        others: ``temperature``, ``margin_strategy``, ``margin``, ``contrast_anchors``,
            ``contrast_positives``, ``gather_across_devices`` as in sentence-transformers
            (``gather_across_devices=True``: this process's anchors against every
            process's positives and negatives, as sentence-transformers computes it).
        backend: flashcl backend ("auto", "dense", "tiled").
        block_size: rows per block of the tiled backend (None: automatic).

    Shape:
        Input columns (anchor, positive[, negative]), B texts each; the loss is a scalar.

    Examples::

        >>> from flashcl.integrations.sentence_transformers import GISTEmbedLoss
        >>> # loss = GISTEmbedLoss(model, guide, temperature=0.01)
        >>> # SentenceTransformerTrainer(model=model, train_dataset=pairs, loss=loss).train()
    """

    backends = _GIST_BACKENDS

    def __init__(
        self,
        model: nn.Module,
        guide: nn.Module,
        temperature: float = 0.01,
        margin_strategy: str = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        super().__init__(
            model,  # type: ignore[arg-type]
            guide,  # type: ignore[arg-type]
            temperature=temperature,
            margin_strategy=margin_strategy,  # type: ignore[arg-type]
            margin=margin,
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
            gather_across_devices=gather_across_devices,
        )
        self.set_flashcl_options(backend, block_size)

    def _guide_features(self, features: List[Dict[str, Tensor]]) -> List[Dict[str, Tensor]]:
        """The guide's inputs: the same tokens, or the texts re-tokenised for it."""
        if not self.must_retokenize:
            return [dict(f) for f in features]
        out = []
        for f in features:
            ids = f["input_ids"]
            if "cu_seq_lens_q" in f:  # packed sequences
                flat, cuts = ids[0].tolist(), f["cu_seq_lens_q"].tolist()
                ids = [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:])]  # type: ignore[assignment]
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            prepare = getattr(self.guide, "preprocess", None) or self.guide.tokenize
            out.append({k: v.to(self.guide.device) if isinstance(v, Tensor) else v for k, v in prepare(texts).items()})
        return out

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Optional[Tensor]) -> Tensor:
        features = list(sentence_features)
        guide_features = self._guide_features(features)
        embeddings = _embed(self.model, features)
        with torch.no_grad():
            guides = _embed(self.guide, guide_features)
        return self.compute_loss_from_embeddings(embeddings, guides)

    def compute_loss_from_embeddings(self, embeddings: List[Tensor], guides: List[Tensor]) -> Tensor:
        """The loss on the model's embeddings (anchor, positive[, negative]) and the guide's."""
        if len(embeddings) not in (2, 3) or len(guides) != len(embeddings):
            raise ValueError(
                f"Expected 2 or 3 embeddings, and as many guide embeddings, got {len(embeddings)} and {len(guides)}"
            )
        return _gist(self, embeddings, guides)


class CachedGISTEmbedLoss(_Fallback, _st_losses.CachedGISTEmbedLoss):
    """sentence-transformers' ``CachedGISTEmbedLoss`` (GISTEmbed with GradCache),
    with the loss computed by flashcl over the whole batch at once
    (:func:`flashcl.gist_loss`, O(B D) memory), so no mini-batch loop over the
    loss; ``mini_batch_size`` sets the size of the embedding passes.

    Args:
        others: ``model``, ``guide``, ``temperature``, ``mini_batch_size``,
            ``mini_batch_num_tokens``, ``show_progress_bar``, ``margin_strategy``,
            ``margin``, ``contrast_anchors``, ``contrast_positives``,
            ``gather_across_devices`` as in sentence-transformers.
        backend: flashcl backend. block_size: rows per block (None: automatic).

    Shape:
        Input columns (anchor, positive[, negative_1, ...]), B texts each; the loss is a scalar.

    Examples::

        >>> from flashcl.integrations.sentence_transformers import CachedGISTEmbedLoss
        >>> # loss = CachedGISTEmbedLoss(model, guide, mini_batch_size=64)
    """

    backends = _GIST_BACKENDS

    def __init__(
        self,
        model: nn.Module,
        guide: nn.Module,
        temperature: float = 0.01,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: Optional[int] = None,
        show_progress_bar: bool = False,
        margin_strategy: str = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        *,
        backend: str = "auto",
        block_size: Optional[int] = None,
    ) -> None:
        kw: Dict[str, Any] = dict(
            temperature=temperature,
            mini_batch_size=mini_batch_size,
            show_progress_bar=show_progress_bar,
            margin_strategy=margin_strategy,
            margin=margin,
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
            gather_across_devices=gather_across_devices,
        )
        if mini_batch_num_tokens is not None:
            kw["mini_batch_num_tokens"] = mini_batch_num_tokens
        super().__init__(model, guide, **kw)  # type: ignore[arg-type]
        self.set_flashcl_options(backend, block_size)

    def calculate_loss(
        self, reps: List[List[Tensor]], reps_guided: List[List[Tensor]], *, with_backward: bool = False
    ) -> Tensor:
        if len(reps) != len(reps_guided):
            raise ValueError("reps and reps_guided must have the same number of columns")
        guides = [torch.cat(r) for r in reps_guided]
        return _cached_loss(lambda e: _gist(self, e, guides), reps, with_backward)


__all__ = [
    "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesRankingLoss",
    "MatryoshkaLoss",
    "GISTEmbedLoss",
    "CachedGISTEmbedLoss",
    "SupConLoss",
    "CoSENTLoss",
    "AnglELoss",
    "BatchAllTripletLoss",
    "BatchHardTripletLoss",
    "BatchSemiHardTripletLoss",
    "BatchHardSoftMarginTripletLoss",
]
