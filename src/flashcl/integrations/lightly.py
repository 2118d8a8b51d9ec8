"""lightly's self-distillation losses with its constructors and calls, computed by
flashcl: replacing ``from lightly.loss import DINOLoss, IBOTPatchLoss, KoLeoLoss,
SwaVLoss`` (and ``from lightly.loss.ibot_loss import IBOTPlusPlusPatchLoss``) by ``from
flashcl.integrations.lightly import ...`` is the whole change;
lightly itself need not be installed.

These take lightly's inputs, the rows x K logits the head already formed: values,
gradients and the center's updates equal lightly's, with fewer intermediates (no
stacked copies of the views, no saved softmax and log-softmax: the student's gradient
is recomputed from its logits and the teacher's probabilities; :class:`KoLeoLoss`
forms no B x B matrix). The rows x K logits themselves are avoided by the fused losses
on the head's bottleneck rows (:func:`flashcl.dino_loss`, :func:`flashcl.swav_loss`),
with :class:`PrototypeHead` in place of the head's last layer: see the migration page
of the documentation.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.weight_norm import WeightNorm

from ..core import compute_dtype
from ..losses.koleo import koleo_loss
from ..losses.prototype_logits import float32_value, paired_rows, sinkhorn_codes, softmax_targets
from ..losses.self_distill import load_center, warn_if_swapped

__all__ = ["DINOLoss", "IBOTPatchLoss", "IBOTPlusPlusPatchLoss", "KoLeoLoss", "SwaVLoss", "PrototypeHead"]


def _center_mean(total: Tensor, count: int) -> Tensor:
    """lightly's ``center_mean``: this process's mean, averaged over the world's
    processes when ``torch.distributed`` is initialised."""
    mean = total / count
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(mean)
        mean = mean / dist.get_world_size()
    return mean


class DINOLoss(nn.Module):
    """lightly's ``DINOLoss``: every teacher view against every student view but the
    same crop, the mean over those pairs and the batch; the center (a (1, 1, K) buffer)
    updated by an EMA of the teacher's batch mean after each call; the teacher's
    temperature per call, or from the warm-up schedule with ``epoch``.

    The call takes lightly's order, ``(teacher_out, student_out)`` (flashcl's own
    :class:`flashcl.DINOLoss` takes ``(student, teacher, prototypes)``); a teacher whose
    logits require grad while the student's do not is warned about. Under autocast it
    returns float32 (computed in float32), where lightly's returns the autocast dtype.

    Examples::

        >>> loss_fn = DINOLoss(output_dim=4096)
        >>> teacher_out = [torch.randn(8, 4096) for _ in range(2)]
        >>> student_out = [torch.randn(8, 4096, requires_grad=True) for _ in range(4)]
        >>> loss = loss_fn(teacher_out, student_out)
    """

    center: Tensor

    def __init__(
        self,
        output_dim: int = 65536,
        warmup_teacher_temp: float = 0.04,
        teacher_temp: float = 0.04,
        warmup_teacher_temp_epochs: int = 30,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        center_mode: str = "mean",
    ) -> None:
        super().__init__()
        if center_mode != "mean":
            raise ValueError(f"Unknown mode '{center_mode}'. Valid modes are ['mean'].")
        self.teacher_temp, self.student_temp, self.center_momentum = teacher_temp, student_temp, center_momentum
        self.register_buffer("center", torch.zeros(1, 1, output_dim))
        self.warmup_teacher_temp_epochs = warmup_teacher_temp_epochs
        self.teacher_temp_schedule = torch.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs)

    def forward(
        self,
        teacher_out: List[Tensor],
        student_out: List[Tensor],
        teacher_temp: Optional[float] = None,
        epoch: Optional[int] = None,
    ) -> Tensor:
        # lightly holds the teacher's temperature as a float32 tensor: its value is taken
        if teacher_temp is not None:
            tt = float32_value(teacher_temp)
        elif epoch is not None and epoch < self.warmup_teacher_temp_epochs:
            tt = float(self.teacher_temp_schedule[epoch])
        else:
            tt = float32_value(self.teacher_temp)
        n_terms = len(teacher_out) * len(student_out) - min(len(teacher_out), len(student_out))
        if n_terms == 0:
            raise ValueError(
                "DINOLoss requires at least two views in total (the diagonal matching the same view index is "
                f"excluded), but got {len(teacher_out)} teacher view(s) and {len(student_out)} student view(s)"
            )
        warn_if_swapped(teacher_out, student_out, "DINOLoss(teacher_out, student_out)")
        dtype = compute_dtype(student_out[0].dtype)
        center = self.center.reshape(-1).to(dtype)
        targets = [softmax_targets(t, center, tt, dtype) for t in teacher_out]
        pairs = [[t for t in range(len(teacher_out)) if t != s] for s in range(len(student_out))]
        rows = paired_rows(1.0 / self.student_temp, pairs, targets, student_out)
        loss = rows.sum() / (n_terms * teacher_out[0].shape[0])
        self.update_center(teacher_out)
        return loss

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        load_center(state_dict, prefix + "center", self.center)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def update_center(self, teacher_out: Union[Tensor, Sequence[Tensor]]) -> None:
        """The EMA of the center with the teacher's batch mean: of a tensor over its first
        two dimensions, as lightly's (views and rows of a (T, B, K) stack), or of a list of
        views over every view and row (the call's; no stacked copy)."""
        if isinstance(teacher_out, Tensor):
            total, count = teacher_out.sum(dim=(0, 1), keepdim=True), teacher_out.shape[0] * teacher_out.shape[1]
        else:
            total = torch.stack([t.reshape(-1, t.shape[-1]).sum(0) for t in teacher_out]).sum(0)
            count = sum(t.reshape(-1, t.shape[-1]).shape[0] for t in teacher_out)
        mean = _center_mean(total, count)
        self.center = self.center * self.center_momentum + mean * (1 - self.center_momentum)


class _Center(nn.Module):
    """lightly's ``Center`` (a (1, K) buffer ``center``, ``value``, ``update``)."""

    center: Tensor

    def __init__(self, size: Tuple[int, ...], momentum: float) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(size))
        self.momentum = momentum

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        load_center(state_dict, prefix + "center", self.center)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def value(self) -> Tensor:
        return self.center

    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        """The EMA with the mean of ``x`` over the dimensions where the center has size 1."""
        dims = tuple(i for i, n in enumerate(self.center.shape) if n == 1)
        count = math.prod(x.shape[i] for i in dims)
        mean = _center_mean(x.sum(dim=dims, keepdim=True), count)
        self.center = self.center * self.momentum + mean * (1 - self.momentum)


class IBOTPatchLoss(nn.Module):
    """lightly's ``IBOTPatchLoss`` (DINOv2's iBOT patch loss): each masked patch's
    cross-entropy weighted by ``1 / (masked patches of its image)``, summed and divided
    by the images; the center updated after each call. lightly's order,
    ``(teacher_out, student_out, mask)``.

    Examples::

        >>> loss_fn = IBOTPatchLoss(output_dim=4096)
        >>> mask = torch.zeros(2, 4, 4, dtype=torch.bool)
        >>> mask[:, :2] = True
        >>> loss = loss_fn(torch.randn(16, 4096), torch.randn(16, 4096, requires_grad=True), mask)
    """

    def __init__(
        self,
        output_dim: int = 65536,
        teacher_temp: float = 0.04,
        student_temp: float = 0.1,
        center_mode: str = "mean",
        center_momentum: float = 0.9,
    ) -> None:
        super().__init__()
        if center_mode != "mean":
            raise ValueError(f"Unknown mode '{center_mode}'. Valid modes are ['mean'].")
        self.teacher_temp, self.student_temp = teacher_temp, student_temp
        self.center = _Center((1, output_dim), center_momentum)

    def forward(
        self, teacher_out: Tensor, student_out: Tensor, mask: Tensor, teacher_temp: Optional[float] = None
    ) -> Tensor:
        warn_if_swapped([teacher_out], [student_out], "IBOTPatchLoss(teacher_out, student_out, mask)")
        tt = float32_value(teacher_temp if teacher_temp is not None else self.teacher_temp)
        dtype = compute_dtype(student_out.dtype)
        target = softmax_targets(teacher_out, self.center.value.reshape(-1).to(dtype), tt, dtype)
        rows = paired_rows(1.0 / self.student_temp, [[0]], [target], [student_out])[0]
        per_image = mask.sum(dim=tuple(range(1, mask.dim())), keepdim=True).clamp(min=1.0)
        weight = (1.0 / per_image).expand_as(mask)[mask]
        loss = (rows * weight).sum() / mask.shape[0]
        self.center.update(teacher_out)
        return loss


class IBOTPlusPlusPatchLoss(IBOTPatchLoss):
    """lightly's ``IBOTPlusPlusPatchLoss`` (iBOT++, TIPSv2): every patch token's
    cross-entropy, the masked and the visible ones, on (B, N, K) logits (or (B N, K)
    with ``mask`` for B); with ``mask`` each image's masked mean plus
    ``visible_loss_weight`` times its visible mean, the mean over the images; without,
    the mean over every token. The center moves with every teacher token.

    Examples::

        >>> loss_fn = IBOTPlusPlusPatchLoss(output_dim=4096)
        >>> loss = loss_fn(torch.randn(2, 196, 4096), torch.randn(2, 196, 4096, requires_grad=True))
    """

    def forward(  # type: ignore[override]
        self,
        teacher_out: Tensor,
        student_out: Tensor,
        mask: Optional[Tensor] = None,
        teacher_temp: Optional[float] = None,
        visible_loss_weight: float = 1.0,
    ) -> Tensor:
        if teacher_out.shape != student_out.shape:
            raise ValueError(
                f"teacher_out and student_out must have the same shape but got "
                f"{tuple(teacher_out.shape)} and {tuple(student_out.shape)}."
            )
        if teacher_out.dim() not in (2, 3):
            raise ValueError(f"teacher_out must be rank 2 or 3 but got rank {teacher_out.dim()}.")
        if teacher_out.dim() == 3:
            b = teacher_out.shape[0]
        elif mask is None:
            raise ValueError("mask is required when teacher_out has rank 2 so that the batch size B can be inferred.")
        else:
            b = mask.shape[0]
            if teacher_out.shape[0] % b != 0:
                raise ValueError(
                    f"teacher_out length {teacher_out.shape[0]} is not divisible by batch size {b} inferred from mask."
                )
        k = teacher_out.shape[-1]
        teacher_flat, student_flat = teacher_out.reshape(-1, k), student_out.reshape(-1, k)
        tt = float32_value(teacher_temp if teacher_temp is not None else self.teacher_temp)
        dtype = compute_dtype(student_out.dtype)
        target = softmax_targets(teacher_flat, self.center.value.reshape(-1).to(dtype), tt, dtype)
        ce = paired_rows(1.0 / self.student_temp, [[0]], [target], [student_flat])[0].view(b, -1)
        if mask is None:
            loss = ce.mean()
        else:
            masked = mask.reshape(b, -1).to(ce.dtype)
            visible = 1.0 - masked
            loss = (
                (ce * masked).sum(1) / masked.sum(1).clamp(min=1.0)
                + visible_loss_weight * (ce * visible).sum(1) / visible.sum(1).clamp(min=1.0)
            ).mean()
        self.center.update(teacher_flat)
        return loss


class KoLeoLoss(nn.Module):
    """lightly's ``KoLeoLoss``: with ``p = 2`` by :func:`flashcl.koleo_loss` (the
    neighbours searched a tile at a time, no B x B matrix) with lightly's rule for the
    self product (``self_score=-2``: a row whose every other row is antipodal has one
    of those as its neighbour; DINOv2's -1, the default there, makes it its own);
    another ``p`` by lightly's formula.

    Examples::

        >>> loss = KoLeoLoss()(torch.randn(64, 384))
    """

    def __init__(self, p: float = 2, eps: float = 1e-8) -> None:
        super().__init__()
        self.p, self.eps = p, eps
        self.pairwise_distance = nn.PairwiseDistance(p=p, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 2:
            return koleo_loss(x, eps=self.eps, self_score=-2.0)
        x = F.normalize(x, p=2, dim=-1, eps=self.eps)
        cos = (x @ x.t()).fill_diagonal_(-2)
        return -(self.pairwise_distance(x, x[cos.argmax(dim=1)]) + self.eps).log().mean()


class SwaVLoss(nn.Module):
    """lightly's ``SwaVLoss``: the codes of each high-resolution view (Sinkhorn-Knopp,
    with the queue's rows when given) are the targets of every other view; the mean
    over those pairs, then over the high-resolution views. Returns a (1,) tensor, as
    lightly does.

    Examples::

        >>> loss_fn = SwaVLoss()
        >>> high = [torch.randn(16, 300, requires_grad=True) for _ in range(2)]
        >>> loss = loss_fn(high, [torch.randn(16, 300, requires_grad=True)])
    """

    def __init__(
        self,
        temperature: float = 0.1,
        sinkhorn_iterations: int = 3,
        sinkhorn_epsilon: float = 0.05,
        sinkhorn_gather_distributed: bool = False,
    ) -> None:
        super().__init__()
        if sinkhorn_gather_distributed and not dist.is_available():
            raise ValueError("sinkhorn_gather_distributed is True but torch.distributed is not available")
        self.temperature, self.sinkhorn_iterations = temperature, sinkhorn_iterations
        self.sinkhorn_epsilon, self.sinkhorn_gather_distributed = sinkhorn_epsilon, sinkhorn_gather_distributed

    def forward(
        self,
        high_resolution_outputs: List[Tensor],
        low_resolution_outputs: List[Tensor],
        queue_outputs: Optional[List[Tensor]] = None,
    ) -> Tensor:
        views = [*high_resolution_outputs, *low_resolution_outputs]
        h, b = len(high_resolution_outputs), high_resolution_outputs[0].shape[0]
        codes = []
        with torch.no_grad():
            for i, out in enumerate(high_resolution_outputs):
                scores = out if queue_outputs is None else torch.cat((out.detach(), queue_outputs[i].detach()))
                q = sinkhorn_codes(
                    scores, self.sinkhorn_iterations, self.sinkhorn_epsilon, self.sinkhorn_gather_distributed
                )
                codes.append(q[:b])
        pairs = [[i for i in range(h) if i != v] for v in range(len(views))]
        rows = paired_rows(1.0 / self.temperature, pairs, codes, views)
        return (rows.sum() / (b * (len(views) - 1) * h)).reshape(1)


def _torch_class(name: str, *modules: str) -> Optional[type]:
    """The class ``name`` of torch.distributed from the first of ``modules`` that has it
    (its home moved between torch versions), or None (no such class, or no
    torch.distributed)."""
    if not dist.is_available():
        return None
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def effective_weight(layer: nn.Module) -> Tensor:
    """A last layer's weight as its forward computes it, from its parameters as they are
    now: ``parametrizations.weight_norm``'s ``g v / |v|`` (formed on access), torch's
    older ``weight_norm`` hook's (its ``compute_weight``: the ``weight`` attribute it
    leaves on the layer is the one of its last forward, stale after an optimizer step),
    or a plain weight; a differentiable function of the magnitude and the direction."""
    parametrizations = getattr(layer, "parametrizations", None)
    if parametrizations is not None and "weight" in parametrizations:
        return layer.weight  # type: ignore[return-value]
    for hook in layer._forward_pre_hooks.values():  # noqa: SLF001 - how torch's remove_weight_norm finds it
        if isinstance(hook, WeightNorm) and hook.name == "weight":
            return hook.compute_weight(layer)
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, Tensor):
        raise ValueError(f"the head's last_layer ({type(layer).__name__}) has no weight")
    return weight


class PrototypeHead(nn.Module):
    """A projection head's MLP and its prototype layer, returning what the fused losses
    need instead of the rows x K logits: the L2-normalised bottleneck rows and the last
    layer's weight (the prototypes), computed from the head's parameters as they are at
    each call (after every optimizer step, in the dtype the head was moved to), every
    parameter reached by the gradient: the layers, the weight norm's direction and a
    trainable magnitude.

    Wraps lightly's ``DINOProjectionHead`` (``layers``, ``last_layer``; both settings of
    ``norm_last_layer``), ``DINOv2ProjectionHead`` and DINOv2's ``DINOHead`` (``mlp``,
    ``last_layer``), the same parameters (an optimizer's state unchanged), with any form
    of the last layer: ``torch.nn.utils.weight_norm``, ``parametrizations.weight_norm``
    (a frozen or a trainable magnitude) or none. The head's logits are ``rows @
    prototypes.T``: pass both to the loss with ``normalize=False`` (:attr:`normalize`).

    Under FSDP2, shard this module (or a module that holds it; the MLP's layers may be
    sharded on their own too) and take the prototypes from its call, ``rows, w =
    head(x, prototypes=True)``: they are formed while ``fully_shard`` holds the
    parameters whole. A head or a last layer sharded on its own is refused (this module
    reads the last layer's weight outside that module's call), with an error that says so.

    Args:
        head: the projection head (the student's or the teacher's).

    Examples::

        >>> class Head(torch.nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.mlp = torch.nn.Linear(32, 16)
        ...         layer = torch.nn.Linear(16, 100, bias=False)
        ...         self.last_layer = torch.nn.utils.parametrizations.weight_norm(layer)
        >>> head = PrototypeHead(Head())
        >>> rows, prototypes = head(torch.randn(8, 32), prototypes=True)
        >>> loss = flashcl.dino_loss(rows, rows.detach(), prototypes, normalize=False)
    """

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        mlp = getattr(head, "layers", None)
        mlp = getattr(head, "mlp", None) if mlp is None else mlp
        last = getattr(head, "last_layer", None)
        if not isinstance(last, nn.Module):
            raise ValueError(f"the head ({type(head).__name__}) has no last_layer module: the prototype layer")
        self.mlp = mlp if mlp is not None else nn.Identity()
        self.last_layer = last

    @property
    def normalize(self) -> bool:
        """False: the rows are unit rows already and the prototypes are the layer's
        weight as its forward applies it, so the loss takes both as given."""
        return False

    def _check_sharding(self) -> None:
        dtensor = _torch_class("DTensor", "torch.distributed.tensor", "torch.distributed._tensor")
        fsdp_module = _torch_class("FSDPModule", "torch.distributed.fsdp", "torch.distributed._composable.fsdp")
        if dtensor is None:
            return
        # parameters of the MLP that a sharded submodule of it gathers in its own call are fine
        gathered: set = set()
        if fsdp_module is not None:
            for name, m in self.mlp.named_modules():
                if isinstance(m, fsdp_module):
                    gathered.update(id(p) for p in self.mlp.get_submodule(name).parameters())
        loose = [n for n, p in self.mlp.named_parameters() if isinstance(p, dtensor) and id(p) not in gathered]
        last = [n for n, p in self.last_layer.named_parameters() if isinstance(p, dtensor)]
        if loose or last:
            where = "the last layer" if last else "the head"
            raise ValueError(
                f"PrototypeHead: {where}'s parameters are sharded (fully_shard on the head or on its last layer "
                "alone), and this module reads the last layer's weight outside that module's call: apply "
                "fully_shard to the PrototypeHead (or a module that holds it; the MLP's layers may be sharded "
                "too) and take the prototypes from its call, rows, prototypes = head(x, prototypes=True)"
            )

    def prototypes(self) -> Tensor:
        """The prototypes (K, D): the last layer's weight as its forward computes it now.
        Under FSDP2, take them from the call instead (``head(x, prototypes=True)``)."""
        self._check_sharding()
        return effective_weight(self.last_layer)

    def forward(self, x: Tensor, prototypes: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """The unit bottleneck rows of ``x`` (as the head normalises them before its last
        layer); with ``prototypes=True`` also the prototypes, formed in this call."""
        self._check_sharding()
        rows = self.mlp(x)
        eps = 1e-6 if rows.dtype == torch.float16 else 1e-12
        rows = F.normalize(rows, dim=-1, p=2, eps=eps)
        if not prototypes:
            return rows
        w = effective_weight(self.last_layer)
        # a plain weight is the parameter itself, whose storage fully_shard frees after the call: a copy
        return rows, (w.clone() if isinstance(w, nn.Parameter) else w)
