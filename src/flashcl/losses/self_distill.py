"""Self-distillation over prototypes (DINO, iBOT, DINOv2; SwAV in
:mod:`flashcl.losses.swav`), without the rows x K logits: :func:`dino_loss`, :func:`prototype_center`,
:class:`DINOLoss`, and the body :mod:`flashcl.losses.swav` shares.

Each student row (a crop's class token, a masked patch token) is scored against K
prototypes (the head's last layer, a weight-normalised ``Linear(D, K)``); the teacher's
rows against the teacher's prototypes give the targets (a centred, sharpened softmax,
or Sinkhorn-Knopp); the loss is the cross-entropy between the two distributions over
K. The prototypes are visited a block at a time (:mod:`flashcl.losses.prototype_targets`), as
the margin losses visit class blocks: with K = 65,536 and 16,384 rows one logits tensor
would be 4.3 GB in float32; here memory beyond the inputs and their gradients is
O((B + K) + B x block)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import autocast_off
from ..reference.families import self_distill_rows as _reference_rows
from .prototype_loss import prototype_cross_entropy, soft_cross_entropy
from .prototype_targets import (
    Blocks,
    Prototypes,
    RowsJoin,
    auto_prototype_block,
    logit_sums,
    paired_targets,
    rows_join,
    scaled_targets,
    sinkhorn_scalings,
    softmax_targets,
    unit_rows,
)

__all__ = ["dino_loss", "prototype_center", "DINOLoss", "load_center", "warn_if_swapped"]

PROTOTYPE_BACKENDS = ("auto", "reference", "dense", "tiled")
TARGETS = ("softmax", "sinkhorn")
PAIRS = ("auto", "cross", "all")


# ----------------------------------------------------------------------------- checks


def check_temperature(value: object, name: str) -> float:
    """A temperature: a float (or a 0-dim tensor without gradient), finite and > 0."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{name} must be a float or a 0-dim floating tensor, got {tuple(value.shape)}")
        if value.requires_grad:
            raise ValueError(f"{name}: a learnable temperature is not supported here (pass a float per call)")
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def check_count(value: object, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def check_views(x: object, name: str, empty_rows: bool = False) -> Tensor:
    """``x`` as (views, B, D): a (B, D) tensor is one view; ``empty_rows``: B may be 0 (a
    rank with no rows of its own, across processes)."""
    if empty_rows and isinstance(x, Tensor) and x.dim() in (2, 3) and x.shape[-2] == 0:
        checks.check_float_tensor(x.reshape(0, x.shape[-1]), name, (2,), empty=True)  # its dtype
        t = x
    else:
        t = checks.check_float_tensor(x, name, (2, 3))
    if t.shape[-1] == 0 or (t.shape[-2] == 0 and not empty_rows) or (t.dim() == 3 and t.shape[0] == 0):
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    return t.unsqueeze(0) if t.dim() == 2 else t


def check_prototypes(w: object, name: str, d: int, like: Tensor) -> Tensor:
    t = checks.check_float_tensor(w, name, (2,))
    checks.same_device(t, like, name, "student")
    if t.shape[1] != d:
        raise ValueError(f"{name} must be (K, D) with the rows' D = {d}, got {tuple(t.shape)}")
    return t


def pairing(s: int, t: int, pairs: str) -> List[List[int]]:
    """The teacher views each student view is paired with: every one (``"all"``), or
    every one but the same crop (``"cross"``: student view ``i`` and teacher view ``i``
    are the same crop)."""
    out = [[v for v in range(t) if pairs == "all" or v != i] for i in range(s)]
    if not any(out):
        raise ValueError(
            f"pairs={pairs!r} with {t} teacher view(s) and {s} student view(s) leaves no pair of views: the "
            "same crop is left out, pass more views or pairs='all'"
        )
    return out


def mask_weights(masks: Optional[Tensor], rows: int, like: Tensor) -> Tuple[Optional[Tensor], Optional[int]]:
    """iBOT's row weights from the images' patch masks (``masks``: (images, ...) bool,
    the rows being the masked patches in the masks' order): each patch ``1 / (masked
    patches of its image)``; and the number of images (the mean's divisor)."""
    if masks is None:
        return None, None
    if not isinstance(masks, Tensor) or masks.dtype != torch.bool or masks.dim() < 2:
        raise ValueError("masks must be a bool tensor (images, ...) of the masked patches")
    checks.same_device(masks, like, "masks", "student")
    flat = masks.flatten(1)  # (images, patches), also for a rank with no image
    per_image = flat.sum(1)
    if int(per_image.sum()) != rows:
        raise ValueError(
            f"masks mark {int(per_image.sum())} patches but the student has {rows} rows: the rows must be the "
            "masked patches, one per True in the masks, in their order"
        )
    weight = (1.0 / per_image.clamp_min(1).to(compute_dtype(like.dtype))).unsqueeze(1).expand_as(flat)[flat]
    return weight, masks.shape[0]


def warn_if_swapped(teacher: Sequence[Tensor], student: Sequence[Tensor], call: str) -> None:
    """A warning when the tensors given as the teacher's require grad and the student's
    do not: the two were likely passed in the other order (``call`` names this one's;
    lightly's losses take the teacher first, flashcl's functions the student)."""
    if not torch.is_grad_enabled():
        return
    if any(t.requires_grad for t in teacher) and not any(t.requires_grad for t in student):
        warnings.warn(
            f"{call}: the teacher's tensors require grad and the student's do not: were they swapped? "
            "(flashcl.dino_loss / flashcl.DINOLoss take (student, teacher, prototypes); lightly's DINOLoss and "
            "IBOTPatchLoss, and their drop-ins, take (teacher_out, student_out); DINOv2's take the student first)",
            UserWarning,
            stacklevel=3,
        )


def load_center(state_dict: Dict[str, Any], key: str, own: Optional[Tensor]) -> Optional[Tensor]:
    """For a Module's ``_load_from_state_dict``: the checkpoint's center ``state_dict[key]``
    (if any) put in the shape of ``own``, the Module's center buffer (None: (K,)), and
    returned. Any shape of K values loads: (K,), lightly's (1, 1, K), DINOv2's (1, K), and
    under ``key + ".center"`` (lightly's ``IBOTPatchLoss``, whose center is a module). A
    different count of values is a ValueError that names both. (``load_state_dict``
    hands its hooks a copy of the caller's dict: the caller's is left as it was.)"""
    value = state_dict.get(key)
    nested = key + ".center"  # lightly's Center module (its IBOTPatchLoss's checkpoint): "center.center"
    if value is None and isinstance(state_dict.get(nested), Tensor):
        value = state_dict.pop(nested)
    if not isinstance(value, Tensor):
        return None
    k = value.numel()
    if own is not None and own.numel() != k:
        raise ValueError(f"{key} holds {k} values but this loss's center has {own.numel()} (K prototypes)")
    if value.dim() > 1 and any(n != 1 for n in value.shape[:-1]):
        raise ValueError(f"{key} must be (K,), (1, K) or (1, 1, K): one value per prototype; got {tuple(value.shape)}")
    state_dict[key] = value = value.reshape(own.shape if own is not None else (k,))
    return value


# ----------------------------------------------------------------------------- the teacher's targets


class Teacher:
    """The teacher's targets for its views: ``rows`` (T, B', D) (``b`` rows of each view
    are targets; the rest, a SwAV queue, enter Sinkhorn only), its prototypes, the
    kind of targets and whether Sinkhorn runs over all views together (DINOv2) or each
    view alone (SwAV)."""

    def __init__(
        self,
        rows: Tensor,
        w_t: Tensor,
        inv_temp: float,
        kind: str,
        center: Optional[Tensor],
        iterations: int,
        joint: bool,
        normalize: bool,
        b: int,
        join: RowsJoin,
    ) -> None:
        self.rows, self.w_t, self.inv_temp, self.kind, self.center = rows, w_t, inv_temp, kind, center
        self.iterations, self.joint, self.normalize, self.b, self.join = iterations, joint, normalize, b, join

    def tiled(self, block: int) -> List[Blocks]:
        """Each view's targets, a block of rows at a time (their rows' sums known for a
        softmax and after a Sinkhorn iteration: 1); Sinkhorn-Knopp's scalings formed
        first by blocks of ``block`` prototypes."""
        protos = Prototypes(self.w_t, self.normalize)
        t, n, d = self.rows.shape
        unit = unit_rows(self.rows.reshape(t * n, d), self.normalize)[0].view(t, n, d)
        if self.kind == "softmax":
            return [softmax_targets(unit[v, : self.b], protos, self.center, self.inv_temp, block) for v in range(t)]
        if self.joint:
            u, v = sinkhorn_scalings(unit.reshape(t * n, d), protos, self.inv_temp, self.iterations, block, self.join)
            vs = v.view(t, n)
            return [self._scaled(unit[i], protos, u, vs[i]) for i in range(t)]
        out = []
        for i in range(t):
            u, v = sinkhorn_scalings(unit[i], protos, self.inv_temp, self.iterations, block, self.join)
            out.append(self._scaled(unit[i], protos, u, v))
        return out

    def _scaled(self, unit: Tensor, protos: Prototypes, u: Tensor, v: Tensor) -> Blocks:
        mass = unit.new_ones(self.b) if self.iterations > 0 else None
        return scaled_targets(unit[: self.b], protos, self.inv_temp, u, v[: self.b], mass)

    def reference(self) -> List[Tensor]:
        """Each view's targets (b, K) from the published formulas, row by row: the
        centred softmax, or DINOv2's ``sinkhorn_knopp_teacher`` (SwAV's ``sinkhorn``)
        on ``exp(t / tau_t)`` (in the log domain), its sums over the rows joined over
        the ranks."""
        unit = _unit_reference(self.w_t, self.normalize)
        t_views = [
            _stack([unit @ _unit_row(y, self.normalize) for y in view], unit.new_zeros(0, unit.shape[0]))
            for view in self.rows
        ]
        if self.kind == "softmax":
            c = unit.new_zeros(unit.shape[0]) if self.center is None else self.center.to(unit.dtype)
            return [
                _stack([torch.softmax((row - c) * self.inv_temp, 0) for row in tv[: self.b]], tv[: self.b])
                for tv in t_views
            ]
        groups = [torch.cat(t_views)] if self.joint else t_views
        out = [self._sinkhorn(g) for g in groups]
        if self.joint:
            n = self.rows.shape[1]
            return [out[0][i * n : i * n + self.b] for i in range(self.rows.shape[0])]
        return [q[: self.b] for q in out]

    def _sinkhorn(self, t: Tensor) -> Tensor:
        """DINOv2's ``sinkhorn_knopp_teacher`` in its order, each normalisation a division
        by a sum, written in the log domain (the sums as logsumexps): ``exp(t / tau)``
        overflows float32 from ``t / tau`` of 89 (a teacher temperature of 2^-10 with unit
        rows), its logarithm does not."""
        lq = (t * self.inv_temp).t()  # log Q, K x B as DINOv2 writes it
        k, b = lq.shape[0], self.join.total_rows(lq.shape[1])
        lq = lq - self.join.lse(torch.logsumexp(lq.flatten(), 0).reshape(1))[0]
        for _ in range(self.iterations):
            lq = lq - self.join.lse(torch.logsumexp(lq, dim=1, keepdim=True)) - math.log(k)
            lq = lq - torch.logsumexp(lq, dim=0, keepdim=True) - math.log(b)
        return (lq + math.log(b)).exp().t()


def _stack(items: List[Tensor], empty: Tensor) -> Tensor:
    """``torch.stack(items)``, or ``empty`` for no items."""
    return torch.stack(items) if items else empty


def _unit_row(x: Tensor, normalize: bool) -> Tensor:
    return x / x.norm().clamp_min(1e-12) if normalize else x


def _unit_reference(w: Tensor, normalize: bool) -> Tensor:
    return torch.stack([_unit_row(row, normalize) for row in w])


# ----------------------------------------------------------------------------- the body


def _dense_rows(
    x: Tensor, w: Tensor, inv_temp: float, targets: List[Tensor], pairs: List[List[int]], normalize: bool
) -> Tensor:
    """Per-row losses on the (S, B, K) logits, each row's cross-entropy against the sum
    of its paired teacher views' targets, as :func:`soft_cross_entropy` forms it (no
    cancellation near collapse)."""
    xs, ws = (torch.nn.functional.normalize(v, dim=-1) for v in (x, w)) if normalize else (x, w)
    p = torch.stack(targets)
    summed = torch.stack([p[ts].sum(0) if ts else torch.zeros_like(p[0]) for ts in pairs])
    return soft_cross_entropy(torch.matmul(xs, ws.T) * inv_temp, summed, owned=True)


def distill_rows(
    student: Tensor,
    w: Tensor,
    teacher: Teacher,
    student_temperature: float,
    pairs: List[List[int]],
    weights: Optional[Tensor],
    count: int,
    reduction: str,
    backend: str,
    block_size: Optional[int],
    group: Any,
    grad_scale: str,
) -> Tensor:
    """The body every prototype loss shares: the student's stacked views (S, B, D)
    against the teacher's targets, per row or reduced over every rank's ``count``
    terms (the pairs times the rows, or the images)."""
    s, b, d = student.shape
    k = w.shape[0]
    dtype = compute_dtype(student.dtype)
    inv_temp = 1.0 / student_temperature
    x, wc = student.to(dtype), w.to(dtype)
    own = x.new_ones(b) if weights is None else weights.to(dtype)
    # a scalar's weight of each row (None: per row), its mean over every rank's terms
    r = runner.share_count(reduction, grad_scale, parallel.reduction_over(group), own.repeat(s), count)

    def tiled() -> Tensor:
        block = block_size or auto_prototype_block(max(s, teacher.rows.shape[0]) * b, k)
        fn = paired_targets(teacher.tiled(block), pairs, b)
        # blocks of images, every view's rows of them (block_size given: as many entries as a block of
        # prototypes); a scalar forms its gradients in that pass, per row the backward recomputes them
        rows_block = None if block_size is None else max(1, block_size * b // max(1, k))
        out = prototype_cross_entropy(student.reshape(s * b, d), w, fn, inv_temp, teacher.normalize, r, rows_block)
        return out if r is not None else out.view(s, b) * own

    def dense() -> Tensor:
        targets = [p.rows(0, b, torch.empty(b, k, dtype=dtype, device=student.device)) for p in teacher.tiled(k)]
        return _weigh(_dense_rows(x, wc, inv_temp, targets, pairs, teacher.normalize), own, r)

    def reference() -> Tensor:
        return _weigh(_reference_rows(x, wc, inv_temp, teacher.reference(), pairs, teacher.normalize), own, r)

    impls = {"reference": reference, "dense": dense, "tiled": tiled}
    return backends.pick(backend, impls, s * b * k, student, "the prototype losses")()


def _weigh(rows: Tensor, own: Tensor, r: Optional[Tensor]) -> Tensor:
    """Per-row losses (S, B) weighed by each row's own factor, or reduced with ``r``."""
    return rows * own if r is None else (r * rows.reshape(-1)).sum()


def check_options(
    backend: object, reduction: object, grad_scale: object, block_size: object, normalize: object
) -> None:
    """The options every prototype loss takes, checked before any collective (a bad one:
    an error on every rank that names it)."""
    checks.check_choice(backend, "backend", PROTOTYPE_BACKENDS)
    checks.check_choice(reduction, "reduction", checks.REDUCTIONS)
    checks.check_choice(grad_scale, "grad_scale", checks.GRAD_SCALES)
    checks.check_block(block_size)  # type: ignore[arg-type]
    checks.check_bool(normalize, "normalize")


# ----------------------------------------------------------------------------- DINO / iBOT


@shared_docs
@compiles(batch_dims={"student": -2, "teacher": -2})
def dino_loss(
    student: Tensor,
    teacher: Tensor,
    prototypes: Tensor,
    *,
    teacher_prototypes: Optional[Tensor] = None,
    student_temperature: float = 0.1,
    teacher_temperature: float = 0.04,
    targets: str = "softmax",
    center: Optional[Tensor] = None,
    sinkhorn_iterations: int = 3,
    pairs: str = "auto",
    masks: Optional[Tensor] = None,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    grad_scale: str = "ddp",
) -> Tensor:
    r"""DINO's and iBOT's self-distillation loss (Caron et al. 2021; Zhou et al. 2022;
    DINOv2, Oquab et al. 2023) from the head's bottleneck rows, without the rows x K
    logits: each student row's cross-entropy against the teacher's distribution over
    K prototypes,

    $$
    \ell_b = -\sum_k p_{bk} \log \operatorname{softmax}_k\!\left(\hat x_b \cdot \hat w_k / \tau_s\right)
    $$

    with the teacher's targets ``p`` either the centred, sharpened softmax
    ``softmax_k((t_bk - c_k) / tau_t)`` (``targets="softmax"``, DINO / iBOT) or DINOv2's
    Sinkhorn-Knopp on ``exp(t / tau_t)`` over every teacher view's rows
    (``targets="sinkhorn"``, its three normalisations in its order), where
    ``t_bk = y^_b . v^_k`` are the teacher's rows against the teacher's prototypes.
    The prototypes are visited a block at a time: at 16,384 masked patches and 65,536
    prototypes, where one logits tensor is 4.3 GB in float32, memory beyond the inputs
    and their gradients is about 100 MB.

    Equal to lightly's ``DINOLoss`` and DINOv2's training (``pairs="cross"``, the
    default with several views), lightly's ``IBOTPatchLoss`` and DINOv2's
    ``iBOTPatchLoss.forward_masked`` (``masks``), DINOv2's ``DINOLoss`` called on every
    pair of views (``pairs="all"``), on the logits the same head would form (drop-ins on
    logits: :mod:`flashcl.integrations.lightly`, :mod:`flashcl.integrations.dinov2`).
    Each row's loss is formed as ``mass log1p(sum_{k != m} exp(z_k - z_m)) + sum_k p_k
    (z_m - z_k)`` (``m`` its largest logit): a tiny loss near collapse keeps its relative
    precision in float32. Second derivatives on every backend (on the tiled one through
    the dense formula: O(rows x K) memory on that path only).

    The student comes first: ``(student, teacher, prototypes)`` (lightly's ``DINOLoss``
    and its drop-in take ``(teacher_out, student_out)``); teacher rows that require grad
    while the student's do not are warned about.

    Args:
        student: the student's bottleneck rows (before the last layer), (B, D) or
            (S, B, D) for S views (crops) of the same B images.
        teacher: the teacher's rows, (B, D) or (T, B, D); no gradient is formed for them.
        prototypes: the student's last layer's weight (K, D) (``head.weight`` of a
            ``Linear(D, K)``; a weight-normalised layer's direction); its gradient is
            formed a block at a time.
        teacher_prototypes: the teacher's (its EMA copy), (K, D). Default: ``prototypes``
            (no gradient through the teacher's side).
        student_temperature: ``tau_s``. Default: 0.1.
        teacher_temperature: ``tau_t`` (a float per call, for the warm-up schedule).
            Default: 0.04.
        targets: ``"softmax"`` (default; centred by ``center``) | ``"sinkhorn"``.
        center: (K,) subtracted from the teacher's logits before the softmax (DINO's
            center, :func:`prototype_center`'s EMA; :class:`DINOLoss` keeps it). Default:
            None (no centering). Only with ``targets="softmax"``.
        sinkhorn_iterations: Sinkhorn-Knopp's iterations. Default: 3.
        pairs: ``"cross"``: every student view against every teacher view but its own
            crop (student view ``i`` and teacher view ``i`` are the same crop, the global
            ones first), as DINO, DINOv2 and lightly train (DINOv2's ``DINOLoss`` is
            called with the global crops' targets swapped: this pairing) | ``"all"``:
            every pair | ``"auto"`` (default): ``"cross"`` with two or more student
            views, ``"all"`` with one (a single view, iBOT's masked patches, against the
            teacher's rows of the same crop).
        masks: iBOT's patch masks, bool (images, ...): the student's and teacher's rows
            are the masked patches, one per True in order; each row weighs ``1 / (masked
            patches of its image)`` and ``"mean"`` divides by the images; with no masked
            patch at all (rows (0, D)) the loss is 0, as DINOv2's. Default: None.
        normalize: L2-normalise the rows and the prototypes (default: a weight-normalised
            last layer, DINO's ``norm_last_layer``); ``False`` takes them as given.
        reduction: ``"mean"`` (default: over the pairs of views and the global rows, or
            the images with ``masks``) | ``"sum"`` | ``"none"`` (each student row's loss
            summed over its pairs, weighted with ``masks``).
        @prototype_options@

    Shape:
        - student: (B, D) or (S, B, D); teacher: (B, D) or (T, B, D); prototypes: (K, D);
          output: scalar, or (B,) / (S, B) with ``reduction="none"``.

    Examples::

        >>> head = torch.nn.Linear(256, 4096, bias=False)
        >>> student, teacher = torch.randn(2, 8, 256), torch.randn(2, 8, 256)
        >>> loss = flashcl.dino_loss(student, teacher, head.weight, pairs="cross")
        >>> loss.backward()
    """
    # no rows: a rank's empty part across processes, or an iBOT batch with no masked patch (the loss is 0)
    empty = process_group is not None or masks is not None
    x = check_views(student, "student", empty)
    y = check_views(teacher, "teacher", empty)
    checks.same_device(y, x, "teacher", "student")
    warn_if_swapped([y], [x], "flashcl.dino_loss(student, teacher, prototypes)")
    s, b, d = x.shape
    if y.shape[1:] != (b, d):
        raise ValueError(f"teacher must hold (views, {b}, {d}) rows like the student, got {tuple(y.shape)}")
    w = check_prototypes(prototypes, "prototypes", d, x)
    w_t = w if teacher_prototypes is None else check_prototypes(teacher_prototypes, "teacher_prototypes", d, x)
    if w_t.shape[0] != w.shape[0]:
        raise ValueError(f"teacher_prototypes must hold K = {w.shape[0]} prototypes, got {w_t.shape[0]}")
    ts = check_temperature(student_temperature, "student_temperature")
    tt = check_temperature(teacher_temperature, "teacher_temperature")
    checks.check_choice(targets, "targets", TARGETS)
    checks.check_choice(pairs, "pairs", PAIRS)
    iterations = check_count(sinkhorn_iterations, "sinkhorn_iterations")
    check_options(backend, reduction, grad_scale, block_size, normalize)
    c = None
    if center is not None:
        if targets != "softmax":
            raise ValueError("center is the softmax targets' centering; targets='sinkhorn' takes none")
        c = checks.check_float_tensor(center, "center", (1, 2, 3))
        if c.numel() != w.shape[0]:
            raise ValueError(f"center must hold K = {w.shape[0]} values, got shape {tuple(c.shape)}")
        checks.same_device(c, x, "center", "student")
        c = c.detach().reshape(-1)
    if masks is not None and s != 1:
        raise ValueError("masks weigh the patches of one view: pass (B, D) student and teacher rows")
    weights, images = mask_weights(masks, b, x)
    plan = pairing(s, y.shape[0], ("cross" if s > 1 else "all") if pairs == "auto" else pairs)
    dtype = compute_dtype(x.dtype)
    with autocast_off(x.device.type), torch.no_grad():
        join = rows_join(process_group, x.device)
        teacher_side = Teacher(
            y.detach().to(dtype), w_t.detach().to(dtype), 1.0 / tt, targets, c, iterations, True, normalize, b, join
        )
    count = sum(map(len, plan)) * (b if images is None else images)
    with autocast_off(x.device.type):
        out = distill_rows(
            x, w, teacher_side, ts, plan, weights, count, reduction, backend, block_size, process_group, grad_scale
        )
    return out[0] if reduction == "none" and student.dim() == 2 else out


@torch.no_grad()
def prototype_center(
    teacher: Tensor,
    teacher_prototypes: Tensor,
    *,
    normalize: bool = True,
    process_group: Any = None,
) -> Tensor:
    """The batch mean of the teacher's logits over every view and every rank's rows,
    (K,): DINO's center EMA takes it (``center = m center + (1 - m) mean``), without the
    rows x K logits (it is the mean row against the prototypes).

    Args:
        teacher: the teacher's rows, (B, D) or (T, B, D).
        teacher_prototypes: (K, D).
        normalize: as in :func:`dino_loss`. Default: True.
        process_group: None (default) or a process group: the mean over every rank's
            rows (uneven batches count their rows), one all-reduce of K values.

    Shape:
        - teacher: (B, D) or (T, B, D); teacher_prototypes: (K, D); output: (K,), float32
          for half-precision inputs.

    Examples::

        >>> center = torch.zeros(4096)
        >>> teacher, w = torch.randn(2, 8, 256), torch.randn(4096, 256)
        >>> center = 0.9 * center + 0.1 * flashcl.prototype_center(teacher, w)
    """
    y = check_views(teacher, "teacher", process_group is not None)
    w_t = check_prototypes(teacher_prototypes, "teacher_prototypes", y.shape[-1], y)
    checks.check_bool(normalize, "normalize")
    dtype = compute_dtype(y.dtype)
    rows = unit_rows(y.reshape(-1, y.shape[-1]).to(dtype), normalize)[0]
    join = rows_join(process_group, y.device)
    sums = join.sum(logit_sums(rows, Prototypes(w_t.detach().to(dtype), normalize)))
    return sums / join.total_rows(rows.shape[0])


# ----------------------------------------------------------------------------- Modules


class DINOLoss(LossModule):
    """Module form of :func:`dino_loss` (``(student, teacher, prototypes)``, the student
    first) that keeps DINO's center: with
    ``targets="softmax"`` each call in training mode centres the teacher with the
    stored center, then updates it, ``center = m center + (1 - m) mean`` (``m``:
    ``center_momentum``; ``mean``: :func:`prototype_center` of the call's teacher rows
    over every rank), as DINO, DINOv2 and lightly do after the loss.

    Args:
        num_prototypes: K, to create the center (zeros) at construction (it moves
            with the Module); None: created at the first call.
        center_momentum: ``m``. Default: 0.9.
        (the rest): :func:`dino_loss`'s options.

    Examples::

        >>> head = torch.nn.Linear(256, 4096, bias=False)
        >>> loss_fn = flashcl.DINOLoss(num_prototypes=4096, pairs="cross")
        >>> loss = loss_fn(torch.randn(4, 8, 256), torch.randn(2, 8, 256), head.weight, teacher_temperature=0.04)
        >>> loss.backward()
    """

    center: Optional[Tensor]

    def __init__(
        self,
        num_prototypes: Optional[int] = None,
        center_momentum: float = 0.9,
        student_temperature: float = 0.1,
        teacher_temperature: float = 0.04,
        targets: str = "softmax",
        sinkhorn_iterations: int = 3,
        pairs: str = "auto",
        normalize: bool = True,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))
        if not isinstance(center_momentum, (int, float)) or isinstance(center_momentum, bool):
            raise TypeError(f"center_momentum must be a float, got {type(center_momentum).__name__}")
        if not 0.0 <= center_momentum <= 1.0:
            raise ValueError(f"center_momentum must be in [0, 1], got {center_momentum!r}")
        center = None if num_prototypes is None else torch.zeros(check_count(num_prototypes, "num_prototypes", 1))
        self.register_buffer("center", center)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # a center of K values loads whatever its shape ((K,); lightly's (1, 1, K), DINOv2's (1, K)) and into a
        # Module that has none yet (made without num_prototypes, not yet called)
        value = load_center(state_dict, prefix + "center", self.center)
        if value is not None and self.center is None:
            self.center = torch.empty_like(value)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(
        self,
        student: Tensor,
        teacher: Tensor,
        prototypes: Tensor,
        teacher_prototypes: Optional[Tensor] = None,
        masks: Optional[Tensor] = None,
        teacher_temperature: Optional[float] = None,
    ) -> Tensor:
        options = self.loss_options()
        num_prototypes, momentum = options.pop("num_prototypes"), options.pop("center_momentum")
        if teacher_temperature is not None:
            options["teacher_temperature"] = teacher_temperature
        softmax = options["targets"] == "softmax"
        if softmax and self.center is None:  # in the teacher's compute dtype, on its device
            self.center = torch.zeros(prototypes.shape[0], dtype=compute_dtype(teacher.dtype), device=teacher.device)
        if (
            softmax
            and self.center is not None
            and num_prototypes is not None
            and self.center.numel() != prototypes.shape[0]
        ):
            raise ValueError(f"num_prototypes = {num_prototypes} but prototypes holds {prototypes.shape[0]} rows")
        loss = dino_loss(
            student,
            teacher,
            prototypes,
            teacher_prototypes=teacher_prototypes,
            center=self.center if softmax else None,
            masks=masks,
            **options,
        )
        if softmax and self.training:
            mean = prototype_center(
                teacher,
                prototypes if teacher_prototypes is None else teacher_prototypes,
                normalize=options["normalize"],
                process_group=options["process_group"],
            )
            assert self.center is not None
            self.center = self.center * momentum + mean.to(self.center.dtype) * (1.0 - momentum)
        return loss


def _example_dino(g: torch.Generator) -> Example:
    return Example(  # (student views, the teacher's views without gradient, prototypes)
        (example_rows(g, 3, 9, 24), example_rows(g, 2, 9, 24), example_rows(g, 301, 24)),
        {"pairs": "cross"},
        leaves=(0, 2),
    )


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "dino_loss": _example_dino,
}
