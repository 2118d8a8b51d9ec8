"""The self-distillation family's losses on given logits (a projection head's output
rather than embeddings against prototypes), which the lightly and DINOv2 drop-ins share: the
cross-entropy of student views against paired teacher targets, in the form of
:func:`flashcl.losses.prototype_loss.soft_cross_entropy` (no cancellation near collapse,
nothing of the logits' size saved), the teacher's centred softmax a block of rows at a
time, and Sinkhorn-Knopp in the log domain."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import compute_dtype
from ..engine.given import run_given
from .prototype_loss import SoftCrossEntropyHead, soft_cross_entropy
from .prototype_targets import Blocks, rows_join

__all__ = [
    "paired_dense",
    "paired_rows",
    "chunks",
    "chunk_rows",
    "softmax_targets",
    "float32_value",
    "sinkhorn_codes",
]


def paired_dense(inv_temp: float, pairs: List[List[int]], targets: Sequence[Tensor], views: Sequence[Tensor]) -> Tensor:
    """:func:`paired_rows`' rows by differentiable torch ops (its second
    derivatives; a teacher whose logits take a gradient, as lightly's)."""
    dtype = compute_dtype(views[0].dtype)
    out = []
    for s, view in enumerate(views):
        p = sum((targets[t].to(dtype) for t in pairs[s]), torch.zeros(view.shape, dtype=dtype, device=view.device))
        out.append(soft_cross_entropy(view.to(dtype) * inv_temp, p))
    return torch.stack(out)


def paired_rows(inv_temp: float, pairs: List[List[int]], targets: List[Tensor], views: Sequence[Tensor]) -> Tensor:
    """Each student view's rows' cross-entropy ``-sum_k p_k log_softmax_k(s / tau)``
    summed over its paired teacher views' probabilities (``targets``: T tensors (B, K);
    ``pairs[s]``: those of view ``s``), (S, B): a
    :class:`~flashcl.losses.prototype_loss.SoftCrossEntropyHead` on the engine's
    given-matrix road (:func:`~flashcl.engine.given.run_given`: nothing of the logits'
    size saved but the logits, the backward a block of rows at a time), or, where a
    target takes a gradient (the teacher's logits require it, as lightly then
    backpropagates into them), the differentiable formula."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in targets):
        return paired_dense(inv_temp, pairs, targets, views)
    out = []
    for view, paired in zip(views, pairs):
        own = [targets[t] for t in paired]

        def rows(r0: int, r1: int, dst: Tensor, own: List[Tensor] = own) -> Tensor:
            dst.copy_(own[0][r0:r1])
            for p in own[1:]:
                dst.add_(p[r0:r1])
            return dst

        # a view with no paired teacher view (lightly's DINO with one teacher view): no target,
        # its rows' losses 0 and their gradient 0
        nothing = Blocks(None, None, view.shape[0], groups=lambda i0, i1, scratch: [([0], None)])
        head = SoftCrossEntropyHead(Blocks(None, rows, view.shape[0]) if own else nothing)
        scale = torch.tensor(inv_temp, dtype=torch.float64, device=view.device)
        out.append(run_given(view, scale, head, None, chunk_rows(view))[0])
    return torch.stack(out)


def chunk_rows(x: Tensor, entries: int = 1 << 20) -> int:
    """Rows of ``x`` per block of about ``entries`` entries (4 MB in float32)."""
    return max(1, entries // max(1, x.shape[-1]))


def chunks(x: Tensor, entries: int = 1 << 20) -> List[slice]:
    """Blocks of ``x``'s rows of about ``entries`` entries (:func:`chunk_rows`)."""
    step = chunk_rows(x, entries)
    return [slice(r, min(r + step, x.shape[0])) for r in range(0, x.shape[0], step)]


def softmax_targets(logits: Tensor, center: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """``softmax((logits - center) / temperature)`` in ``dtype``: with the logits' gradient
    where they require one (lightly backpropagates into the teacher's logits then), else
    a block of rows at a time into one tensor (no temporaries of the logits' size)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return torch.softmax((logits.to(dtype) - center) / temperature, dim=-1)
    out = torch.empty(logits.shape, dtype=dtype, device=logits.device)
    for r in chunks(logits):
        torch.softmax((logits[r].detach().to(dtype) - center) / temperature, dim=-1, out=out[r])
    return out


def float32_value(value: float) -> float:
    """``value`` rounded to float32, as lightly's ``torch.tensor(teacher_temp)`` holds it."""
    return float(torch.tensor(float(value), dtype=torch.float32))


def sinkhorn_codes(out: Tensor, iterations: int, epsilon: float, gather: bool, rows: Optional[Tensor] = None) -> Tensor:
    """lightly's (SwAV's) ``sinkhorn`` and DINOv2's ``sinkhorn_knopp_teacher`` in the log
    domain (``exp(out / epsilon)`` overflows float32 from 89, its logarithm does not):
    the whole matrix to sum 1, then ``iterations`` times each prototype's sum over the
    rows to 1 (1/K: a constant the rows' step takes out) and each row's to 1/B; times B. With ``gather`` (and
    ``torch.distributed`` initialised) the sums over the rows and B span every process;
    ``rows``: B as a tensor of this process's count instead (DINOv2's iBOT passes the
    masked patches' count, summed over the processes)."""
    group = dist.group.WORLD if gather and dist.is_available() and dist.is_initialized() else None
    join = rows_join(group, out.device)
    z = out.detach().to(compute_dtype(out.dtype)) / epsilon
    b = join.total_rows(z.shape[0]) if rows is None else int(join.sum(rows.detach().reshape(1))[0])
    z = z - join.lse(torch.logsumexp(z.flatten(), 0).reshape(1))[0]
    for _ in range(iterations):
        z = z - join.lse(torch.logsumexp(z, 0)).unsqueeze(0)
        z = z - torch.logsumexp(z, 1, keepdim=True) - math.log(b)
    return torch.exp(z + math.log(b))
