"""Proxy-Anchor loss (Kim et al., CVPR 2020), exact at any batch: :func:`proxy_anchor_loss`
and :class:`ProxyAnchorLoss`, the proxies' rows against the batch's on the engine's tiles
(:class:`~flashcl.losses.multi_similarity.MultiSimilarityHead` configured for it), with
the per-proxy oracle beside it.

For cosine scores ``s_ki`` between class proxies ``w_k`` and L2-normalised rows ``x_i``::

    L = 1/|P+| sum_{k in P+} log(1 + sum_{i: y_i = k} exp(-alpha (s_ki - delta)))
      + 1/C    sum_k         log(1 + sum_{i: y_i != k} exp( alpha (s_ki + delta)))

with ``P+`` the classes present in the batch. Across processes the proxies' rows are
split between the ranks (each rank its share of the sum), the batch's rows are every
rank's.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_labels, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import Problem, autocast_off
from ..engine.heads import softplus
from ..reference.families import proxy_anchor_rows as _reference_rows
from .flex_head import PairSets
from .multi_similarity import MultiSimilarityHead

__all__ = ["proxy_anchor_loss", "ProxyAnchorLoss", "ProxyAnchorSets"]


@shared_docs
@compiles()
def proxy_anchor_loss(
    embeddings: Tensor,
    labels: Tensor,
    proxies: Tensor,
    *,
    margin: float = 0.1,
    alpha: float = 32.0,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
) -> Tensor:
    r"""Proxy-Anchor loss (Kim et al. 2020): each class proxy pulls the batch's rows of its
    class and pushes the others, exact over the whole batch without the B x C matrix;
    pytorch-metric-learning's ``ProxyAnchorLoss(num_classes, embedding_size, margin, alpha)``
    with its proxies given, on cosine scores,

    $$
    L = \frac{1}{|P^+|} \sum_{k \in P^+} \log\Big(1 + \sum_{i: y_i = k} e^{-\alpha (s_{ki} - \delta)}\Big)
      + \frac{1}{C} \sum_{k} \log\Big(1 + \sum_{i: y_i \ne k} e^{\alpha (s_{ki} + \delta)}\Big)
    $$

    with ``P+`` the classes with a row in the batch. The gradient reaches the rows and the
    proxies.

    Args:
        embeddings: (B, D) rows (L2-normalised here).
        labels: (B,) class indices in ``[0, C)``.
        proxies: (C, D) one proxy per class (L2-normalised here; a learnable parameter).
        margin: ``delta``. Default: 0.1.
        alpha: the scale (> 0). Default: 32.
        reduction: ``"mean"`` (the loss above) | ``"sum"`` (C times it) | ``"none"``
            (each proxy's term, (C,), whose mean is the loss; across processes this
            rank's share of the proxies).
        @backend@
        @process_group@

    Shape:
        - embeddings: (B, D); labels: (B,); proxies: (C, D); output: scalar, or (C,) with
          ``reduction="none"`` (across processes: this rank's proxies)

    Examples::

        >>> x, y, w = torch.randn(32, 16), torch.randint(0, 10, (32,)), torch.randn(10, 16)
        >>> loss = flashcl.proxy_anchor_loss(x, y, w)
    """
    embeddings, labels = checks.validate_labelled(embeddings, labels, empty=process_group is not None)
    proxies = checks.check_float_tensor(proxies, "proxies", (2,))
    checks.same_device(proxies, embeddings, "proxies", "embeddings")
    if proxies.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"proxies must be (C, D) with the embeddings' D = {embeddings.shape[1]}, got {tuple(proxies.shape)}"
        )
    num_classes = proxies.shape[0]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"labels must be class indices in [0, {num_classes}), got {int(labels.min())}..{int(labels.max())}"
        )
    delta = checks.number(margin, "margin")
    scale = checks.number(alpha, "alpha", positive=True)
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    with autocast_off(embeddings.device.type):
        return _proxy_anchor(embeddings, labels.long(), proxies, delta, scale, opts)


def _proxy_anchor(
    embeddings: Tensor, labels: Tensor, proxies: Tensor, margin: float, alpha: float, opts: checks.Options
) -> Tensor:
    """The one body: this rank's share of the proxies against every rank's rows."""
    # rows and proxies of two dtypes (bfloat16 rows, float32 proxies): both in the wider, on every backend
    wide = torch.promote_types(embeddings.dtype, proxies.dtype)
    embeddings, proxies = embeddings.to(wide), proxies.to(wide)
    cols = parallel.columns(embeddings, opts.strategy, opts.process_group, own=False)
    every = cols.gather(labels)  # every column's class
    c = proxies.shape[0]
    rank, world = (0, 1) if opts.process_group is None else (parallel.rank_of(opts.process_group), len(cols.sizes))
    c0, c1 = rank * c // world, (rank + 1) * c // world
    rows, classes = proxies[c0:c1], torch.arange(c0, c1, device=proxies.device)
    dtype = compute_dtype(embeddings.dtype)
    present = int((torch.bincount(every, minlength=c) > 0).sum())
    pos_weight = float(c) / max(present, 1)  # each proxy's term, so that their mean over the C proxies is the loss
    valid = torch.ones(rows.shape[0], dtype=dtype, device=embeddings.device)
    weights = runner.share(opts.reduction, opts.grad_scale, cols, valid)
    head = MultiSimilarityHead(
        classes, every, False, 0, alpha, alpha, margin, None, neg_base=-margin, weights=(pos_weight, 1.0)
    )
    one = torch.ones((), dtype=dtype, device=embeddings.device)

    def oracle() -> Tuple[Tensor, Tuple[Tensor, ...]]:
        return _reference_rows(rows.to(dtype), cols.keys.to(dtype), every, classes, margin, alpha), ()

    pair = None if weights is None else (weights, None)
    return backends.solve(
        rows, cols, one, Problem(head, (), True, 0), pair, opts, "proxy_anchor_loss", oracle, embeddings
    )[0]


class ProxyAnchorLoss(LossModule):
    """Module form of :func:`proxy_anchor_loss`; the proxies are the call's (a parameter of
    the model, as a classifier's weights). See :class:`flashcl.integrations.pytorch_metric_learning.ProxyAnchorLoss`
    for pytorch-metric-learning's class, which holds them.

    Examples::

        >>> proxies = torch.nn.Parameter(torch.randn(10, 16))
        >>> loss = flashcl.ProxyAnchorLoss()(torch.randn(32, 16), torch.randint(0, 10, (32,)), proxies)
    """

    def __init__(
        self,
        margin: float = 0.1,
        alpha: float = 32.0,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, embeddings: Tensor, labels: Tensor, proxies: Tensor) -> Tensor:
        return proxy_anchor_loss(embeddings, labels, proxies, **self.loss_options())


def _example_proxy_anchor(g: torch.Generator) -> Example:
    return Example((example_rows(g, 37, 24), example_labels(g, 37, 11), example_rows(g, 11, 24)), {"alpha": 8.0})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {"proxy_anchor_loss": _example_proxy_anchor}


class ProxyAnchorSets(PairSets):
    """Proxy-Anchor's two sums of a proxy over the rows as a two-set kind: ``pos_factor
    softplus(P) + softplus(N)`` with ``P`` over its class's rows of ``-alpha (s - margin)``,
    ``N`` over the others of ``alpha (s + margin)`` (``pos_factor``: C over the classes
    present, so that the mean over the proxies is PML's two divisors)."""

    name = "proxy_anchor"

    def __init__(self, alpha: float, margin: float, pos_factor: float) -> None:
        self.alpha, self.margin, self.pos_factor = alpha, margin, pos_factor

    def pos_mod(self, s: Tensor, a: Any, b: Any) -> Tensor:
        return (s - self.margin) * -self.alpha

    def neg_mod(self, s: Tensor, a: Any, b: Any) -> Tensor:
        return (s + self.margin) * self.alpha

    def loss(self, p: Tensor, n: Tensor) -> Tensor:
        return self.pos_factor * softplus(p) + softplus(n)

    def slopes(self, p: Tensor, n: Tensor) -> Tuple[Tensor, Tensor]:
        return self.pos_factor * torch.sigmoid(p), torch.sigmoid(n)

    def counted(self, p: Tensor, n: Tensor) -> Tensor:
        return torch.ones_like(p, dtype=torch.bool)
