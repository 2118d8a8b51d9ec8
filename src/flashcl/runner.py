"""The one runner of the core losses: a call's anchor rows against its column
source, on the backend it asks for, reduced.

A loss forms its anchor rows and a :class:`Source`: the candidates it scores them
against. One process is a world of one: the source holds this process's block (or,
for self-contrast, the anchors themselves) and makes no collective;
:func:`flashcl.distributed.columns` gives, with a process group, every rank's block
(gathered with its gradient, or visited round the ring) and the shared keys once.
The loss then writes ONE body in global coordinates (its anchors' first column is
the source's ``offset``) and :func:`run` does the rest for every scale:

* the backend: ``"reference"`` (the oracle's loops on the source's keys),
  ``"dense"``, ``"tiled"``, ``"triton"``, ``"auto"`` resolved by
  :func:`flashcl.backends.resolve` (round the ring only the tiled core);
* Matryoshka (every prefix width in one pass);
* the reduction over the global batch: ``"mean"`` over every rank's valid rows, the
  ``grad_scale`` factor (1 for a world of one);
* float32 accumulation for half inputs and autocast off.

Every loss is one configuration of the masked-softmax core of
:mod:`flashcl.core`::

    loss_i = c_i * LSE_{j in Den(i)} s_ij  -  a_i * sum_{j in Pos(i)} m_ij * s_ij

The backends (argument ``backend``), which one ``"auto"`` stands for, their drivers
and block sizes: :mod:`flashcl.backends`.

Inputs in float16/bfloat16 are computed with float32 accumulation and the loss
is returned in float32; gradients come back in the input's dtype. A 0-dim
temperature (or logit scale) in a lower precision than the embeddings is
promoted to theirs; its gradient comes back in its own dtype.

Under ``torch.autocast`` the losses run with autocast disabled, in the dtype of
the embeddings they are given (float32 accumulation for half precision), as
torch's own losses do; call ``backward()`` after the autocast region, as torch
recommends (flashcl's own backward passes run without autocast either way).

Second derivatives (``backward(create_graph=True)``: gradient penalties,
Hessian-vector products) are exact on every backend: the tiled and triton
backends compute them through the dense formula, whose memory is O(M N) on that
path only. :mod:`flashcl.distributed` raises a clear error instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import checks, reference
from .backends import ENGINE_BACKENDS, Source, local, pick_name
from .core import CoreSpec, Exclusions, Tile, compute_dtype
from .engine import matryoshka
from .engine.engine import Problem, autocast_off, normalize_rows
from .engine.heads import KernelId, SoftmaxHead, SoftplusHead
from .engine.positives import (
    Positives,
    PositiveTerm,
    column_spec,
    positives,
    row_weights,
    single_positives,
    valid_rows,
)

__all__ = [
    "run",
    "run_both_ways",
    "reduce",
    "share",
    "share_count",
    "reduce_total",
    "run_core",
    "problem_of",
    "row_lse",
    "sigmoid_problem",
    "unit_rows",
]


def _valid(spec: CoreSpec, problem: Problem, m: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The rows a ``"mean"`` counts (:func:`flashcl.engine.positives.valid_rows`), from the
    problem's LSE weights (``pos_mode="mean"``: 1 where a row has a positive), not
    counted again."""
    if spec.pos_mode != "mean":
        return torch.ones(m, dtype=dtype, device=device)  # every row counts
    weight = getattr(problem.head, "row_weight", None)
    if isinstance(weight, Tensor):
        return (weight > 0).to(device=device, dtype=dtype)
    return valid_rows(spec, m).to(device=device, dtype=dtype)


def _scalar_weights(
    spec: CoreSpec,
    problem: Problem,
    m: int,
    opts: checks.Options,
    source: Source,
    dtype: torch.dtype,
    device: torch.device,
    extra: Any,
) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """The weights ``(r, u)`` of a scalar reduction over the global batch: ``"mean"``
    over every rank's valid rows, times the ``grad_scale`` factor; ``extra``: a
    further per-row factor. None for ``reduction="none"``."""
    if opts.reduction == "none":
        return None
    if spec.both_directions:  # one process: CLIP's column direction in the same pass, each half
        full = torch.full((m,), 0.5 / m if opts.reduction == "mean" else 0.5, dtype=dtype, device=device)
        return full, full
    r = share(opts.reduction, opts.grad_scale, source, _valid(spec, problem, m, dtype, device))
    assert r is not None
    return (r if extra is None else r * extra), None


def softmax_kernel(spec: CoreSpec, pivots: bool = False) -> Optional[KernelId]:
    """The Triton kernel of :func:`problem_of`'s head (``pivots``: with the rows' pivots)."""
    return SoftmaxHead.kernel_for(spec.exclude_self, spec.both_directions, spec.self_index, spec.exclude, None, pivots)


def problem_of(
    spec: CoreSpec,
    m: int,
    n: int,
    dtype: torch.dtype,
    pivots: bool = True,
    across: bool = False,
    kernels: bool = False,
) -> Problem:
    """The engine's form: a :class:`~flashcl.engine.heads.SoftmaxHead` with the LSE weights
    ``c`` and the positive term ``-a_i sum_j m_ij s_ij`` (for ``both_directions``, the
    column direction's positive term too: ``-s_jj``, or with labels the mean of
    column ``j``'s same-label scores). With ``pivots``, a row's one positive column is
    taken into the head (:func:`~flashcl.engine.positives.single_positives`; ``across``:
    the call spans processes, where every rank must decide alike); with ``kernels``
    only where the Triton kernels compute the head with them."""
    c, a = row_weights(spec, m, dtype)
    if spec.positive_weight is not None:
        a = a * spec.positive_weight
    terms = [PositiveTerm(positives(spec), a)]
    a_col = None
    if spec.both_directions:
        cols = column_spec(spec)
        a_col = row_weights(cols, n, dtype)[1]
        terms.append(PositiveTerm(positives(cols), a_col, target="col"))
    pivot, col_pivot = single_positives(spec, m, n, a, a_col, across) if pivots else (None, None)
    if kernels and pivot is not None and softmax_kernel(spec, pivots=True) is None:
        pivot = col_pivot = None
    head = SoftmaxHead(
        c,
        exclude_self=spec.exclude_self,
        offset=spec.offset,
        columns=spec.both_directions,
        self_index=spec.self_index,
        exclude=spec.exclude,
        pivot=pivot,
        col_pivot=col_pivot,
    )
    return Problem(head, tuple(terms), spec.normalize, spec.offset)


def run(
    q: Tensor,
    source: Source,
    scale: Tensor,
    spec: CoreSpec,
    opts: checks.Options,
    valid_weight: Optional[Tensor] = None,
    widths: Optional[Tuple[Any, Any]] = None,
) -> Tensor:
    """The core (``spec``, in global coordinates) of the rows ``q`` against ``source``,
    reduced over the global batch, on the backend ``opts.backend`` stands for.
    ``widths``: Matryoshka's ``(matryoshka_dims, matryoshka_weights)``: one pass over
    every width (one ring round per width on the ring). ``valid_weight``: a further
    factor on each row's share."""
    m, n = q.shape[0], source.total
    k = None if source.own else source.keys
    dtype = compute_dtype(q.dtype)
    kernel = softmax_kernel(spec) if widths is None else None
    name = pick_name(opts.backend, ENGINE_BACKENDS, m * n, q, "this loss", source=source, kernel=kernel)
    # the positives a head takes in (a tiny loss's precision), where its backend computes them: the
    # Triton kernels leave out the rows' pivots, not the columns' (CLIP's one-process pass stays as it was)
    pivots = widths is None and name in ("dense", "tiled", "triton")
    problem = problem_of(spec, m, n, dtype, pivots, source.group is not None, kernels=name == "triton")
    weights = _scalar_weights(spec, problem, m, opts, source, dtype, q.device, valid_weight)
    if widths is not None:
        ds, ws = checks.check_dims(widths[0], widths[1], q.shape[-1])
        if name == "triton":
            raise ValueError(
                "matryoshka_dims has no Triton kernel: use backend='tiled' (one pass over every width) or 'auto'"
            )
        if name == "tiled" and not source.ring:
            return matryoshka.run_widths(q, k, scale, problem, ds, ws, weights, opts.block_size)
        parts = [w * run(q[:, :d], source.narrow(d), scale, spec, opts, valid_weight) for d, w in zip(ds, ws)]
        return torch.stack(parts).sum(0)
    col: Optional[Tensor] = None
    if name != "reference":
        out = source.run(q, scale, problem, weights, opts.block_size, backend=name)[0]
        if weights is not None or not spec.both_directions:
            return out
        row, col = out[:m], out[m:]
    else:
        with autocast_off(q.device.type):
            row, col = reference.core_loss(q, k, scale, spec)
    if weights is None:  # per row: for both directions the mean of each row's and its column's
        return row if col is None else 0.5 * (row + col)
    r, u = weights
    out = (r * row).sum()
    return out if col is None or u is None else out + (u * col).sum()


def run_both_ways(
    a: Tensor,
    b: Tensor,
    a_source: Source,
    b_source: Source,
    scale: Tensor,
    spec: CoreSpec,
    opts: checks.Options,
    widths: Optional[Tuple[Any, Any]] = None,
) -> Tensor:
    """The core in both directions, each weighing half (CLIP): the rows of ``a``
    against ``b_source`` and the rows of ``b`` against ``a_source``, the positives of
    ``spec`` seen from either side (``spec`` in global coordinates, as from ``a``).
    One process: both directions in one pass over the tiles (the column direction
    of the same scores); across processes: one run per direction."""
    if a_source.group is None and b_source.group is None:
        return run(a, b_source, scale, replace(spec, both_directions=True), opts, widths=widths)
    half = torch.full((a.shape[0],), 0.5, dtype=compute_dtype(a.dtype), device=a.device)
    rows, cols = (run(q, s, scale, spec, opts, half, widths) for q, s in ((a, b_source), (b, a_source)))
    return 0.5 * (rows + cols) if opts.reduction == "none" else rows + cols


def share(
    reduction: str, grad_scale: str, source: Source, valid: Tensor, divisor: Optional[float] = None
) -> Optional[Tensor]:
    """The weights ``r`` of a scalar reduction ``sum_i r_i row_i`` over the global
    batch, for the rows ``valid`` weighs (0: a row without positives): ``"mean"`` over
    every rank's rows with a positive weight (``divisor``: the mean's divisor as
    given), ``"sum"``, each times the ``grad_scale`` factor (1 for one process). None
    for ``"none"``. Every loss's reduction is formed here."""
    if reduction == "none":
        return None
    factor = source.factor(grad_scale)
    if reduction == "sum":
        return valid * factor
    if divisor is None:
        return valid * (factor / source.count((valid > 0).to(valid.dtype).sum().reshape(1)).clamp_min(1)[0])
    return valid * (factor / max(divisor, 1.0))


def share_count(reduction: str, grad_scale: str, source: Source, weights: Tensor, count: int) -> Optional[Tensor]:
    """The weights ``r`` of a scalar reduction ``sum_i r_i row_i`` whose ``"mean"``
    divides by a count of terms that is not the rows' (the pairs of views times the
    rows, or the images), ``count`` this rank's, summed over the ranks; ``weights``:
    each row's own factor. ``"sum"``: the weights; each times the ``grad_scale``
    factor. None for ``"none"``."""
    if reduction == "none":
        return None
    factor = source.factor(grad_scale)
    if reduction == "sum":
        return weights * factor
    return weights * (factor / source.count(weights.new_tensor([float(count)])).clamp_min(1)[0])


def reduce(rows: Tensor, valid: Tensor, reduction: str, grad_scale: str, source: Source) -> Tensor:
    """Per-row losses reduced over the global batch (:func:`share`)."""
    r = share(reduction, grad_scale, source, valid)
    return rows if r is None else (r * rows).sum()


def reduce_total(total: Tensor, count: Tensor, reduction: str, grad_scale: str, source: Source) -> Tensor:
    """A sum ``total`` of this rank's ``count`` terms reduced over the global batch:
    ``"mean"`` over every rank's terms, ``"sum"``; each times the ``grad_scale`` factor."""
    factor = source.factor(grad_scale)
    if reduction == "sum":
        return total * factor
    return total * (factor / source.count(count.reshape(1).to(total.dtype)).clamp_min(1)[0])


def run_core(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    spec: CoreSpec,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
) -> Tensor:
    """The masked-softmax core (:class:`flashcl.core.CoreSpec`) on one process's
    embeddings, reduced: :func:`run` on a world of one. ``k=None`` means the
    candidates are the anchors; ``scale`` is a 0-dim tensor (1 / temperature).

    Args:
        q: (M, D) anchors. k: (N, D) candidates, or None.
        scale: 0-dim floating tensor; a learnable one gets its gradient.
        spec: the core's configuration.
        reduction: ``"mean"`` (over the rows :meth:`CoreSpec.valid_rows` keeps) |
            ``"sum"`` | ``"none"`` (per-row losses; for ``spec.both_directions`` the mean
            of each row's and its column's).
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` | ``"triton"``.
        block_size: rows per block of the tiled backend; None picks one.
        matryoshka_dims, matryoshka_weights: ``sum_m w_m`` of the core at every prefix
            width ``d_m`` of the embeddings (Matryoshka), each width normalised on its
            own; the tiled backend computes every width in one pass.
    """
    if matryoshka_dims is None and matryoshka_weights is not None:
        raise ValueError("matryoshka_weights needs matryoshka_dims")
    opts = checks.Options(spec.normalize, reduction, backend, block_size)
    source = local(q, own=True) if k is None else local(k)
    widths = None if matryoshka_dims is None else (matryoshka_dims, matryoshka_weights)
    return run(q, source, scale, spec, opts, widths=widths)


def row_lse(
    q: Tensor,
    source: Source,
    scale: Tensor,
    normalize: bool,
    name: str,
    block_size: Optional[int],
    exclude: Optional[Exclusions] = None,
    exclude_self: bool = False,
    boost: Optional[Tuple[float, Callable[[Tile], Tensor]]] = None,
) -> Tensor:
    """Each row's logsumexp over the columns of ``source`` (``exclude``, and with
    ``exclude_self`` each row's own column, left out; ``boost``: the softmax head's
    hardness penalty), (M,), differentiable: one part of a loss composed of several
    candidate sets, on backend ``name``."""
    ones = torch.ones(q.shape[0], dtype=compute_dtype(q.dtype), device=q.device)
    head = SoftmaxHead(ones, exclude_self=exclude_self, offset=source.offset, exclude=exclude, boost=boost)
    return source.run(q, scale, Problem(head, (), normalize, source.offset), None, block_size, backend=name)[0]


def sigmoid_problem(
    b: int,
    n: int,
    labels: Optional[Tensor],
    device: torch.device,
    dtype: torch.dtype,
    bias: float,
    normalize: bool,
    offset: int = 0,
    col_labels: Optional[Tensor] = None,
) -> Problem:
    """SigLIP as an engine problem (b image rows, n text columns): the softplus head
    and the positive term. Positives: the diagonal (image ``i`` and text
    ``i + offset``), or, with labels, every pair of the same label (``col_labels``:
    the texts' labels, default ``labels``)."""
    if labels is None:
        pos = Positives(index=(torch.arange(b, device=device) + offset).unsqueeze(1))
    else:
        cols = labels if col_labels is None else col_labels
        uniq, ids = torch.unique(torch.cat([labels, cols]), return_inverse=True)
        pos = Positives(row_labels=ids[:b], col_labels=ids[b:], num_classes=int(uniq.numel()))
    head = SoftplusHead(bias, pos.counts(b, n))
    return Problem(head, (PositiveTerm(pos, torch.ones(b, dtype=dtype, device=device)),), normalize)


def unit_rows(x: Tensor, normalize: bool) -> Tensor:
    x = x.to(compute_dtype(x.dtype))
    return normalize_rows(x) if normalize else x
