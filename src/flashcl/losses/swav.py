"""SwAV's swapped prediction over prototypes without the rows x K scores:
:func:`swav_loss` and :class:`SwAVLoss`, on the body of :mod:`flashcl.losses.self_distill`."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import checks
from ..base import LossModule, shared_docs
from ..checks import Example, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import autocast_off
from .prototype_targets import rows_join
from .self_distill import (
    Teacher,
    check_count,
    check_options,
    check_prototypes,
    check_temperature,
    check_views,
    distill_rows,
    pairing,
)

__all__ = ["swav_loss", "SwAVLoss"]


@shared_docs
@compiles(batch_dims={"views": -2, "queue": -2})
def swav_loss(
    views: Tensor,
    prototypes: Tensor,
    *,
    high_resolution: Optional[int] = None,
    queue: Optional[Tensor] = None,
    temperature: float = 0.1,
    sinkhorn_epsilon: float = 0.05,
    sinkhorn_iterations: int = 3,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    grad_scale: str = "ddp",
) -> Tensor:
    r"""SwAV's swapped prediction (Caron et al. 2020) without the rows x K scores: the
    codes of each high-resolution view (Sinkhorn-Knopp on ``exp(z^ . c^_k / epsilon)``
    over its rows, and a queue's) are the targets of every other view's softmax,

    $$
    \frac{1}{H (V - 1) B} \sum_{i < H} \sum_{v \ne i} \sum_b -\sum_k q^{(i)}_{bk}
        \log \operatorname{softmax}_k\!\left(\hat z^{(v)}_b \cdot \hat c_k / \tau\right)
    $$

    Equal to lightly's ``SwaVLoss`` on the scores ``z^ . c^`` (its high-resolution
    views first). With ``normalize=True`` the prototypes' gradient is taken through
    their normalisation; SwAV's recipe normalises the prototypes in place before each
    step and takes the gradient of the unit rows: pass unit rows with
    ``normalize=False`` for exactly that.

    Args:
        views: the features of V views of the same B images, (V, B, D), the
            high-resolution ones first.
        prototypes: (K, D), SwAV's prototype layer's weight.
        high_resolution: the number H of leading views whose codes are targets.
            Default: None (every view).
        queue: (H, Q, D) earlier batches' features of each high-resolution view (no
            gradient): they enter that view's Sinkhorn-Knopp, as SwAV's queue; Q = 0 (a
            queue not filled yet) is the loss without one. Default: None.
        temperature: ``tau``. Default: 0.1.
        sinkhorn_epsilon: Sinkhorn-Knopp's ``epsilon``. Default: 0.05.
        sinkhorn_iterations: Default: 3.
        normalize: L2-normalise the features and the prototypes. Default: True.
        reduction: ``"mean"`` (default) | ``"sum"`` | ``"none"`` ((V, B): each row's
            loss summed over its pairs).
        @prototype_options@

    Shape:
        - views: (V, B, D); prototypes: (K, D); queue: (H, Q, D); output: scalar or (V, B).

    Examples::

        >>> prototypes = torch.nn.Linear(128, 3000, bias=False)
        >>> loss = flashcl.swav_loss(torch.randn(4, 16, 128), prototypes.weight, high_resolution=2)
        >>> loss.backward()
    """
    if not isinstance(views, Tensor) or views.dim() != 3:
        checks.check_float_tensor(views, "views", (3,))  # the type's or the shape's error
    x = check_views(views, "views", process_group is not None)
    v, b, d = x.shape
    w = check_prototypes(prototypes, "prototypes", d, x)
    h = v if high_resolution is None else check_count(high_resolution, "high_resolution", 1)
    if h > v:
        raise ValueError(f"high_resolution = {h} but views holds {v} views")
    ts = check_temperature(temperature, "temperature")
    eps = check_temperature(sinkhorn_epsilon, "sinkhorn_epsilon")
    iterations = check_count(sinkhorn_iterations, "sinkhorn_iterations")
    check_options(backend, reduction, grad_scale, block_size, normalize)
    dtype = compute_dtype(x.dtype)
    codes = x[:h].detach().to(dtype)
    if queue is not None:
        if isinstance(queue, Tensor) and queue.dim() == 3 and queue.shape[1] == 0 and queue.is_floating_point():
            q = queue  # (H, 0, D): a queue not filled yet, as lightly takes it (the loss without one)
        else:
            q = checks.check_float_tensor(queue, "queue", (3,))
        checks.same_device(q, x, "queue", "views")
        if q.shape[0] != h or q.shape[2] != d:
            raise ValueError(f"queue must be (high_resolution = {h}, Q, {d}), got {tuple(q.shape)}")
        codes = torch.cat([codes, q.detach().to(dtype)], dim=1)
    plan = pairing(v, h, "cross")
    join = rows_join(process_group, x.device)
    teacher = Teacher(codes, w.detach().to(dtype), 1.0 / eps, "sinkhorn", None, iterations, False, normalize, b, join)
    count = sum(map(len, plan)) * b
    with autocast_off(x.device.type):
        return distill_rows(
            x, w, teacher, ts, plan, None, count, reduction, backend, block_size, process_group, grad_scale
        )


class SwAVLoss(LossModule):
    """Module form of :func:`swav_loss` (the prototypes passed to each call).

    Examples::

        >>> prototypes = torch.nn.Linear(128, 3000, bias=False)
        >>> loss = flashcl.SwAVLoss(high_resolution=2)(torch.randn(4, 16, 128), prototypes.weight)
    """

    def __init__(
        self,
        high_resolution: Optional[int] = None,
        temperature: float = 0.1,
        sinkhorn_epsilon: float = 0.05,
        sinkhorn_iterations: int = 3,
        normalize: bool = True,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, views: Tensor, prototypes: Tensor, queue: Optional[Tensor] = None) -> Tensor:
        return swav_loss(views, prototypes, queue=queue, **self.loss_options())


def _example_swav(g: torch.Generator) -> Example:
    return Example((example_rows(g, 3, 11, 24), example_rows(g, 97, 24)), {"high_resolution": 2})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "swav_loss": _example_swav,
}
