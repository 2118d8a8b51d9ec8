"""CLIP's symmetric InfoNCE and SigLIP's sigmoid loss: :func:`clip_loss`, :func:`siglip_loss`,
:class:`ClipLoss`, :class:`SigLipLoss`."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import Tensor

from . import backends, checks, reference
from .base import LossModule, reject_open_clip_keywords, shared_docs
from .core import CoreSpec
from .dispatch import (
    Scalar,
    check_across_ranks,
    dense_ids,
    run_with_widths,
    scale_dtype,
    warn_small_logit_scale,
)
from .engine import Problem
from .heads import SoftplusHead
from .linear import Linear, Positives
from .utils import autocast_off


@shared_docs
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

    Shape:
        - image_embeds, text_embeds: (B, D); labels: (B,)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> img, txt = torch.randn(4, 16), torch.randn(4, 16)
        >>> loss = flashcl.clip_loss(img, txt, logit_scale=100.0)
        >>> loss = flashcl.clip_loss(img, txt, 100.0, labels=torch.tensor([0, 1, 1, 2]))
    """
    image_embeds, text_embeds = checks.validate_pair(image_embeds, text_embeds, "image_embeds", "text_embeds")
    checks.Options(normalize, reduction, backend, block_size)
    if process_group is not None:
        check_across_ranks("clip_loss", strategy, grad_scale,
                           matryoshka_dims=matryoshka_dims is not None or matryoshka_weights is not None,
                           backend=backend != "auto")
        from . import distributed

        return distributed.clip_loss(image_embeds, text_embeds, logit_scale, normalize=normalize, reduction=reduction,
                                     grad_scale=grad_scale, strategy=strategy, group=process_group,
                                     block_size=block_size, labels=labels, logit_bias=logit_bias)
    dtype = scale_dtype(image_embeds)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device, dtype)
    warn_small_logit_scale(scale)
    bias = None if logit_bias is None else checks.check_real_scalar(logit_bias, "logit_bias", image_embeds.device,
                                                                    dtype)
    b = image_embeds.shape[0]
    if labels is None:
        index = torch.arange(b, device=image_embeds.device).unsqueeze(1)
        spec = CoreSpec(index=index, pos_mode="sum", symmetric=True, normalize=normalize)
    else:
        _, labels = checks.validate_labelled(image_embeds, labels, names=("image_embeds", "labels"))
        ids, num_classes = dense_ids(labels)
        spec = CoreSpec(row_labels=ids, col_labels=ids, num_classes=num_classes, pos_mode="mean", symmetric=True,
                        normalize=normalize)
    loss = run_with_widths(image_embeds, text_embeds, scale, spec, reduction, backend, block_size, matryoshka_dims,
                 matryoshka_weights)
    if bias is not None and bias.requires_grad:
        loss = loss + 0.0 * bias  # the bias's gradient: exactly 0, as the formula's
    return loss


def siglip_problem(b: int, n: int, labels: Optional[Tensor], device: torch.device, dtype: torch.dtype,
                    bias: float, normalize: bool, offset: int = 0,
                    col_labels: Optional[Tensor] = None) -> Problem:
    """SigLIP as an engine problem (b image rows, n text columns): the softplus head
    and the positive term. Positives:
    the diagonal (image ``i`` and text ``i + offset``), or, with labels, every pair
    of the same label (``col_labels``: the texts' labels, default ``labels``)."""
    if labels is None:
        pos = Positives(index=(torch.arange(b, device=device) + offset).unsqueeze(1))
    else:
        cols = labels if col_labels is None else col_labels
        uniq, ids = torch.unique(torch.cat([labels, cols]), return_inverse=True)
        pos = Positives(row_labels=ids[:b], col_labels=ids[b:], num_classes=int(uniq.numel()))
    counts = pos.counts(b, n)
    head = SoftplusHead(bias, counts)
    return Problem(head, (Linear(pos, torch.ones(b, dtype=dtype, device=device)),), normalize)


@shared_docs
def siglip_loss(
    image_embeds: Tensor,
    text_embeds: Tensor,
    logit_scale: Scalar,
    logit_bias: Scalar,
    *,
    labels: Optional[Tensor] = None,
    normalize: bool = False,
    reduction: str = "mean",
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
    image_embeds, text_embeds = checks.validate_pair(image_embeds, text_embeds, "image_embeds", "text_embeds")
    checks.Options(normalize, reduction, backend, block_size)
    if process_group is not None:
        check_across_ranks("siglip_loss", strategy, grad_scale, backend=backend != "auto")
        from . import distributed

        return distributed.siglip_loss(image_embeds, text_embeds, logit_scale, logit_bias, labels=labels,
                                       normalize=normalize, reduction=reduction, grad_scale=grad_scale,
                                       strategy=strategy, group=process_group, block_size=block_size)
    dtype = scale_dtype(image_embeds)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device, dtype)
    warn_small_logit_scale(scale)
    bias = checks.check_real_scalar(logit_bias, "logit_bias", image_embeds.device, dtype)
    b = image_embeds.shape[0]
    if labels is not None:
        _, labels = checks.validate_labelled(image_embeds, labels, names=("image_embeds", "labels"))
        labels = labels.long()
    name = backends.resolve(backend, b * b, image_embeds.device, image_embeds.dtype, image_embeds.shape[1],
                            kernel="softplus")
    if name == "reference":
        with autocast_off(image_embeds.device.type):
            rows = reference.siglip_loss(image_embeds, text_embeds, scale, bias, labels, normalize)
        return rows if reduction == "none" else (rows.sum() / b if reduction == "mean" else rows.sum())
    problem = siglip_problem(b, b, labels, image_embeds.device, dtype, float(bias.detach()), normalize)
    weights = None
    if reduction != "none":
        weights = (torch.full((b,), 1.0 / b if reduction == "mean" else 1.0, dtype=dtype,
                              device=image_embeds.device), None)
    return backends.run(image_embeds, text_embeds, scale, problem, name, weights, block_size, param=bias)



class ClipLoss(LossModule):
    """Module form of :func:`clip_loss`; called as open_clip's ``ClipLoss`` is:
    ``loss_fn(image_features, text_features, logit_scale, logit_bias=None, output_dict=False)``
    (plus ``labels=`` for several positives per image).

    Examples::

        >>> loss = flashcl.ClipLoss()(torch.randn(4, 16), torch.randn(4, 16), 100.0)
    """

    def __init__(self, normalize: bool = True, reduction: str = "mean", backend: str = "auto",
                 block_size: Optional[int] = None, matryoshka_dims: Optional[Sequence[int]] = None,
                 matryoshka_weights: Optional[Sequence[float]] = None, process_group: Any = None,
                 strategy: str = "all_gather", grad_scale: str = "ddp", **open_clip: Any) -> None:
        reject_open_clip_keywords("ClipLoss", open_clip)
        super().__init__(normalize=normalize, reduction=reduction, backend=backend, block_size=block_size,
                         matryoshka_dims=matryoshka_dims, matryoshka_weights=matryoshka_weights,
                         process_group=process_group, strategy=strategy, grad_scale=grad_scale)

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Scalar,
                logit_bias: Optional[Scalar] = None, output_dict: bool = False,
                labels: Optional[Tensor] = None) -> Union[Tensor, Dict[str, Tensor]]:
        loss = clip_loss(image_features, text_features, logit_scale, logit_bias, labels=labels,
                         **self.loss_options())
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(LossModule):
    """Module form of :func:`siglip_loss`; called as open_clip's ``SigLipLoss``
    is: ``loss_fn(image_features, text_features, logit_scale, logit_bias)``
    (``output_dict=True`` returns ``{"contrastive_loss": loss}``, as open_clip).
    Across processes: :func:`flashcl.distributed.siglip_loss`.

    Examples::

        >>> loss = flashcl.SigLipLoss()(torch.randn(4, 16), torch.randn(4, 16), 10.0, -10.0)
    """

    def __init__(self, normalize: bool = False, reduction: str = "mean", backend: str = "auto",
                 block_size: Optional[int] = None, process_group: Any = None, strategy: str = "ring",
                 grad_scale: str = "ddp", **open_clip: Any) -> None:
        reject_open_clip_keywords("SigLipLoss", open_clip)
        super().__init__(normalize=normalize, reduction=reduction, backend=backend, block_size=block_size,
                         process_group=process_group, strategy=strategy, grad_scale=grad_scale)

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Scalar, logit_bias: Scalar,
                labels: Optional[Tensor] = None, output_dict: bool = False) -> Union[Tensor, Dict[str, Tensor]]:
        loss = siglip_loss(image_features, text_features, logit_scale, logit_bias, labels=labels,
                           **self.loss_options())
        return {"contrastive_loss": loss} if output_dict else loss
