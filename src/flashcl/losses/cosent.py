"""Pairwise ranking of similarity scores (CoSENT, AnglE) without the B x B matrix of
score differences: :func:`cosent_loss` and :class:`CoSENTLoss`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, Scalar, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import autocast_off, normalize_rows
from ..reference.families import cosent_sum as _reference_loss

__all__ = ["cosent_loss", "CoSENTLoss", "pair_scores"]

SIMILARITIES = ("cosine", "angle")
COSENT_BACKENDS = ("auto", "reference", "dense", "tiled")


def pair_scores(a: Tensor, b: Tensor, similarity: str) -> Tensor:
    """Each pair's similarity ``s_i`` in the compute dtype: the cosine of ``a_i`` and
    ``b_i``, or AnglE's angle similarity ``|cos(a_i, b_i) + sin(a_i, b_i)|``
    (sentence-transformers' ``pairwise_angle_sim``: after L2 normalisation,
    coordinates ``t`` and ``t + D/2`` pair for the sine term; an odd D is padded
    with a zero)."""
    dtype = compute_dtype(a.dtype)
    x, y = normalize_rows(a.to(dtype)), normalize_rows(b.to(dtype))
    cos = (x * y).sum(1)
    if similarity == "cosine":
        return cos
    if x.shape[1] % 2:
        x, y = torch.nn.functional.pad(x, (0, 1)), torch.nn.functional.pad(y, (0, 1))
    h = x.shape[1] // 2
    sin = (x[:, h:] * y[:, :h] - x[:, :h] * y[:, h:]).sum(1)
    return (cos + sin).abs()


def _sorted_loss(z: Tensor, labels: Tensor) -> Tensor:
    """``log(1 + sum_{i, j: y_i < y_j} exp(z_i - z_j))`` in O(B log B) time and O(B)
    memory: over the pairs sorted by label, each ``z_i`` meets the log-sum-exp of
    ``-z_j`` over the strictly larger labels (a suffix ``logcumsumexp``; a tie of
    labels contributes nothing)."""
    y, order = labels.sort(stable=True)
    z = z[order]
    higher = torch.searchsorted(y, y, right=True)  # the first index of a strictly larger label
    suffix = torch.logcumsumexp(-z.flip(0), dim=0).flip(0)
    suffix = torch.cat([suffix, suffix.new_full((1,), float("-inf"))])
    terms = z + suffix[higher]
    return torch.logsumexp(torch.cat([terms.new_zeros(1), terms]), dim=0)


def _dense_loss(z: Tensor, labels: Tensor) -> Tensor:
    """The same sum over the B x B matrix of differences (the ``"dense"`` backend)."""
    diff = z.unsqueeze(1) - z.unsqueeze(0)
    diff = diff.masked_fill(~(labels.unsqueeze(1) < labels.unsqueeze(0)), float("-inf"))
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff.reshape(-1)]), dim=0)


_LOSSES = {"reference": _reference_loss, "dense": _dense_loss, "tiled": _sorted_loss}


@shared_docs
@compiles()
def cosent_loss(
    a: Tensor,
    b: Tensor,
    labels: Tensor,
    *,
    scale: Scalar = 20.0,
    similarity: str = "cosine",
    backend: str = "auto",
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""CoSENT (Su, 2022) and AnglE (Li & Li, 2024): every pair ``(a_i, b_i)`` has a
    graded similarity label ``y_i``; the loss asks every pair with a larger label
    for a larger similarity score ``s_i``:

    $$
    \log\Big(1 + \sum_{i, j:\ y_i < y_j} e^{\,\lambda (s_i - s_j)}\Big)
    $$

    with ``s`` the pair's cosine (``similarity="cosine"``: sentence-transformers'
    ``CoSENTLoss``) or AnglE's angle similarity ``|cos + sin|``
    (``similarity="angle"``: its ``AnglELoss``). Pairs with equal labels add
    nothing. The sum over the ``O(B^2)`` ordered pairs is computed over the pairs
    sorted by label, each score meeting a running log-sum-exp of the scores of
    larger labels: ``O(B log B)`` time and ``O(B)`` memory (``backend="auto"`` or
    ``"tiled"``); ``"dense"`` forms the B x B differences, ``"reference"`` loops
    over the pairs. The loss is one log-sum-exp over all pairs, so it has no
    per-row form and no ``reduction``.

    Args:
        a, b: (B, D) the two sides of each pair (L2-normalised inside).
        labels: (B,) each pair's similarity label (float, int or bool; only their
            order counts).
        scale: ``lambda``, the inverse temperature. Default: 20.
        similarity: ``"cosine"`` | ``"angle"``.
        backend: ``"auto"`` | ``"tiled"`` (the sorted form) | ``"dense"`` | ``"reference"``.
        @process_group@

    Shape:
        - a, b: (B, D); labels: (B,); output: scalar

    Examples::

        >>> a, b = torch.randn(16, 8), torch.randn(16, 8)
        >>> loss = flashcl.cosent_loss(a, b, torch.rand(16))
        >>> angle = flashcl.cosent_loss(a, b, torch.rand(16), similarity="angle")
    """
    a, b = checks.validate_pair(a, b, "a", "b", process_group is not None)
    labels = _check_labels(labels, a)
    checks.check_choice(similarity, "similarity", SIMILARITIES)
    checks.check_choice(backend, "backend", COSENT_BACKENDS)
    opts = checks.Options(True, "mean", "auto", None, process_group, strategy, grad_scale)
    lam = checks.check_positive_scalar(scale, "scale", a.device, compute_dtype(a.dtype))
    with autocast_off(a.device.type):
        scores = pair_scores(a, b, similarity)
        return _cosent(scores, lam, labels, similarity, backend, opts)


def _check_labels(labels: object, a: Tensor) -> Tensor:
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a tensor, got {type(labels).__name__}")
    if labels.dim() != 1 or labels.shape[0] != a.shape[0]:
        raise ValueError(f"labels must be (B,) with B = {a.shape[0]} (one per pair), got shape {tuple(labels.shape)}")
    checks.same_device(labels, a, "labels", "a")
    if labels.dtype == torch.bool:
        labels = labels.int()
    if labels.is_floating_point() and not bool(torch.isfinite(labels).all()):
        raise ValueError("labels must be finite")
    if labels.is_complex():
        raise TypeError("labels must be real")
    return labels.detach()


def _cosent(scores: Tensor, lam: Tensor, labels: Tensor, similarity: str, backend: str, opts: checks.Options) -> Tensor:
    """:func:`cosent_loss`'s body, one process being a world of one: the loss over
    every rank's pairs, the scores (B scalars a rank) gathered with their gradient;
    each rank returns its share (the global loss over the world size, times the world
    size for ``grad_scale="ddp"``). ``similarity`` is here for the check that every
    rank makes the same call."""
    pairs = parallel.columns((lam * scores).unsqueeze(1), "all_gather", opts.process_group)
    all_labels = pairs.gather(labels.unsqueeze(1)).squeeze(1)
    loss = backends.pick(backend, _LOSSES, 0, scores, "cosent_loss", auto="tiled")(pairs.keys.squeeze(1), all_labels)
    # one term that every rank holds alike: the mean over the ranks' terms is the loss
    return runner.reduce_total(loss, torch.ones((), device=loss.device), "mean", opts.grad_scale, pairs)


class CoSENTLoss(LossModule):
    """Module form of :func:`cosent_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.CoSENTLoss(scale=20.0, similarity="angle")
        >>> loss = loss_fn(torch.randn(8, 16), torch.randn(8, 16), torch.rand(8))
    """

    def __init__(
        self,
        scale: Scalar = 20.0,
        similarity: str = "cosine",
        backend: str = "auto",
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, a: Tensor, b: Tensor, labels: Tensor) -> Tensor:
        return cosent_loss(a, b, labels, **self.loss_options())


def _example_cosent(g: torch.Generator) -> Example:
    return Example(
        (example_rows(g, 25, 24), example_rows(g, 25, 24), torch.rand(25, generator=g, dtype=torch.float64)),
        {"scale": 20.0},
        leaves=(0, 1),
    )


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "cosent_loss": _example_cosent,
}
