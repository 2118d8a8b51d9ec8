"""DINOv2's KoLeo regulariser without the B x B products (``-mean log(min_j |x^_i - x^_j|
+ eps)``): :func:`koleo_loss` and :class:`KoLeoLoss`; each row's nearest other row by the
largest dot product of the unit rows, found in tiles of products
(:func:`nearest_neighbours`), and the per-row terms with their gradient (:class:`KoLeoRows`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..base import LossModule, shared_docs
from ..checks import Example, example_rows
from ..compiled import compiles
from ..core import compute_dtype
from ..engine.engine import FusedFunction, autocast_off, normalize_backward_
from ..reference.families import koleo_rows as _koleo_reference
from .self_distill import check_options, check_temperature

__all__ = ["koleo_loss", "KoLeoLoss", "nearest_neighbours", "KoLeoRows", "koleo_dense"]


def nearest_neighbours(
    q: Tensor,
    keys: Optional[Tensor] = None,
    *,
    offset: int = 0,
    inv_q: Optional[Tensor] = None,
    inv_k: Optional[Tensor] = None,
    rows: int = 512,
    cols: int = 8192,
    diagonal: float = -1.0,
) -> Tensor:
    """Each row of ``q``'s nearest other row of ``keys`` (default: ``q`` itself; ``q``'s
    row ``i`` is key ``offset + i``) by the largest dot product of the unit rows
    (``inv_q``, ``inv_k``: the rows' inverse norms; None: the rows are unit already),
    KoLeo's neighbour: the first column on a tie, as ``argmax`` of the products with
    the diagonal at ``diagonal`` finds it (-1: DINOv2's ``pairwise_NNs_inner``, so that
    a row whose every other row is antipodal is its own neighbour; lightly's
    ``KoLeoLoss`` takes -2, an antipodal row then); in tiles of
    ``rows x cols`` products (16 MB in float32 by default), O(rows) memory beyond one
    tile and no unit copy of the rows. (M,) int64; a single row is its own neighbour."""
    qd = q.detach()
    kd = qd if keys is None else keys.detach()
    m, n = qd.shape[0], kd.shape[0]
    where = torch.zeros(m, dtype=torch.long, device=qd.device)
    buf = qd.new_empty(min(rows, m), min(cols, n))  # one tile, reused
    for r0 in range(0, m, rows):
        r1 = min(r0 + rows, m)
        top = qd.new_full((r1 - r0,), float("-inf"))
        at = torch.zeros(r1 - r0, dtype=torch.long, device=qd.device)
        own = torch.arange(r0 + offset, r1 + offset, device=qd.device)
        for c0 in range(0, n, cols):
            c1 = min(c0 + cols, n)
            dots = torch.mm(qd[r0:r1], kd[c0:c1].T, out=buf[: r1 - r0, : c1 - c0])
            if inv_q is not None and inv_k is not None:
                dots.mul_(inv_q[r0:r1].unsqueeze(1)).mul_(inv_k[c0:c1].unsqueeze(0))
            inside = (own >= c0) & (own < c1)
            dots[inside.nonzero().flatten(), own[inside] - c0] = diagonal
            v, i = dots.max(1)
            take = v > top  # strictly larger: an earlier column keeps a tie
            top = torch.where(take, v, top)
            at = torch.where(take, i + c0, at)
        where[r0:r1] = at
    return where


def _normalize_inverse(x: Tensor, eps: float) -> Tensor:
    """``1 / max(|x_i|, eps)``: ``F.normalize(x, eps=eps)`` is ``x`` times it."""
    return 1.0 / torch.linalg.vector_norm(x, dim=1).clamp_min(eps)


def koleo_dense(q: Tensor, keys: Optional[Tensor], offset: int, eps: float, diagonal: float = -1.0) -> Tensor:
    """DINOv2's ``KoLeoLoss`` terms on the M x N products, by differentiable torch ops
    (the dense backend, and the tiled one's second derivatives); ``keys`` None: ``q``'s
    own rows."""
    qh = torch.nn.functional.normalize(q, eps=eps, p=2, dim=-1)
    kh = qh if keys is None else torch.nn.functional.normalize(keys, eps=eps, p=2, dim=-1)
    dots = (qh @ kh.T).detach()
    own = torch.arange(q.shape[0], device=q.device)
    dots[own, own + offset] = diagonal
    return -torch.log(torch.nn.functional.pairwise_distance(qh, kh[dots.argmax(1)], 2, eps) + eps)


class KoLeoRows(FusedFunction):
    """``apply(q, keys, offset, eps, rows, cols[, diagonal]) -> (M,)``: DINOv2's KoLeo term of each
    row of ``q``, ``-log(|q^_i - k^_nn(i) + eps| + eps)`` (``^``: ``F.normalize`` with
    ``eps``; the neighbour by :func:`nearest_neighbours`; ``keys`` None: ``q``'s own
    rows, whose row ``i`` is then left out of its own search; else ``q``'s row ``i``
    is key ``offset + i``). Beyond the inputs: O(M) vectors and a tile of products;
    the backward forms the gradient a block of rows at a time, straight into the
    inputs' gradients (the normalisation's backward is linear in each row's
    gradient); with ``create_graph=True`` the gradient comes from :func:`koleo_dense`
    (memory O(M N) on that path only). ``diagonal``: see :func:`nearest_neighbours`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        keys: Optional[Tensor],
        offset: int,
        eps: float,
        rows: int,
        cols: int,
        diagonal: float = -1.0,
    ) -> Tensor:
        dtype = compute_dtype(q.dtype)
        qd = q.detach().to(dtype)
        kd = qd if keys is None else keys.detach().to(dtype)
        inv_q = _normalize_inverse(qd, eps)
        inv_k = inv_q if keys is None else _normalize_inverse(kd, eps)
        nn = nearest_neighbours(
            qd,
            None if keys is None else kd,
            offset=offset,
            inv_q=inv_q,
            inv_k=inv_k,
            rows=rows,
            cols=cols,
            diagonal=diagonal,
        )
        dist = qd.new_empty(qd.shape[0])
        for r0 in range(0, qd.shape[0], rows):
            r1 = min(r0 + rows, qd.shape[0])
            diff = qd[r0:r1] * inv_q[r0:r1].unsqueeze(1) - kd[nn[r0:r1]] * inv_k[nn[r0:r1]].unsqueeze(1) + eps
            dist[r0:r1] = torch.linalg.vector_norm(diff, dim=1)
        FusedFunction.setup(ctx, (q, keys), (nn, dist))
        ctx.opts = (eps, rows, offset, diagonal)
        return -torch.log(dist + eps)

    @classmethod
    def dense(cls, ctx: Any, q: Tensor, keys: Optional[Tensor]) -> Tensor:
        eps, _, offset, diagonal = ctx.opts
        dtype = compute_dtype(q.dtype)
        return koleo_dense(q.to(dtype), None if keys is None else keys.to(dtype), offset, eps, diagonal)

    @classmethod
    def recompute(cls, ctx: Any, grad: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        q, keys, nn, dist = saved
        eps, rows, offset, diagonal = ctx.opts
        dtype = compute_dtype(q.dtype)
        qd = q.detach().to(dtype)
        kd = qd if keys is None else keys.detach().to(dtype)
        inv_q = _normalize_inverse(qd, eps)
        inv_k = inv_q if keys is None else _normalize_inverse(kd, eps)
        dq = torch.zeros_like(qd)
        dk = dq if keys is None else torch.zeros_like(kd)
        # d(-log(d + eps)) / d diff = -diff / (d (d + eps)); diff = q^_i - k^_j + eps
        factor = -grad.to(dtype) / (dist * (dist + eps))
        factor = torch.where(dist > 0, factor, torch.zeros_like(factor))  # the norm's subgradient at 0
        for r0 in range(0, qd.shape[0], rows):
            r1 = min(r0 + rows, qd.shape[0])
            j = nn[r0:r1]
            diff = qd[r0:r1] * inv_q[r0:r1].unsqueeze(1) - kd[j] * inv_k[j].unsqueeze(1) + eps
            g = diff.mul_(factor[r0:r1].unsqueeze(1))
            dk.index_add_(0, j, normalize_backward_(-g, kd[j], eps))
            dq[r0:r1] += normalize_backward_(g, qd[r0:r1], eps)
        return dq, None if keys is None else dk


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
    65,536 and D = 256: about 25 MB beyond the input and its gradient). Equal to DINOv2's ``KoLeoLoss``,
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
        rows = backends.pick(backend, impls, x.shape[0] * others.shape[0], x, "koleo_loss")()
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
