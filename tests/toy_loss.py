"""A loss written for the tests only, as a new loss is added to flashcl: one family
module (this file: the function, its Module twin and its problem) built on the
public layer's shared pieces, with ONE body for one process and every rank (the
column source and the runner, :mod:`flashcl.runner`), and one test file
(test_toy_loss.py). Nothing else in the package changes for it, yet it takes every
backend on one process and across processes, ``process_group=`` on both strategies
and a learnable temperature. (A family of the package adds one import line to
``flashcl/__init__.py``: its names are then public, in the API reference and in
``flashcl check``, from its ``EXAMPLES``.)

The loss: InfoNCE over one batch of interleaved views, rows ``2j`` and ``2j + 1``
each other's positive, every other row a negative (NT-Xent with the two views
interleaved rather than stacked).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from flashcl import checks, distributed, runner
from flashcl.base import LossModule, shared_docs
from flashcl.checks import Scalar, scale_dtype
from flashcl.compiled import compiles
from flashcl.core import CoreSpec


def interleaved_spec(n: int, offset: int, device: torch.device) -> CoreSpec:
    """The problem: row ``i``'s positive is column ``(i ^ 1) + offset``, its own column excluded."""
    partner = (torch.arange(n, device=device) ^ 1) + offset
    return CoreSpec(exclude_self=True, self_pairs=True, offset=offset, index=partner.unsqueeze(1), pos_mode="sum")


@shared_docs
@compiles()
def interleaved_loss(
    x: Tensor,
    *,
    temperature: Scalar = 0.1,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    """InfoNCE over interleaved views: rows ``2j`` and ``2j + 1`` are a pair.

    Args:
        x: (2P, D) the views, pair by pair.
        temperature: float or 0-dim tensor.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        @backend@
        @process_group@

    Shape:
        - x: (2P, D); output: scalar, or (2P,) with ``reduction="none"``

    Examples::

        >>> loss = interleaved_loss(torch.randn(8, 4))
    """
    x = checks.check_float_tensor(x, "x", (2,))
    if x.shape[0] < 2 or x.shape[0] % 2:
        raise ValueError(f"x must hold pairs of views (an even number of rows >= 2), got {x.shape[0]} rows")
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", x.device, scale_dtype(x))
    return _interleaved(x, scale, opts)


def _interleaved(x: Tensor, scale: Tensor, opts: checks.Options) -> Tensor:
    """The one body: this process's rows against every rank's (one process: its own)."""
    cols = distributed.columns(x, opts.strategy, opts.process_group, own=True)
    return runner.run(x, cols, scale, interleaved_spec(x.shape[0], cols.offset, x.device), opts)


class InterleavedLoss(LossModule):
    """Module form of :func:`interleaved_loss`."""

    def __init__(
        self,
        temperature: Scalar = 0.1,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, x: Tensor) -> Tensor:
        return interleaved_loss(x, **self.loss_options())
