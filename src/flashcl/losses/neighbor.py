"""The sampled-neighbours loss on a given score matrix: :func:`neighbor_loss`,
:func:`sample_neighbors` and :class:`NeighborLoss`."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from .. import backends, checks, parallel, reference, runner
from ..base import LossModule
from ..checks import Example, example_rows
from ..compiled import compiles
from ..core import CoreSpec, compute_dtype
from ..engine.engine import autocast_off
from ..engine.given import run_given
from .neighbor_scores import NeighborHead, auto_scores_block, dense_rows


@compiles()
def neighbor_loss(
    scores: Tensor,
    neighbors: Tensor,
    *,
    exclude_diagonal: bool = True,
    reduction: str = "sum",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""The "sampled neighbours" contrastive loss on a given n x n score matrix.

    Every row ``i`` has k positive columns ``neighbors[i]`` (repeats and the
    diagonal allowed), each its own cross-entropy term against the row's
    denominator (every column but ``i`` when ``exclude_diagonal``)::

        loss_i = sum_t ( LSE_{c != i} scores[i, c] - scores[i, neighbors[i, t]] )

    computed as a masked logsumexp, so scores up to 1e4 in magnitude stay
    finite (``log(exp(x) / (sum(exp(x)) - exp(diag)))`` overflows past ~88 in
    float32). It is the loss of ``-log(exp(y) / row_sum)`` over neighbours copied
    element by element in Python loops, whose backward takes tens of seconds at
    n = 2000; here it takes milliseconds, with the same value and gradient for the
    same sampled indices.

    Args:
        scores: (n, n) floating score matrix.
        neighbors: (n, k) integer column indices, ``0 <= neighbors < n``.
        exclude_diagonal: drop column ``i`` from row ``i``'s denominator. Default: True.
        reduction: ``"sum"`` (default), ``"mean"`` (over the n rows) or
            ``"none"`` (per-row sums over the row's k neighbours).
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (no
            ``"triton"``: the matrix is given, there are no embeddings to tile);
            ``"auto"`` is tiled, whose only n x n allocation is the gradient.
        block_size: rows per block of the tiled backend; None picks one.
        process_group: None (default) or a process group of ``torch.distributed``:
            each rank passes its rows of the global n x n matrix, ``scores``
            (n_rank, n), rows in rank order, and their ``neighbors`` (n_rank, k)
            (global columns); the loss is the global matrix's. The rows are
            independent, so the ranks meet in the reduction only.
        strategy: accepted for symmetry with the other losses (no candidates
            travel: the columns are in the given rows).
        grad_scale: ``"ddp"`` (default: world size x this rank's share) |
            ``"sum"`` (its share); see :mod:`flashcl.distributed`.

    Shape:
        - scores: (n, n), or (n_rank, n) with ``process_group``; neighbors: (n, k)
        - output: scalar, or (n,) with ``reduction="none"``

    Examples::

        >>> scores = torch.randn(100, 100, requires_grad=True)
        >>> nb = flashcl.sample_neighbors(100, 2)
        >>> flashcl.neighbor_loss(scores, nb).backward()
    """
    checks.check_float_tensor(scores, "scores", (2,), process_group is not None)
    neighbors = checks.check_index_tensor(neighbors, "neighbors")
    checks.check_bool(exclude_diagonal, "exclude_diagonal")
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    rows, n = scores.shape
    if scores.shape[1] != rows and process_group is None:
        raise ValueError(f"scores must be square (n, n), got shape {tuple(scores.shape)}")
    if neighbors.dim() != 2 or neighbors.shape[0] != rows or neighbors.shape[1] < 1:
        raise ValueError(f"neighbors must be 2-D of shape ({rows}, k) with k >= 1, got shape {tuple(neighbors.shape)}")
    checks.same_device(neighbors, scores, "neighbors", "scores")
    if bool(((neighbors < 0) | (neighbors >= n)).any()):
        raise ValueError(f"neighbors values must be column indices in [0, {n})")
    if exclude_diagonal and n < 2:
        raise ValueError("neighbor_loss needs n >= 2 when exclude_diagonal=True: the denominator would be empty")
    return _neighbor(scores, neighbors.long(), exclude_diagonal, opts)


def _neighbor(scores: Tensor, neighbors: Tensor, exclude_diagonal: bool, opts: checks.Options) -> Tensor:
    """:func:`neighbor_loss`'s body, one process being a world of one: this rank's rows
    of the global score matrix (one process: the whole matrix)."""
    rows, n = scores.shape
    source: backends.Source = backends.Source(scores, 0, [rows])
    if opts.process_group is not None:
        sizes = parallel.row_counts(rows, scores.device, opts.process_group)
        if sum(sizes) != n:
            raise ValueError(
                f"with process_group, scores holds this rank's rows of the global (n, n) matrix: the ranks "
                f"hold {sum(sizes)} rows of {n} columns"
            )
        offset = sum(sizes[: parallel.rank_of(opts.process_group)])
        source = parallel.Columns(scores, offset, sizes, False, opts.process_group)
    spec = CoreSpec(
        exclude_self=exclude_diagonal, index=neighbors, pos_mode="pairs", normalize=False, offset=source.offset
    )

    def by_rows(rows_of: Callable[[Tensor, CoreSpec], Tensor]) -> Callable[[], Tensor]:
        def run() -> Tensor:
            losses = rows_of(scores, spec)
            return runner.reduce(losses, torch.ones_like(losses), opts.reduction, opts.grad_scale, source)

        return run

    def tiled() -> Tensor:
        block = opts.block_size or auto_scores_block(n)
        one = torch.ones((), dtype=compute_dtype(scores.dtype), device=scores.device)
        weights = runner.share(opts.reduction, opts.grad_scale, source, one.expand(rows))
        return run_given(scores, one, NeighborHead(spec), weights, block, offset=spec.offset)[0]

    # the score matrix already exists: no Triton kernel (the tiled backend's only n x n allocation is the gradient)
    impls = {"reference": by_rows(reference.scores_loss), "dense": by_rows(dense_rows), "tiled": tiled}
    family = "neighbor_loss (a given score matrix)"
    with autocast_off(scores.device.type):
        return backends.pick(opts.backend, impls, rows * n, scores, family, auto="tiled")()


def sample_neighbors(
    n: int,
    k: int,
    *,
    generator: Optional[torch.Generator] = None,
    device: Optional[Union[str, torch.device]] = None,
    exclude_self: bool = False,
) -> Tensor:
    """k uniformly sampled columns per row, vectorised (``random.randrange`` in a loop, at once).

    Args:
        n: number of rows (and of columns to sample from).
        k: samples per row, with replacement (repeats possible).
        generator: optional ``torch.Generator`` for reproducible draws.
        device: where the result lives. Default: CPU.
        exclude_self: never draw column ``i`` for row ``i``. Default: False.

    Shape:
        - output: (n, k) int64

    Examples::

        >>> nb = flashcl.sample_neighbors(5, 2, generator=torch.Generator().manual_seed(0))
        >>> nb.shape
        torch.Size([5, 2])
    """
    for value, name in ((n, "n"), (k, "k")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    checks.check_bool(exclude_self, "exclude_self")
    if exclude_self and n < 2:
        raise ValueError("sample_neighbors with exclude_self=True needs n >= 2")
    gen_device = generator.device if generator is not None else None
    dev = torch.device(device) if device is not None else (gen_device or torch.device("cpu"))
    high = n - 1 if exclude_self else n
    draw = torch.randint(0, high, (n, k), generator=generator, device=gen_device or dev).to(dev)
    if exclude_self:
        draw += (draw >= torch.arange(n, device=dev).unsqueeze(1)).long()
    return draw


class NeighborLoss(LossModule):
    """Module form of :func:`neighbor_loss`.

    Examples::

        >>> scores = torch.randn(10, 10)
        >>> loss = flashcl.NeighborLoss()(scores, flashcl.sample_neighbors(10, 2))
    """

    def __init__(
        self,
        exclude_diagonal: bool = True,
        reduction: str = "sum",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, scores: Tensor, neighbors: Tensor) -> Tensor:
        return neighbor_loss(scores, neighbors, **self.loss_options())


def _example_neighbor(g: torch.Generator) -> Example:
    return Example((example_rows(g, 33, 33), torch.randint(0, 33, (33, 3), generator=g)), {})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "neighbor_loss": _example_neighbor,
}
