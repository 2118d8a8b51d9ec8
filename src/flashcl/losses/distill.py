"""Distillation from a teacher's similarities, in O(B) memory: :func:`distill_loss`
and :class:`DistillLoss`."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, Scalar, example_rows, scale_dtype
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import Problem, autocast_off
from ..runner import unit_rows
from .family_heads import SoftTargetHead

__all__ = ["distill_loss", "DistillLoss"]


@shared_docs
@compiles()
def distill_loss(
    q: Tensor,
    k: Tensor,
    teacher_q: Tensor,
    teacher_k: Tensor,
    *,
    scale: Scalar,
    teacher_scale: Scalar,
    symmetric: bool = False,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Distillation from a teacher's similarities: the student's softmax over each
    row's candidates trained toward the teacher's, per row::

        -sum_j softmax_j(teacher_scale * tq_i . tk_j) * log_softmax_j(scale * q_i . k_j)

    that is ``F.cross_entropy(student_logits, teacher_logits.softmax(1))``, and with
    ``symmetric=True`` the mean of the row and column directions: open_clip's
    ``DistillClipLoss`` distillation term (its features normalised, here
    ``normalize=False``). The teacher's softmax is formed tile by tile (its row
    logsumexp first): O(B D) memory where the peers build both B x N logits. The
    student gets its gradient, and so do the teacher's inputs when they require it.

    Args:
        q, k: (B, D), (N, D) the student's queries and candidates.
        teacher_q, teacher_k: (B, D_t), (N, D_t) the teacher's (any width).
        scale, teacher_scale: the multipliers of the two score matrices (floats or
            0-dim tensors; learnable ones get their gradients).
        symmetric: also the column direction (N = B), the mean of the two.
        normalize: L2-normalise the rows of all four first. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        @backend@
        @process_group@

    Shape:
        - q: (B, D); k: (N, D); teacher_q: (B, D_t); teacher_k: (N, D_t)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> img, txt = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16)
        >>> t_img, t_txt = torch.randn(8, 32), torch.randn(8, 32)
        >>> loss = flashcl.distill_loss(img, txt, t_img, t_txt, scale=20.0, teacher_scale=50.0, symmetric=True)
        >>> loss.backward()
    """
    q = checks.check_float_tensor(q, "q", (2,), process_group is not None)
    names = ("k", "teacher_q", "teacher_k")
    k, teacher_q, teacher_k = (
        checks.check_float_tensor(x, n, (2,), process_group is not None)
        for x, n in zip((k, teacher_q, teacher_k), names)
    )
    for x, n in ((k, "k"), (teacher_q, "teacher_q"), (teacher_k, "teacher_k")):
        checks.same_device(x, q, n, "q")
    if k.shape[1] != q.shape[1] or k.dtype != q.dtype:
        raise ValueError(
            f"k must match q's width and dtype: got {tuple(k.shape)} {k.dtype} and {tuple(q.shape)} {q.dtype}"
        )
    if teacher_q.shape[0] != q.shape[0] or teacher_k.shape[0] != k.shape[0] or teacher_q.shape[1] != teacher_k.shape[1]:
        raise ValueError(
            f"the teacher's rows must match the student's: teacher_q ({q.shape[0]}, D_t) and teacher_k "
            f"({k.shape[0]}, D_t), got {tuple(teacher_q.shape)} and {tuple(teacher_k.shape)}"
        )
    checks.check_bool(symmetric, "symmetric")
    opts = checks.Options(normalize, reduction, backend, block_size, process_group, strategy, grad_scale)
    if symmetric and k.shape[0] != q.shape[0]:
        raise ValueError(
            f"symmetric=True needs as many candidates as queries (pairs), got {q.shape[0]} and {k.shape[0]}"
        )
    sc = checks.check_positive_scalar(scale, "scale", q.device, scale_dtype(q))
    tsc = checks.check_positive_scalar(teacher_scale, "teacher_scale", q.device, scale_dtype(teacher_q))
    return _distill(q, k, teacher_q, teacher_k, sc, tsc, symmetric, opts)


def _formula(q: Tensor, k: Tensor, tq: Tensor, tk: Tensor, sc: Tensor, tsc: Tensor, normalize: bool) -> Tensor:
    """The per-row loss by the plain formula on the whole matrices (the reference)."""
    dtype = compute_dtype(q.dtype)
    s = sc.to(dtype) * unit_rows(q, normalize) @ unit_rows(k, normalize).T
    t = tsc.to(dtype) * unit_rows(tq, normalize) @ unit_rows(tk, normalize).T
    return -(torch.softmax(t, dim=1) * F.log_softmax(s, dim=1)).sum(1)


def _direction(
    q: Tensor,
    k: Tensor,
    tq: Tensor,
    tk: Tensor,
    sc: Tensor,
    tsc: Tensor,
    normalize: bool,
    run: Callable[[Tensor, Tensor, Tensor, Problem], Tensor],
    offset: int = 0,
    other: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tensor:
    """One direction's per-row losses ``LSE_j S_ij - sum_j p_ij S_ij``: the student's
    logsumexp, the cross term with the gradient to the student (teacher fixed) and,
    when the teacher's inputs require it, the same term with the gradient to the
    teacher (student fixed), whose value cancels. ``run(a, b, scale, problem)``: the
    engine on this process's rows ``a`` against the columns of ``b``; ``other``: the
    other side's columns (gathered across processes)."""
    every = other or (lambda x: x)
    tqn, tkn = unit_rows(tq.detach(), normalize), every(unit_rows(tk.detach(), normalize))
    student = SoftTargetHead(tqn, tkn, float(tsc.detach()), own_is_teacher=False, offset=offset)
    rows = run(q, k, sc, Problem(student, (), normalize, offset))
    if tq.requires_grad or tk.requires_grad or tsc.requires_grad:
        qn, kn = unit_rows(q.detach(), normalize), every(unit_rows(k.detach(), normalize))
        teacher = SoftTargetHead(qn, kn, float(sc.detach()), own_is_teacher=True, offset=offset)
        cross = run(tq, tk, tsc, Problem(teacher, (), normalize, offset))
        rows = rows + (cross - cross.detach())
    return rows


def _distill(
    q: Tensor,
    k: Tensor,
    tq: Tensor,
    tk: Tensor,
    sc: Tensor,
    tsc: Tensor,
    symmetric: bool,
    opts: checks.Options,
) -> Tensor:
    """:func:`distill_loss`'s body, one process being a world of one: each rank's rows
    against every rank's candidates (the other side's, without gradient, gathered)."""
    group = opts.process_group
    cols = parallel.columns(k, opts.strategy, group)

    def formula(a: Tensor, b: Tensor, ta: Tensor, tb: Tensor) -> Tensor:
        """The plain formula on every rank's columns."""
        if group is None:
            return _formula(a, b, ta, tb, sc, tsc, opts.normalize)
        b_all, tb_all = (parallel.columns(x, "all_gather", group).keys for x in (b, tb))
        return _formula(a, b_all, ta, tb_all, sc, tsc, opts.normalize)

    def engine(a: Tensor, b: Tensor, ta: Tensor, tb: Tensor) -> Tensor:
        source = parallel.columns(b, opts.strategy, group)

        def run(x: Tensor, y: Tensor, s: Tensor, problem: Problem) -> Tensor:
            ys = source if y is b else parallel.columns(y, opts.strategy, group)
            return ys.run(x, s, problem, None, opts.block_size, backend=name)[0]

        return _direction(a, b, ta, tb, sc, tsc, opts.normalize, run, source.offset, source.rows_of_every_rank)

    impls = {"reference": formula, "dense": engine, "tiled": engine}
    name = backends.pick_name(opts.backend, tuple(impls), q.shape[0] * cols.total, q, "distill_loss", source=cols)
    one_way = impls[name]
    with autocast_off(q.device.type):
        rows = one_way(q, k, tq, tk)
        if symmetric:
            rows = 0.5 * (rows + one_way(k, q, tk, tq))
    return runner.reduce(rows, torch.ones_like(rows), opts.reduction, opts.grad_scale, cols)


class DistillLoss(LossModule):
    """Module form of :func:`distill_loss` (the scales are the call's).

    Examples::

        >>> loss = flashcl.DistillLoss(symmetric=True)(torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 6),
        ...                                            torch.randn(4, 6), scale=10.0, teacher_scale=20.0)
    """

    def __init__(
        self,
        symmetric: bool = False,
        normalize: bool = True,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self, q: Tensor, k: Tensor, teacher_q: Tensor, teacher_k: Tensor, *, scale: Scalar, teacher_scale: Scalar
    ) -> Tensor:
        return distill_loss(q, k, teacher_q, teacher_k, scale=scale, teacher_scale=teacher_scale, **self.loss_options())


def _example_distill(g: torch.Generator) -> Example:
    return Example(
        (example_rows(g, 21, 24), example_rows(g, 27, 24), example_rows(g, 21, 16), example_rows(g, 27, 16)),
        {"scale": 10.0, "teacher_scale": 20.0},
        leaves=(0, 1),
    )


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "distill_loss": _example_distill,
}
