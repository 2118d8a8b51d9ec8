"""Class proxies at scale for :func:`flashcl.cosface_loss` and :func:`flashcl.arcface_loss`:
the class weights sharded across a process group (each rank holds a contiguous slice
of the classes, as insightface's Partial FC: no rank holds all of W or its gradient),
and sampled classes (:func:`sample_classes`: every class with a sample in the batch
and a uniform sample of the others).

Sharded, every rank's embeddings are gathered (O(B_global D)); each rank visits its
own classes for every global row in blocks (the engine's column blocks with a margin head),
the ranks join their running logsumexps and the target logits (formed by the rank
that holds each label's class) with two all-reduces of B_global numbers, and the
backward pass sums the embeddings' gradients over the ranks (one all-reduce of
B_global x D) while each rank forms its own slice's weight gradient alone.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import backends, parallel, runner
from ..core import compute_dtype
from ..engine.engine import FusedFunction
from .margin_blocks import Margin, Shard, auto_class_block

__all__ = ["sample_classes", "sharded_margin", "kept_labels"]


class _GroupShard(Shard):
    """The slices of a process group joined by all-reduces."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def lse(self, part: Tensor) -> Tensor:
        return parallel.logsumexp_across(part, self.group)

    def targets(self, t: Tensor) -> Tensor:
        return parallel.sum_across(t, self.group)


class _ShardedMargin(FusedFunction):
    """``apply(e, w, scale, labels, opts, weights, factor, sizes, group, share) -> rows``: the
    global rows' losses (every rank alike) of this rank's embeddings ``e`` and every
    rank's, over every rank's class slice (a :class:`~flashcl.losses.margin_blocks.MarginHead`
    on :class:`~flashcl.engine.columns.ColumnBlocks` joined by a :class:`_GroupShard`);
    ``labels``: the global rows' classes in this slice's ``w`` (-1: another slice's).
    Backward: ``weights`` (the global rows' factors of a scalar loss, or None: the
    gathered upstream gradients of each rank's own rows); this rank's rows' embedding
    gradient (summed over the slices, times ``factor``), this slice's weight gradient,
    the scale's (summed over the slices; ``share``: of this rank's rows only, its share
    of a replicated parameter's gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        e: Tensor,
        w: Tensor,
        scale: Tensor,
        labels: Tensor,
        opts: Tuple[Any, ...],
        weights: Optional[Tensor],
        factor: float,
        sizes: List[int],
        group: Any,
        share: bool,
    ) -> Tensor:
        everyone = parallel.gather_plain(e, group)
        ctx.margin = Margin(everyone, w, scale, labels, opts, _GroupShard(group), scale_rows=ctx.needs_input_grad[2])
        rows = ctx.margin.values(everyone, w, scale)
        FusedFunction.setup(ctx, (e, w, scale), (everyone,))
        ctx.weights, ctx.factor, ctx.group, ctx.sizes, ctx.share = weights, factor, group, sizes, share
        return rows

    @classmethod
    def no_second_derivatives(cls, ctx: Any) -> Optional[str]:
        return "shard_classes=True does not compute second derivatives (its collectives' gradients have no graph)"

    @classmethod
    def recompute(cls, ctx: Any, grad: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        _, w, scale, everyone = saved
        rank = parallel.rank_of(ctx.group)
        start, mine = sum(ctx.sizes[:rank]), ctx.sizes[rank]  # this rank's rows among everyone's
        dtype = compute_dtype(everyone.dtype)
        if ctx.weights is not None:  # a scalar loss: every rank holds every row's factor alike
            g = grad.to(dtype)
        else:  # each rank's own rows' upstream gradients
            g = parallel.gather_plain(grad[start : start + mine].to(dtype), ctx.group)
        de, dw, dscale = ctx.margin.grads(everyone, w, scale, g)
        de = parallel.sum_across(de, ctx.group)[start : start + mine] * ctx.factor
        if ctx.needs_input_grad[2]:  # per global row, summed over the slices
            dscale = parallel.sum_across(dscale, ctx.group)
            dscale = (dscale[start : start + mine] if ctx.share else dscale).sum()
        return de, dw, dscale


def sharded_margin(
    e: Tensor,
    labels: Tensor,
    w: Tensor,
    scale: Tensor,
    opts: Tuple[Any, ...],
    classes: Optional[Tensor],
    reduction: str,
    grad_scale: str,
    group: Any,
) -> Tensor:
    """The margin softmax with ``w`` this rank's slice of the classes (rank order, possibly
    empty) and ``labels`` global class ids of this rank's rows; ``classes``: the slice's
    kept classes (sampled) or None. Returns, as every loss with a process group, this
    rank's share of the global loss times the ``grad_scale`` factor: with ``"ddp"`` the
    global loss on every rank (their mean is the loss), with ``"sum"`` this rank's rows'
    part (their sum is the loss; a learnable scale's gradient likewise its share);
    ``"none"``: this rank's rows' losses (global softmax). The class slice's gradient is
    its exact gradient of the global loss either way."""
    k = opts[4]
    mine = w.shape[0] // k
    counts = parallel.row_counts(mine, e.device, group)
    lo, total = sum(counts[: parallel.rank_of(group)]), sum(counts)
    everyone = parallel.gather_plain(labels, group)
    if everyone.numel() and (int(everyone.min()) < 0 or int(everyone.max()) >= total):
        raise ValueError(
            f"labels must be global class ids in [0, {total}) (every rank's class slice, in rank order), got "
            f"{int(everyone.min())}..{int(everyone.max())}"
        )
    local = torch.where((everyone >= lo) & (everyone < lo + mine), everyone - lo, torch.full_like(everyone, -1))
    if classes is not None:
        local, w = kept_labels(local, classes, mine, w, k)
    # tiles of the gathered batch's rows x a block of classes
    block = opts[3] or auto_class_block(everyone.shape[0], w.shape[0] // k, k)
    opts = (*opts[:3], block, k)
    ones = torch.ones(everyone.shape[0], dtype=scale.dtype, device=e.device)
    # the global rows' weights, as one process would form them: every rank returns the global value
    weights = runner.share(reduction, "sum", backends.Source(e, 0, [everyone.shape[0]]), ones)
    factor = parallel.grad_factor(grad_scale, group)
    sizes = parallel.row_counts(e.shape[0], e.device, group)
    share = grad_scale == "sum"
    # a share of the scalar loss: this rank's rows' terms, the backward gathering every rank's upstream
    fused = None if share else weights
    rows = _ShardedMargin.apply(e, w, scale, local, opts, fused, factor, sizes, group, share)
    start = sum(sizes[: parallel.rank_of(group)])
    mine = slice(start, start + e.shape[0])
    if weights is None:
        return rows[mine]
    return (weights * rows).sum() if fused is not None else (weights[mine] * rows[mine]).sum()


def kept_labels(local: Tensor, classes: Tensor, num_classes: int, w: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The labels as positions among the kept ``classes`` (-1 stays -1) and the kept
    classes' proxies (a differentiable gather of ``w``'s rows); a label whose class is
    in the slice but not kept is a ValueError."""
    if not isinstance(classes, Tensor) or classes.dim() != 1 or classes.dtype not in (torch.int32, torch.int64):
        raise TypeError("classes must be a 1-D integer tensor of kept class indices (see flashcl.sample_classes)")
    classes = classes.to(local.device).long()
    if num_classes == 0 and classes.numel() == 0:  # an empty class slice keeps nothing
        return local, w
    if classes.numel() == 0 or int(classes.min()) < 0 or int(classes.max()) >= num_classes:
        raise ValueError(f"classes must be non-empty indices in [0, {num_classes}) of the class weights' classes")
    if classes.numel() > 1 and not bool((classes[1:] > classes[:-1]).all()):
        raise ValueError("classes must be sorted and without repeats (torch.unique gives them so)")
    position = torch.full((num_classes,), -1, dtype=torch.long, device=local.device)
    position[classes] = torch.arange(classes.numel(), device=local.device)
    own = local >= 0
    mapped = torch.where(own, position[local.clamp_min(0)], local)
    if bool((own & (mapped < 0)).any()):
        missing = int(local[own & (mapped < 0)][0])
        raise ValueError(f"classes must keep every labelled class: class {missing} has a sample but is not kept")
    rows = (classes.unsqueeze(1) * k + torch.arange(k, device=local.device)).flatten()
    return mapped, w[rows]


def sample_classes(
    labels: Tensor,
    num_classes: int,
    sample_rate: float,
    *,
    first_class: int = 0,
    process_group: Any = None,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """The classes a sampled margin softmax keeps this step (insightface's Partial FC):
    every class of ``[first_class, first_class + num_classes)`` that has a sample in
    the batch, and a uniform sample of the others, ``max(int(sample_rate *
    num_classes), positives, 1)`` classes in all. Pass them as ``classes=`` to
    :func:`flashcl.cosface_loss` / :func:`flashcl.arcface_loss`; the optimizer updates
    those rows of the class weights only (the others get a zero gradient).

    Args:
        labels: (B,) global class ids of this rank's batch (every rank's, gathered,
            with ``process_group``).
        num_classes: the classes of this slice (all of them on one process).
        sample_rate: the kept fraction, in (0, 1]; 1 keeps every class.
        first_class: this slice's first class id (rank order); 0 on one process.
        process_group: the group whose batches the labels are gathered from.
        generator: the random draw's generator (every rank may use its own).

    Returns:
        The kept classes' indices into this slice, sorted: (K,) int64.

    Shape:
        - labels: (B,); output: (K,), ``K = max(int(sample_rate * num_classes), positives, 1)``

    Examples::

        >>> labels = torch.tensor([3, 3, 17])
        >>> kept = flashcl.sample_classes(labels, 100, 0.1, generator=torch.Generator().manual_seed(0))
        >>> kept.numel(), bool(torch.isin(torch.tensor([3, 17]), kept).all())
        (10, True)
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < (0 if process_group else 1):
        raise ValueError(
            f"num_classes must be a positive int (0: an empty class slice, with process_group), got {num_classes!r}"
        )
    if not isinstance(labels, Tensor) or labels.dim() != 1 or labels.is_floating_point():
        raise TypeError("labels must be a 1-D integer tensor of class ids")
    if process_group is not None:
        labels = parallel.gather_plain(labels, process_group)
    local = labels.long() - first_class
    positive = torch.unique(local[(local >= 0) & (local < num_classes)])
    count = min(max(int(sample_rate * num_classes), positive.numel(), 1), num_classes)  # one per non-empty slice
    if count >= num_classes:
        return torch.arange(num_classes, device=labels.device)
    draw = torch.rand(num_classes, generator=generator, device=generator.device if generator else labels.device)
    draw = draw.to(labels.device)
    draw[positive] = 2.0  # above every draw: the labelled classes are always kept
    return torch.sort(torch.topk(draw, count).indices).values
