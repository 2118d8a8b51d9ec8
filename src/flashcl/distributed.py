"""The same exact losses over a batch spread across processes (``torch.distributed``).

Each rank passes its local batch; the loss is the loss over the global batch
(the ranks' batches concatenated in rank order), with positives and negatives
from every rank. Strategy ``"all_gather"``: the candidates are gathered with an
autograd-aware collective (uneven batch sizes allowed), then the tiled core runs
local anchor rows against the global candidate columns, so no rank ever holds
the global score matrix, only the global embeddings.

Gradient convention (``grad_scale``):

* ``"ddp"`` (default): each rank returns ``world_size x`` its share of the global
  loss (for ``reduction="mean"``: its anchors' terms over the global number of
  anchors). The mean of the returned values over ranks is the global loss, and
  DistributedDataParallel's gradient averaging (sum over ranks / world_size)
  then gives exactly the single-process gradient of the global loss, for the
  model and for a learnable temperature alike. The embeddings' gradient on each
  rank is ``world_size x`` the single-process gradient's rows of that rank.
* ``"sum"``: each rank returns its share; the sum over ranks is the global loss
  and each rank's embeddings' gradient equals the single-process gradient's
  rows of that rank. A replicated learnable temperature then needs its
  gradient summed over ranks (``all_reduce``), not averaged.

Every call first checks, with one small collective, that all ranks called the
same loss with the same options, embedding dim and dtype; a mismatch raises a
``ValueError`` on every rank instead of hanging in a later collective. The
collectives use the process group's timeout (``init_process_group(timeout=...)``).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import backends, checks, engine
from .core import CoreSpec
from .dispatch import class_ids
from .engine import Problem
from .estimators import DebiasedHead
from .functional import Scalar, siglip_problem
from .heads import Exclusions
from .ring import RingDriver
from .tiled import auto_block
from .utils import compute_dtype

__all__ = ["supcon_loss", "nt_xent_loss", "info_nce_loss", "clip_loss", "siglip_loss", "all_gather_with_grad",
           "reduce_across"]

_GRAD_SCALES = ("ddp", "sum")
_STRATEGIES = ("all_gather", "ring")


def _world(group: Any) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashcl.distributed needs an initialised process group (torch.distributed."
                           "init_process_group); for one process use the flashcl.* losses")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_same_call(signature: str, device: torch.device, group: Any) -> None:
    """All ranks must make the same call: compare a digest of its signature."""
    digest = int(hashlib.sha256(signature.encode()).hexdigest()[:12], 16)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    _, world = _world(group)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if any(int(t) != digest for t in everyone):
        raise ValueError(f"flashcl.distributed: the ranks made different calls (loss, options, embedding dim "
                         f"or dtype differ); this rank's call: {signature}")


#: inputs that every rank passes alike (a queue's keys and their labels): compared by value
SHARED_INPUTS = ("ref", "ref_labels", "negatives")


def same_call_across_ranks(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Decorates a loss so that every rank must make the same call: the signature
    compared across ranks is formed from every argument of the call (all the
    options; of a tensor, its dtype and its shape past the batch dimension, and of
    a 0-dim tensor its value), so that no option can be left out of it. Ranks that
    differ get a ValueError each, not a hang."""
    params = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Tensor:
        if not (dist.is_available() and dist.is_initialized()):
            return fn(*args, **kwargs)  # its checks first, then the error that names the missing group
        bound = params.bind(*args, **kwargs)
        bound.apply_defaults()
        parts, device = [fn.__name__], None
        for name, value in bound.arguments.items():
            if name == "group":
                continue
            if isinstance(value, Tensor):
                device = device or value.device
                detail = f"{float(value.detach()):.12g}" if value.dim() == 0 else str(tuple(value.shape[1:]))
                if name in SHARED_INPUTS:  # the same on every rank: its size and a fingerprint of its values
                    v = value.detach().double()
                    detail = f"{tuple(value.shape)}:{float(v.sum()):.12g}:{float((v * v).sum()):.12g}"
                parts.append(f"{name}:{value.dtype}:{detail}")
            elif isinstance(value, (tuple, list)) and any(isinstance(v, Tensor) for v in value):
                parts.append(f"{name}:" + ",".join(f"{v.dtype}:{tuple(v.shape[1:])}" if isinstance(v, Tensor)
                                                   else repr(v) for v in value))
            else:
                parts.append(f"{name}={value!r}")
        _check_same_call("|".join(parts), device if device is not None else torch.device("cpu"),
                         bound.arguments.get("group"))
        return fn(*args, **kwargs)

    return checked


def _sizes(n: int, device: torch.device, group: Any) -> List[int]:
    _, world = _world(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [int(t) for t in everyone]


def _gather_rows(x: Tensor, sizes: List[int], group: Any) -> Tensor:
    """Every rank's rows concatenated in rank order (uneven counts: padded to the
    largest for the collective, then trimmed)."""
    padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
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
        start = sum(ctx.sizes[:ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


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
            "The single-process losses (flashcl.supcon_loss, ...) compute them on every backend.")


def _all_gather_plain(x: Tensor, group: Any) -> Tensor:
    return _gather_rows(x, _sizes(x.shape[0], x.device, group), group)


def _global_count(n: Tensor, group: Any) -> Tensor:
    n = n.clone()
    dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    return n


def _candidates(k_local: Tensor, strategy: str, group: Any) -> Tuple[Tensor, int, List[int]]:
    """(the candidates this rank computes against, this rank's first global column,
    every rank's candidate count): all of them gathered, or only its own (ring)."""
    rank, _ = _world(group)
    sizes = _sizes(k_local.shape[0], k_local.device, group)
    offset = sum(sizes[:rank])
    if strategy == "ring":
        return k_local, offset, sizes
    return _AllGather.apply(k_local, sizes, group), offset, sizes


def _run(q: Tensor, k: Tensor, scale: Tensor, spec: CoreSpec, reduction: str, grad_scale: str,
         block_size: Optional[int], group: Any, valid_weight: Optional[Tensor] = None,
         ring_sizes: Optional[List[int]] = None, widths: Optional[Tuple[Any, Any]] = None) -> Tensor:
    """Local rows of the core against global columns, reduced with the global count.
    ``ring_sizes``: k is this rank's block only and the others come round the ring;
    else k holds every rank's candidates (gathered). ``widths``: Matryoshka's
    ``(matryoshka_dims, matryoshka_weights)`` (gathered columns only)."""
    if widths is not None:
        from .dispatch import matryoshka_core

        if ring_sizes is not None:
            raise ValueError("matryoshka_dims across processes takes strategy='all_gather'")
        rows = matryoshka_core(q, k, scale, spec, widths[0], widths[1], "none", "tiled", block_size)
        valid = spec.valid_rows(q.shape[0]).to(device=q.device, dtype=rows.dtype)
        return reduce_across(rows, valid, reduction, grad_scale, group)
    _, world = _world(group)
    m = q.shape[0]
    dtype = compute_dtype(q.dtype)
    factor = float(world) if grad_scale == "ddp" else 1.0
    weights = None
    if reduction != "none":
        valid = spec.valid_rows(m).to(device=q.device, dtype=dtype)
        if reduction == "mean":
            total = _global_count(valid.sum().reshape(1), group).clamp_min(1)
            r = valid * (factor / total)
        else:
            r = valid * factor
        if valid_weight is not None:
            r = r * valid_weight
        weights = (r, None)
    n_all = k.shape[0] if ring_sizes is None else sum(ring_sizes)
    problem = spec.problem(m, n_all, dtype)
    if ring_sizes is None:
        return backends.run(q, k, scale, problem, "tiled", weights, block_size)
    ring = RingDriver(ring_sizes, group)
    block = block_size or auto_block(m, max(ring_sizes), dtype, self_contrast=True)
    return engine.run(q, k, scale, ring.local_problem(problem), ring, weights, block)


def _check(grad_scale: str, strategy: str) -> None:
    checks.check_choice(grad_scale, "grad_scale", _GRAD_SCALES)
    checks.check_choice(strategy, "strategy", _STRATEGIES)


@same_call_across_ranks
def supcon_loss(embeddings: Tensor, labels: Tensor, *, temperature: Scalar = 0.1, positives: str = "mean",
                include_self: bool = False, normalize: bool = True, reduction: str = "mean",
                grad_scale: str = "ddp", strategy: str = "all_gather",
                group: Any = None, block_size: Optional[int] = None, ref: Optional[Tensor] = None,
                ref_labels: Optional[Tensor] = None, ref_self: Optional[Tensor] = None,
                matryoshka_dims: Optional[Any] = None, matryoshka_weights: Optional[Any] = None) -> Tensor:
    """:func:`flashcl.supcon_loss` over the global batch (see the module docstring).

    Args:
        embeddings: (B_rank, D) this rank's samples (batch sizes may differ by rank).
        labels: (B_rank,) their labels; positives are found on every rank.
        ref, ref_labels: keys without gradient (a :class:`flashcl.MemoryBank`'s
            contents), the same on every rank: they enter the global loss once
            (``strategy="all_gather"``). Ranks that pass different ones get a
            ValueError.
        ref_self: (B_rank,) each of this rank's rows' slot in ``ref`` (the queue
            holds the batch: the columns are the queue's), or -1.
        grad_scale: ``"ddp"`` (default) or ``"sum"``; see the module docstring.
        group: the process group (default: the world).
        other arguments: as :func:`flashcl.supcon_loss`.

    Shape:
        - embeddings: (B_rank, D); labels: (B_rank,)
        - output: scalar, or (B_rank,) with ``reduction="none"``

    Examples::

        >>> # in each of the processes of an initialised group (not run here):
        >>> loss = flashcl.distributed.supcon_loss(local_emb, local_labels)  # doctest: +SKIP
    """
    embeddings, labels = checks.validate_labelled(embeddings, labels)
    checks.check_choice(positives, "positives", ("mean", "sum"))
    checks.check_bool(include_self, "include_self")
    checks.Options(normalize, reduction, "auto", block_size)
    _check(grad_scale, strategy)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", embeddings.device,
                                            compute_dtype(embeddings.dtype))
    if ref is not None or ref_labels is not None or ref_self is not None:
        from .supcon import validate_ref

        if matryoshka_dims is not None or matryoshka_weights is not None:
            raise ValueError("matryoshka_dims does not combine with ref (keys without gradient)")

        if strategy == "ring":
            raise ValueError("supcon_loss with ref across processes takes strategy='all_gather'")
        ref, ref_labels, ref_self = validate_ref(embeddings, ref, ref_labels, ref_self)
        if ref_self is not None:  # the queue holds the batch: its columns are the queue's, the same on every rank
            (row_ids, col_ids), num_classes = class_ids(labels, ref_labels)
            spec = CoreSpec(exclude_self=not include_self, self_pairs=True, row_labels=row_ids, col_labels=col_ids,
                            num_classes=num_classes, pos_mode=positives, normalize=normalize, self_index=ref_self)
            return _run(embeddings, ref, scale, spec, reduction, grad_scale, block_size, group)
    widths = None if matryoshka_dims is None and matryoshka_weights is None else (matryoshka_dims, matryoshka_weights)
    return _supcon_core(embeddings, labels, scale, positives, include_self, normalize, reduction, grad_scale,
                        block_size, group, strategy, ref, ref_labels, widths)


def _supcon_core(embeddings: Tensor, labels: Tensor, scale: Tensor, positives: str, include_self: bool,
                 normalize: bool, reduction: str, grad_scale: str, block_size: Optional[int], group: Any,
                 strategy: str, ref: Optional[Tensor] = None, ref_labels: Optional[Tensor] = None,
                 widths: Optional[Tuple[Any, Any]] = None) -> Tensor:
    """The global batch's SupCon; with ``ref`` (all_gather only), the queue's keys
    as further columns after the gathered batch."""
    k, offset, sizes = _candidates(embeddings, strategy, group)
    all_labels = _all_gather_plain(labels.long(), group)
    if all_labels.shape[0] < 2 and not include_self and ref is None:
        raise ValueError("supcon_loss needs at least 2 samples in the global batch when include_self=False")
    if ref is not None:
        assert ref_labels is not None
        k = torch.cat([k, ref])
        all_labels = torch.cat([all_labels, ref_labels.long()])
    uniq, ids = torch.unique(all_labels, return_inverse=True)
    ids = ids.reshape(-1)
    spec = CoreSpec(exclude_self=not include_self, self_pairs=True, offset=offset,
                    row_labels=ids[offset:offset + embeddings.shape[0]], col_labels=ids,
                    num_classes=int(uniq.numel()), pos_mode=positives, normalize=normalize)
    return _run(embeddings, k, scale, spec, reduction, grad_scale, block_size, group,
                ring_sizes=sizes if strategy == "ring" else None, widths=widths)


@same_call_across_ranks
def nt_xent_loss(z1: Tensor, z2: Tensor, *, temperature: Scalar = 0.07, normalize: bool = True,
                 reduction: str = "mean", grad_scale: str = "ddp", strategy: str = "all_gather",
                group: Any = None,
                 block_size: Optional[int] = None, decoupled: bool = False,
                 weighting: Optional[str] = None, sigma: float = 0.5,
                 estimator: str = "standard", tau_plus: float = 0.1, beta: float = 1.0) -> Tensor:
    """:func:`flashcl.nt_xent_loss` over the global batch: every view of every rank is
    a negative; ``z1[i]`` and ``z2[i]`` of the same rank are a pair.

    Shape:
        - z1, z2: (N_rank, D)
        - output: scalar, or (2 N_rank,) with ``reduction="none"`` (rows of z1, then z2)

    Examples::

        >>> loss = flashcl.distributed.nt_xent_loss(view1, view2, temperature=0.5)  # doctest: +SKIP
    """
    z1, z2 = checks.validate_pair(z1, z2, "z1", "z2")
    checks.Options(normalize, reduction, "auto", block_size)
    _check(grad_scale, strategy)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", z1.device, compute_dtype(z1.dtype))
    n = z1.shape[0]
    checks.check_bool(decoupled, "decoupled")
    checks.check_choice(estimator, "estimator", ("standard", "debiased", "hard"))
    if estimator != "standard":
        if decoupled:
            raise ValueError("the debiased and hard estimators reweigh the negatives of the standard denominator: "
                             "use them with decoupled=False")
        if strategy == "ring":
            raise ValueError("nt_xent_loss with an estimator across processes takes strategy='all_gather'")
        return _estimator(z1, z2, scale, normalize, reduction, grad_scale, block_size, group, float(tau_plus),
                          0.0 if estimator == "debiased" else float(beta))
    if decoupled:
        return _decoupled(z1, z2, scale, normalize, reduction, grad_scale, block_size, group, strategy, weighting,
                          sigma)
    pair_offset = sum(_sizes(n, z1.device, group)[:_world(group)[0]])
    ids = (torch.arange(n, device=z1.device) + pair_offset).repeat(2)
    return _supcon_core(torch.cat([z1, z2]), ids, scale, "sum", False, normalize, reduction, grad_scale,
                        block_size, group, strategy)


def _estimator(z1: Tensor, z2: Tensor, scale: Tensor, normalize: bool, reduction: str, grad_scale: str,
               block_size: Optional[int], group: Any, tau_plus: float, beta: float) -> Tensor:
    """The debiased / hard-negative estimators over the global batch: each rank's
    rows ``[z1; z2]`` against every rank's, gathered."""
    n = z1.shape[0]
    z = torch.cat([z1, z2])
    k, offset, sizes = _candidates(z, "all_gather", group)
    n_all = sum(sizes)
    if n_all < 4:
        raise ValueError("the debiased and hard estimators need at least 2 pairs (2 negatives per anchor)")
    partner = (torch.arange(2 * n, device=z.device) + n) % (2 * n) + offset
    head = DebiasedHead(partner, tau_plus, beta, n_all - 2, float(scale.detach()), offset=offset)
    weights = None
    if reduction != "none":
        _, world = _world(group)
        factor = float(world) if grad_scale == "ddp" else 1.0
        w = factor / n_all if reduction == "mean" else factor
        weights = (torch.full((2 * n,), w, dtype=compute_dtype(z.dtype), device=z.device), None)
    return backends.run(z, k, scale, Problem(head, (), normalize, offset), "tiled", weights, block_size)


def _decoupled(z1: Tensor, z2: Tensor, scale: Tensor, normalize: bool, reduction: str, grad_scale: str,
               block_size: Optional[int], group: Any, strategy: str, weighting: Optional[str], sigma: float) -> Tensor:
    """Decoupled NT-Xent (the positive out of the denominator) over the global batch:
    each rank's rows are its ``[z1; z2]``, the columns every rank's, in rank order;
    with ``weighting="vmf"`` the positives' weights from a softmax over every rank's pairs."""
    n = z1.shape[0]
    z = torch.cat([z1, z2])
    k, offset, sizes = _candidates(z, strategy, group)
    if sum(sizes) < 4:
        raise ValueError("decoupled=True needs at least 2 pairs in the global batch: with one pair the denominator "
                         "without the positive is empty (the loss would be -inf)")
    partner = ((torch.arange(2 * n, device=z.device) + n) % (2 * n) + offset).unsqueeze(1)
    weight = None
    if weighting == "vmf":
        from .dispatch import unit_rows

        with torch.no_grad():
            sim = (unit_rows(z1.detach(), True) * unit_rows(z2.detach(), True)).sum(1) / sigma
            every = _all_gather_plain(sim, group)
            w = 2.0 - every.shape[0] * torch.exp(sim - torch.logsumexp(every, dim=0))
        weight = torch.cat([w, w]).to(compute_dtype(z.dtype))
    spec = CoreSpec(exclude_self=True, self_pairs=True, offset=offset, index=partner, pos_mode="sum",
                    normalize=normalize, exclude=Exclusions(index=partner), positive_weight=weight)
    return _run(z, k, scale, spec, reduction, grad_scale, block_size, group,
                ring_sizes=sizes if strategy == "ring" else None)


@same_call_across_ranks
def info_nce_loss(query: Tensor, keys: Tensor, positive_index: Optional[Tensor] = None, *,
                  temperature: Scalar = 0.05, normalize: bool = True, reduction: str = "mean",
                  grad_scale: str = "ddp", strategy: str = "all_gather",
                  group: Any = None, block_size: Optional[int] = None, negatives: Optional[Tensor] = None,
                  in_batch_negatives: bool = True,
                  matryoshka_dims: Optional[Any] = None, matryoshka_weights: Optional[Any] = None,
                  query_labels: Optional[Tensor] = None, key_labels: Optional[Tensor] = None,
                  duplicates: str = "mask") -> Tensor:
    """:func:`flashcl.info_nce_loss` over the global batch: each query is scored
    against the keys of every rank; ``positive_index`` indexes this rank's keys.

    Shape:
        - query: (B_rank, D); keys: (N_rank, D); positive_index: (B_rank,) into this rank's keys
        - output: scalar, or (B_rank,) with ``reduction="none"``

    Examples::

        >>> loss = flashcl.distributed.info_nce_loss(q_local, docs_local)  # doctest: +SKIP
    """
    index = checks.validate_info_nce(query, keys, positive_index)
    checks.Options(normalize, reduction, "auto", block_size)
    _check(grad_scale, strategy)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", query.device, compute_dtype(query.dtype))
    checks.check_bool(in_batch_negatives, "in_batch_negatives")
    if negatives is not None and (matryoshka_dims is not None or matryoshka_weights is not None):
        raise ValueError("matryoshka_dims does not combine with negatives (keys without gradient)")
    if not in_batch_negatives and (query_labels is not None or key_labels is not None):
        raise ValueError("in_batch_negatives=False takes no labels (each query's keys are its positive only)")
    if not in_batch_negatives:
        # MoCo: each query against its own positive and the shared negatives only; the
        # ranks meet in the reduction
        from .info_nce import info_nce_loss as local_info_nce

        rows = local_info_nce(query, keys, positive_index, temperature=temperature, normalize=normalize,
                              reduction="none", negatives=negatives, in_batch_negatives=False, block_size=block_size)
        return reduce_across(rows, torch.ones_like(rows), reduction, grad_scale, group)
    if negatives is not None and strategy == "ring":
        raise ValueError("info_nce_loss with negatives across processes takes strategy='all_gather'")
    k, offset, sizes = _candidates(keys, strategy, group)
    if negatives is not None:  # the shared negatives: further columns after every rank's keys
        from .dispatch import check_keys

        k = torch.cat([k, check_keys(negatives, "negatives", query).detach()])
    if (query_labels is None) != (key_labels is None):
        raise ValueError("query_labels and key_labels go together: pass both or neither")
    checks.check_choice(duplicates, "duplicates", ("mask", "positive"))
    all_key_labels = None
    if query_labels is not None:
        if strategy == "ring":
            raise ValueError("info_nce_loss with labels across processes takes strategy='all_gather'")
        _, query_labels = checks.validate_labelled(query, query_labels, names=("query", "query_labels"))
        _, key_labels = checks.validate_labelled(keys, key_labels, names=("keys", "key_labels"))
        all_key_labels = _all_gather_plain(key_labels.long(), group)
        if negatives is not None:  # the shared negatives take a label no query has
            fresh = torch.full((negatives.shape[0],), int(torch.cat([query_labels.long(), all_key_labels]).max()) + 1,
                               dtype=torch.long, device=query.device)
            all_key_labels = torch.cat([all_key_labels, fresh])
    from .info_nce import info_nce_spec

    spec = info_nce_spec(index.long() + offset, normalize, query_labels, all_key_labels, duplicates)
    widths = None if matryoshka_dims is None and matryoshka_weights is None else (matryoshka_dims, matryoshka_weights)
    return _run(query, k, scale, spec, reduction, grad_scale, block_size, group,
                ring_sizes=sizes if strategy == "ring" else None, widths=widths)


def reduce_across(rows: Tensor, valid: Tensor, reduction: str, grad_scale: str, group: Any) -> Tensor:
    """Local per-row losses reduced over the global batch (the ``grad_scale`` convention)."""
    if reduction == "none":
        return rows
    _, world = _world(group)
    factor = float(world) if grad_scale == "ddp" else 1.0
    if reduction == "sum":
        return factor * (rows * valid).sum()
    total = _global_count(valid.sum().reshape(1).to(rows.dtype), group).clamp_min(1)
    return (factor / total[0]) * (rows * valid).sum()


@same_call_across_ranks
def clip_loss(image_embeds: Tensor, text_embeds: Tensor, logit_scale: Scalar, *, normalize: bool = True,
              reduction: str = "mean", grad_scale: str = "ddp", strategy: str = "all_gather",
                group: Any = None,
              block_size: Optional[int] = None, labels: Optional[Tensor] = None,
              logit_bias: Optional[Scalar] = None) -> Tensor:
    """:func:`flashcl.clip_loss` over the global batch: both directions against
    the image and text towers of every rank (open_clip's ``gather_with_grad=True``,
    ``local_loss=True`` arrangement, exact).

    Shape:
        - image_embeds, text_embeds: (B_rank, D)
        - output: scalar, or (B_rank,) with ``reduction="none"``

    Examples::

        >>> loss = flashcl.distributed.clip_loss(img_local, txt_local, model.logit_scale.exp())  # doctest: +SKIP
    """
    image_embeds, text_embeds = checks.validate_pair(image_embeds, text_embeds, "image_embeds", "text_embeds")
    checks.Options(normalize, reduction, "auto", block_size)
    _check(grad_scale, strategy)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device,
                                      compute_dtype(image_embeds.dtype))
    bias = None if logit_bias is None else checks.check_real_scalar(logit_bias, "logit_bias", image_embeds.device,
                                                                    compute_dtype(image_embeds.dtype))
    all_text, offset, sizes = _candidates(text_embeds, strategy, group)
    all_image, _, _ = _candidates(image_embeds, strategy, group)
    ring = sizes if strategy == "ring" else None
    b = image_embeds.shape[0]
    if labels is None:
        index = (torch.arange(b, device=image_embeds.device) + offset).unsqueeze(1)
        spec = CoreSpec(index=index, pos_mode="sum", normalize=normalize)
    else:  # every same-label pair of the global batch, the mean over them, in both directions
        _, labels = checks.validate_labelled(image_embeds, labels, names=("image_embeds", "labels"))
        (ids,), num_classes = class_ids(_all_gather_plain(labels.long(), group))
        spec = CoreSpec(row_labels=ids[offset:offset + b], col_labels=ids, num_classes=num_classes, pos_mode="mean",
                        normalize=normalize)
    if reduction == "none":
        rows = _run(image_embeds, all_text, scale, spec, "none", grad_scale, block_size, group, ring_sizes=ring)
        cols = _run(text_embeds, all_image, scale, spec, "none", grad_scale, block_size, group, ring_sizes=ring)
        loss = 0.5 * (rows + cols)
    else:
        half = torch.full((b,), 0.5, dtype=compute_dtype(image_embeds.dtype), device=image_embeds.device)
        loss = (_run(image_embeds, all_text, scale, spec, reduction, grad_scale, block_size, group, half, ring)
                + _run(text_embeds, all_image, scale, spec, reduction, grad_scale, block_size, group, half, ring))
    if bias is not None and bias.requires_grad:
        loss = loss + 0.0 * bias  # a constant shift of every logit: its gradient is exactly 0, as the formula's
    return loss


@same_call_across_ranks
def siglip_loss(image_embeds: Tensor, text_embeds: Tensor, logit_scale: Scalar, logit_bias: Scalar, *,
                labels: Optional[Tensor] = None, normalize: bool = False, reduction: str = "mean",
                normalize_by: str = "global", grad_scale: str = "ddp", strategy: str = "ring", group: Any = None,
                block_size: Optional[int] = None) -> Tensor:
    """:func:`flashcl.siglip_loss` over the global batch: each rank's images against
    the texts of every rank; image ``i`` and text ``i`` of the same rank are the
    matching pair (or, with ``labels``, every pair of the same label on any rank).

    The texts of the other ranks come round the ring (``strategy="ring"``, the
    default: per-rank memory flat in the world size, as open_clip's neighbour
    exchange) or are gathered (``"all_gather"``).

    Args:
        normalize_by: ``"global"`` (default): the mean over the global batch, SigLIP's
            loss; ``"local"``: each rank's sum over its own images divided by its own
            batch size, as open_clip's ``SigLipLoss`` computes it on each rank. With
            equal batches the two agree; with ``grad_scale="ddp"`` and equal batches,
            or ``normalize_by="local", grad_scale="sum"`` for any batches, each rank's
            value and gradients equal open_clip's ``SigLipLoss(rank=..., world_size=...)``.
        grad_scale, group, block_size: as the other distributed losses (module docstring).
        other arguments: as :func:`flashcl.siglip_loss`.

    Shape:
        - image_embeds, text_embeds: (B_rank, D); labels: (B_rank,)
        - output: scalar, or (B_rank,) with ``reduction="none"``

    Examples::

        >>> loss = flashcl.distributed.siglip_loss(img_local, txt_local, scale, bias)  # doctest: +SKIP
    """
    image_embeds, text_embeds = checks.validate_pair(image_embeds, text_embeds, "image_embeds", "text_embeds")
    checks.Options(normalize, reduction, "auto", block_size)
    checks.check_choice(normalize_by, "normalize_by", ("global", "local"))
    _check(grad_scale, strategy)
    dtype = compute_dtype(image_embeds.dtype)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device, dtype)
    bias = checks.check_real_scalar(logit_bias, "logit_bias", image_embeds.device, dtype)
    if labels is not None:
        _, labels = checks.validate_labelled(image_embeds, labels, names=("image_embeds", "labels"))
        labels = labels.long()
    rank, world = _world(group)
    texts, offset, sizes = _candidates(text_embeds, strategy, group)
    b = image_embeds.shape[0]
    all_labels = None if labels is None else _all_gather_plain(labels, group)
    problem = siglip_problem(b, sum(sizes), labels, image_embeds.device, dtype, float(bias.detach()), normalize,
                             offset=offset, col_labels=all_labels)
    weights = None
    if reduction != "none":
        factor = float(world) if grad_scale == "ddp" else 1.0
        count = 1.0
        if reduction == "mean":
            count = float(sum(sizes)) if normalize_by == "global" else float(b)
        weights = (torch.full((b,), factor / count, dtype=dtype, device=image_embeds.device), None)
    if strategy == "all_gather":
        return backends.run(image_embeds, texts, scale, problem, "tiled", weights, block_size, param=bias)
    ring = RingDriver(sizes, group)
    block = block_size or auto_block(b, max(sizes), dtype, self_contrast=True)
    return engine.run(image_embeds, texts, scale, ring.local_problem(problem), ring, weights, block, param=bias)


# ----------------------------------------------------------------------------- ring
