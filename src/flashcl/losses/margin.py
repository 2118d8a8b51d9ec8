"""Margin softmax over class proxies (CosFace, ArcFace) without the B x C logits:
:func:`cosface_loss`, :func:`arcface_loss` and their Modules.

The class weights ``W`` (C, D) are visited in blocks of classes (the engine's
:class:`~flashcl.engine.columns.ColumnBlocks` with a
:class:`~flashcl.losses.margin_blocks.MarginHead`): each block's cosines ``e^_i . w^_j``
(the block's weights normalised as it is formed, never a normalised copy of W) feed
a running logsumexp per row; a second visit forms each block's gradient and writes
its rows of ``dW``. The target logits ``s f(cos_y)`` are formed apart, in O(B D), by
differentiable ops. Beyond the weights and their gradient, memory is O(B D + B x
block)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_labels, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine import engine
from ..engine.engine import Driver, Problem, autocast_off
from ..reference.families import margin_rows as margin_oracle_rows
from .class_shards import kept_labels, sharded_margin
from .margin_blocks import TARGETS, MarginHead, auto_class_block, target_logits, target_rows

__all__ = ["cosface_loss", "arcface_loss", "CosFaceLoss", "ArcFaceLoss"]

MARGIN_BACKENDS = ("auto", "reference", "dense", "tiled")


def _margin_loss(
    name: str,
    target: str,
    embeddings: Tensor,
    labels: Tensor,
    class_weights: Tensor,
    margin: float,
    scale: Any,
    easy: bool,
    reduction: str,
    backend: str,
    block_size: Optional[int],
    process_group: Any,
    strategy: str,
    grad_scale: str,
    subcenters: int = 1,
    shard_classes: bool = False,
    classes: Optional[Tensor] = None,
) -> Tensor:
    embeddings, labels = checks.validate_labelled(embeddings, labels, empty=process_group is not None)
    checks.check_bool(shard_classes, "shard_classes")
    w = checks.check_float_tensor(class_weights, "class_weights", (2,), empty=shard_classes)
    checks.same_device(w, embeddings, "class_weights", "embeddings")
    if isinstance(subcenters, bool) or not isinstance(subcenters, int) or subcenters < 1:
        raise ValueError(f"subcenters must be a positive int (proxies per class), got {subcenters!r}")
    if (w.shape[0] == 0 and not shard_classes) or w.shape[0] % subcenters:  # a rank's slice may be empty
        raise ValueError(
            f"class_weights must hold subcenters = {subcenters} rows per class (C x {subcenters} rows), got "
            f"{w.shape[0]} rows"
        )
    if w.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"class_weights must be (C, D) with the embeddings' D = {embeddings.shape[1]}, got {tuple(w.shape)}"
        )
    num_classes = w.shape[0] // subcenters
    if shard_classes and process_group is None:
        raise ValueError("shard_classes=True needs a process_group (each rank holds its slice of the classes)")
    if not shard_classes and labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"labels must be class indices in [0, {num_classes}), got {int(labels.min())}..{int(labels.max())}"
        )
    checks.check_choice(backend, "backend", MARGIN_BACKENDS)
    if shard_classes:  # blocks of classes: the tiled backend alone
        backends.pick_name(backend, ("tiled",), 0, embeddings, f"{name} with shard_classes=True", auto="tiled")
    m = _check_margin(margin, name)
    checks.check_bool(easy, "easy_margin")
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    sc = checks.check_positive_scalar(scale, "scale", embeddings.device, compute_dtype(embeddings.dtype))
    with autocast_off(embeddings.device.type):
        if shard_classes:
            # the block is sized in sharded_margin, on the gathered batch
            spec = (target, m, easy, block_size, subcenters)
            return sharded_margin(embeddings, labels.long(), w, sc, spec, classes, reduction, grad_scale, process_group)
        labels = labels.long()
        if classes is not None:
            labels, w = kept_labels(labels, classes, num_classes, w, subcenters)
        return _margin(embeddings, labels, w, sc, target, m, easy, backend, opts, subcenters)


def _margin(
    embeddings: Tensor,
    labels: Tensor,
    class_weights: Tensor,
    scale: Tensor,
    target: str,
    margin: float,
    easy: bool,
    backend: str,
    opts: checks.Options,
    k: int = 1,
) -> Tensor:
    """The body, one process being a world of one: this rank's rows against every
    class (the class weights the same on every rank, as a replicated parameter),
    reduced over every rank's rows; ``k`` proxies per class."""
    b = embeddings.shape[0]
    group = opts.process_group
    rows_of: backends.Source = backends.Source(embeddings, 0, [b])
    if group is not None:
        rows_of = parallel.Columns(embeddings, 0, [b], False, group)

    def reference() -> Tensor:
        e, w = embeddings.to(scale.dtype), class_weights.to(scale.dtype)
        out = margin_oracle_rows(e, w, labels, target, margin, scale, easy, k)
        return runner.reduce(out, torch.ones_like(out), opts.reduction, opts.grad_scale, rows_of)

    def on_engine(driver: Optional[Driver]) -> Callable[[], Tensor]:
        """The rows on ``driver`` (None: the dense formula): a :class:`MarginHead` over the
        classes, each row's target logit ``u_i`` (its own formula, O(B D)) the head's
        learnable tensor, differentiated by autograd through it."""

        def rows() -> Tensor:
            own, rows_y = target_rows(embeddings, class_weights, labels, k)
            t = target_logits(embeddings[own], class_weights[rows_y], scale, TARGETS[target], margin, easy)
            u = t.new_zeros(b).index_put((own,), t)
            head = MarginHead(labels, u.detach(), k, float(scale))
            ones = torch.ones(b, dtype=scale.dtype, device=embeddings.device)
            weights = runner.share(opts.reduction, opts.grad_scale, rows_of, ones)
            block = k * (opts.block_size or auto_class_block(b, class_weights.shape[0] // k, k))
            pair = None if weights is None else (weights, None)
            return engine.run(embeddings, class_weights, scale, Problem(head), driver, pair, block, (u,))[0]

        return rows

    tiled = backends.layout_driver("columns", embeddings.device.type)  # blocks of classes against every row
    impls = {"reference": reference, "dense": on_engine(None), "tiled": on_engine(tiled)}
    return backends.pick(backend, impls, b * class_weights.shape[0], embeddings, "the margin losses", auto="tiled")()


def _check_margin(margin: object, name: str) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be a float, got {type(margin).__name__}")
    value = float(margin)
    upper = math.pi if name == "arcface_loss" else float("inf")
    if not (0.0 <= value < upper):
        bound = "[0, pi) radians" if name == "arcface_loss" else "a finite number >= 0"
        raise ValueError(f"{name}: margin must be {bound}, got {margin!r}")
    return value


@shared_docs
@compiles()
def cosface_loss(
    embeddings: Tensor,
    labels: Tensor,
    class_weights: Tensor,
    *,
    margin: float = 0.35,
    scale: Any = 64.0,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
    subcenters: int = 1,
    shard_classes: bool = False,
    classes: Optional[Tensor] = None,
) -> Tensor:
    r"""CosFace (Wang et al. 2018, large margin cosine loss): softmax cross-entropy
    over class proxies with the target class's cosine lowered by a margin, so that
    each class is separated from the others by ``m`` in cosine:

    $$
    -\log \frac{e^{s (\cos\theta_{y_i} - m)}}{e^{s (\cos\theta_{y_i} - m)} + \sum_{j \ne y_i} e^{s \cos\theta_j}}
    $$

    Equal to pytorch-metric-learning's ``CosFaceLoss`` (its weights are ``W.T``) and
    insightface's CosFace. The classes are visited in blocks: with a million
    classes the B x C logits (4 GB at B = 1024) are never formed; memory beyond the
    weights and their gradient is O(B D + B x block).

    Args:
        @margin_args@
        margin: ``m``, subtracted from the target cosine (>= 0). Default: 0.35.
        @process_group@
        @proxies@

    Shape:
        - embeddings: (B, D); labels: (B,); class_weights: (C, D); output: scalar, or (B,)

    Examples::

        >>> w = torch.nn.Parameter(torch.randn(1000, 64))
        >>> loss = flashcl.cosface_loss(torch.randn(32, 64), torch.randint(0, 1000, (32,)), w)
        >>> loss.backward()
    """
    return _margin_loss(
        "cosface_loss",
        "cosface",
        embeddings,
        labels,
        class_weights,
        margin,
        scale,
        False,
        reduction,
        backend,
        block_size,
        process_group,
        strategy,
        grad_scale,
        subcenters,
        shard_classes,
        classes,
    )


@shared_docs
@compiles()
def arcface_loss(
    embeddings: Tensor,
    labels: Tensor,
    class_weights: Tensor,
    *,
    margin: float = 0.5,
    scale: Any = 64.0,
    easy_margin: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
    subcenters: int = 1,
    shard_classes: bool = False,
    classes: Optional[Tensor] = None,
) -> Tensor:
    r"""ArcFace (Deng et al. 2019, additive angular margin): softmax cross-entropy over
    class proxies with the target's angle widened by ``m``:

    $$
    -\log \frac{e^{s \cos(\theta_{y_i} + m)}}{e^{s \cos(\theta_{y_i} + m)} + \sum_{j \ne y_i} e^{s \cos\theta_j}}
    $$

    Past ``theta > pi - m``, where ``cos(theta + m)`` would increase again, the target
    logit is ``cos(theta) - m sin(m)`` (insightface's and pytorch-metric-learning's
    rule); ``easy_margin=True`` keeps ``cos(theta)`` wherever ``cos(theta) <= 0``
    (insightface's option). Equal to pytorch-metric-learning's ``ArcFaceLoss`` (whose
    margin is in degrees: ``margin=28.6`` there is ``0.5`` here) and to insightface's
    formula. Classes in blocks, as :func:`cosface_loss`.

    Args:
        @margin_args@
        margin: ``m`` in radians, in ``[0, pi)``. Default: 0.5.
        easy_margin: see above. Default: False.
        @process_group@
        @proxies@

    Shape:
        - embeddings: (B, D); labels: (B,); class_weights: (C, D); output: scalar, or (B,)

    Examples::

        >>> w = torch.nn.Parameter(torch.randn(1000, 64))
        >>> loss = flashcl.arcface_loss(torch.randn(32, 64), torch.randint(0, 1000, (32,)), w)
    """
    return _margin_loss(
        "arcface_loss",
        "arcface",
        embeddings,
        labels,
        class_weights,
        margin,
        scale,
        easy_margin,
        reduction,
        backend,
        block_size,
        process_group,
        strategy,
        grad_scale,
        subcenters,
        shard_classes,
        classes,
    )


class CosFaceLoss(LossModule):
    """Module form of :func:`cosface_loss` (the class weights passed to each call,
    as a model's parameter; see :class:`torch.nn.Linear`).

    Examples::

        >>> head = torch.nn.Linear(64, 1000, bias=False)
        >>> loss = flashcl.CosFaceLoss()(torch.randn(8, 64), torch.randint(0, 1000, (8,)), head.weight)
    """

    def __init__(
        self,
        margin: float = 0.35,
        scale: Any = 64.0,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
        subcenters: int = 1,
        shard_classes: bool = False,
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self, embeddings: Tensor, labels: Tensor, class_weights: Tensor, classes: Optional[Tensor] = None
    ) -> Tensor:
        return cosface_loss(embeddings, labels, class_weights, classes=classes, **self.loss_options())


class ArcFaceLoss(LossModule):
    """Module form of :func:`arcface_loss` (the class weights passed to each call).

    Examples::

        >>> head = torch.nn.Linear(64, 1000, bias=False)
        >>> loss = flashcl.ArcFaceLoss(margin=0.5)(torch.randn(8, 64), torch.randint(0, 1000, (8,)), head.weight)
    """

    def __init__(
        self,
        margin: float = 0.5,
        scale: Any = 64.0,
        easy_margin: bool = False,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
        subcenters: int = 1,
        shard_classes: bool = False,
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self, embeddings: Tensor, labels: Tensor, class_weights: Tensor, classes: Optional[Tensor] = None
    ) -> Tensor:
        return arcface_loss(embeddings, labels, class_weights, classes=classes, **self.loss_options())


def _example_cosface(g: torch.Generator) -> Example:
    return Example((example_rows(g, 26, 24), example_labels(g, 26, 57), example_rows(g, 57, 24)), {"scale": 30.0})


def _example_arcface(g: torch.Generator) -> Example:
    return Example((example_rows(g, 26, 24), example_labels(g, 26, 57), example_rows(g, 57, 24)), {"scale": 30.0})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "cosface_loss": _example_cosface,
    "arcface_loss": _example_arcface,
}
