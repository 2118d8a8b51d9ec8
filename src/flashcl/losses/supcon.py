"""Supervised contrastive losses (SupCon, supervised SimCSE): :func:`supcon_loss` and
:class:`SupConLoss`."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import checks, parallel, runner
from ..base import LossModule, reject_pml_call, shared_docs
from ..checks import Example, Scalar, check_keys, class_ids, example_labels, example_rows, no_matryoshka
from ..compiled import compiles
from ..core import CoreSpec, compute_dtype
from .flex import flex_loss
from .multilabel import multilabel_supcon


def validate_ref(
    embeddings: Tensor, ref: Optional[Tensor], ref_labels: Optional[Tensor], ref_self: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(ref detached, ref_labels, ref_self as int64 or None), checked against the embeddings."""
    if embeddings.dim() != 2:
        raise ValueError(f"ref takes 2-D embeddings (B, D), got shape {tuple(embeddings.shape)}")
    if ref is None:
        raise ValueError("ref_labels / ref_self need ref (the keys)")
    ref = check_keys(ref, "ref", embeddings).detach()
    if ref_labels is None:
        raise ValueError("ref_labels is None: the keys of ref need their labels")
    ref, ref_labels = checks.validate_labelled(ref, ref_labels, names=("ref", "ref_labels"))
    b, n = embeddings.shape[0], ref.shape[0]
    if ref_self is not None:
        ref_self = checks.check_index_tensor(ref_self, "ref_self")
        if ref_self.shape != (b,):
            raise ValueError(f"ref_self must have shape ({b},), got {tuple(ref_self.shape)}")
        checks.same_device(ref_self, embeddings, "ref_self", "embeddings")
        if bool(((ref_self < -1) | (ref_self >= n)).any()):
            raise ValueError(f"ref_self values must be rows of ref in [0, {n}), or -1")
        ref_self = ref_self.long()
    return ref, ref_labels, ref_self


@shared_docs
@compiles()
def supcon_loss(
    embeddings: Tensor,
    labels: Tensor,
    *,
    temperature: Scalar = 0.1,
    positives: str = "mean",
    include_self: bool = False,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    ref: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
    ref_self: Optional[Tensor] = None,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
    overlap_threshold: float = 0.3,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Supervised contrastive loss: samples with the same label are positives.

    With ``s_ij = z_i . z_j / temperature`` (``z`` the L2-normalised embeddings)
    and ``P(i) = {j != i : y_j = y_i}``, the loss of anchor ``i`` is::

        positives="mean":  LSE_{j in Den(i)} s_ij - (1/|P(i)|) sum_{p in P(i)} s_ip
        positives="sum":   LSE_{j in Den(i)} s_ij - sum_{p in P(i)} s_ip
        positives="lse":   LSE_{j in Den(i)} s_ij - LSE_{p in P(i)} s_ip + log |P(i)|

    where ``Den(i)`` is every sample but ``i`` (``include_self=False``) or every
    sample (``include_self=True``). The defaults are SupCon's ``L_out`` (Khosla
    et al., 2020); ``positives="lse"`` is their ``L_in``, ``-log((1/|P(i)|) sum_p
    exp(s_ip) / sum_{a != i} exp(s_ia))``: the positives' probability mass, its
    ``log |P(i)|`` term a constant (no gradient), computed as ``softplus(LSE_{negatives}
    - LSE_{positives})`` so that it stays exact near 0 (class-id labels; no ``ref``, no
    ``include_self``, no Matryoshka widths). ``positives="sum", include_self=True, temperature=0.05`` is
    the supervised SimCSE loss as it is commonly written (every same-label
    sample's score subtracted from a logsumexp over the whole batch, self
    included), every anchor counted.

    With ``positives="mean"``, anchors without any positive have an undefined
    term: their per-anchor loss is 0 and ``reduction="mean"`` averages over the
    other anchors only; if no anchor has a positive, the loss is 0 with a zero
    gradient (never NaN). A batch whose samples all share one label (no
    negative) keeps the formula's value, which is positive;
    pytorch-metric-learning's ``SupConLoss`` returns 0 there, and so does
    :class:`flashcl.integrations.pytorch_metric_learning.SupConLoss`.

    Args:
        embeddings: (B, D), or (B, V, D) for V views of each sample that share
            its label (SupContrast's convention: the B * V views are all anchors).
        labels: (B,) integer class labels, or (B, C) multi-hot label sets (bool or
            0/1): then ``j != i`` is a positive of ``i`` when the Jaccard similarity
            ``J_ij = |y_i & y_j| / |y_i | y_j|`` exceeds ``overlap_threshold``,
            weighted by it, and the anchor's term is
            ``-(1/|P(i)|) sum_{p in P(i)} J_ip log softmax_p`` (``positives="sum"``:
            without the ``1/|P(i)|``) over the same denominator: the
            ``MultiSupConLoss`` of pytorch-metric-learning's pull request #667
            (multi-label SupCon), ``J`` formed tile by tile from the label rows.
        overlap_threshold: multi-hot labels only: the Jaccard similarity a positive
            must exceed, in [0, 1). Default: 0.3.
        temperature: float or 0-dim tensor (a learnable temperature gets its
            gradient). Default: 0.1.
        positives: ``"mean"`` (default), ``"sum"`` or ``"lse"`` over each anchor's positives.
        include_self: keep ``j = i`` in the denominator. Default: False.
        normalize: L2-normalise the embeddings first. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (per-anchor losses).
        @backend@

        ref: (N, D) keys without gradient (a queue, :class:`flashcl.MemoryBank`):
            each anchor is contrasted with the batch itself and with these keys
            (same label: positive). Requires ``ref_labels``; 2-D embeddings.
        ref_labels: (N,) the keys' labels.
        ref_self: (B,) the row of ``ref`` that holds each anchor itself, for a queue
            that already holds the current batch (:meth:`flashcl.MemoryBank.push`
            returns them): then the anchors are contrasted with ``ref`` only, each
            anchor's own entry left out (pytorch-metric-learning's
            ``CrossBatchMemory``); -1 for an anchor not in it.
        @matryoshka@
        @process_group@

    Shape:
        - embeddings: (B, D) or (B, V, D)
        - labels: (B,); ref: (N, D); ref_labels: (N,); ref_self: (B,)
        - output: scalar, or (B,) / (B, V) with ``reduction="none"``

    Examples::

        >>> emb = torch.randn(8, 16, requires_grad=True)
        >>> labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = flashcl.supcon_loss(emb, labels, temperature=0.1)
        >>> loss.backward()
    """
    if isinstance(labels, Tensor) and labels.dim() not in (1, 2):
        raise ValueError(f"labels must be (B,) class ids or (B, C) multi-hot sets, got shape {tuple(labels.shape)}")
    if isinstance(labels, Tensor) and labels.dim() == 2 and labels.shape[1] < 2:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)}: pass class ids as (B,) (labels.squeeze(1)), or "
            "multi-hot sets of C >= 2 classes as (B, C)"
        )
    if isinstance(labels, Tensor) and labels.dim() == 2:  # multi-hot label sets
        embeddings = checks.check_float_tensor(embeddings, "embeddings", (2, 3), process_group is not None)
        checks.check_choice(positives, "positives", ("mean", "sum"))
        checks.check_bool(include_self, "include_self")
        opts = checks.Options(normalize, reduction, backend, block_size, process_group, strategy, grad_scale)
        threshold = _check_threshold(overlap_threshold)
        no_matryoshka(matryoshka_dims, matryoshka_weights, "multi-hot labels")
        if ref_self is not None:
            raise ValueError("ref_self takes class-id labels; with multi-hot labels, pass the queue as ref alone")
        if ref is not None:
            ref = check_keys(ref, "ref", embeddings).detach()
        scale = 1.0 / checks.check_positive_scalar(
            temperature, "temperature", embeddings.device, compute_dtype(embeddings.dtype)
        )
        return multilabel_supcon(embeddings, labels, scale, threshold, positives, include_self, opts, ref, ref_labels)
    if overlap_threshold != 0.3:
        _check_threshold(overlap_threshold)
        raise ValueError("overlap_threshold is for multi-hot (B, C) labels; these labels are class ids (B,)")
    embeddings, labels = checks.validate_labelled(embeddings, labels, (2, 3), empty=process_group is not None)
    checks.check_choice(positives, "positives", ("mean", "sum", "lse"))
    checks.check_bool(include_self, "include_self")
    opts = checks.Options(normalize, reduction, backend, block_size, process_group, strategy, grad_scale)
    if positives == "lse":
        if include_self or ref is not None or ref_labels is not None or ref_self is not None:
            raise ValueError("positives='lse' (SupCon's L_in) takes the batch alone: no include_self, no ref")
        no_matryoshka(matryoshka_dims, matryoshka_weights, "positives='lse'")
        return _supcon_in(embeddings, labels, temperature, opts)
    scale = 1.0 / checks.check_positive_scalar(
        temperature, "temperature", embeddings.device, compute_dtype(embeddings.dtype)
    )
    if ref is not None or ref_labels is not None or ref_self is not None:
        no_matryoshka(matryoshka_dims, matryoshka_weights, "ref (keys without gradient)")
        ref, ref_labels, ref_self = validate_ref(embeddings, ref, ref_labels, ref_self)
    return _supcon(
        embeddings,
        labels,
        scale,
        positives,
        include_self,
        opts,
        ref,
        ref_labels,
        ref_self,
        matryoshka_dims,
        matryoshka_weights,
    )


def _check_threshold(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value < 1.0):
        raise ValueError(f"overlap_threshold must be a float in [0, 1), got {value!r}")
    return float(value)


def _supcon(
    embeddings: Tensor,
    labels: Tensor,
    scale: Tensor,
    positives: str,
    include_self: bool,
    opts: checks.Options,
    ref: Optional[Tensor],
    ref_labels: Optional[Tensor],
    ref_self: Optional[Tensor],
    dims: Any,
    weights: Any,
) -> Tensor:
    """:func:`supcon_loss`'s body, one process being a world of one: this rank's rows
    against every rank's (:mod:`flashcl.distributed`) and, with ``ref``, the queue's
    keys once."""
    b = embeddings.shape[0]
    views = 1 if embeddings.dim() == 2 else embeddings.shape[1]
    flat = embeddings if embeddings.dim() == 2 else embeddings.transpose(0, 1).reshape(b * views, embeddings.shape[-1])
    labels = labels.long().repeat(views)
    widths = None if dims is None and weights is None else (dims, weights)
    if ref_self is not None:  # the queue holds the batch: its columns are the queue's, the same on every rank
        assert ref is not None and ref_labels is not None
        (row_ids, col_ids), num_classes = class_ids(labels, ref_labels)
        spec = CoreSpec(
            exclude_self=not include_self,
            self_pairs=True,
            row_labels=row_ids,
            col_labels=col_ids,
            num_classes=num_classes,
            pos_mode=positives,
            normalize=opts.normalize,
            self_index=ref_self,
        )
        return runner.run(flat, parallel.replicated(ref, opts.process_group), scale, spec, opts)
    if embeddings.dim() == 3 and embeddings.shape[1] == 0:
        raise ValueError(f"embeddings must have at least one view, got shape {tuple(embeddings.shape)}")
    cols = parallel.columns(flat, opts.strategy, opts.process_group, shared=ref, own=True)
    ids, num_classes = cols.class_ids(labels, None if ref_labels is None else ref_labels.long())
    if cols.total - cols.shared < 2 and not include_self and ref is None:
        raise ValueError(
            "supcon_loss needs at least 2 samples (views) when include_self=False (across processes: in the "
            "global batch): the denominator of a single sample is empty"
        )
    spec = CoreSpec(
        exclude_self=not include_self,
        self_pairs=True,
        offset=cols.offset,
        row_labels=ids[cols.offset : cols.offset + flat.shape[0]],
        col_labels=ids,
        num_classes=num_classes,
        pos_mode=positives,
        normalize=opts.normalize,
    )
    out = runner.run(flat, cols, scale, spec, opts, widths=widths)
    return out.reshape(views, b).T if opts.reduction == "none" and embeddings.dim() == 3 else out


def _supcon_in(embeddings: Tensor, labels: Tensor, temperature: Scalar, opts: checks.Options) -> Tensor:
    """SupCon's ``L_in`` (``positives="lse"``): the positive-LSE flex loss of the views, plus
    each counted anchor's ``log |P(i)|`` (its positives over every rank)."""
    b = embeddings.shape[0]
    views = 1 if embeddings.dim() == 2 else embeddings.shape[1]
    flat = embeddings if embeddings.dim() == 2 else embeddings.transpose(0, 1).reshape(b * views, embeddings.shape[-1])
    ids = labels.long().repeat(views)
    rows = flex_loss(
        flat, rows={"y": ids}, positive=lambda a, c: a.y == c.y, positives="lse", temperature=temperature,
        normalize=opts.normalize, reduction="none", backend=opts.backend, block_size=opts.block_size,
        process_group=opts.process_group, strategy=opts.strategy,
    )  # fmt: skip
    every = ids if opts.process_group is None else parallel.gather_plain(ids, opts.process_group)
    uniq, inv = torch.unique(torch.cat([every, ids]), return_inverse=True)
    sizes = torch.bincount(inv[: every.shape[0]], minlength=uniq.shape[0])
    count = (sizes[inv[every.shape[0] :]] - 1).to(rows.dtype)  # |P(i)|: the same label, not itself
    valid = count > 0
    rows = rows + torch.where(valid, torch.log(count.clamp_min(1.0)), torch.zeros_like(count))
    if opts.reduction == "none":
        return rows.reshape(views, b).T if embeddings.dim() == 3 else rows
    source = parallel.reduction_over(opts.process_group)
    return runner.reduce_total(rows.sum(), valid.sum(), opts.reduction, opts.grad_scale, source)


class SupConLoss(LossModule):
    """Module form of :func:`supcon_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.SupConLoss(temperature=0.1)
        >>> loss = loss_fn(torch.randn(8, 16), torch.randint(0, 3, (8,)))
    """

    def __init__(
        self,
        temperature: Scalar = 0.1,
        positives: str = "mean",
        include_self: bool = False,
        normalize: bool = True,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        matryoshka_dims: Optional[Sequence[int]] = None,
        matryoshka_weights: Optional[Sequence[float]] = None,
        overlap_threshold: float = 0.3,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref: Optional[Tensor] = None,
        ref_labels: Optional[Tensor] = None,
        ref_self: Optional[Tensor] = None,
        **pml: Any,
    ) -> Tensor:
        if isinstance(ref, tuple):  # PML's third positional argument: a miner's indices_tuple
            pml["indices_tuple"] = ref
        reject_pml_call("SupConLoss", pml)
        return supcon_loss(embeddings, labels, ref=ref, ref_labels=ref_labels, ref_self=ref_self, **self.loss_options())


def _example_supcon(g: torch.Generator) -> Example:
    return Example((example_rows(g, 37, 24), example_labels(g, 37, 5)), {"temperature": 0.1})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "supcon_loss": _example_supcon,
}
