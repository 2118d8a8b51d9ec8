"""open_clip's losses with open_clip's constructors and calls, computed by flashcl:
replacing ``from open_clip.loss import ClipLoss, SigLipLoss, DistillClipLoss, CoCaLoss`` by
``from flashcl.integrations.open_clip import ...`` is the whole change. The B x B
logits are never formed; open_clip itself need not be installed.

Each class takes open_clip's arguments (``local_loss``, ``gather_with_grad``,
``cache_labels``, ``rank``, ``world_size``, ``use_horovod``; SigLIP's
``dist_impl``) and the call ``loss(image_features, text_features, logit_scale,
...[, output_dict=True])``, and returns open_clip's values and per-rank gradients.
Across processes (``world_size > 1``, the default process group):

* ``gather_with_grad=True`` (what open_clip recommends): the exact loss over the
  global batch, computed by flashcl across processes (every rank's features
  exchanged with their gradient; no rank forms the global logits). With DDP's
  averaging the parameter gradients are the full-batch step's.
* ``gather_with_grad=False``: open_clip's gradient through this rank's features
  only. With ``local_loss=False`` every rank's features enter the global loss but
  only its own carry a gradient; after DDP's averaging the parameter gradient is
  ``1 / world_size`` of the full-batch gradient. With ``local_loss=True`` the
  other ranks' features are constants of this rank's loss. Neither is the
  full-batch gradient: ``gather_with_grad=True`` is.
* ``local_loss``: each rank's loss over its own rows (images and texts) against
  every rank's columns (open_clip's ``local_loss=True``) or the global loss on
  every rank (``False``).

open_clip needs equal batches on every rank; flashcl's exchanges also take uneven
ones (with ``local_loss=True`` each rank's value is then its rows' mean).
Horovod is not supported: ``use_horovod=True`` raises.

Features are used as given (``normalize=False``), as open_clip uses them (its
models normalise them).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import parallel
from ..losses.clip import clip_loss, siglip_loss
from ..losses.distill import distill_loss
from ..losses.info_nce import info_nce_loss

__all__ = ["ClipLoss", "SigLipLoss", "DistillClipLoss", "CoCaLoss"]


class _SumGradAcrossRanks(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over ranks, times ``factor``.
    A replicated scalar (the logit scale) gets on every rank the gradient of the
    global loss, as open_clip's per-rank graphs give it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float, group: Any) -> Tensor:  # type: ignore[override]
        ctx.factor, ctx.group = factor, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad * ctx.factor, None, None


def _world(loss: Any) -> Optional[Any]:
    """The process group the loss runs over, or None for one process."""
    if loss.use_horovod:
        raise ValueError(
            f"{type(loss).__name__}(use_horovod=True): flashcl's losses run over torch.distributed, not horovod; "
            "launch with torch.distributed (torchrun) and use_horovod=False"
        )
    if loss.world_size <= 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{type(loss).__name__}(world_size={loss.world_size}) needs an initialised process group")
    if dist.get_world_size() != loss.world_size or dist.get_rank() != loss.rank:
        raise ValueError(
            f"{type(loss).__name__}(rank={loss.rank}, world_size={loss.world_size}) does not match the process group "
            f"(rank {dist.get_rank()} of {dist.get_world_size()})"
        )
    return dist.group.WORLD


def _gathered(x: Tensor, group: Any, keep_own: bool) -> Tuple[Tensor, int]:
    """Every rank's rows of ``x`` without gradient, in rank order, with this rank's
    own rows (and their gradient) in their place when ``keep_own``; and this rank's
    first row."""
    everyone = parallel.gather_plain(x, group)
    sizes = parallel.row_counts(x.shape[0], x.device, group)
    start = sum(sizes[: parallel.rank_of(group)])
    if not keep_own:
        return everyone, start
    return torch.cat([everyone[:start], x, everyone[start + x.shape[0] :]]), start


def _global_value(share: Tensor, value: Tensor, group: Any) -> Tensor:
    """``share``'s graph (its gradient) with the value of the global loss: the sum of
    every rank's ``value``."""
    total = parallel.sum_across(value.detach().reshape(1), group)[0]
    return share + (total - share).detach()


def _scale_for(logit_scale: Any, group: Any, local_loss: bool) -> Any:
    """The logit scale as the exact cross-rank losses should see it: with
    ``local_loss=False`` every rank's gradient of it is the global loss's (summed
    over ranks, over the world size: their shares carry the world size)."""
    if local_loss or not isinstance(logit_scale, Tensor) or not logit_scale.requires_grad:
        return logit_scale
    return _SumGradAcrossRanks.apply(logit_scale, 1.0 / parallel.world_size(group), group)


def _clip_terms(
    loss: Any, image_features: Tensor, text_features: Tensor, logit_scale: Any, logit_bias: Any, group: Any
) -> Tensor:
    """open_clip's ``ClipLoss`` value (with its per-rank gradients)."""
    kw: Dict[str, Any] = {"normalize": False, "logit_bias": logit_bias}
    if group is None:
        return clip_loss(image_features, text_features, logit_scale, **kw)
    if loss.gather_with_grad:
        s = _scale_for(logit_scale, group, loss.local_loss)
        share = clip_loss(image_features, text_features, s, process_group=group, grad_scale="ddp", **kw)
        if loss.local_loss:  # each rank's rows' mean: the ddp share itself (equal batches)
            return share
        return _global_value(share, share / parallel.world_size(group), group)
    if not loss.local_loss:  # the global loss with this rank's features live, the others constants
        img, _ = _gathered(image_features, group, keep_own=True)
        txt, _ = _gathered(text_features, group, keep_own=True)
        return clip_loss(img, txt, logit_scale, **kw)
    img, start = _gathered(image_features, group, keep_own=False)
    txt, _ = _gathered(text_features, group, keep_own=False)
    pos = start + torch.arange(image_features.shape[0], device=image_features.device)
    temperature = 1.0 / logit_scale
    per_image = info_nce_loss(image_features, txt, pos, temperature=temperature, normalize=False)
    per_text = info_nce_loss(text_features, img, pos, temperature=temperature, normalize=False)
    return (per_image + per_text) / 2


class ClipLoss(nn.Module):
    """open_clip's ``ClipLoss``: ``(CE(logits_per_image, labels) + CE(logits_per_text,
    labels)) / 2`` over ``logit_scale * image_features @ text_features.T``, computed
    by :func:`flashcl.clip_loss` without the logits (see the module docstring for
    ``local_loss`` and ``gather_with_grad``).

    Args:
        local_loss, gather_with_grad, cache_labels, rank, world_size, use_horovod:
            open_clip's (``cache_labels`` has nothing to cache here).

    Examples::

        >>> from flashcl.integrations.open_clip import ClipLoss
        >>> img = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> txt = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> loss = ClipLoss()(img, txt, torch.tensor(14.3))
        >>> out = ClipLoss()(img, txt, torch.tensor(14.3), output_dict=True)   # {"contrastive_loss": ...}
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
    ) -> None:
        super().__init__()
        self.local_loss, self.gather_with_grad, self.cache_labels = local_loss, gather_with_grad, cache_labels
        self.rank, self.world_size, self.use_horovod = rank, world_size, use_horovod

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Any,
        logit_bias: Any = None,
        output_dict: bool = False,
    ) -> Union[Tensor, Dict[str, Tensor]]:
        group = _world(self)
        total = _clip_terms(self, image_features, text_features, logit_scale, logit_bias, group)
        return {"contrastive_loss": total} if output_dict else total


class DistillClipLoss(ClipLoss):
    """open_clip's ``DistillClipLoss``: the CLIP loss and the distillation term
    ``(dist(T_img, S_img) + dist(T_txt, S_txt)) / 2``, ``dist(t, s) = -mean_i sum_j
    softmax(t)_ij log_softmax(s)_ij``, computed by :func:`flashcl.clip_loss` and
    :func:`flashcl.distill_loss` without the logits. Returns ``(contrastive_loss,
    distill_loss)``, or with ``output_dict=True`` the dict of both.

    Examples::

        >>> from flashcl.integrations.open_clip import DistillClipLoss
        >>> f = [torch.nn.functional.normalize(torch.randn(8, 16), dim=1) for _ in range(4)]
        >>> c, d = DistillClipLoss()(f[0], f[1], torch.tensor(14.3), f[2], f[3], torch.tensor(20.0))
    """

    def forward(  # type: ignore[override]
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Any,
        dist_image_features: Tensor,
        dist_text_features: Tensor,
        dist_logit_scale: Any,
        output_dict: bool = False,
    ) -> Union[Tuple[Tensor, Tensor], Dict[str, Tensor]]:
        group = _world(self)
        contrastive = _clip_terms(self, image_features, text_features, logit_scale, None, group)
        distill = self._distill(
            image_features, text_features, logit_scale, dist_image_features, dist_text_features, dist_logit_scale, group
        )
        if output_dict:
            return {"contrastive_loss": contrastive, "distill_loss": distill}
        return contrastive, distill

    def _distill(self, img: Tensor, txt: Tensor, s: Any, t_img: Tensor, t_txt: Tensor, ts: Any, group: Any) -> Tensor:
        kw: Dict[str, Any] = {"normalize": False}
        if group is None:
            return distill_loss(img, txt, t_img, t_txt, scale=s, teacher_scale=ts, symmetric=True, **kw)
        if self.gather_with_grad:
            sc = _scale_for(s, group, self.local_loss)
            share = distill_loss(
                img,
                txt,
                t_img,
                t_txt,
                scale=sc,
                teacher_scale=ts,
                symmetric=True,
                process_group=group,
                grad_scale="ddp",
                **kw,
            )
            if self.local_loss:
                return share
            return _global_value(share, share / parallel.world_size(group), group)
        if not self.local_loss:
            parts = [_gathered(x, group, keep_own=True)[0] for x in (img, txt, t_img, t_txt)]
            return distill_loss(*parts, scale=s, teacher_scale=ts, symmetric=True, **kw)
        a_img, a_txt, a_timg, a_ttxt = (_gathered(x, group, keep_own=False)[0] for x in (img, txt, t_img, t_txt))
        per_image = distill_loss(img, a_txt, t_img, a_ttxt, scale=s, teacher_scale=ts, **kw)
        per_text = distill_loss(txt, a_img, t_txt, a_timg, scale=s, teacher_scale=ts, **kw)
        return (per_image + per_text) / 2


class CoCaLoss(ClipLoss):
    """open_clip's ``CoCaLoss``: ``clip_loss_weight`` x the CLIP loss (computed by
    flashcl, as :class:`ClipLoss`) and ``caption_loss_weight`` x the captioner's
    token cross-entropy (``nn.CrossEntropyLoss(ignore_index=pad_id)`` over
    ``logits.permute(0, 2, 1)``, as open_clip computes it: that term is per token,
    not a B x B matrix). Returns ``(contrastive_loss, caption_loss)`` or, with
    ``output_dict=True``, their dict.

    Examples::

        >>> from flashcl.integrations.open_clip import CoCaLoss
        >>> f = [torch.nn.functional.normalize(torch.randn(4, 16), dim=1) for _ in range(2)]
        >>> logits, tokens = torch.randn(4, 7, 50), torch.randint(1, 50, (4, 7))
        >>> c, cap = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0)(f[0], f[1], logits, tokens, 14.3)
    """

    def __init__(
        self,
        caption_loss_weight: float,
        clip_loss_weight: float,
        pad_id: int = 0,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
    ) -> None:
        super().__init__(local_loss, gather_with_grad, cache_labels, rank, world_size, use_horovod)
        self.clip_loss_weight, self.caption_loss_weight = clip_loss_weight, caption_loss_weight
        self.caption_loss = nn.CrossEntropyLoss(ignore_index=pad_id)

    def forward(  # type: ignore[override]
        self,
        image_features: Tensor,
        text_features: Tensor,
        logits: Tensor,
        labels: Tensor,
        logit_scale: Any,
        output_dict: bool = False,
    ) -> Union[Tuple[Tensor, Tensor], Dict[str, Tensor]]:
        if self.clip_loss_weight:
            group = _world(self)
            clip = _clip_terms(self, image_features, text_features, logit_scale, None, group)
            contrastive = self.clip_loss_weight * clip
        else:
            contrastive = torch.tensor(0, device=logits.device)
        caption = self.caption_loss(logits.permute(0, 2, 1), labels) * self.caption_loss_weight
        if output_dict:
            return {"contrastive_loss": contrastive, "caption_loss": caption}
        return contrastive, caption


class SigLipLoss(nn.Module):
    """open_clip's ``SigLipLoss``: ``-sum_ij log sigmoid(z_ij (logit_scale x_i . y_j +
    logit_bias)) / B_local`` over this rank's images against every rank's texts,
    computed by :func:`flashcl.siglip_loss` (the texts passed around a ring, as
    open_clip's neighbour exchange; ``dist_impl`` ``"bidir"``, ``"shift"``,
    ``"reduce"`` and ``"gather"`` all give the same values and gradients, so it only
    selects nothing here).

    Args:
        cache_labels, rank, world_size, dist_impl: open_clip's.
        chunk_size: open_clip's (rows of logits formed at a time; 0: all at once).
            Any value gives the same loss here: flashcl never forms the B x B logits.

    The call takes ``logit_bias=None`` as open_clip does: no bias is added.

    Examples::

        >>> from flashcl.integrations.open_clip import SigLipLoss
        >>> img = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> txt = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> loss = SigLipLoss()(img, txt, torch.tensor(10.0), torch.tensor(-10.0))
    """

    use_horovod = False

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: Optional[str] = None,
        chunk_size: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int (0: no chunking), got {chunk_size!r}")
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.chunk_size = chunk_size
        self.dist_impl = dist_impl or "bidir"
        if self.dist_impl not in ("bidir", "shift", "reduce", "gather"):
            raise ValueError(f"dist_impl must be 'bidir', 'shift', 'reduce' or 'gather', got {dist_impl!r}")

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Any,
        logit_bias: Any,
        output_dict: bool = False,
    ) -> Union[Tensor, Dict[str, Tensor]]:
        group = _world(self)
        kw: Dict[str, Any] = {"normalize": False}
        if group is not None:
            kw.update(process_group=group, normalize_by="local", grad_scale="sum", strategy="ring")
        bias = 0.0 if logit_bias is None else logit_bias  # open_clip adds no bias for None
        loss = siglip_loss(image_features, text_features, logit_scale, bias, **kw)
        return {"contrastive_loss": loss} if output_dict else loss
