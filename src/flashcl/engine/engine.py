"""The tile engine: one autograd Function for every loss and every backend.

A loss is a :class:`Problem`: a :class:`~flashcl.engine.heads.Head` (its nonlinear part
over score tiles) and :class:`~flashcl.engine.positives.PositiveTerm` terms (its positives, in
embedding space). A *driver* visits the tiles of ``s_ij = scale * q^_i . k^_j``
(:mod:`flashcl.engine.tiled`'s row blocks, :mod:`flashcl.engine.panels`'s upper panels,
the Triton kernels, the distributed ring) and hands each one to the head. This
module does what is common to all of them, once:

* casting (float32 accumulation for half precision) and the L2 normalisation,
  with its backward;
* the linear terms and their gradients;
* the reduction (``reduce_weights``): with a scalar loss and a gradient to come,
  the gradient is formed during the forward pass when the driver can (rows that
  are complete in one tile: three GEMMs instead of four) and only scaled in
  backward;
* the second derivatives (``create_graph=True``), through the head's dense
  formula (:func:`dense_values`), and autocast kept out of the computation.

``dense_values`` is also the dense backend: the whole score matrix as one tile,
differentiated by autograd.

Driver protocol (see :class:`Driver`): ``reduce`` visits every tile for one of the
head's reduction passes (the loop over the passes, with ``head.finish`` after each,
is :meth:`Driver.forward`'s, once for every driver); ``rows_fused``, where the driver
can, reduces complete rows and accumulates their gradient in the same visit; ``backward`` recomputes each
tile, turns it into ``dL/ds`` with ``head.grad`` and accumulates
``dq^ += scale G k^``, ``dk^ += scale G^T q^``. Both return
``sum_ij G_ij q^_i . k^_j`` (the scale's gradient).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import compute_dtype
from .heads import Head, PivotHead, ReportingHead, Tile, grad_weight, takes_in, value_weight
from .positives import PositiveTerm, Rows, RowScaled, class_sums, raw_rows, rows_dtype

__all__ = [
    "Problem",
    "Operands",
    "Driver",
    "KernelFailure",
    "EngineFunction",
    "dense_values",
    "run",
    "NORM_EPS",
    "finite_rows",
    "all_finite",
    "scores_product",
    "autocast_off",
    "differentiable_grads",
    "normalize_rows",
    "squared_distance_rows",
    "RowsDone",
    "visit_values",
    "visit_grads",
]


@contextlib.contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """Autocast disabled for ``device_type``: every backend computes in the
    inputs' own dtype (float32 accumulation for half inputs), as torch's own
    losses do under autocast, so that the backends agree with each other and
    with the float64 reference whatever the caller's autocast state."""
    if torch.amp.is_autocast_available(device_type):
        with torch.autocast(device_type, enabled=False):
            yield
    else:
        yield


def differentiable_grads(
    fn: Callable[..., Tensor], inputs: Sequence[Optional[Tensor]], needs: Sequence[bool], grad_out: Tensor
) -> List[Optional[Tensor]]:
    """For the backward of a custom Function run with ``create_graph=True``:
    ``grad_out``-weighted gradients of ``fn(*inputs)`` with respect to the inputs
    that ``needs`` marks, built with a graph so that they can be differentiated
    again (second derivatives, gradient penalties, Hessian-vector products).

    The fast backwards form their gradients without a graph; rather than return
    a gradient whose own derivative would be silently wrong, they hand this path
    a differentiable formula of the same loss (the dense backend's: memory
    O(M N) on this path only)."""
    with torch.enable_grad():
        # one view per slot: when a tensor fills two slots (k is q), each slot's
        # gradient is its own part, as the Function's backward returns it
        inputs = [x.view_as(x) if x is not None else None for x in inputs]
        wrt = [x for x, need in zip(inputs, needs) if need and x is not None]
        out = fn(*inputs)
        grads = list(torch.autograd.grad(out, wrt, grad_out, create_graph=True, allow_unused=True)) if wrt else []
    result: List[Optional[Tensor]] = []
    for x, need in zip(inputs, needs):
        g = grads.pop(0) if need and x is not None else None
        if g is None and need and x is not None:
            g = torch.zeros_like(x)
        result.append(g)
    return result


class _NormalizeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.eps = eps
        return x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(eps)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        # differentiable ops on x: create_graph=True gives exact second derivatives
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        clamped = norms.clamp_min(ctx.eps)
        y = x / clamped
        dot = (grad * y).sum(1, keepdim=True) * (norms > ctx.eps)
        return (grad - y * dot) / clamped, None


def normalize_rows(x: Tensor, eps: float = 1e-12) -> Tensor:
    """``F.normalize(x, dim=1, eps=eps)`` whose backward projects before it divides,
    ``(g - (g . y) y) / |x|`` with ``y = x / |x|``: autograd of ``F.normalize`` forms
    ``g / |x| - x (g . x) / |x|^3``, two terms that cancel only up to rounding, an
    error of ``eps |g| / |x|`` that is large for short rows (a narrow prefix)."""
    return _NormalizeRows.apply(x, eps)


def squared_distance_rows(x: Tensor, y: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Rows whose products are squared distances, so that a loss of distances is a head
    on the engine's scores: ``[-2 x, |x|^2, 1] . [y, 1, |y|^2] = |x - y|^2`` (the
    matrix-product form ``torch.cdist`` takes; ``y=None``: ``x``), zero columns after them up
    to a multiple of 8 (D = 256 lifted to 258 made the CPU's score GEMMs 1.4x slower).
    Differentiable: the norms' gradient is autograd's through the two added columns.
    Returns (the anchors' rows, the candidates')."""
    y = x if y is None else y
    x_norms, y_norms = (x * x).sum(1, keepdim=True), (y * y).sum(1, keepdim=True)
    pad = -(x.shape[1] + 2) % 8
    return (
        torch.cat([-2.0 * x, x_norms, torch.ones_like(x_norms), x.new_zeros(x.shape[0], pad)], 1),
        torch.cat([y, torch.ones_like(y_norms), y_norms, y.new_zeros(y.shape[0], pad)], 1),
    )


class FusedFunction(torch.autograd.Function):
    """The base of flashcl's autograd Functions (the tile engine's, Matryoshka's
    widths, a given score matrix's): its :meth:`backward` owns the rules they share,
    once:

    * a gradient formed during the forward pass (``ctx.grads``) is handed over,
      scaled by ``grad_out``, and dropped (never kept for a second backward);
    * otherwise the subclass's :meth:`recompute` forms it, with autocast off;
    * with ``create_graph=True`` (second derivatives), the gradient comes from the
      subclass's differentiable :meth:`dense` formula of the same output, or a
      RuntimeError says why there is none (:meth:`no_second_derivatives`);
    * each gradient is cast to its input's dtype, and inputs that need none get None.

    A subclass's ``forward`` calls :meth:`setup` with its differentiable inputs (the
    leading arguments of ``apply``, None allowed) and the other saved tensors.
    """

    @staticmethod
    def setup(
        ctx: Any,
        inputs: Sequence[Optional[Tensor]],
        extra: Sequence[Tensor] = (),
        grads: Optional[Sequence[Optional[Tensor]]] = None,
        slots: Optional[Sequence[int]] = None,
    ) -> None:
        """Saves the differentiable ``inputs`` (and ``extra`` tensors for
        :meth:`recompute`); ``grads``: their gradients, formed in the forward pass;
        ``slots``: the inputs' positions among ``apply``'s arguments (default: the
        leading ones)."""
        ctx.n_inputs = len(inputs)
        ctx.slots = list(range(len(inputs))) if slots is None else list(slots)
        ctx.grads = None if grads is None else list(grads)
        ctx.save_for_backward(*inputs, *extra)

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        """The output as a differentiable function of the inputs (create_graph)."""
        raise NotImplementedError

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        """The inputs' gradients by a second visit (autocast off); ``saved``: the
        inputs, then the extra tensors."""
        raise NotImplementedError

    @classmethod
    def no_second_derivatives(cls, ctx: Any) -> Optional[str]:
        """Why this call has no second derivatives (a RuntimeError), or None."""
        return None

    @classmethod
    def backward(cls, ctx: Any, grad_out: Tensor, *non_differentiable: Any):  # type: ignore[override]
        # further outputs (counts) are marked non-differentiable: their gradients are None
        saved = ctx.saved_tensors
        n = ctx.n_inputs
        inputs = saved[:n]
        needs = [ctx.needs_input_grad[i] for i in ctx.slots]
        if torch.is_grad_enabled():  # create_graph=True: a gradient that can be differentiated again
            reason = cls.no_second_derivatives(ctx)
            if reason is not None:
                raise RuntimeError(reason)
            ctx.grads = None
            grads: Sequence[Optional[Tensor]] = differentiable_grads(
                lambda *xs: cls.dense(ctx, *xs), inputs, needs, grad_out
            )
        else:
            if ctx.grads is not None:  # formed by the forward pass; handed over (not copied) the first time
                grads, ctx.grads = ctx.grads, None
                if not bool((grad_out == 1).all()):
                    grads = [None if g is None else g.mul_(grad_out) for g in grads]
            else:
                device = next(x for x in inputs if x is not None).device
                with autocast_off(device.type):
                    grads = cls.recompute(ctx, grad_out, saved)
            grads = [None if g is None or x is None else g.to(x.dtype) for g, x in zip(grads, inputs)]
        out: List[Optional[Tensor]] = [None] * len(ctx.needs_input_grad)
        for slot, g, need in zip(ctx.slots, grads, needs):
            out[slot] = g if need else None
        return tuple(out)


NORM_EPS = 1e-12  # F.normalize's default

ReduceWeights = Optional[Tuple[Tensor, Optional[Tensor]]]


@dataclass(frozen=True, eq=False)
class Problem:
    """One loss on one pair of embedding sets.

    Attributes:
        head: the nonlinear part.
        linears: the linear terms (positives).
        normalize: L2-normalise the rows of q and k first.
        offset: column of anchor 0 (self-contrast on a slice of the candidates).
    """

    head: Head
    linears: Tuple[PositiveTerm, ...] = field(default_factory=tuple)
    normalize: bool = True
    offset: int = 0


@dataclass
class Operands:
    """The prepared inputs of one call: rows normalised (``q``, ``k``; lazily, as
    :class:`~flashcl.engine.positives.RowScaled`, when the driver asks) in the compute dtype,
    their norms, ``same`` (k is q), the scale, ``bound >= max |s_ij|``, the rows
    per block."""

    q: Rows
    k: Rows
    q_norms: Optional[Tensor]
    k_norms: Optional[Tensor]
    same: bool
    scale: float
    bound: float
    block: int
    offset: int = 0
    #: the inputs as given (detached, their own dtype): for drivers that compute
    #: in it (the Triton kernels take half precision as is)
    q_in: Optional[Tensor] = None
    k_in: Optional[Tensor] = None
    _q_grad: Any = None
    _k_grad: Any = None

    @property
    def q_grad(self) -> Rows:
        """q for the gradient GEMMs (``dk += G^T q``): the same rows with non-finite
        entries zeroed (``q`` itself when all are finite; found on first use). An
        entry that a head excludes has ``G_ij = 0``, and ``0 * nan`` would carry a
        NaN key into every row's gradient; where a NaN row is not excluded, ``G_ij``
        is NaN itself."""
        if self._q_grad is None:
            self._q_grad = finite_rows(self.q)
        return self._q_grad

    @property
    def k_grad(self) -> Rows:
        """k for the gradient GEMMs (``dq += G k``); see :attr:`q_grad`."""
        if self._k_grad is None:
            self._k_grad = self.q_grad if self.k is self.q else finite_rows(self.k)
        return self._k_grad

    def form_grad_operands(self) -> None:
        """Forms :attr:`q_grad` and :attr:`k_grad` now."""
        self._q_grad, self._k_grad = self.q_grad, self.k_grad

    @property
    def like(self) -> Tensor:
        """A tensor of the compute dtype on the rows' device (the heads' accumulators are
        made like it): the rows themselves, or, where they are the inputs as given (half
        precision), an empty float32 one."""
        raw = raw_rows(self.q)[0]
        dtype = rows_dtype(self.q)
        return raw if raw.dtype == dtype else raw.new_empty(0, dtype=dtype)


class Driver:
    """Visits the tiles of a problem; see the module docstring.

    Attributes:
        lazy: takes the normalised rows as :class:`~flashcl.engine.positives.RowScaled` views.
        no_second_derivatives: see below.
        class_sums: the per-class row sums the linear terms use (the distributed
            ring adds every rank's).
    """

    lazy = False
    #: multiplies by :attr:`Operands.q_grad` / :attr:`Operands.k_grad`: they are then
    #: formed with the operands, before the driver's buffers (formed later, their
    #: temporaries landed on top of the tile buffers: the CPU allocator then kept
    #: about 50 MB more resident at B = 8192, D = 768)
    uses_grad_operands = False
    class_sums = staticmethod(class_sums)
    #: why this driver's losses have no second derivatives (None: they have, through
    #: the dense formula); raised as a RuntimeError on ``create_graph=True``
    no_second_derivatives: Optional[str] = None
    #: applies a head's :meth:`~flashcl.engine.heads.Head.row_factor` (heads with
    #: ``factored_rows`` run only on such a driver)
    applies_row_factor = False
    #: takes the rows as given, in their own dtype, with float32 inverse norms (a
    #: :class:`~flashcl.engine.positives.RowScaled` of the inputs): no float32 copy of
    #: half-precision embeddings; the driver casts what it multiplies
    raw_inputs = False
    #: each block of rows it visits holds every column, so that a row's gradient is whole
    #: when its block is done: with :class:`RowsDone` as ``dq`` the driver hands each
    #: block's gradient to it (``dq.finish(r0, rows)``) instead of accumulating an M x D
    #: float32 ``dq``
    completes_rows = False

    def num_columns(self, ops: Operands) -> int:
        """Columns of the whole score matrix (more than ``k``'s rows when the other
        columns live elsewhere, as on the distributed ring)."""
        return ops.k.shape[0]

    def bound(self, ops: Operands) -> Optional[float]:
        """A value ``>= max |s_ij|`` over every tile this driver visits, or None."""
        return ops.bound

    def forward(
        self, ops: Operands, head: Head, st: Any, g_row: Optional[Tensor], dq: Optional[Tensor], dk: Optional[Tensor]
    ) -> Optional[Tensor]:
        """Every reduction pass; with ``g_row`` (and dq, dk), also the gradient when the
        driver can form it in the same visit: then returns d scale (else None).

        The pass loop is the engine's, here once for every driver: the rows' fused visit
        (:meth:`rows_fused`) where the head and the driver both offer it, else each of the
        head's :attr:`~flashcl.engine.heads.Head.passes` by :meth:`reduce`, then
        ``head.finish``. A driver whose kernels reduce every pass at once (the Triton
        one) overrides this instead."""
        if head.fuses_rows and self.fuses(ops, head):
            return self.rows_fused(ops, head, st, g_row, dq, dk)
        for p in range(head.passes):
            self.reduce(ops, head, st, p)
            head.finish(st, p)
        return None

    def reduce(self, ops: Operands, head: Head, st: Any, p: int) -> None:
        """Pass ``p`` of the head's reductions: every tile handed to ``head.reduce`` (or
        ``head.reduce_panel``)."""
        raise NotImplementedError

    def fuses(self, ops: Operands, head: Head) -> bool:
        """Whether :meth:`rows_fused` can visit this call (asked only of heads with
        :attr:`~flashcl.engine.heads.Head.fuses_rows`): each row complete in one visit."""
        return False

    def rows_fused(
        self, ops: Operands, head: Head, st: Any, g_row: Optional[Tensor], dq: Any, dk: Optional[Tensor]
    ) -> Optional[Tensor]:
        """One visit of complete rows, each reduced by ``head.rows_fused`` and, with
        ``g_row``, its gradient accumulated into dq, dk: returns d scale (None without
        ``g_row``)."""
        raise NotImplementedError

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        """The head's gradient (``head.begin_grad`` was called), accumulated into dq, dk
        as gradients with respect to the normalised rows; returns
        ``sum_ij G_ij q^_i . k^_j``."""
        raise NotImplementedError

    def release(self) -> None:
        """Drops the buffers kept between the passes of one call (forward and a
        fused gradient share them); called when the forward pass ends."""

    #: the driver that computes the same problem when this one's kernels fail on the
    #: device (:class:`KernelFailure`: a GPU kernel that does not compile or launch);
    #: None: the failure is raised
    fallback: Optional[Driver] = None


class KernelFailure(RuntimeError):
    """A driver's kernels failed to compile or launch on this device (the cause
    chained): the engine computes the call with the driver's :attr:`Driver.fallback`
    instead, with one warning that names the cause."""


_WARNED_FAILURES: set = set()


def _fall_back(driver: Driver, failure: KernelFailure) -> Driver:
    """The driver to use after ``failure`` (one warning per cause and process)."""
    if driver.fallback is None:
        raise failure
    cause = str(failure)
    if cause not in _WARNED_FAILURES:
        _WARNED_FAILURES.add(cause)
        warnings.warn(
            f"flashcl: {type(driver).__name__}'s kernels failed on this device ({cause}); computing with "
            f"{type(driver.fallback).__name__} (the tiled backend) instead",
            RuntimeWarning,
            stacklevel=4,
        )
    return driver.fallback


def _row_norms(x: Tensor, dtype: torch.dtype, block: int = 4096) -> Tensor:
    """Each row's L2 norm in ``dtype``, a block of rows at a time (no copy of ``x`` in it)."""
    out = torch.empty(x.shape[0], dtype=dtype, device=x.device)
    for r0 in range(0, x.shape[0], block):
        out[r0 : r0 + block] = torch.linalg.vector_norm(x[r0 : r0 + block].to(dtype), dim=1)
    return out


def _prepare(
    x: Tensor, normalize: bool, dtype: torch.dtype, lazy: bool, raw: bool = False
) -> Tuple[Rows, Optional[Tensor]]:
    """Cast (never in place) and optionally L2-normalise rows: (rows, norms). ``raw``:
    the rows as given with their inverse norms in ``dtype`` (1 without normalising),
    as a :class:`RowScaled` whose blocks come out in ``dtype``: no copy."""
    if raw:
        x = x.detach()
        if not normalize:
            return RowScaled(x, torch.ones(x.shape[0], dtype=dtype, device=x.device)), None
        norms = _row_norms(x, dtype).clamp_min_(NORM_EPS)
        return RowScaled(x, 1.0 / norms), norms
    x = x.detach().to(dtype)
    if not normalize:
        return x, None
    norms = torch.linalg.vector_norm(x, dim=1).clamp_min(NORM_EPS)
    if lazy:
        return RowScaled(x, 1.0 / norms), norms
    return x / norms.unsqueeze(1), norms


def all_finite(x: Tensor) -> bool:
    """No NaN or infinite entry in ``x``, without a temporary of its size (as
    ``torch.isfinite(x).all()`` makes, or a float64 sum's cast): its smallest and
    largest entries in one reduction, a NaN anywhere making both NaN and an
    infinity one of them."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def finite_rows(rows: Rows) -> Rows:
    """``rows`` with non-finite entries replaced by 0 (a copy), or ``rows`` itself
    when every entry is finite."""
    raw, inv = raw_rows(rows)
    if all_finite(raw) and (inv is None or all_finite(inv)):
        return rows
    clean = torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0)
    if inv is None:
        return clean
    return RowScaled(clean, torch.nan_to_num(inv, nan=0.0, posinf=0.0, neginf=0.0))


class _FiniteGradProduct(torch.autograd.Function):
    """``q @ k.T`` whose backward multiplies by ``k`` and ``q`` with non-finite entries
    zeroed (see :attr:`Operands.q_grad`); differentiable again (create_graph)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(q, k)
        return q @ k.T

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        q, k = ctx.saved_tensors
        return grad @ torch.nan_to_num(k, 0.0, 0.0, 0.0), grad.T @ torch.nan_to_num(q, 0.0, 0.0, 0.0)


def scores_product(q: Tensor, k: Tensor) -> Tensor:
    """``q @ k.T``; where an input holds a non-finite entry, through a backward that
    keeps it out of the gradients of the entries it does not reach (a masked NaN key)."""
    if all_finite(q) and all_finite(k):
        return q @ k.T
    return _FiniteGradProduct.apply(q, k)


def _max_row_norm(rows: Rows) -> float:
    raw, inv = raw_rows(rows)
    norms = _row_norms(raw, rows_dtype(rows))
    return float((norms if inv is None else norms * inv).max()) if norms.numel() else 0.0


def operands(
    q_in: Tensor, k_in: Optional[Tensor], scale: float, normalize: bool, driver: Driver, block: int, offset: int = 0
) -> Operands:
    """Casts and normalises the inputs (``k_in=None``: k is q) for ``driver`` (lazily, or
    as given: :attr:`Driver.lazy`, :attr:`Driver.raw_inputs`)."""
    dtype = compute_dtype(q_in.dtype)
    lazy, raw = driver.lazy, driver.raw_inputs
    q, q_norms = _prepare(q_in, normalize, dtype, lazy, raw)
    k, k_norms = (q, q_norms) if k_in is None else _prepare(k_in, normalize, dtype, lazy, raw)
    # Cauchy-Schwarz: |s_ij| <= scale * max |q^_i| * max |k^_j|
    qmax = 1.0 if normalize else _max_row_norm(q)
    kmax = qmax if k_in is None or normalize else _max_row_norm(k)
    return Operands(
        q,
        k,
        q_norms,
        k_norms,
        k_in is None,
        scale,
        scale * qmax * kmax,
        block,
        offset,
        q_in.detach(),
        None if k_in is None else k_in.detach(),
    )


def normalize_backward_(grad: Tensor, x: Tensor, eps: float = NORM_EPS, block: int = 4096) -> Tensor:
    """In place, the gradient ``grad`` of ``x / max(|x|, eps)`` (row by row; ``x`` as
    given, any dtype) taken back to ``x``: ``(g - y (y . g)) / |x|`` with ``y = x / |x|``
    where ``|x| > eps`` (the projection before the division: exact where a row's
    direction is fixed), ``g / eps`` elsewhere; a block of rows at a time (no
    temporary of ``x``'s size). The one normalisation backward of every fused loss.
    Returns ``grad``."""
    for r0 in range(0, grad.shape[0], block):
        g, xb = grad[r0 : r0 + block], x[r0 : r0 + block].to(grad.dtype)
        norms = torch.linalg.vector_norm(xb, dim=1)
        clamped = norms.clamp_min(eps).unsqueeze(1)
        y = xb / clamped
        dot = (g * y).sum(1) * (norms > eps)
        g.sub_(y * dot.unsqueeze(1)).div_(clamped)
    return grad


def _add_linear(
    rows: Tensor, cols: Optional[Tensor], lin: PositiveTerm, value: Tensor, scale: Any, head: Head
) -> Tuple[Tensor, Optional[Tensor]]:
    weight = value_weight(head, lin.target, lin.weight)  # 0 where the head takes the term in
    if lin.target == "row":
        return rows - scale * weight * value, cols
    assert cols is not None, "a column linear term needs a head with columns"
    return rows, cols - scale * weight * value


def dense_values(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    problem: Problem,
    params: Sequence[Tensor] = (),
    reports: Optional[List[Tensor]] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-row (and per-column) losses by differentiable torch ops on the whole
    score matrix: the dense backend, and the second derivatives of the others.
    ``params``: the head's learnable tensors (SigLIP's bias; a flex loss's);
    ``reports``: a list that takes a :class:`~flashcl.engine.heads.ReportingHead`'s results."""
    dtype = compute_dtype(q.dtype)
    q = q.to(dtype)
    same = k is None
    k = q if k is None else k.to(dtype)
    if problem.normalize:  # the backward projects before it divides (exact where a row's direction is fixed)
        q = normalize_rows(q, NORM_EPS)
        k = q if same else normalize_rows(k, NORM_EPS)
    s = scores_product(q, k) * scale.to(dtype)
    tile = Tile(0, s.shape[0], 0, s.shape[1], problem.offset)
    if reports is not None and isinstance(problem.head, ReportingHead):
        (rows, cols), found = problem.head.dense_reported(s, tile, tuple(params))
        reports.extend(found)
    else:
        rows, cols = problem.head.dense(s, tile, tuple(params))
    for lin in problem.linears:
        rows, cols = _add_linear(rows, cols, lin, lin.dense(s if lin.target == "row" else s.T), 1.0, problem.head)
    return rows, cols


def _output(rows: Tensor, cols: Optional[Tensor], reduce_weights: ReduceWeights) -> Tensor:
    if reduce_weights is None:
        return rows if cols is None else torch.cat([rows, cols])
    r, u = reduce_weights
    out = (r * rows).sum()
    if cols is not None:
        assert u is not None
        out = out + (u * cols).sum()
    return out


def dense_output(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    problem: Problem,
    reduce_weights: ReduceWeights,
    params: Sequence[Tensor] = (),
    reports: Optional[List[Tensor]] = None,
) -> Tensor:
    """What :class:`EngineFunction` returns, by :func:`dense_values` (``reports``: see there)."""
    rows, cols = dense_values(q, k, scale, problem, params, reports)
    return _output(rows, cols, reduce_weights)


class RowsDone:
    """``dq`` completed a block of rows at a time (for a driver that
    :attr:`~Driver.completes_rows`, two sets of rows, every linear term a row's): each
    block's gradient with respect to the normalised rows, handed over by
    :meth:`finish`, gets the linear terms' part of those rows, the normalisation's
    backward, and is written once in the inputs' dtype into :attr:`out`. Only ``dk``
    then accumulates over the call in float32: the M x D float32 ``dq`` (4 GB at a
    million rows of 1,024) is never made."""

    def __init__(self, ops: Operands, problem: Problem, st: Any, g_row: Tensor, q_in: Tensor) -> None:
        self.ops, self.problem, self.st, self.g_row, self.q_in = ops, problem, st, g_row, q_in
        #: the gradient of the anchors as given (their dtype and shape)
        self.out = torch.empty(q_in.shape, dtype=q_in.dtype, device=q_in.device)
        self._sums: Optional[List[Optional[Tensor]]] = None

    @staticmethod
    def applies(ops: Operands, problem: Problem, driver: Driver) -> bool:
        return driver.completes_rows and not ops.same and all(lin.target == "row" for lin in problem.linears)

    @property
    def dtype(self) -> torch.dtype:
        return rows_dtype(self.ops.q)

    def finish(self, r0: int, rows: Tensor) -> None:
        """Rows ``r0 .. r0 + len(rows)``'s gradient (float32, with respect to the normalised
        rows, complete but for the linear terms), overwritten, written into :attr:`out`."""
        ops, head = self.ops, self.problem.head
        r1 = r0 + rows.shape[0]
        if self._sums is None:
            self._sums = [lin.column_sums(ops.k, ops.block) for lin in self.problem.linears]
        for lin, sums in zip(self.problem.linears, self._sums):
            w = self.g_row[r0:r1] * grad_weight(head, self.st, "row", lin.weight, slice(r0, r1))
            lin.grad_rows_(ops.k, ops.scale, w, rows, r0, sums)
        if ops.q_norms is not None:
            normalize_backward_(rows, self.q_in[r0:r1], block=rows.shape[0])
        self.out[r0:r1] = rows


Grad = Any  # a float32 gradient accumulator, or a :class:`RowsDone`


def _linear_grads(
    ops: Operands,
    problem: Problem,
    driver: Driver,
    raws: List[Tensor],
    g_row: Tensor,
    g_col: Optional[Tensor],
    dq: Grad,
    dk: Tensor,
    st: Any,
) -> Tensor:
    """Adds the linear terms' gradients (with ``dq`` a :class:`RowsDone`, the rows' sides
    are in already: the columns' alone); returns their part of d scale."""
    dscale = dk.new_zeros(())
    for lin, raw in zip(problem.linears, raws):
        g = g_row if lin.target == "row" else g_col
        assert g is not None
        w = g * grad_weight(problem.head, st, lin.target, lin.weight)
        if isinstance(dq, RowsDone):
            lin.grad_cols_(ops.q, ops.k, ops.scale, w, dk, ops.block, driver.class_sums)
        elif lin.target == "row":
            lin.grad_(ops.q, ops.k, ops.scale, w, dq, dk, ops.block, driver.class_sums)
        else:  # a column term: the same computation with the two sides swapped
            lin.grad_(ops.k, ops.q, ops.scale, w, dk, dq, ops.block, driver.class_sums)
        dscale = dscale - (w * raw).sum()
    return dscale


def _raws(ops: Operands, problem: Problem, driver: Driver, block: int) -> List[Tensor]:
    """Each linear term's raw value (``sum_j m_ij q^_i . k^_j`` per row, or per column)."""
    return [
        lin.raw(ops.q, ops.k, block, driver.class_sums)
        if lin.target == "row"
        else lin.raw(ops.k, ops.q, block, driver.class_sums)
        for lin in problem.linears
    ]


def _input_grads(
    ops: Operands, dq: Grad, dk: Tensor, q_in: Tensor, k_in: Optional[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """The normalisation's backward and the cast back to the inputs' dtypes (``dq`` a
    :class:`RowsDone`: done a block at a time already)."""
    done = isinstance(dq, RowsDone)
    if ops.q_norms is not None:
        if not done:
            normalize_backward_(dq, q_in, block=ops.block)
        if not ops.same:
            assert k_in is not None
            normalize_backward_(dk, k_in, block=ops.block)
    dq_in = dq.out if done else dq.to(q_in.dtype)
    return dq_in, None if ops.same else dk.to(k_in.dtype)  # type: ignore[union-attr]


def _new_grads(ops: Operands, done: Optional[RowsDone] = None) -> Tuple[Grad, Tensor]:
    """``(dq, dk)``: float32 accumulators (one when k is q), or ``done`` as ``dq``."""
    dtype = rows_dtype(ops.k)
    dk = torch.zeros(ops.k.shape, dtype=dtype, device=raw_rows(ops.k)[0].device)
    if done is not None:
        return done, dk
    return (dk if ops.same else torch.zeros(ops.q.shape, dtype=dtype, device=dk.device)), dk


class EngineFunction(FusedFunction):
    """``apply(q, k, scale, problem, driver, reduce_weights, block, *params)``.

    ``k=None`` means the candidates are the anchors (one gradient); ``params`` are the
    head's learnable tensors (SigLIP's bias, a flex loss's), each with its gradient
    (:meth:`~flashcl.engine.heads.Head.param_grads`). Returns the
    per-row losses (M,), with the per-column losses appended for a head with
    columns (M + N,), or, for ``reduce_weights=(r, u)``, the scalar
    ``sum r * rows + sum u * cols``. Its backward's rules (a gradient formed in the
    forward pass, create_graph, autocast) are :class:`~flashcl.engine.FusedFunction`'s.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q_in: Tensor,
        k_in: Optional[Tensor],
        scale: Tensor,
        problem: Problem,
        driver: Driver,
        reduce_weights: ReduceWeights,
        block: int,
        *params: Tensor,
    ) -> Tensor:
        head = problem.head
        if head.factored_rows and not driver.applies_row_factor:
            raise ValueError(f"{type(driver).__name__} does not apply {type(head).__name__}'s row factors")
        s = float(scale)
        ops = operands(q_in, k_in, s, problem.normalize, driver, block, problem.offset)
        m, n = ops.q.shape[0], driver.num_columns(ops)
        needs_grad = any(ctx.needs_input_grad[:3]) or any(ctx.needs_input_grad[7:])
        if needs_grad and driver.uses_grad_operands:
            ops.form_grad_operands()
        fused = reduce_weights is not None and needs_grad
        st = head.state(m, n, ops.like, driver.bound(ops))
        raws: Optional[List[Tensor]] = None
        if isinstance(head, PivotHead) and (head.takes_in("row") or head.takes_in("col")):
            # the pivots' scores, before the tiles that need them
            raws = _raws(ops, problem, driver, block)
            pivots = {lin.target: s * raw for lin, raw in zip(problem.linears, raws) if takes_in(head, lin.target)}
            head.prepare(st, (pivots.get("row"), pivots.get("col")))
        dq = dk = dscale = None
        if fused:
            assert reduce_weights is not None
            r, u = reduce_weights
            done = RowsDone(ops, problem, st, r, q_in) if RowsDone.applies(ops, problem, driver) else None
            dq, dk = _new_grads(ops, done)
            dscale = driver.forward(ops, head, st, r if not head.has_columns else None, dq, dk)
            if dscale is None:  # the driver could not form it in the same visit: a second pass now
                head.begin_grad(st, r, u)
                dscale = driver.backward(ops, head, st, dq, dk)
        else:
            driver.forward(ops, head, st, None, None, None)
        driver.release()  # before the linear terms: their temporaries need not stack on the tile buffers
        head.release(st)
        rows, cols = head.values(st)
        if raws is None:
            raws = _raws(ops, problem, driver, block)
        for lin, raw in zip(problem.linears, raws):
            rows, cols = _add_linear(rows, cols, lin, raw, s, head)

        ctx.problem, ctx.driver, ctx.block, ctx.reduce_weights = problem, driver, block, reduce_weights
        ctx.st, ctx.raws = st, raws
        grads = None
        if fused:
            assert reduce_weights is not None and dq is not None and dk is not None and dscale is not None
            r, u = reduce_weights
            dscale = dscale + _linear_grads(ops, problem, driver, raws, r, u, dq, dk, st)
            dq_in, dk_in = _input_grads(ops, dq, dk, q_in, k_in)
            grads = (dq_in, dk_in, dscale, *head.param_grads(st, len(params)))
        inputs = (q_in, k_in, scale, *params) if needs_grad else (None,) * (3 + len(params))
        FusedFunction.setup(ctx, inputs, grads=grads, slots=(0, 1, 2, *range(7, 7 + len(params))))
        out = _output(rows, cols, reduce_weights)
        found = tuple(head.report(st)) if isinstance(head, ReportingHead) else ()
        if found:  # its results beside the losses, without gradient
            ctx.mark_non_differentiable(*found)
            return (out, *found)  # type: ignore[return-value]
        return out

    @classmethod
    def no_second_derivatives(cls, ctx: Any) -> Optional[str]:
        return ctx.driver.no_second_derivatives

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        q, k, scale, *params = inputs
        return dense_output(q, k, scale, ctx.problem, ctx.reduce_weights, params)

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        q_in, k_in, scale = saved[:3]
        n_params = ctx.n_inputs - 3
        problem, driver, block = ctx.problem, ctx.driver, ctx.block
        head, st = problem.head, ctx.st
        ops = operands(q_in, k_in, float(scale), problem.normalize, driver, block, problem.offset)
        if driver.uses_grad_operands:
            ops.form_grad_operands()
        m = ops.q.shape[0]
        dtype = compute_dtype(q_in.dtype)
        if ctx.reduce_weights is not None:
            r, u = ctx.reduce_weights
            g_row, g_col = r * grad_out, (None if u is None else u * grad_out)
        else:
            g = grad_out.to(dtype)
            g_row, g_col = g[:m], (g[m:] if head.has_columns else None)
        head.begin_grad(st, g_row, g_col)

        def done() -> Optional[RowsDone]:
            return RowsDone(ops, problem, st, g_row, q_in) if RowsDone.applies(ops, problem, driver) else None

        try:
            dq, dk, dscale = _grad_visit(ops, head, driver, st, done())
        except KernelFailure as failure:  # the forward's reductions stand; the gradient by the fallback
            driver = ctx.driver = _fall_back(driver, failure)
            ops = operands(q_in, k_in, float(scale), problem.normalize, driver, block, problem.offset)
            if driver.uses_grad_operands:
                ops.form_grad_operands()
            dq, dk, dscale = _grad_visit(ops, head, driver, st, done())
        dscale = dscale + _linear_grads(ops, problem, driver, ctx.raws, g_row, g_col, dq, dk, st)
        dq_in, dk_in = _input_grads(ops, dq, dk, q_in, k_in)
        return (dq_in, dk_in, dscale, *head.param_grads(st, n_params))


def _grad_visit(
    ops: Operands, head: Head, driver: Driver, st: Any, done: Optional[RowsDone] = None
) -> Tuple[Grad, Tensor, Tensor]:
    """The driver's gradient visit (``head.begin_grad`` called): (dq, dk, d scale) with
    respect to the normalised rows (``done``: dq's rows completed by it); the buffers
    released after."""
    dq, dk = _new_grads(ops, done)
    dscale = driver.backward(ops, head, st, dq, dk)
    driver.release()
    head.release(st)
    return dq, dk, dscale


def visit_values(
    q: Tensor, k: Tensor, scale: Tensor, problem: Problem, driver: Driver, block: int
) -> Tuple[Tensor, Any]:
    """The per-row losses of a problem without linear terms and the head's state, by
    ``driver``, without a graph: for an autograd Function of a loss's own that joins
    processes in its head (:meth:`~flashcl.engine.heads.Head.finish`) and forms its
    backward with :func:`visit_grads`."""
    if problem.linears:
        raise ValueError("visit_values computes a head without linear terms")
    head = problem.head
    ops = operands(q, k, float(scale), problem.normalize, driver, block, problem.offset)
    st = head.state(ops.q.shape[0], driver.num_columns(ops), ops.like, driver.bound(ops))
    driver.forward(ops, head, st, None, None, None)
    driver.release()
    head.release(st)
    return head.values(st)[0], st


def visit_grads(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    problem: Problem,
    driver: Driver,
    block: int,
    st: Any,
    g_row: Tensor,
    n_params: int,
) -> Tuple[Optional[Tensor], ...]:
    """After :func:`visit_values`: the gradients of ``sum_i g_row_i rows_i`` with
    respect to ``q``, ``k`` (in their dtypes), the scale and the head's ``n_params``
    learnable tensors."""
    ops = operands(q, k, float(scale), problem.normalize, driver, block, problem.offset)
    if driver.uses_grad_operands:
        ops.form_grad_operands()
    problem.head.begin_grad(st, g_row, None)
    dq, dk, dscale = _grad_visit(ops, problem.head, driver, st)
    dq_in, dk_in = _input_grads(ops, dq, dk, q, k)
    return (dq_in, dk_in, dscale, *problem.head.param_grads(st, n_params))


def run(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    problem: Problem,
    driver: Optional[Driver],
    reduce_weights: ReduceWeights,
    block: int,
    params: Sequence[Tensor] = (),
) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """The problem's losses, through ``driver`` (an :class:`EngineFunction`) or by the
    dense formula when ``driver`` is None (autocast off either way), and the results a
    :class:`~flashcl.engine.heads.ReportingHead` reports beside them (none for another
    head). ``params``: the head's learnable tensors, if it has any."""
    head_offset = getattr(problem.head, "offset", problem.offset)
    if head_offset != problem.offset:
        raise ValueError(
            f"the head's offset ({head_offset}) and the problem's ({problem.offset}) differ: the "
            "tiles would mask other columns than the head's kernels"
        )
    with autocast_off(q.device.type):
        if driver is None:
            reports: List[Tensor] = []
            return dense_output(q, k, scale, problem, reduce_weights, params, reports), tuple(reports)
        try:
            out = EngineFunction.apply(q, k, scale, problem, driver, reduce_weights, block, *params)
        except KernelFailure as failure:
            fallback = _fall_back(driver, failure)
            out = EngineFunction.apply(q, k, scale, problem, fallback, reduce_weights, block, *params)
        return (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())
