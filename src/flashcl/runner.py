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
  :func:`flashcl.runner.resolve` (round the ring only the tiled core);
* Matryoshka (every prefix width in one pass);
* the reduction over the global batch: ``"mean"`` over every rank's valid rows, the
  ``grad_scale`` factor (1 for a world of one);
* float32 accumulation for half inputs and autocast off.

Every loss is one configuration of the masked-softmax core of
:mod:`flashcl.core`::

    loss_i = c_i * LSE_{j in Den(i)} s_ij  -  a_i * sum_{j in Pos(i)} m_ij * s_ij

Backends (argument ``backend``):

* ``"reference"``: per-anchor loops, as a loss is first written by hand. Slow; the tests' oracle.
* ``"dense"``: vectorised, materialises the M x N score matrix.
* ``"tiled"``: blocks of rows, O((M + N) D + block x N) memory, exact.
* ``"triton"``: the tiled algorithm in Triton kernels (CUDA; on a CPU only
  under Triton's interpreter, ``TRITON_INTERPRET=1``, for tests).
* ``"auto"``: ``"triton"`` for CUDA tensors when Triton is importable, the
  dtype is float32/float16/bfloat16 and the embedding at most
  :data:`flashcl.runner.AUTO_TRITON_MAX_WIDTH` (256) wide (half precision: at least
  :data:`flashcl.triton.HALF_MIN_WIDTH`, 64); else ``"tiled"``
  (on CUDA in half precision: stripes of tensor-core GEMMs) when the score
  matrix has at least :data:`AUTO_TILED_MIN_ENTRIES` entries (M x N),
  ``"dense"`` below; the neighbour loss, whose score matrix is given, always
  uses ``"tiled"`` (it allocates nothing of the matrix's size but the gradient
  itself).

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

import importlib.util
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import checks, reference
from .core import CoreSpec, Exclusions, compute_dtype
from .engine import engine, matryoshka
from .engine.engine import Driver, Problem, ReduceWeights, autocast_off, normalize_rows
from .engine.heads import SoftmaxHead, SoftplusHead, kernel_of
from .engine.panels import UpperPanels
from .engine.positives import (
    Positives,
    PositiveTerm,
    column_spec,
    positives,
    row_weights,
    single_positives,
    valid_rows,
)
from .engine.stripes import Stripes
from .engine.tiled import RowBlocks
from .triton import DTYPES as TRITON_DTYPES
from .triton import HALF_MIN_WIDTH as TRITON_HALF_MIN_WIDTH

__all__ = [
    "Source",
    "local",
    "run",
    "run_both_ways",
    "reduce",
    "share",
    "share_count",
    "reduce_total",
    "run_core",
    "matryoshka_core",
    "AUTO_TILED_MIN_ENTRIES",
    "AUTO_TRITON_MAX_WIDTH",
    "resolve",
    "pick",
    "pick_name",
    "driver",
    "run_problem",
    "auto_block",
]


@dataclass
class Source:
    """The candidates a call scores its anchor rows against; this class: one process
    (a world of one). :class:`flashcl.distributed.Columns` is the same across
    processes.

    Attributes:
        keys: the candidates' rows (the anchors themselves when ``own``).
        offset: the anchors' first column in the global order (0 for one process).
        sizes: each rank's block size (one block for one process).
        ring: the blocks travel round the ranks (strategy ``"ring"``).
        group: the process group; None for one process.
        shared: the number of shared keys (a queue) at the end of rank 0's block.
        own: the keys are the anchor rows themselves (self-contrast: the drivers
            visit the symmetric upper panels).
    """

    keys: Tensor
    offset: int
    sizes: List[int]
    ring: bool = False
    group: Any = None
    shared: int = 0
    own: bool = False

    @property
    def total(self) -> int:
        """Columns of the global score matrix."""
        return sum(self.sizes)

    def class_ids(self, labels: Tensor, shared: Optional[Tensor] = None) -> Tuple[Tensor, int]:
        """Dense class ids (from 0) of every column's label (:meth:`gather` of the
        labels, ``shared``: the shared keys'), and the number of classes."""
        uniq, ids = torch.unique(self.gather(labels, shared), return_inverse=True)
        return ids.reshape(-1), int(uniq.numel())

    def gather(self, x: Tensor, shared: Optional[Tensor] = None) -> Tensor:
        """Per-column rows of ``x`` (one per key of this block; no gradient: labels,
        a guide's embeddings) in the columns' order; ``shared``: those of the shared
        keys."""
        if (shared is None) != (self.shared == 0) or (shared is not None and shared.shape[0] != self.shared):
            raise ValueError("the shared keys' rows must come with the shared keys")
        return x.detach() if shared is None else torch.cat([x.detach(), shared.to(x.dtype)])

    def narrow(self, width: int) -> Source:
        """The same columns with the keys' first ``width`` coordinates (Matryoshka)."""
        return replace(self, keys=self.keys[:, :width])

    def run(
        self,
        q: Tensor,
        scale: Tensor,
        problem: Problem,
        weights: Any,
        block_size: Optional[int],
        params: Sequence[Tensor] = (),
        backend: str = "tiled",
    ) -> Tensor:
        """``problem``'s losses of the rows ``q`` against these columns on ``backend``."""
        return run_problem(q, None if self.own else self.keys, scale, problem, backend, weights, block_size, params)

    def count(self, n: Tensor) -> Tensor:
        """``n`` summed over the ranks (a world of one: ``n``)."""
        return n

    def rows_of_every_rank(self, x: Tensor) -> Tensor:
        """Every rank's rows of ``x`` in rank order, without gradient (a world of one: ``x``)."""
        return x.detach()

    def factor(self, grad_scale: str) -> float:
        """The factor each rank's share is returned with (``grad_scale``); 1 for one process."""
        return 1.0


def local(keys: Tensor, shared: Optional[Tensor] = None, own: bool = False) -> Source:
    """One process's source: ``keys`` (``own``: the anchors themselves), then
    ``shared`` keys without gradient."""
    if shared is None:
        return Source(keys, 0, [keys.shape[0]], own=own)
    joined = torch.cat([keys, shared.detach().to(keys.dtype)])
    return Source(joined, 0, [joined.shape[0]], shared=shared.shape[0])


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


def problem_of(
    spec: CoreSpec, m: int, n: int, dtype: torch.dtype, pivots: bool = True, across: bool = False
) -> Problem:
    """The engine's form: a :class:`~flashcl.engine.heads.SoftmaxHead` with the LSE weights
    ``c`` and the positive term ``-a_i sum_j m_ij s_ij`` (for ``both_directions``, the
    column direction's positive term too: ``-s_jj``, or with labels the mean of
    column ``j``'s same-label scores). With ``pivots``, a row's one positive column is
    taken into the head (:func:`~flashcl.engine.positives.single_positives`; ``across``:
    the call spans processes, where every rank must decide alike)."""
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
    problem = problem_of(spec, m, n, dtype, pivots=False)
    name = pick_name(
        opts.backend,
        ENGINE_BACKENDS,
        m * n,
        q,
        "this loss",
        source=source,
        kernel=kernel_of(problem.head) if widths is None else None,
    )
    if widths is None and name in ("dense", "tiled", "triton"):
        # the positives a head takes in (a tiny loss's precision), where its backend computes them: the
        # Triton kernels leave out the rows' pivots, not the columns' (CLIP's one-process pass stays as it was)
        with_pivots = problem_of(spec, m, n, dtype, across=source.group is not None)
        if name != "triton" or kernel_of(with_pivots.head) is not None:
            problem = with_pivots
    weights = _scalar_weights(spec, problem, m, opts, source, dtype, q.device, valid_weight)
    if widths is not None:
        ds, ws = matryoshka.check_dims(widths[0], widths[1], q.shape[-1])
        if name == "triton":
            raise ValueError(
                "matryoshka_dims has no Triton kernel: use backend='tiled' (one pass over every width) or 'auto'"
            )
        if name == "tiled" and not source.ring:
            return _matryoshka_pass(q, k, scale, spec, problem, ds, ws, weights, opts.block_size)
        parts = [w * run(q[:, :d], source.narrow(d), scale, spec, opts, valid_weight) for d, w in zip(ds, ws)]
        return torch.stack(parts).sum(0)
    col: Optional[Tensor] = None
    if name != "reference":
        out = source.run(q, scale, problem, weights, opts.block_size, backend=name)
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


def matryoshka_core(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    spec: CoreSpec,
    dims: Sequence[int],
    weights: Optional[Sequence[float]] = None,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
) -> Tensor:
    """:func:`run_core` at every prefix width ``dims`` (Matryoshka)."""
    return run_core(q, k, scale, spec, reduction, backend, block_size, dims, weights)


def _matryoshka_pass(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    spec: CoreSpec,
    problem: Problem,
    ds: List[int],
    ws: List[float],
    weights: Optional[Tuple[Tensor, Optional[Tensor]]],
    block_size: Optional[int],
) -> Tensor:
    """The tiled backend at every width in one pass over per-segment partial scores
    (:mod:`flashcl.engine.matryoshka`); ``weights``: a scalar reduction's ``(r, u)``
    (None: per-row losses)."""
    m, dtype = q.shape[0], compute_dtype(q.dtype)
    with autocast_off(q.device.type):
        qc = q.to(dtype)
        kc = None if k is None else k.to(dtype)
        aq = matryoshka.prefix_scales(qc, ds, spec.normalize)
        ak = aq if kc is None else matryoshka.prefix_scales(kc, ds, spec.normalize)
        sc = scale.to(dtype)
        if weights is not None and not problem.head.has_columns:
            # a scalar: the heads' weighted rows in one call (its gradient formed in the
            # same pass), then each width's positive terms
            per_width = torch.tensor(ws, dtype=dtype, device=q.device).unsqueeze(1) * weights[0].unsqueeze(0)
            out = matryoshka.head_values(qc, kc, aq, ak, scale, problem, ds, block_size, per_width)
            zeros = torch.zeros(m, dtype=dtype, device=q.device)
            for i, d in enumerate(ds):
                rows, _ = matryoshka.linear_terms(qc, kc, aq, ak, sc, problem, i, d, zeros, None)
                out = out + (per_width[i] * rows).sum()
            return out
        values = matryoshka.head_values(qc, kc, aq, ak, scale, problem, ds, block_size)
        total: Optional[Tensor] = None
        for i, (d, w) in enumerate(zip(ds, ws)):
            cols = values[i, m:] if problem.head.has_columns else None
            rows, cols = matryoshka.linear_terms(qc, kc, aq, ak, sc, problem, i, d, values[i, :m], cols)
            if weights is None:
                part = rows if cols is None else 0.5 * (rows + cols)
            else:
                part = (weights[0] * rows).sum()
                if cols is not None and weights[1] is not None:
                    part = part + (weights[1] * cols).sum()
            total = w * part if total is None else total + w * part
    assert total is not None
    return total


#: ``backend="auto"`` switches from dense to tiled at this many score-matrix
#: entries (M x N). Measured on the 2-core CPU (``flashcl bench --suite simcse``,
#: D = 768): at B = 256 both took 4.7-4.8 ms; at B = 1024 (2^20 entries) tiled
#: took 33 ms and dense 59 ms, and above that tiled's memory stays O(B).
AUTO_TILED_MIN_ENTRIES = 1 << 20


#: On CUDA, ``auto`` takes the Triton kernels up to this embedding width and the
#: tiled backend's stripes of cuBLAS GEMMs above it (half precision narrower than
#: :data:`flashcl.triton.HALF_MIN_WIDTH`: the stripes too). Measured on an H200,
#: bfloat16, B = 32,768 (``flashcl bench --suite gpu --device cuda``,
#: docs/bench/gpu-report.md), forward + backward: at D = 256 the kernels took 18-22 ms
#: (SupCon, InfoNCE, CLIP, SigLIP) and the stripes 43-69 ms; at D = 768 the kernels
#: 78-102 ms and the stripes 50-76 ms; at D = 1024 and 4096 the stripes won by 2-20x.
AUTO_TRITON_MAX_WIDTH = 256


def resolve(
    backend: str,
    entries: int,
    device: torch.device,
    dtype: torch.dtype,
    width: int = 0,
    kernel: Optional[str] = "softmax",
) -> str:
    """The backend ``"auto"`` stands for: ``"triton"`` for CUDA tensors when Triton is
    importable, the head has kernels (``kernel``), the dtype is one they take and the
    embedding at most :data:`AUTO_TRITON_MAX_WIDTH` wide (and, in half precision, at least
    :data:`flashcl.triton.HALF_MIN_WIDTH`); else ``"tiled"`` from
    :data:`AUTO_TILED_MIN_ENTRIES` score entries, ``"dense"`` below. Any other name
    is returned as is."""
    if backend != "auto":
        return backend
    if (
        device.type == "cuda"
        and kernel is not None
        and dtype in TRITON_DTYPES
        and width <= AUTO_TRITON_MAX_WIDTH
        and (dtype == torch.float32 or width >= TRITON_HALF_MIN_WIDTH)
        and importlib.util.find_spec("triton") is not None
    ):
        return "triton"
    return "tiled" if entries >= AUTO_TILED_MIN_ENTRIES else "dense"


#: the backends the engine's problems run on (:func:`run`)
ENGINE_BACKENDS = ("reference", "dense", "tiled", "triton")

#: ``kernel`` of :func:`pick_name` left out: the softmax kernels where the family has ``"triton"``
_FROM_NAMES = "from names"


def pick_name(
    backend: str,
    names: Sequence[str],
    entries: int,
    x: Optional[Tensor],
    family: str,
    auto: Optional[str] = None,
    min_tiled: Optional[int] = None,
    source: Optional[Source] = None,
    kernel: Optional[str] = _FROM_NAMES,
) -> str:
    """The backend among ``names`` (those a family computes with) that ``backend``
    stands for, decided here alone: round the ring (``source.ring``) only the tiled core;
    ``"auto"`` is the family's fixed choice ``auto`` where it has one, else ``"tiled"``
    from ``min_tiled`` entries (the family's own threshold), else :func:`resolve` from
    ``entries`` (the call's score entries) and ``x``'s device, dtype and width, the Triton
    kernels only for a head that has them (``kernel``: ``"softmax"``, ``"softplus"`` or
    None; left out: the softmax kernels where ``names`` has ``"triton"``). A backend the
    family lacks is a ValueError that names those it has."""
    if source is not None and source.ring:
        if backend not in ("auto", "tiled"):
            raise ValueError(
                f"backend={backend!r} with strategy='ring': the blocks travel round the ranks through "
                "the tiled core; pass backend='auto' or 'tiled', or strategy='all_gather'"
            )
        name = "tiled"
    elif backend != "auto":
        name = backend
    elif auto is not None:
        name = auto
    elif (min_tiled is not None and "triton" not in names) or x is None:
        name = "tiled" if entries >= (min_tiled or AUTO_TILED_MIN_ENTRIES) else "dense"
    else:
        if kernel == _FROM_NAMES:
            kernel = "softmax" if "triton" in names else None
        name = resolve(backend, entries, x.device, x.dtype, x.shape[-1], kernel=kernel)
    if name not in names:
        missing = "no Triton kernel" if name == "triton" else f"no {name!r} implementation"
        raise ValueError(f"{family} has {missing}: backend={backend!r}; it takes one of {('auto', *names)}")
    return name


def pick(
    backend: str,
    impls: Mapping[str, Callable[..., Any]],
    entries: int,
    x: Tensor,
    family: str,
    auto: Optional[str] = None,
    min_tiled: Optional[int] = None,
    source: Optional[Source] = None,
    kernel: Optional[str] = _FROM_NAMES,
) -> Callable[..., Any]:
    """A family's implementation for ``backend``: ``impls`` maps the backends the family
    computes with (``"reference"``, ``"dense"``, ``"tiled"``, ``"triton"``) to its
    implementation of each (a family hands its implementations to the runner, which
    picks, resolves ``"auto"`` and refuses what the family lacks, in this one place:
    :func:`pick_name`)."""
    return impls[pick_name(backend, tuple(impls), entries, x, family, auto, min_tiled, source, kernel)]


def _self_contrast(k: Optional[Tensor], problem: Problem) -> bool:
    return k is None and problem.offset == 0 and problem.head.symmetric_tiles


def _stripes(device_type: str, dtype: torch.dtype, self_contrast: bool = False) -> bool:
    """Half precision: the tiled backend's stripes, tensor-core GEMMs on CUDA; elsewhere
    (the GEMMs emulated) for all but the symmetric self-contrast panels. The stripes
    take the embeddings as given and write dQ once in their dtype (InfoNCE in
    bfloat16 at B = 16,384, D = 768 on the 2-core CPU: 64-91 MB beyond the inputs and
    their gradients against the row blocks' 199-207 MB, in about the same time, 2.0-2.1 s
    against 1.9-2.4 s at 8,192); the upper panels compute 2/3 of the products (SupCon
    in bfloat16 at 8,192: 1.5 s against the stripes' 2.6 s)."""
    half = dtype in (torch.float16, torch.bfloat16)
    return half and (device_type == "cuda" or not self_contrast)


def driver(
    name: str, problem: Problem, k: Optional[Tensor], device_type: str, dtype: torch.dtype = torch.float32
) -> Optional[Driver]:
    """The driver for backend ``name`` (None: the dense formula)."""
    if name == "dense":
        return None
    if name == "tiled":
        symmetric = _self_contrast(k, problem)
        if _stripes(device_type, dtype, symmetric):
            return Stripes()
        return UpperPanels(device_type) if symmetric else RowBlocks(device_type)
    if name == "triton":
        from .triton import availability

        ok, why = availability(device_type)
        if not ok:
            raise ValueError(f"backend='triton' is not usable here: {why}")
        from .triton.driver import TritonDriver

        # where the kernels fail on the device: the tiled backend, with a warning (never a crashed step)
        return TritonDriver(problem.head, fallback=driver("tiled", problem, k, device_type, dtype))
    raise ValueError(f"backend {name!r} does not run engine problems")


def auto_block(
    m: int, n: int, dtype: torch.dtype = torch.float32, self_contrast: bool = False, device_type: str = "cpu"
) -> int:
    """Rows per block, from measurements on the 2-core CPU at B = 8192, D = 768.

    Self-contrast (SupCon, NT-Xent: the symmetric upper-panel path): buffers
    near 8 MB, at least 128 rows. Its GEMM work is already two thirds of the
    unsymmetric path's, 256-row panels ran as fast as 512 (0.82-0.94x of the
    three-GEMM bound) with half the buffer memory.
    Otherwise (CLIP, InfoNCE): buffers near 16 MB, at least 256 rows: the block
    GEMMs (inner dimension = block rows for ``G^T Q_blk``) lose ~30% of their
    speed at 256 rows and CLIP went from ~1.65x to ~1.4x of the bound at 512.
    On CUDA the stripes' GEMMs want many rows and device memory is large: 256 MB
    of score buffer per stripe, at least 64 rows (at a million keys: 64 rows, 384 MB
    with the stripe's ``G''``, beside the keys' 3 GB gradient accumulator at D = 768;
    provisional: not yet timed on a GPU).
    """
    if device_type == "cuda":
        budget, floor = 256 * 2**20, 64
    else:
        budget, floor = (8 * 2**20, 128) if self_contrast else (16 * 2**20, 256)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = max(budget // max(1, n * itemsize), floor)
    return int(max(1, min(m, rows)))


def run_problem(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    problem: Problem,
    name: str,
    reduce_weights: ReduceWeights,
    block_size: Optional[int],
    params: Sequence[Tensor] = (),
) -> Tensor:
    """:func:`flashcl.engine.run` with backend ``name``'s driver; ``block_size=None``
    picks the rows per block (:func:`flashcl.runner.auto_block`); ``params``: the
    head's learnable tensors, if it has any."""
    m = q.shape[0]
    n = m if k is None else k.shape[0]
    chosen = driver(name, problem, k, q.device.type, q.dtype)
    block = block_size or auto_block(
        m, n, compute_dtype(q.dtype), self_contrast=isinstance(chosen, UpperPanels), device_type=q.device.type
    )
    return engine.run(q, k, scale, problem, chosen, reduce_weights, block, params)


def row_lse(
    q: Tensor,
    source: Source,
    scale: Tensor,
    normalize: bool,
    name: str,
    block_size: Optional[int],
    exclude: Optional[Exclusions] = None,
    exclude_self: bool = False,
) -> Tensor:
    """Each row's logsumexp over the columns of ``source`` (``exclude``, and with
    ``exclude_self`` each row's own column, left out), (M,), differentiable: one part
    of a loss composed of several candidate sets, on backend ``name``."""
    ones = torch.ones(q.shape[0], dtype=compute_dtype(q.dtype), device=q.device)
    head = SoftmaxHead(ones, exclude_self=exclude_self, offset=source.offset, exclude=exclude)
    return source.run(q, scale, Problem(head, (), normalize, source.offset), None, block_size, backend=name)


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
