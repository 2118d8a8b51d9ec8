"""InfoNCE with in-batch and hard negatives: :func:`info_nce_loss` and :class:`InfoNCELoss`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, Scalar, check_keys, check_smoothing, class_ids, example_rows, no_matryoshka
from ..compiled import compiles
from ..core import CoreSpec, Exclusions, Tile, compute_dtype
from ..engine import matryoshka
from ..engine.engine import Problem
from ..engine.heads import SoftmaxHead
from ..runner import unit_rows


def _same_label_mask(q_ids: Tensor, k_ids: Tensor, index: Tensor) -> Callable[[Tile], Tensor]:
    """The tile mask of keys that share the query's label, the positive excepted."""

    def mask(tile: Tile) -> Tensor:
        same = q_ids[tile.r0 : tile.r1].unsqueeze(1) == k_ids[tile.c0 : tile.c1].unsqueeze(0)
        cols = torch.arange(tile.c0, tile.c1, device=same.device).unsqueeze(0)
        return same & (cols != index[tile.r0 : tile.r1].unsqueeze(1))

    return mask


def info_nce_spec(
    index: Tensor,
    normalize: bool,
    query_labels: Optional[Tensor] = None,
    key_labels: Optional[Tensor] = None,
    duplicates: str = "mask",
) -> CoreSpec:
    """InfoNCE's core configuration: query ``i``'s positive is key ``index[i]``; with
    labels on both sides, other keys of the query's label are left out of its
    denominator (``duplicates="mask"``) or are positives too (``"positive"``).
    ``index`` and ``key_labels`` may be global (keys gathered across processes)."""
    if query_labels is None or key_labels is None:
        return CoreSpec(index=index.unsqueeze(1), pos_mode="sum", normalize=normalize)
    (q_ids, k_ids), num_classes = class_ids(query_labels, key_labels)
    if bool((k_ids[index] != q_ids).any()):
        raise ValueError("each query's positive key must share its label (key_labels[positive_index] == query_labels)")
    if duplicates == "positive":
        return CoreSpec(
            row_labels=q_ids, col_labels=k_ids, num_classes=num_classes, pos_mode="mean", normalize=normalize
        )
    return CoreSpec(
        index=index.unsqueeze(1),
        pos_mode="sum",
        normalize=normalize,
        exclude=Exclusions(fn=_same_label_mask(q_ids, k_ids, index)),
    )


@shared_docs
@compiles()
def info_nce_loss(
    query: Tensor,
    keys: Tensor,
    positive_index: Optional[Tensor] = None,
    *,
    temperature: Scalar = 0.05,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    negatives: Optional[Tensor] = None,
    in_batch_negatives: bool = True,
    query_labels: Optional[Tensor] = None,
    key_labels: Optional[Tensor] = None,
    duplicates: str = "mask",
    label_smoothing: float = 0.0,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""InfoNCE with in-batch negatives and optional extra hard negatives.

    Row ``i`` of ``query`` is scored against every row of ``keys``; its positive
    is ``keys[positive_index[i]]`` (default ``i``); rows of ``keys`` past B are
    extra (hard) negatives. Exactly::

        F.cross_entropy(q_hat @ k_hat.T / temperature, positive_index)

    with ``q_hat, k_hat`` the L2-normalised rows, without the B x N matrix on
    the tiled backend.

    Args:
        query: (B, D).
        keys: (N, D), N >= B.
        positive_index: (B,) integer column of each row's positive; default arange(B).
        temperature: float or 0-dim tensor. Default: 0.05.
        normalize: L2-normalise first. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        @backend@

        negatives: (K, D) more negatives without gradient (a queue,
            :class:`flashcl.MemoryBank`: MoCo's), in every row's denominator.
        in_batch_negatives: the rows of ``keys`` other than a query's positive are
            its negatives. Default: True. False (with ``negatives``) is MoCo's loss:
            each query against its own key and the queue only.
        query_labels, key_labels: (B,) and (N,) labels, both or neither: keys that
            share a query's label are not its negatives (a duplicate, a same-class
            text). The positive must share its query's label.
        duplicates: what becomes of those keys: ``"mask"`` (default): left out of
            the denominator; ``"positive"``: positives, the loss subtracting the mean
            of the positives' scores (as SupCon).
        label_smoothing: ``eps`` in [0, 1): the target spread over every column (the
            keys and ``negatives``, the positive's included), as
            ``F.cross_entropy(logits, target, label_smoothing=eps)``. Default: 0.
            Not with labels, ``in_batch_negatives=False`` or Matryoshka.
        @matryoshka@
        @process_group@

    Shape:
        - query: (B, D); keys: (N, D); positive_index: (B,); negatives: (K, D);
          query_labels: (B,); key_labels: (N,)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> q, docs = torch.randn(4, 16), torch.randn(12, 16)  # 8 hard negatives
        >>> loss = flashcl.info_nce_loss(q, docs, temperature=0.05)
        >>> loss = flashcl.info_nce_loss(q, docs, temperature=0.05, matryoshka_dims=[16, 8, 4])
    """
    index = checks.validate_info_nce(query, keys, positive_index, process_group is not None)
    opts = checks.Options(normalize, reduction, backend, block_size, process_group, strategy, grad_scale)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", query.device, compute_dtype(query.dtype))
    checks.check_bool(in_batch_negatives, "in_batch_negatives")
    checks.check_choice(duplicates, "duplicates", ("mask", "positive"))
    index = index.long()
    if (query_labels is None) != (key_labels is None):
        raise ValueError("query_labels and key_labels go together: pass both or neither")
    if query_labels is not None:
        _, query_labels = checks.validate_labelled(
            query, query_labels, names=("query", "query_labels"), empty=process_group is not None
        )
        _, key_labels = checks.validate_labelled(
            keys, key_labels, names=("keys", "key_labels"), empty=process_group is not None
        )
    if process_group is not None:  # the labels checked on this rank before any collective
        info_nce_spec(index, normalize, query_labels, key_labels, duplicates)
    if not in_batch_negatives and negatives is None:
        raise ValueError("in_batch_negatives=False leaves each query its positive alone: pass negatives")
    if not in_batch_negatives and query_labels is not None:
        raise ValueError("in_batch_negatives=False takes no labels (each query's keys are its positive only)")
    if negatives is not None:
        no_matryoshka(matryoshka_dims, matryoshka_weights, "negatives (keys without gradient)")
        negatives = check_keys(negatives, "negatives", query).detach()
    eps = check_smoothing(label_smoothing)
    if eps:
        if query_labels is not None or not in_batch_negatives:
            raise ValueError(
                "label_smoothing spreads the target over every key: it takes neither labels (several "
                "positives) nor in_batch_negatives=False"
            )
        no_matryoshka(matryoshka_dims, matryoshka_weights, "label_smoothing")
        core = info_nce_loss(
            query,
            keys,
            index,
            temperature=temperature,
            normalize=normalize,
            reduction=reduction,
            backend=backend,
            block_size=block_size,
            negatives=negatives,
            process_group=process_group,
            strategy=strategy,
            grad_scale=grad_scale,
        )
        rows = smoothing_rows(query, keys, index, scale, normalize, negatives, process_group)
        over = parallel.reduction_over(process_group)
        return core + eps * runner.reduce(rows, torch.ones_like(rows), reduction, grad_scale, over)
    return _info_nce(
        query,
        keys,
        index,
        scale,
        opts,
        negatives,
        in_batch_negatives,
        query_labels,
        key_labels,
        duplicates,
        matryoshka_dims,
        matryoshka_weights,
    )


def _info_nce(
    query: Tensor,
    keys: Tensor,
    index: Tensor,
    scale: Tensor,
    opts: checks.Options,
    negatives: Optional[Tensor],
    in_batch_negatives: bool,
    query_labels: Optional[Tensor],
    key_labels: Optional[Tensor],
    duplicates: str,
    dims: Any,
    weights: Any,
) -> Tensor:
    """:func:`info_nce_loss`'s body, one process being a world of one: each query
    against every rank's keys (``index`` into this rank's; :mod:`flashcl.distributed`)
    and the shared ``negatives`` once; MoCo's (``in_batch_negatives=False``) against
    its own key and the negatives, the ranks meeting in the reduction."""
    if not in_batch_negatives:  # MoCo: LSE over its own key and the queue; the ranks meet in the reduction
        assert negatives is not None
        cols = parallel.replicated(negatives[:0], opts.process_group, shared=negatives)
        alone = CoreSpec(index=index.new_empty((query.shape[0], 0)), normalize=opts.normalize)  # no positive: the LSE
        lse = runner.run(query, cols, scale, alone, replace(opts, reduction="none"))
        q, k = unit_rows(query, opts.normalize), unit_rows(keys[index], opts.normalize)
        pos = scale.to(q.dtype) * (q * k).sum(1)
        rows = torch.nn.functional.softplus(lse - pos)
        return runner.reduce(rows, torch.ones_like(rows), opts.reduction, opts.grad_scale, cols)
    cols = parallel.columns(keys, opts.strategy, opts.process_group, shared=negatives)
    all_key_labels = None
    if query_labels is not None and key_labels is not None:
        fresh = None
        if negatives is not None:  # the shared negatives take a label no query and no key has
            top = parallel.global_max(
                int(torch.cat([query_labels.long(), key_labels.long()]).max()), query.device, opts.process_group
            )
            fresh = torch.full((negatives.shape[0],), top + 1, dtype=torch.long, device=query.device)
        all_key_labels = cols.gather(key_labels.long(), fresh)
    spec = info_nce_spec(index + cols.offset, opts.normalize, query_labels, all_key_labels, duplicates)
    widths = None if dims is None and weights is None else (dims, weights)
    return runner.run(query, cols, scale, spec, opts, widths=widths)


class InfoNCELoss(LossModule):
    """Module form of :func:`info_nce_loss`.

    Examples::

        >>> loss = flashcl.InfoNCELoss(temperature=0.05)(torch.randn(4, 16), torch.randn(6, 16))
    """

    def __init__(
        self,
        temperature: Scalar = 0.05,
        normalize: bool = True,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        in_batch_negatives: bool = True,
        duplicates: str = "mask",
        label_smoothing: float = 0.0,
        matryoshka_dims: Optional[Sequence[int]] = None,
        matryoshka_weights: Optional[Sequence[float]] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        positive_index: Optional[Tensor] = None,
        negatives: Optional[Tensor] = None,
        query_labels: Optional[Tensor] = None,
        key_labels: Optional[Tensor] = None,
    ) -> Tensor:
        return info_nce_loss(
            query,
            keys,
            positive_index,
            negatives=negatives,
            query_labels=query_labels,
            key_labels=key_labels,
            **self.loss_options(),
        )


def smoothing_rows(
    q: Tensor,
    keys: Tensor,
    index: Tensor,
    scale: Tensor,
    normalize: bool,
    extra: Optional[Tensor] = None,
    group: Any = None,
) -> Tensor:
    """Per row ``s_it - mean_j s_ij`` over every column (the keys of every rank of
    ``group``, then ``extra`` once), by a mean key in O((M + N) D): label smoothing
    ``eps`` adds ``eps`` times it to the cross-entropy, since
    ``(1 - eps) CE + eps mean_j (-log p_ij) = CE + eps (s_it - mean_j s_ij)``."""
    qn, kn = unit_rows(q, normalize), unit_rows(keys, normalize)
    total, count = kn.sum(0), kn.shape[0]
    if group is not None:
        sums, _ = parallel.all_gather_with_grad(total.unsqueeze(0), group)
        total, count = sums.sum(0), sum(parallel.row_counts(count, q.device, group))
    if extra is not None:
        total, count = total + unit_rows(extra, normalize).sum(0), count + extra.shape[0]
    return scale.to(qn.dtype) * ((qn * kn[index]).sum(1) - qn @ (total / count))


def row_logsumexps(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    *,
    normalize: bool,
    backend: str = "auto",
    block_size: Optional[int] = None,
    widths: Sequence[int] = (),
    exclude_self: bool = False,
    offset: int = 0,
    exclude: Optional[Exclusions] = None,
    boost: Optional[Tuple[float, Callable[[Tile], Tensor]]] = None,
) -> Tensor:
    """Each row's log-sum-exp of its scaled scores ``scale q k^T`` over its candidates: a
    denominator of InfoNCE's kind, the positives' terms left to the caller (the
    directions of sentence-transformers' MultipleNegativesRankingLoss).

    Args:
        q: (M, D) rows. k: (N, D) candidates. scale: 0-dim (1 / temperature).
        normalize: L2-normalise the rows (each prefix width on its own).
        backend: ``"auto"`` (from the M N scores) | ``"dense"`` | ``"tiled"`` | ``"triton"``
            (without ``widths``: they take one pass over the tiles). block_size: rows per block
            (None: picked).
        widths: prefix widths (Matryoshka): every width's in one pass over the tiles.
        exclude_self: candidate ``i + offset`` of row ``i`` left out. offset: its column.
        exclude: further candidates left out (:class:`flashcl.core.Exclusions`).
        boost: ``(f, fn)``: the candidates of ``fn(tile)`` (a bool mask) weigh ``exp(f s)``
            more (a hardness penalty).

    Shape:
        - output: (M,), or (W, M) with ``widths``

    Examples::

        >>> q, k = torch.randn(4, 8), torch.randn(6, 8)
        >>> row_logsumexps(q, k, torch.tensor(20.0), normalize=True).shape
        torch.Size([4])
    """
    if not widths:
        entries = q.shape[0] * k.shape[0]
        name = backends.pick_name(backend, backends.ENGINE_BACKENDS, entries, q, "row_logsumexps", kernel=None)
        source = backends.Source(k, offset, [k.shape[0]])
        return runner.row_lse(q, source, scale, normalize, name, block_size, exclude, exclude_self, boost)
    ones = torch.ones(q.shape[0], dtype=compute_dtype(q.dtype), device=q.device)
    head = SoftmaxHead(ones, exclude_self=exclude_self, offset=offset, exclude=exclude, boost=boost)
    problem = Problem(head, (), normalize, offset)
    dims = list(widths)
    qc, kc = q.to(ones.dtype), k.to(ones.dtype)
    aq, ak = matryoshka.prefix_scales(qc, dims, True), matryoshka.prefix_scales(kc, dims, True)
    return matryoshka.head_values(qc, kc, aq, ak, scale, problem, dims, block_size)


def _example_info_nce(g: torch.Generator) -> Example:
    return Example(
        (example_rows(g, 23, 24), example_rows(g, 41, 24), torch.randint(0, 41, (23,), generator=g)),
        {"temperature": 0.05},
    )


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "info_nce_loss": _example_info_nce,
}
