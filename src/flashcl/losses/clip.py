"""CLIP's symmetric InfoNCE and SigLIP's sigmoid loss: :func:`clip_loss`, :func:`siglip_loss`,
:class:`ClipLoss`, :class:`SigLipLoss`."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import Tensor

from .. import backends, checks, parallel, reference, runner
from ..base import LossModule, reject_open_clip_keywords, shared_docs
from ..checks import Example, Scalar, check_smoothing, class_ids, example_rows, no_matryoshka, warn_small_logit_scale
from ..compiled import compiles
from ..core import CoreSpec, compute_dtype
from ..engine.engine import autocast_off
from .info_nce import smoothing_rows


@shared_docs
@compiles()
def clip_loss(
    image_embeds: Tensor,
    text_embeds: Tensor,
    logit_scale: Scalar,
    logit_bias: Optional[Scalar] = None,
    *,
    labels: Optional[Tensor] = None,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
    label_smoothing: float = 0.0,
) -> Tensor:
    r"""The symmetric CLIP loss (open_clip's ``ClipLoss`` on one process).

    With ``logits = logit_scale * image_hat @ text_hat.T`` (B x B), the mean of
    the image->text and text->image cross-entropies with the diagonal as targets::

        (F.cross_entropy(logits, arange(B)) + F.cross_entropy(logits.T, arange(B))) / 2

    With ``labels``, every image-text pair of the same label is a positive in both
    directions (duplicate captions, same-class pairs), with uniform soft targets
    over each row's (and column's) positives::

        (F.cross_entropy(logits, P / P.sum(1)) + F.cross_entropy(logits.T, P.T / P.T.sum(1))) / 2,
        P = labels[:, None] == labels[None, :]

    without labels, the loss above bit for bit. ``logit_bias`` (open_clip's biased
    variant) is accepted: a constant added to every logit leaves both
    cross-entropies unchanged, and a learnable bias gets its gradient, 0.

    Args:
        image_embeds: (B, D).
        text_embeds: (B, D).
        logit_scale: the multiplier (not its log), a float or a 0-dim tensor
            (learnable: it gets its gradient). open_clip passes
            ``model.logit_scale.exp()``.
        logit_bias: a float, a 0-dim tensor, or None.
        labels: (B,) integer labels of the pairs, or None (the diagonal).
        normalize: L2-normalise first. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (per pair: the mean of its
            row and column terms).
        @backend@
        @matryoshka@
        @process_group@
        label_smoothing: ``eps`` in [0, 1): each direction's target spread over every
            column, as ``F.cross_entropy(logits, arange(B), label_smoothing=eps)``
            in both directions. Default: 0. Not with labels or Matryoshka.

    Shape:
        - image_embeds, text_embeds: (B, D); labels: (B,)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> img, txt = torch.randn(4, 16), torch.randn(4, 16)
        >>> loss = flashcl.clip_loss(img, txt, logit_scale=100.0)
        >>> loss = flashcl.clip_loss(img, txt, 100.0, labels=torch.tensor([0, 1, 1, 2]))
    """
    image_embeds, text_embeds = checks.validate_pair(
        image_embeds, text_embeds, "image_embeds", "text_embeds", process_group is not None
    )
    opts = checks.Options(normalize, reduction, backend, block_size, process_group, strategy, grad_scale)
    dtype = compute_dtype(image_embeds.dtype)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device, dtype)
    warn_small_logit_scale(scale)
    bias = (
        None if logit_bias is None else checks.check_real_scalar(logit_bias, "logit_bias", image_embeds.device, dtype)
    )
    if labels is not None:
        _, labels = checks.validate_labelled(
            image_embeds, labels, names=("image_embeds", "labels"), empty=process_group is not None
        )
    eps = check_smoothing(label_smoothing)
    if eps:
        if labels is not None:
            raise ValueError(
                "label_smoothing spreads the target over every column: it takes no labels (several positives)"
            )
        no_matryoshka(matryoshka_dims, matryoshka_weights, "label_smoothing")
        core = clip_loss(
            image_embeds,
            text_embeds,
            logit_scale,
            logit_bias,
            normalize=normalize,
            reduction=reduction,
            backend=backend,
            block_size=block_size,
            process_group=process_group,
            strategy=strategy,
            grad_scale=grad_scale,
        )
        pairs = torch.arange(image_embeds.shape[0], device=image_embeds.device)
        rows = 0.5 * (
            smoothing_rows(image_embeds, text_embeds, pairs, scale, normalize, group=process_group)
            + smoothing_rows(text_embeds, image_embeds, pairs, scale, normalize, group=process_group)
        )
        over = parallel.reduction_over(process_group)
        return core + eps * runner.reduce(rows, torch.ones_like(rows), reduction, grad_scale, over)
    loss = _clip(image_embeds, text_embeds, scale, opts, labels, matryoshka_dims, matryoshka_weights)
    if bias is not None and bias.requires_grad:
        loss = loss + 0.0 * bias  # the bias's gradient: exactly 0, as the formula's
    return loss


def _clip(
    image_embeds: Tensor,
    text_embeds: Tensor,
    scale: Tensor,
    opts: checks.Options,
    labels: Optional[Tensor],
    dims: Any,
    weights: Any,
) -> Tensor:
    """:func:`clip_loss`'s body, one process being a world of one: both directions
    against the image and text towers of every rank (:mod:`flashcl.distributed`;
    open_clip's ``gather_with_grad=True, local_loss=True`` arrangement, exact); on
    one process both directions in one pass."""
    texts = parallel.columns(text_embeds, opts.strategy, opts.process_group)
    images = parallel.columns(image_embeds, opts.strategy, opts.process_group)
    b, offset = image_embeds.shape[0], texts.offset
    if labels is None:
        spec = CoreSpec(
            index=(torch.arange(b, device=image_embeds.device) + offset).unsqueeze(1),
            pos_mode="sum",
            normalize=opts.normalize,
        )
    else:  # every same-label pair of the global batch, the mean over them, in both directions
        (ids,), num_classes = class_ids(texts.gather(labels.long()))
        spec = CoreSpec(
            row_labels=ids[offset : offset + b],
            col_labels=ids,
            num_classes=num_classes,
            pos_mode="mean",
            normalize=opts.normalize,
        )
    widths = None if dims is None and weights is None else (dims, weights)
    return runner.run_both_ways(image_embeds, text_embeds, images, texts, scale, spec, opts, widths)


@shared_docs
@compiles()
def siglip_loss(
    image_embeds: Tensor,
    text_embeds: Tensor,
    logit_scale: Scalar,
    logit_bias: Scalar,
    *,
    labels: Optional[Tensor] = None,
    normalize: bool = False,
    reduction: str = "mean",
    normalize_by: str = "global",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "ring",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""The sigmoid loss of SigLIP (Zhai et al., 2023; open_clip's ``SigLipLoss`` on one process).

    Every image-text pair is its own binary classification: with
    ``logits = logit_scale * image @ text.T + logit_bias`` (B x B) and ``z_ij = +1``
    on the matching pairs (the diagonal), -1 elsewhere::

        loss = -sum_ij log sigmoid(z_ij * logits_ij) / B

    computed without the B x B matrix on the tiled and triton backends: memory
    O(B D), the gradient formed in the same pass as the loss. With ``labels``, every
    image-text pair of the same label is a positive (several captions of one image,
    same-class pairs).

    Args:
        image_embeds: (B, D). open_clip passes normalised features.
        text_embeds: (B, D).
        logit_scale: the multiplier (not its log), a float or a 0-dim tensor
            (learnable: it gets its gradient); open_clip passes ``logit_scale.exp()``.
        logit_bias: the bias, a float or a 0-dim tensor (learnable).
        labels: (B,) integer labels of the pairs, or None (the diagonal).
        normalize: L2-normalise the embeddings first. Default: False (open_clip's).
        reduction: ``"mean"`` (the sum over pairs divided by B, as open_clip) |
            ``"sum"`` | ``"none"`` (per image: the sum over its row of pairs).
        normalize_by: with ``process_group``: ``"global"`` (default): the mean over the
            global batch, SigLIP's loss; ``"local"``: each rank's sum over its own
            images divided by its own batch size, as open_clip's ``SigLipLoss``
            computes it on each rank. With equal batches the two agree; with
            ``grad_scale="ddp"`` and equal batches, or ``normalize_by="local",
            grad_scale="sum"`` for any batches, each rank's value and gradients
            equal open_clip's ``SigLipLoss(rank=..., world_size=...)``. On one
            process both are the mean over B.
        backend: ``"auto"`` (``"triton"`` for CUDA tensors up to D = 256 when Triton is
            installed, else ``"tiled"`` from 2^20 pairs, ``"dense"`` below) |
            ``"reference"`` (per-image loops) | ``"dense"`` (the B x B logits) |
            ``"tiled"`` (row blocks, O(B) memory) | ``"triton"`` (GPU kernels).
        block_size: rows per block of the tiled backend; None picks one.
        @process_group@

    Shape:
        - image_embeds, text_embeds: (B, D); labels: (B,)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> img = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> txt = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> loss = flashcl.siglip_loss(img, txt, logit_scale=10.0, logit_bias=-10.0)
    """
    image_embeds, text_embeds = checks.validate_pair(
        image_embeds, text_embeds, "image_embeds", "text_embeds", process_group is not None
    )
    opts = checks.Options(normalize, reduction, backend, block_size, process_group, strategy, grad_scale)
    checks.check_choice(normalize_by, "normalize_by", ("global", "local"))
    dtype = compute_dtype(image_embeds.dtype)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device, dtype)
    warn_small_logit_scale(scale)
    bias = checks.check_real_scalar(logit_bias, "logit_bias", image_embeds.device, dtype)
    if labels is not None:
        _, labels = checks.validate_labelled(
            image_embeds, labels, names=("image_embeds", "labels"), empty=process_group is not None
        )
        labels = labels.long()
    return _siglip(image_embeds, text_embeds, scale, bias, labels, opts, normalize_by)


def _siglip(
    image_embeds: Tensor,
    text_embeds: Tensor,
    scale: Tensor,
    bias: Tensor,
    labels: Optional[Tensor],
    opts: checks.Options,
    normalize_by: str,
) -> Tensor:
    """:func:`siglip_loss`'s body, one process being a world of one: each rank's
    images against the texts of every rank (:mod:`flashcl.distributed`)."""
    texts = parallel.columns(text_embeds, opts.strategy, opts.process_group)
    b, dtype = image_embeds.shape[0], compute_dtype(image_embeds.dtype)
    all_labels = None if labels is None else texts.gather(labels)
    divisor = float(texts.total if normalize_by == "global" else b)
    r = runner.share(
        opts.reduction, opts.grad_scale, texts, torch.ones(b, dtype=dtype, device=image_embeds.device), divisor
    )

    def formula() -> Tensor:
        with autocast_off(image_embeds.device.type):
            rows = reference.siglip_loss(
                image_embeds, texts.keys, scale, bias, labels, opts.normalize, texts.offset, all_labels
            )
        return rows if r is None else (r * rows).sum()

    def engine() -> Tensor:
        problem = runner.sigmoid_problem(
            b,
            texts.total,
            labels,
            image_embeds.device,
            dtype,
            float(bias.detach()),
            opts.normalize,
            offset=texts.offset,
            col_labels=all_labels,
        )
        weights = None if r is None else (r, None)
        return texts.run(image_embeds, scale, problem, weights, opts.block_size, (bias,), backend=name)[0]

    impls = {"reference": formula, "dense": engine, "tiled": engine, "triton": engine}
    name = backends.pick_name(
        opts.backend, tuple(impls), b * texts.total, image_embeds, "siglip_loss", source=texts, kernel="softplus"
    )
    return impls[name]()


class ClipLoss(LossModule):
    """Module form of :func:`clip_loss`; called as open_clip's ``ClipLoss`` is:
    ``loss_fn(image_features, text_features, logit_scale, logit_bias=None, output_dict=False)``
    (plus ``labels=`` for several positives per image).

    Examples::

        >>> loss = flashcl.ClipLoss()(torch.randn(4, 16), torch.randn(4, 16), 100.0)
    """

    def __init__(
        self,
        normalize: bool = True,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        matryoshka_dims: Optional[Sequence[int]] = None,
        matryoshka_weights: Optional[Sequence[float]] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
        label_smoothing: float = 0.0,
        **open_clip: Any,
    ) -> None:
        reject_open_clip_keywords("ClipLoss", open_clip)
        super().__init__(**self.given(locals(), "open_clip"))

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Scalar,
        logit_bias: Optional[Scalar] = None,
        output_dict: bool = False,
        labels: Optional[Tensor] = None,
    ) -> Union[Tensor, Dict[str, Tensor]]:
        loss = clip_loss(image_features, text_features, logit_scale, logit_bias, labels=labels, **self.loss_options())
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(LossModule):
    """Module form of :func:`siglip_loss`; called as open_clip's ``SigLipLoss``
    is: ``loss_fn(image_features, text_features, logit_scale, logit_bias)``
    (``output_dict=True`` returns ``{"contrastive_loss": loss}``, as open_clip).
    Across processes: ``process_group=``.

    Examples::

        >>> loss = flashcl.SigLipLoss()(torch.randn(4, 16), torch.randn(4, 16), 10.0, -10.0)
    """

    def __init__(
        self,
        normalize: bool = False,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "ring",
        grad_scale: str = "ddp",
        normalize_by: str = "global",
        **open_clip: Any,
    ) -> None:
        reject_open_clip_keywords("SigLipLoss", open_clip)
        super().__init__(**self.given(locals(), "open_clip"))

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Scalar,
        logit_bias: Scalar,
        labels: Optional[Tensor] = None,
        output_dict: bool = False,
    ) -> Union[Tensor, Dict[str, Tensor]]:
        loss = siglip_loss(image_features, text_features, logit_scale, logit_bias, labels=labels, **self.loss_options())
        return {"contrastive_loss": loss} if output_dict else loss


def _example_clip(g: torch.Generator) -> Example:
    return Example((example_rows(g, 31, 24), example_rows(g, 31, 24), 14.0), {})


def _example_siglip(g: torch.Generator) -> Example:
    return Example((example_rows(g, 31, 24), example_rows(g, 31, 24), 10.0, -5.0), {})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "clip_loss": _example_clip,
    "siglip_loss": _example_siglip,
}
