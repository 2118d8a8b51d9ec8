"""DINOv2's KoLeo regulariser without the B x B products: :func:`koleo_loss` and
:class:`KoLeoLoss` (the neighbours and the per-row terms: :class:`flashcl.engine.neighbours.KoLeoRows`)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import autocast_off
from ..engine.neighbours import KoLeoRows, koleo_dense
from ..reference.families import koleo_rows as _koleo_reference
from .self_distill import check_options, check_temperature

__all__ = ["koleo_loss", "KoLeoLoss"]


@shared_docs
@compiles()
def koleo_loss(
    x: Tensor,
    *,
    eps: float = 1e-8,
    self_score: float = -1.0,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    grad_scale: str = "ddp",
) -> Tensor:
    r"""DINOv2's KoLeo regulariser (Sablayrolles et al. 2019): spreads the rows
    uniformly by pushing each away from its nearest neighbour,

    $$
    -\frac{1}{B} \sum_i \log\left(\lVert \hat x_i - \hat x_{n(i)} \rVert + \epsilon\right),
    \quad n(i) = \arg\max_{j \ne i} \hat x_i \cdot \hat x_j
    $$

    on the L2-normalised rows (``F.normalize`` with ``eps``; the distance as
    ``nn.PairwiseDistance(2, eps)``), without the B x B products: the neighbours are
    found a tile at a time and the gradient formed a block of rows at a time (at B =
    65,536 and D = 256: under 20 MB beyond the input). Equal to DINOv2's ``KoLeoLoss``,
    its rule for the self product included (-1 in the search: a row whose every other
    row is antipodal is its own neighbour); lightly's ``KoLeoLoss`` takes -2 there
    (``self_score=-2``) and equals it elsewhere. Second derivatives (``create_graph=True``) on every backend, on the
    tiled one through the dense formula (memory O(B^2) on that path only).

    Args:
        x: the rows, (B, D) (DINOv2: the student's class tokens of one global crop).
        eps: Default: 1e-8.
        self_score: the row's product with itself in the search for its neighbour, a
            finite number: -1 (DINOv2's, the default) or -2 (lightly's: a row whose every
            other row is antipodal then has one of those as its neighbour).
        reduction: ``"mean"`` (default) | ``"sum"`` | ``"none"``.
        @prototype_options@

    With ``process_group`` the neighbours are searched among every rank's rows (the
    rows gathered with their gradient); without it, among this process's rows
    (DINOv2's default).

    Shape:
        - x: (B, D); output: scalar, or (B,) with ``reduction="none"``.

    Examples::

        >>> x = torch.randn(64, 384, requires_grad=True)
        >>> flashcl.koleo_loss(x).backward()
    """
    x = checks.check_float_tensor(x, "x", (2,), empty=process_group is not None)
    if x.shape[1] == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")
    e = check_temperature(eps, "eps")
    diagonal = checks.number(self_score, "self_score")
    check_options(backend, reduction, grad_scale, block_size, True)
    dtype = compute_dtype(x.dtype)
    with autocast_off(x.device.type):
        keys, offset = None, 0
        if process_group is not None:
            keys, offset = parallel.all_gather_with_grad(x, process_group)
        others = x if keys is None else keys

        def tiled() -> Tensor:
            return KoLeoRows.apply(x, keys, offset, e, block_size or 512, 8192, diagonal)

        def dense() -> Tensor:
            return koleo_dense(x.to(dtype), others.to(dtype), offset, e, diagonal)

        def reference() -> Tensor:
            return _koleo_reference(x.to(dtype), others.to(dtype), offset, e, diagonal)

        impls = {"reference": reference, "dense": dense, "tiled": tiled}
        rows = runner.pick(backend, impls, x.shape[0] * others.shape[0], x, "koleo_loss")()
        if reduction == "none":
            return rows
        total = rows.sum()
        count = total.new_tensor(float(x.shape[0]))
        return runner.reduce_total(total, count, reduction, grad_scale, parallel.reduction_over(process_group))


class KoLeoLoss(LossModule):
    """Module form of :func:`koleo_loss`.

    Examples::

        >>> loss = flashcl.KoLeoLoss()(torch.randn(64, 384))
    """

    def __init__(
        self,
        eps: float = 1e-8,
        self_score: float = -1.0,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, x: Tensor) -> Tensor:
        return koleo_loss(x, **self.loss_options())


def _example_koleo(g: torch.Generator) -> Example:
    return Example((example_rows(g, 41, 24),), {})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "koleo_loss": _example_koleo,
}
