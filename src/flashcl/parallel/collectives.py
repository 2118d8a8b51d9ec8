"""The collectives of the losses across processes and their column source
(:class:`Columns`, a :class:`flashcl.backends.Source` over every rank); the public
face is :mod:`flashcl.distributed`."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import backends
from ..backends import Source, auto_block, local
from ..core import compute_dtype
from ..engine import engine
from ..engine.engine import Problem
from .ring import RingDriver

__all__ = [
    "all_gather_with_grad",
    "world_size",
    "rank_of",
    "row_counts",
    "sum_across",
    "max_across",
    "logsumexp_across",
    "gather_plain",
    "global_max",
    "grad_factor",
    "same_call",
    "columns",
    "replicated",
    "reduction_over",
    "Columns",
]


def _world(group: Any) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flashcl.distributed needs an initialised process group (torch.distributed."
            "init_process_group); for one process use the flashcl.* losses"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _check_same_call(signature: str, device: torch.device, group: Any) -> None:
    """All ranks must make the same call: compare a digest of its signature."""
    digest = int(hashlib.sha256(signature.encode()).hexdigest()[:12], 16)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    _, world = _world(group)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if any(int(t) != digest for t in everyone):
        raise ValueError(
            f"flashcl.distributed: the ranks made different calls (loss, options, embedding dim "
            f"or dtype differ); this rank's call: {signature}"
        )


def same_call(
    fn: Callable[..., Tensor],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    batch_dims: Optional[Dict[str, int]] = None,
) -> None:
    """Every rank must make the same call of the public loss ``fn``: a digest of it is
    compared across ``process_group``'s ranks (a ValueError on each, not a hang). It
    is formed from every argument (the options; of a tensor, its dtype and its shape
    past the batch dimension, and of a 0-dim tensor its value), so that no option can
    be left out of it. Keys that every rank holds alike (a queue) are compared by
    value where they join the column source (:func:`columns`, :func:`replicated`).
    ``batch_dims``: the batch dimension of an argument where it is not the first (-2:
    the rows of (B, D) and of a stack of views (views, B, D))."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # the loss's checks, then the error that names the missing group
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    parts, device = [fn.__name__], None
    for name, value in bound.arguments.items():
        if name == "process_group":
            continue
        if isinstance(value, Tensor):
            device = device or value.device
            at = (batch_dims or {}).get(name, 0) % max(value.dim(), 1)  # -2: the rows of (B, D) and (views, B, D)
            shape = tuple(value.shape[:at]) + tuple(value.shape[at + 1 :])
            detail = f"{float(value.detach()):.12g}" if value.dim() == 0 else str(shape)
            parts.append(f"{name}:{value.dtype}:{detail}")
        elif isinstance(value, (tuple, list)) and any(isinstance(v, Tensor) for v in value):
            parts.append(
                f"{name}:"
                + ",".join(f"{v.dtype}:{tuple(v.shape[1:])}" if isinstance(v, Tensor) else repr(v) for v in value)
            )
        else:
            parts.append(f"{name}={value!r}")
    _check_same_call("|".join(parts), device if device is not None else torch.device("cpu"), kwargs["process_group"])


def _fingerprint(x: Optional[Tensor]) -> int:
    """A digest of ``x``'s shape and values (keys every rank must hold alike)."""
    if x is None:
        return 0
    v = x.detach().double()
    text = f"{tuple(x.shape)}:{float(v.sum()):.12g}:{float((v * v).sum()):.12g}"
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


def _sizes(n: int, device: torch.device, group: Any, alike: Optional[Tensor] = None) -> List[int]:
    """Every rank's ``n``; ``alike``: keys every rank must hold alike, compared in the
    same collective (a ValueError on every rank if they differ)."""
    _, world = _world(group)
    mine = torch.tensor([n, _fingerprint(alike)], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if any(int(t[1]) != int(mine[1]) for t in everyone):
        raise ValueError(
            "flashcl.distributed: the ranks made different calls: the keys every rank must hold alike (a "
            "queue, extra negatives, their labels) differ between them"
        )
    return [int(t[0]) for t in everyone]


def _gather_rows(x: Tensor, sizes: List[int], group: Any) -> Tensor:
    """Every rank's rows concatenated in rank order (uneven counts: padded to the
    largest for the collective, then trimmed)."""
    padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class _AllGather(torch.autograd.Function):
    """:func:`_gather_rows` with a gradient: backward sums over ranks the
    gradients of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: List[int], group: Any) -> Tensor:
        ctx.sizes, ctx.group, ctx.rank = sizes, group, _world(group)[0]
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        _no_double_backward()
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


def all_gather_with_grad(x: Tensor, group: Any = None) -> Tuple[Tensor, int]:
    """Every rank's rows of ``x`` concatenated in rank order (uneven row counts
    allowed), differentiable: backward hands each rank the sum over ranks of the
    gradients of its rows. For losses composed by hand from flashcl's
    single-process functions (local rows against the gathered candidates).

    Args:
        x: (n_rank, ...) this rank's rows.
        group: the process group (default: the world).

    Returns:
        (the gathered rows, (sum of n_rank, ...); this rank's first row in them).

    Shape:
        - x: (n_rank, D); output: (sum over ranks of n_rank, D)

    Examples::

        >>> # inside an initialised process group:
        >>> # docs_all, offset = flashcl.distributed.all_gather_with_grad(docs)
        >>> # loss = flashcl.info_nce_loss(queries, docs_all, offset + torch.arange(len(queries)))
    """
    rank, _ = _world(group)
    sizes = _sizes(x.shape[0], x.device, group)
    return _AllGather.apply(x, sizes, group), sum(sizes[:rank])


def _no_double_backward() -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            "flashcl.distributed does not compute second derivatives (backward with create_graph=True, as a "
            "gradient penalty or a Hessian-vector product needs): its collectives' gradients have no graph. "
            "The single-process losses (flashcl.supcon_loss, ...) compute them on every backend."
        )


def _all_gather_plain(x: Tensor, group: Any) -> Tensor:
    return _gather_rows(x, _sizes(x.shape[0], x.device, group), group)


def _global_count(n: Tensor, group: Any) -> Tensor:
    n = n.clone()
    dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    return n


class Columns(Source):
    """The candidates one rank scores its rows against (a :class:`flashcl.backends.Source`
    across processes): every rank's block, gathered (``ring=False``), or its own
    block, the others coming round the ring; ``shared`` keys at the end of rank 0's
    block."""

    def gather(self, x: Tensor, shared: Optional[Tensor] = None) -> Tensor:
        """Every rank's rows of ``x`` (one per key of its block; no gradient: labels,
        a guide's embeddings), in the columns' order; ``shared``: those of the
        shared keys, the same on every rank."""
        if (shared is None) != (self.shared == 0) or (shared is not None and shared.shape[0] != self.shared):
            raise ValueError("the shared keys' rows must come with the shared keys")
        if shared is not None:
            _sizes(0, x.device, self.group, alike=shared)
            if _world(self.group)[0] == 0:
                x = torch.cat([x, shared.to(x.dtype)])
        return _gather_rows(x.detach(), self.sizes, self.group)

    def run(
        self,
        q: Tensor,
        scale: Tensor,
        problem: Problem,
        weights: Any,
        block_size: Optional[int],
        params: Sequence[Tensor] = (),
        backend: str = "tiled",
    ) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        """``problem``'s losses of this rank's rows ``q`` against the global columns (and
        what its head reports): backend ``backend`` on the gathered keys, or the ring
        driver (tiled)."""
        if not self.ring:
            return backends.run_problem(q, self.keys, scale, problem, backend, weights, block_size, params)
        ring = RingDriver(self.sizes, self.group)
        block = block_size or auto_block(q.shape[0], max(self.sizes), compute_dtype(q.dtype), self_contrast=True)
        return engine.run(q, self.keys, scale, ring.local_problem(problem), ring, weights, block, params)

    def count(self, n: Tensor) -> Tensor:
        return _global_count(n, self.group)

    def rows_of_every_rank(self, x: Tensor) -> Tensor:
        return _all_gather_plain(x.detach(), self.group)

    def factor(self, grad_scale: str) -> float:
        return grad_factor(grad_scale, self.group)


def columns(k_local: Tensor, strategy: str, group: Any, shared: Optional[Tensor] = None, own: bool = False) -> Source:
    """The global candidates from this rank's block ``k_local``: gathered with a
    gradient (``strategy="all_gather"``) or left for the ring. ``shared``: keys
    without gradient that every rank holds alike (a queue): they join rank 0's
    block after its own rows, so that they enter the global loss once. ``group=None``:
    this process's block alone, no collective (``own``: the keys are the anchors
    themselves)."""
    if group is None:  # a world of one
        if shared is None:
            return Source(k_local, 0, [k_local.shape[0]], own=own)
        return local(k_local, shared)
    rank, _ = _world(group)
    n_shared = 0
    if shared is not None:
        n_shared = shared.shape[0]
        if rank == 0:
            k_local = torch.cat([k_local, shared.detach().to(k_local.dtype)])
    sizes = _sizes(k_local.shape[0], k_local.device, group, alike=shared)
    offset = sum(sizes[:rank])
    keys = k_local if strategy == "ring" else _AllGather.apply(k_local, sizes, group)
    return Columns(keys, offset, sizes, strategy == "ring", group, n_shared)


def replicated(keys: Tensor, group: Any, shared: Optional[Tensor] = None) -> Source:
    """Keys each rank scores its own rows against, not gathered (a queue that holds
    the batch, a query's own key), then ``shared`` keys: the ranks meet in the
    reduction only. ``group=None``: one process."""
    if shared is not None:
        keys = torch.cat([keys, shared.detach().to(keys.dtype)])
    n_shared = 0 if shared is None else shared.shape[0]
    if group is None:
        return Source(keys, 0, [keys.shape[0]], shared=n_shared)
    _sizes(keys.shape[0], keys.device, group, alike=keys)
    return Columns(keys, 0, [keys.shape[0]], False, group, n_shared)


def grad_factor(grad_scale: str, group: Any) -> float:
    """The factor each rank's share is returned with: the world size for ``"ddp"``, 1 for
    ``"sum"`` and for one process (``group=None``)."""
    return float(_world(group)[1]) if grad_scale == "ddp" and group is not None else 1.0


def reduction_over(group: Any) -> Source:
    """The ranks a per-row loss is reduced over (:func:`flashcl.runner.reduce`): every
    rank of ``group``, or one process for None."""
    empty = torch.empty(0)
    return Source(empty, 0, [0]) if group is None else Columns(empty, 0, [], False, group)


def row_counts(n: int, device: torch.device, group: Any) -> List[int]:
    """Every rank's ``n``, in rank order."""
    return _sizes(n, device, group)


def world_size(group: Any) -> int:
    """The number of ranks of ``group``."""
    return _world(group)[1]


def rank_of(group: Any) -> int:
    """This process's rank in ``group``."""
    return _world(group)[0]


def sum_across(x: Tensor, group: Any) -> Tensor:
    """The sum over ranks of ``x`` (a copy; no gradient)."""
    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def max_across(x: Tensor, group: Any) -> Tensor:
    """The elementwise largest over ranks of ``x`` (a copy; no gradient)."""
    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def logsumexp_across(x: Tensor, group: Any) -> Tensor:
    """The elementwise log-sum-exp over ranks of ``x`` (each rank's own log-sum-exps of its
    part), shifted by their largest (0 where that is infinite: every part empty); no gradient."""
    top = max_across(x, group)
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return safe + sum_across(torch.exp(x - safe), group).log()


def gather_plain(x: Tensor, group: Any) -> Tensor:
    """Every rank's rows of ``x`` in rank order, without gradient (labels, counts)."""
    return _all_gather_plain(x.detach(), group)


def global_max(value: int, device: torch.device, group: Any) -> int:
    """The largest of every rank's ``value`` (``group=None``: one process's)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)
