"""DINOv2's self-distillation losses (``dinov2.loss``: ``DINOLoss``, ``iBOTPatchLoss``,
``KoLeoLoss``) with their constructors, methods and calls, computed by flashcl:
replacing ``from dinov2.loss import DINOLoss, iBOTPatchLoss, KoLeoLoss`` by ``from
flashcl.integrations.dinov2 import ...`` is the whole change; DINOv2 itself need not be
installed.

They take DINOv2's inputs, the rows x K logits its heads formed, and give its values,
gradients and centers (its delayed center update included: ``update_center`` starts
the reduction, the next ``softmax_center_teacher`` applies it), with fewer
intermediates (no saved softmax or log-softmax) and three differences, each where
DINOv2's own arithmetic fails:

* the cross-entropy is formed without cancellation (a tiny loss near collapse keeps its
  precision in float32);
* Sinkhorn-Knopp runs in the log domain (``exp(t / tau)`` overflows float32 at a teacher
  temperature that makes ``t / tau`` pass 88: DINOv2 gives NaN there), in the logits'
  precision (DINOv2 casts to float32: float64 logits give float64 targets here), its B
  the count of every process's rows (DINOv2 multiplies this process's by the world
  size, the same for even batches);
* the iBOT ``sinkhorn_knopp_teacher`` leaves the caller's ``n_masked_patches_tensor``
  as it was (DINOv2's all-reduces it in place) and runs without ``torch.distributed``
  initialised (DINOv2's calls ``dist.all_reduce`` unconditionally).

The rows x K logits themselves are avoided by :func:`flashcl.dino_loss` on the heads'
bottleneck rows (:class:`flashcl.integrations.lightly.PrototypeHead` wraps DINOv2's
``DINOHead``): see the migration page of the documentation. DINOv2's training pairs each
student crop with every teacher crop but its own (its global crops' teacher outputs are
swapped), which is ``pairs="cross"`` there.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..losses.koleo import koleo_loss, nearest_neighbours
from ..losses.prototype_logits import paired_rows, sinkhorn_codes, softmax_targets
from ..losses.self_distill import load_center
from .lightly import PrototypeHead

__all__ = ["DINOLoss", "iBOTPatchLoss", "KoLeoLoss", "PrototypeHead"]


class _DelayedCenter(nn.Module):
    """DINOv2's center of a loss (a buffer ``center``) and its delayed EMA update:
    :meth:`update_center` sums the teacher's outputs and starts their all-reduce (async,
    when ``torch.distributed`` is initialised); :meth:`apply_center_update`, called by
    ``softmax_center_teacher``, waits for it and moves the center."""

    center: Tensor

    def __init__(self, shape: Sequence[int], center_momentum: float) -> None:
        super().__init__()
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(*shape))
        self.updated = True
        self.reduce_handle: Any = None
        self.len_teacher_output: Optional[int] = None
        self.async_batch_center: Optional[Tensor] = None

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        load_center(state_dict, prefix + "center", self.center)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _batch_sum(self, teacher_output: Tensor) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def update_center(self, teacher_output: Tensor) -> None:
        self.reduce_center_update(teacher_output)

    @torch.no_grad()
    def reduce_center_update(self, teacher_output: Tensor) -> None:
        self.updated = False
        self.len_teacher_output = len(teacher_output)
        self.async_batch_center = self._batch_sum(teacher_output)
        if dist.is_available() and dist.is_initialized():
            self.reduce_handle = dist.all_reduce(self.async_batch_center, async_op=True)

    @torch.no_grad()
    def apply_center_update(self) -> None:
        if self.updated is False:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            if self.reduce_handle is not None:
                self.reduce_handle.wait()
            assert self.async_batch_center is not None and self.len_teacher_output is not None
            mean = self.async_batch_center / (self.len_teacher_output * world)
            self.center = self.center * self.center_momentum + mean * (1 - self.center_momentum)
            self.updated = True

    def _centred_softmax(self, teacher_output: Tensor, teacher_temp: float) -> Tensor:
        """``softmax((teacher_output - center) / teacher_temp)`` in DINOv2's shape and dtype
        (the broadcast of the two), a block of rows at a time."""
        self.apply_center_update()
        shape = torch.broadcast_shapes(teacher_output.shape, self.center.shape)
        dtype = torch.promote_types(teacher_output.dtype, self.center.dtype)
        flat = teacher_output.reshape(-1, teacher_output.shape[-1])
        return softmax_targets(flat, self.center.reshape(-1).to(dtype), float(teacher_temp), dtype).reshape(shape)


class DINOLoss(_DelayedCenter):
    """DINOv2's ``DINOLoss``: :meth:`softmax_center_teacher` or
    :meth:`sinkhorn_knopp_teacher` make the teacher's targets; the call sums, over the
    student outputs and the teacher targets it is given, the mean cross-entropy of each
    pair; the center (a (1, K) buffer) with DINOv2's delayed update.

    Args:
        out_dim: K.
        student_temp: Default: 0.1.
        center_momentum: Default: 0.9.

    Examples::

        >>> loss_fn = DINOLoss(4096)
        >>> teacher = loss_fn.softmax_center_teacher(torch.randn(16, 4096), teacher_temp=0.04)
        >>> loss = loss_fn([torch.randn(8, 4096, requires_grad=True)], list(teacher.chunk(2)))
        >>> loss_fn.update_center(torch.randn(16, 4096))
    """

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9) -> None:
        super().__init__((1, out_dim), center_momentum)
        self.student_temp = student_temp

    def _batch_sum(self, teacher_output: Tensor) -> Tensor:
        return torch.sum(teacher_output, dim=0, keepdim=True)

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_output: Tensor, teacher_temp: float) -> Tensor:
        return self._centred_softmax(teacher_output, teacher_temp)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(self, teacher_output: Tensor, teacher_temp: float, n_iterations: int = 3) -> Tensor:
        return sinkhorn_codes(teacher_output, n_iterations, float(teacher_temp), gather=True)

    def forward(
        self, student_output_list: Sequence[Tensor], teacher_out_softmaxed_centered_list: Sequence[Tensor]
    ) -> Tensor:
        students = list(student_output_list)
        teachers = list(teacher_out_softmaxed_centered_list)
        shapes = {tuple(t.shape) for t in students + teachers}
        if len(shapes) != 1:
            raise ValueError(
                f"DINOLoss: every student output and teacher target must have one shape, got {sorted(shapes)}"
            )
        k = students[0].shape[-1]
        views = [s.reshape(-1, k) for s in students]
        targets = [t.reshape(-1, k) for t in teachers]
        rows = paired_rows(1.0 / self.student_temp, [list(range(len(targets)))] * len(views), targets, views)
        return rows.mean(1).sum()


class iBOTPatchLoss(_DelayedCenter):  # noqa: N801 - DINOv2's name
    """DINOv2's ``iBOTPatchLoss``: :meth:`forward` on (B, N, K) patch logits with the
    student's masks, :meth:`forward_masked` on the masked patches' logits (DINOv2's
    padded buffers: the first ``n_masked_patches`` rows count, the gradient of the
    others is 0; ``masks_weight`` given, or each patch ``1 / (its image's masked
    patches)``), :meth:`softmax_center_teacher` / :meth:`sinkhorn_knopp_teacher` for the
    targets; the center a (1, 1, K) buffer, its update the mean over the patches.

    Args:
        patch_out_dim: K.
        student_temp: Default: 0.1.
        center_momentum: Default: 0.9.

    Examples::

        >>> loss_fn = iBOTPatchLoss(4096)
        >>> masks = torch.rand(4, 196) < 0.3
        >>> n = int(masks.sum())
        >>> t = loss_fn.softmax_center_teacher(torch.randn(1, n, 4096), teacher_temp=0.07).squeeze(0)
        >>> loss = loss_fn.forward_masked(torch.randn(n, 4096, requires_grad=True), t, masks)
    """

    def __init__(self, patch_out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9) -> None:
        super().__init__((1, 1, patch_out_dim), center_momentum)
        self.student_temp = student_temp

    def _batch_sum(self, teacher_output: Tensor) -> Tensor:
        return torch.sum(teacher_output.mean(1), dim=0, keepdim=True)

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_patch_tokens: Tensor, teacher_temp: float) -> Tensor:
        return self._centred_softmax(teacher_patch_tokens, teacher_temp)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(
        self, teacher_output: Tensor, teacher_temp: float, n_masked_patches_tensor: Tensor, n_iterations: int = 3
    ) -> Tensor:
        return sinkhorn_codes(teacher_output, n_iterations, float(teacher_temp), True, rows=n_masked_patches_tensor)

    def _rows(self, s: Tensor, t: Tensor) -> Tensor:
        k = s.shape[-1]
        return paired_rows(1.0 / self.student_temp, [[0]], [t.reshape(-1, k)], [s.reshape(-1, k)])[0].view(s.shape[:-1])

    def forward(self, student_patch_tokens: Tensor, teacher_patch_tokens: Tensor, student_masks_flat: Tensor) -> Tensor:
        """(B, N, K) logits and targets, (B, N) masks: each image's mean cross-entropy over
        its masked patches (0 for an image with none), the mean over the images."""
        ce = self._rows(student_patch_tokens, teacher_patch_tokens)
        masks = student_masks_flat.to(ce.dtype)
        return ((ce * masks).sum(-1) / masks.sum(-1).clamp(min=1.0)).mean()

    def forward_masked(
        self,
        student_patch_tokens_masked: Tensor,
        teacher_patch_tokens_masked: Tensor,
        student_masks_flat: Tensor,
        n_masked_patches: Optional[int] = None,
        masks_weight: Optional[Tensor] = None,
    ) -> Tensor:
        s, t = student_patch_tokens_masked, teacher_patch_tokens_masked
        if n_masked_patches is not None:  # a padded buffer: its first rows are the masked patches
            s, t = s[:n_masked_patches], t[:n_masked_patches]
        ce = self._rows(s, t)
        if masks_weight is None:
            per_image = student_masks_flat.sum(-1).clamp(min=1.0).to(ce.dtype)
            masks_weight = (1 / per_image).unsqueeze(-1).expand_as(student_masks_flat)[student_masks_flat]
        return (ce * masks_weight).sum() / student_masks_flat.shape[0]


class KoLeoLoss(nn.Module):
    """DINOv2's ``KoLeoLoss`` by :func:`flashcl.koleo_loss` (its rule for the self product:
    -1 in the search), without the B x B products.

    Examples::

        >>> loss = KoLeoLoss()(torch.randn(64, 384))
    """

    def __init__(self) -> None:
        super().__init__()
        self.pdist = nn.PairwiseDistance(2, eps=1e-8)

    def pairwise_NNs_inner(self, x: Tensor) -> Tensor:  # noqa: N802 - DINOv2's name
        """Each unit row's nearest other row by the largest dot product, (B,) int64."""
        return nearest_neighbours(x)

    def forward(self, student_output: Tensor, eps: float = 1e-8) -> Tensor:
        return koleo_loss(student_output, eps=eps)
