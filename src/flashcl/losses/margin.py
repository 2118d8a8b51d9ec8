"""Margin softmax over class proxies (CosFace, ArcFace) without the B x C logits:
:func:`cosface_loss`, :func:`arcface_loss` and their Modules.

The class weights ``W`` (C, D) are visited in blocks of classes: each block's
cosines ``e^_i . w^_j`` (the embeddings normalised, the block's weights scaled by
their inverse norms, never a normalised copy of W) feed a running logsumexp per
row; a second visit forms each block's gradient and writes its rows of ``dW``
straight into the one (C, D) tensor that becomes ``W.grad``. Beyond the weights
and their gradient, memory is O(B D + B x block)."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor

from .. import checks, parallel, registry, runner
from ..base import LossModule, shared_docs
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import FusedFunction, autocast_off, normalize_rows

__all__ = ["cosface_loss", "arcface_loss", "CosFaceLoss", "ArcFaceLoss"]

MARGIN_BACKENDS = ("auto", "reference", "dense", "tiled")


def _cosface(c: Tensor, sin: Tensor, margin: float, easy: bool) -> Tuple[Tensor, Tensor]:
    """CosFace's target logit ``cos - m`` and its derivative in ``cos`` times ``sin``
    (see :func:`_arcface`)."""
    return c - margin, sin


def _arcface(c: Tensor, sin: Tensor, margin: float, easy: bool) -> Tuple[Tensor, Tensor]:
    """ArcFace's target logit ``cos(theta + m)``, with ``theta`` the angle whose cosine
    is ``c`` and whose sine is ``sin`` (the norm of the class direction's part
    orthogonal to the embedding, formed from the vectors: accurate at ``theta`` near 0
    and pi, where ``acos`` has an infinite derivative); past ``theta > pi - m``
    (where it would stop decreasing) ``cos - m sin(m)``, as insightface and
    pytorch-metric-learning; ``easy``: ``cos`` itself where ``cos <= 0``.

    Returns the logit and ``d logit / d cos * sin(theta)``: the gradient's
    coefficient on the unit vector orthogonal to the embedding, bounded where the
    derivative in ``cos`` alone is not (``sin(theta + m)``, ``sin(m)`` at
    ``theta = 0``). Written without ``acos``, so that autograd through it (the dense
    and reference backends) is finite at ``cos = +-1`` as well."""
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    phi = c * cos_m - sin * sin_m  # cos(theta + m)
    slope = sin * cos_m + c * sin_m  # sin(theta + m) = d cos(theta + m) / d cos * sin(theta)
    keep = c > 0 if easy else c >= -cos_m  # theta <= pi - m
    other = c if easy else c - margin * sin_m
    return torch.where(keep, phi, other), torch.where(keep, slope, sin)


def _orthogonal(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a - c b`` for unit rows ``a``, ``b`` with ``c = a . b``: ``a``'s part
    orthogonal to ``b``, whose norm is the sine of their angle."""
    return a - c.unsqueeze(1) * b


def _noise(dtype: torch.dtype) -> float:
    """The largest norm :func:`_orthogonal` gives from rounding alone (unit rows along
    one line): below it the angle is 0 or pi and the direction is noise."""
    return 64 * torch.finfo(dtype).eps


def _sine(across: Tensor) -> Tensor:
    """The norms of ``across``'s rows (the sines of angles, see :func:`_orthogonal`).
    Below the rounding noise no gradient flows through them: at an angle of 0 the
    margin's term is the tip of a cone whose direction rounding cannot tell, and 0 is
    its subgradient (the mean of the gradients on either side), as on the tiled path."""
    sin = torch.linalg.vector_norm(across, dim=1)
    return torch.where(sin > _noise(sin.dtype), sin, sin.detach())


TargetFn = Callable[[Tensor, Tensor, float, bool], Tuple[Tensor, Tensor]]
#: the target logits by name (a name, not a function, crosses processes in the call check)
TARGETS = {"cosface": _cosface, "arcface": _arcface}


def _dense_rows(
    e: Tensor, w: Tensor, labels: Tensor, target: TargetFn, margin: float, scale: Tensor, easy: bool
) -> Tensor:
    """Per-row losses on the B x C logits (differentiable): the dense backend and
    the second-derivative path."""
    eh, wh = normalize_rows(e), normalize_rows(w)
    cos = eh @ wh.T
    rows = torch.arange(e.shape[0], device=e.device)
    c = cos[rows, labels]
    t, _ = target(c, _sine(_orthogonal(wh[labels], eh, c)), margin, easy)
    logits = cos.index_put((rows, labels), t) * scale
    return torch.logsumexp(logits, dim=1) - logits[rows, labels]


def _reference_rows(
    e: Tensor, w: Tensor, labels: Tensor, target: TargetFn, margin: float, scale: Tensor, easy: bool
) -> Tensor:
    """Per-row losses one row at a time from the published formula (the oracle):
    ``-log(exp(s f(cos_y)) / (exp(s f(cos_y)) + sum_{j != y} exp(s cos_j)))``."""
    wn = w / w.norm(dim=1, keepdim=True).clamp_min(1e-12)
    out = []
    for i in range(e.shape[0]):
        eh = e[i] / e[i].norm().clamp_min(1e-12)
        cos = wn @ eh
        y = int(labels[i])
        sin = _sine((wn[y] - cos[y] * eh).unsqueeze(0))  # the sine of the angle between e_i and w_y
        t, _ = target(cos[y : y + 1], sin, margin, easy)
        others = torch.cat([cos[:y], cos[y + 1 :]]) * scale
        top = t[0] * scale
        out.append(torch.logsumexp(torch.cat([top.reshape(1), others]), dim=0) - top)
    return torch.stack(out)


def auto_class_block(b: int, c: int) -> int:
    """Classes per block: a B x block tile of about 4M entries (16 MB in float32)."""
    return max(1, min(c, (1 << 22) // max(1, b)))


class _MarginRows(FusedFunction):
    """Per-row margin-softmax losses over class blocks (see the module docstring);
    ``weights``: each row's factor of a scalar loss, whose gradient is then formed
    in the forward pass (both visits)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        e: Tensor,
        w: Tensor,
        scale: Tensor,
        labels: Tensor,
        target: str,
        margin: float,
        easy: bool,
        weights: Optional[Tensor],
        block: int,
    ) -> Tensor:
        ctx.opts = (target, margin, easy, block)
        ctx.weights = weights
        needs = tuple(ctx.needs_input_grad[:3])
        fused = weights is not None and any(needs)
        rows, lse, grads = _visit(e, w, scale, labels, ctx.opts, weights if fused else None, needs, None)
        FusedFunction.setup(ctx, (e, w, scale), (labels, lse), grads=grads)
        return rows if weights is None else (weights * rows).sum()

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        e, w, scale = inputs
        labels = ctx.saved_tensors[3]
        name, margin, easy, _ = ctx.opts
        rows = _dense_rows(e, w, labels, TARGETS[name], margin, scale, easy)
        return rows if ctx.weights is None else (ctx.weights * rows).sum()

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Any) -> Any:
        e, w, scale, labels, lse = saved
        g = grad_out.to(compute_dtype(e.dtype))
        weights = g if ctx.weights is None else ctx.weights * g
        _, _, grads = _visit(e, w, scale, labels, ctx.opts, weights, tuple(ctx.needs_input_grad[:3]), lse)
        return grads


def _visit(
    e: Tensor,
    w: Tensor,
    scale: Tensor,
    labels: Tensor,
    opts: Tuple[Any, ...],
    weights: Optional[Tensor],
    needs: Tuple[bool, ...],
    lse: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Optional[List[Optional[Tensor]]]]:
    """The rows' losses and logsumexps (a first visit unless ``lse`` is given) and,
    with ``weights``, the gradients of ``sum weights * rows`` for the inputs that
    ``needs`` marks (a second visit)."""
    name, margin, easy, block = opts
    target = TARGETS[name]
    dtype = compute_dtype(e.dtype)
    s = float(scale)
    b, c = e.shape[0], w.shape[0]
    ed = e.detach().to(dtype)
    e_norm = torch.linalg.vector_norm(ed, dim=1).clamp_min(1e-12)
    eh = ed / e_norm.unsqueeze(1)
    wd = w.detach()
    # the norms in the wider of the two dtypes (class weights may be wider than the embeddings)
    norm_dtype = torch.promote_types(wd.dtype, dtype)
    w_inv = 1.0 / torch.linalg.vector_norm(wd, dim=1, dtype=norm_dtype).to(dtype).clamp_min(1e-12)
    rows_idx = torch.arange(b, device=e.device)
    # the target cosines and logits, from the labels' rows of W
    wy = wd[labels].to(dtype) * w_inv[labels].unsqueeze(1)
    c_y = (eh * wy).sum(1)
    # the target's gradient runs along the unit vectors orthogonal to e^ (for e) and to
    # w^_y (for w), formed from the vectors: through the projections it would carry
    # d logit / d cos, unbounded at cos = +-1 for ArcFace, times a difference of rounding
    across_e = _orthogonal(wy, eh, c_y)
    sin = torch.linalg.vector_norm(across_e, dim=1)
    t, t_slope = target(c_y, sin, margin, easy)
    width = min(block, c)
    buf = eh.new_empty(b, width)

    def tile(c0: int, c1: int) -> Tensor:
        """Block ``c0:c1``'s logits ``s cos``, the targets' replaced by ``s f(cos_y)``."""
        out = torch.mm(eh, wd[c0:c1].to(dtype).T, out=buf[:, : c1 - c0]).mul_(w_inv[c0:c1].unsqueeze(0) * s)
        inside = (labels >= c0) & (labels < c1)
        out[rows_idx[inside], labels[inside] - c0] = s * t[inside]
        return out

    if lse is None:
        mx = eh.new_full((b,), float("-inf"))
        total = eh.new_zeros(b)
        for c0 in range(0, c, block):
            z = tile(c0, min(c0 + block, c))
            new_mx = torch.maximum(mx, z.amax(1))
            total = total * torch.exp(mx - new_mx) + z.sub_(new_mx.unsqueeze(1)).exp_().sum(1)
            mx = new_mx
        lse = mx + total.log()
    rows = lse - s * t
    if weights is None:
        return rows, lse, None
    need_e, need_w, need_scale = needs
    de_hat = torch.zeros_like(eh) if need_e else None
    dw = torch.empty_like(w) if need_w else None
    # d rows / d s = sum_j p_ij a_ij - a_iy with logit = s a: the logits are kept for it
    logits = eh.new_empty(b, width) if need_scale else None
    dscale = -(weights * t).sum()
    # d sum(weights * rows) / d logit_y = weighted softmax - weight; times s and the slope;
    # nothing along a direction that is rounding noise (see _sine)
    coef = (torch.exp(s * t - lse) * weights - weights) * s * t_slope
    coef = torch.where(sin > _noise(dtype), coef, torch.zeros_like(coef))
    unit_e = across_e / sin.clamp_min(_noise(dtype)).unsqueeze(1)
    across_w = _orthogonal(eh, wy, c_y)
    unit_w = across_w / torch.linalg.vector_norm(across_w, dim=1).clamp_min(_noise(dtype)).unsqueeze(1)
    for c0 in range(0, c, block):
        c1 = min(c0 + block, c)
        z = tile(c0, c1)
        if logits is not None:
            kept = logits[:, : c1 - c0].copy_(z)
        p = z.sub_(lse.unsqueeze(1)).exp_().mul_(weights.unsqueeze(1))  # weighted softmax of the block
        if logits is not None:
            dscale += torch.bmm(p.unsqueeze(1), kept.unsqueeze(2)).sum() / s
        # d rows_i / d logit_ij = softmax_ij, d logit / d cos = s; the targets' terms apart (coef)
        inside = (labels >= c0) & (labels < c1)
        p[rows_idx[inside], labels[inside] - c0] = 0.0
        g = p.mul_(s)
        wb = wd[c0:c1].to(dtype) * w_inv[c0:c1].unsqueeze(1)
        if de_hat is not None:
            de_hat.addmm_(g, wb)
        if dw is not None:
            dwh = g.T @ eh  # d / d w^ of the block's classes; through w^ = w / |w|:
            dwh.sub_(wb * (wb * dwh).sum(1, keepdim=True)).mul_(w_inv[c0:c1].unsqueeze(1))
            ys = labels[inside]
            dwh.index_add_(0, ys - c0, (coef[inside] * w_inv[ys]).unsqueeze(1) * unit_w[inside])
            dw[c0:c1] = dwh
    de = None
    if de_hat is not None:  # through e^ = e / |e|
        de = (de_hat - eh * (eh * de_hat).sum(1, keepdim=True) + coef.unsqueeze(1) * unit_e) / e_norm.unsqueeze(1)
    return rows, lse, [de, dw, dscale if need_scale else None]


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
) -> Tensor:
    embeddings, labels = checks.validate_labelled(embeddings, labels)
    w = checks.check_float_tensor(class_weights, "class_weights", (2,))
    checks.same_device(w, embeddings, "class_weights", "embeddings")
    if w.shape[0] == 0:
        raise ValueError("class_weights has no classes (C = 0)")
    if w.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"class_weights must be (C, D) with the embeddings' D = {embeddings.shape[1]}, got {tuple(w.shape)}"
        )
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= w.shape[0]):
        raise ValueError(
            f"labels must be class indices in [0, {w.shape[0]}), got {int(labels.min())}..{int(labels.max())}"
        )
    checks.check_choice(backend, "backend", MARGIN_BACKENDS)
    m = _check_margin(margin, name)
    checks.check_bool(easy, "easy_margin")
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    sc = checks.check_positive_scalar(scale, "scale", embeddings.device, compute_dtype(embeddings.dtype))
    with autocast_off(embeddings.device.type):
        return _margin(embeddings, labels.long(), w, sc, target, m, easy, backend, opts)


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
) -> Tensor:
    """The body, one process being a world of one: this rank's rows against every
    class (the class weights the same on every rank, as a replicated parameter),
    reduced over every rank's rows."""
    b = embeddings.shape[0]
    group = opts.process_group
    rows_of: runner.Source = runner.Source(embeddings, 0, [b])
    if group is not None:
        rows_of = parallel.Columns(embeddings, 0, [b], False, group)
    if backend in ("reference", "dense"):
        fn = _reference_rows if backend == "reference" else _dense_rows
        e, w = embeddings.to(scale.dtype), class_weights.to(scale.dtype)
        rows = fn(e, w, labels, TARGETS[target], margin, scale, easy)
        return runner.reduce(rows, torch.ones_like(rows), opts.reduction, opts.grad_scale, rows_of)
    block = opts.block_size or auto_class_block(b, class_weights.shape[0])
    ones = torch.ones(b, dtype=scale.dtype, device=embeddings.device)
    weights = runner.share(opts.reduction, opts.grad_scale, rows_of, ones)
    return _MarginRows.apply(embeddings, class_weights, scale, labels, target, margin, easy, weights, block)


def _check_margin(margin: object, name: str) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be a float, got {type(margin).__name__}")
    value = float(margin)
    upper = math.pi if name == "arcface_loss" else float("inf")
    if not (0.0 <= value < upper):
        bound = "[0, pi) radians" if name == "arcface_loss" else "a finite number >= 0"
        raise ValueError(f"{name}: margin must be {bound}, got {margin!r}")
    return value


@registry.loss
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
    )


@registry.loss
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
    )


@registry.module
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
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, embeddings: Tensor, labels: Tensor, class_weights: Tensor) -> Tensor:
        return cosface_loss(embeddings, labels, class_weights, **self.loss_options())


@registry.module
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
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, embeddings: Tensor, labels: Tensor, class_weights: Tensor) -> Tensor:
        return arcface_loss(embeddings, labels, class_weights, **self.loss_options())
