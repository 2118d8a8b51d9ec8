"""Loss heads: what a loss computes from tiles of scores ``s_ij = scale * q^_i . k^_j``.

Every loss in flashcl is a *head* (the part that is not linear in the scores:
a logsumexp, a sigmoid, ...) plus *linear terms* (``sum_j m_ij s_ij``: the
positives, computed in embedding space by :mod:`flashcl.engine.positives`). The backends
(:mod:`flashcl.engine.tiled`, :mod:`flashcl.engine.panels`, :mod:`flashcl.distributed`'s
ring, :mod:`flashcl.triton`) visit tiles of the score matrix and hand each one
to the head; they never know which head they serve. :func:`flashcl.engine.dense_values` (the dense backend) and
the second-derivative path use the head's differentiable :meth:`Head.dense` formula
on the whole matrix.

A head answers, for a tile ``s`` (rows ``tile.r0:tile.r1``, columns
``tile.c0:tile.c1`` of the problem):

* :meth:`Head.reduce`: merge the tile into its per-row / per-column
  accumulators (pass ``p`` of :attr:`Head.passes`; a head whose gradient needs
  one reduction before another, as an LSE before a softplus of it, has two);
* :meth:`Head.values`: once every tile was reduced, the per-row and per-column
  losses (the nonlinear part);
* :meth:`Head.grad`: ``dL/ds`` of the tile, weighted by the upstream gradient of
  each row's (and column's) loss;
* optionally :meth:`Head.rows_fused`: a tile of complete rows reduced *and*
  turned into its gradient in one visit (the fused forward of scalar losses:
  three GEMMs instead of four).

What only some drivers ask is a capability beside the core: :class:`KernelHead`
(the Triton kernels), :class:`PanelHead` (the self-contrast driver's panels in one
pass; without it the driver builds them from :meth:`Head.reduce` and
:meth:`Head.grad`), :class:`PivotHead` (a positive term the head computes itself),
:class:`ReportingHead` (results besides the losses, returned from its state).

Tiles may be overwritten in place by every method (the drivers recompute
scores when they need them again), so that no second buffer of a tile's size
is needed on the common paths.

Adding a loss whose nonlinear part is new = one :class:`Head` subclass
(see CONTRIBUTING.md); the backends need no change, except the Triton kernels,
which implement the heads named by :attr:`KernelHead.kernel`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..core import Exclusions, Tile
from .sparsity import BlockSparsity

__all__ = [
    "Tile",
    "KernelId",
    "KernelArgs",
    "Head",
    "KernelHead",
    "PanelHead",
    "PivotHead",
    "kernel_of",
    "kernel_args",
    "reduce_panel",
    "grad_panel",
    "ReportingHead",
    "AutogradHead",
    "logsumexp_safe",
    "takes_in",
    "value_weight",
    "grad_weight",
    "SoftmaxHead",
    "SoftplusHead",
    "Exclusions",
    "lse_inplace",
    "mask_self_",
    "mask_columns_",
    "scratch",
    "softplus_rows_",
    "scattered_lse",
    "row_dot",
    "row_max",
]


def mask_self_(s: Tensor, tile: Tile, value: float) -> None:
    """In place: the self entries of the tile take ``value``."""
    tile.self_diagonal(s).fill_(value)


def mask_columns_(s: Tensor, tile: Tile, index: Tensor, value: float) -> None:
    """In place: entry ``(i, index[i, t])`` of every row ``i`` of the tile takes ``value``
    (columns in problem coordinates, (M,) or (M, k); those outside the tile, or
    negative, are skipped)."""
    idx = index[tile.r0 : tile.r1]
    if idx.dim() == 1:
        idx = idx.unsqueeze(1)
    local = idx - tile.c0
    inside = (idx >= 0) & (local >= 0) & (local < tile.c1 - tile.c0)
    rows = torch.arange(idx.shape[0], device=s.device).unsqueeze(1).expand_as(idx)
    s[rows[inside], local[inside]] = value


def scratch(buf: Tensor, like: Tensor) -> Tensor:
    """A contiguous view of a free buffer (any shape, at least as many elements)
    with the shape of ``like``."""
    return buf.view(-1)[: like.numel()].view(like.shape)


class WorkBuffer:
    """A buffer made on first use in a call and handed out in the shape of each
    tile after (a fresh tile-sized allocation per tile costs page faults)."""

    def __init__(self) -> None:
        self.buf: Optional[Tensor] = None

    def like(self, t: Tensor) -> Tensor:
        """A free view of ``t``'s shape, dtype and device."""
        if self.buf is None or self.buf.numel() < t.numel() or self.buf.dtype != t.dtype:
            self.buf = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        return scratch(self.buf, t)


def row_dot(a: Tensor, b: Tensor, buffer_elements: int = 1 << 18) -> Tensor:
    """``(a * b).sum(1)`` of two (R, C) tiles without a temporary of their size: the
    products of a few rows at a time in one small buffer (1 MB of float32), then their
    sums. (A batched matrix-vector product, ``bmm`` of (R, 1, C) by (R, C, 1), takes no
    buffer but ran 3-4x slower on a 512 x 8192 tile on the CPU.)"""
    m, n = a.shape
    dtype = torch.result_type(a, b)
    out = torch.empty(m, dtype=dtype, device=a.device)
    if m == 0 or n == 0:
        return out.zero_()
    step = max(1, min(m, buffer_elements // n))
    buf = torch.empty(step, n, dtype=dtype, device=a.device)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        part = buf[: r1 - r0]
        torch.mul(a[r0:r1], b[r0:r1], out=part)
        torch.sum(part, 1, out=out[r0:r1])
    return out


def row_max(s: Tensor, width: int = 128) -> Tuple[Tensor, Tensor]:
    """``s.max(1)`` of a wide tile (R, C): each row's largest entry and an index of it,
    from the largest of each run of ``width`` columns (a reduction without indices)
    and then the indices within the one run that holds it. On a 2-core CPU, 128 x
    65,536 float32: 0.8 ms against ``max(1)``'s 2.2 ms; on other devices ``max(1)``."""
    m, n = s.shape
    if s.device.type != "cpu" or n % width or n < 4 * width or s.stride() != (n, 1):
        return s.max(1)
    runs = s.view(m, n // width, width)
    top, run = runs.amax(2).max(1)
    within = runs.gather(1, run.view(m, 1, 1).expand(m, 1, width)).squeeze(1).argmax(1)
    return top, run * width + within


def lse_inplace(s: Tensor) -> Tuple[Tensor, Tensor]:
    """Row logsumexp of ``s``; leaves ``exp(s - rowmax)`` in it; returns (lse, row sums)."""
    mx = s.amax(1, keepdim=True)
    # a row whose entries are all -inf (empty denominator): shift by 0, not by -inf
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    s.sub_(mx).exp_()
    total = s.sum(1, keepdim=True)
    return (mx + total.log()).squeeze(1), total


class KernelId(str, enum.Enum):
    """The Triton tile functions a head can run on (the kernels' ``HEAD`` switch)."""

    SOFTMAX = "softmax"
    SOFTPLUS = "softplus"


@dataclass(frozen=True)
class KernelArgs:
    """What the Triton driver passes to the kernels for a head.

    Attributes:
        kernel: the tile function.
        exclude_self: leave the self column ``i + offset`` out of row ``i``.
        offset: column of anchor 0.
        bias: the softplus head's bias (0 for the softmax).
        excluded: (M,) int64, one further column left out of each row (-1: none), or None.
    """

    kernel: KernelId
    exclude_self: bool = False
    offset: int = 0
    bias: float = 0.0
    excluded: Optional[Tensor] = None


class Head:
    """The interface every backend drives; see the module docstring.

    Attributes:
        passes: reduction passes before :meth:`grad` can run.
        fuses_rows: :meth:`rows_fused` is implemented.
        has_columns: the head also returns per-column losses (CLIP's column direction).
        symmetric_tiles: for self-contrast (``k is q``, no offset) its tile values and
            gradients depend on ``(i, j)`` symmetrically, so that the self-contrast
            driver may visit only the panels on and above the diagonal.
        sparsity: the tiles where some pair contributes (:mod:`flashcl.engine.sparsity`),
            or None (every tile): the row-block driver skips the others.

    What only some drivers ask is a capability of its own: :class:`KernelHead` (the
    Triton kernels), :class:`PanelHead` (a head's own symmetric panels),
    :class:`PivotHead` (a positive term the head computes itself), :class:`ReportingHead`
    (results besides the losses).
    """

    passes: int = 1
    fuses_rows: bool = False
    has_columns: bool = False
    symmetric_tiles: bool = False
    sparsity: Optional[BlockSparsity] = None
    #: :meth:`grad` and :meth:`rows_fused` return ``dL/ds`` less a factor of each row,
    #: :meth:`row_factor`, that the driver applies to the block's rows (rows x D)
    #: instead of the tile (rows x N): one pass over the tile fewer. Only drivers with
    #: :attr:`~flashcl.engine.engine.Driver.applies_row_factor` take such a head.
    factored_rows: bool = False

    # ------------------------------------------------------------------ state
    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> Any:
        """Fresh accumulators for an (m, n) problem; ``bound``: a value ``>= max |s_ij|``
        (from the rows' norms), or None when unknown."""
        raise NotImplementedError

    def reduce(self, s: Tensor, tile: Tile, st: Any, p: int = 0) -> None:
        """Merges tile ``s`` into the accumulators of pass ``p``; may overwrite ``s``."""
        raise NotImplementedError

    def finish(self, st: Any, p: int = 0) -> None:
        """Called after pass ``p`` has visited every tile."""

    def values(self, st: Any) -> Tuple[Tensor, Optional[Tensor]]:
        """The nonlinear part of the per-row losses (m,) and of the per-column losses (n,) or None."""
        raise NotImplementedError

    # --------------------------------------------------------------- gradient
    def begin_grad(self, st: Any, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        """Called once before the tiles' gradients, with the upstream gradient of each
        row's (and column's) loss."""
        st.g_row, st.g_col = g_row, g_col

    def grad(self, s: Tensor, tile: Tile, st: Any, buf: Optional[Tensor] = None) -> Tensor:
        """``dL/ds`` of the tile (weighted by the upstream gradients); may be ``s`` itself.
        ``buf``: a free buffer of at least the tile's size, when the driver has one."""
        raise NotImplementedError

    def rows_fused(self, s: Tensor, tile: Tile, st: Any, g_row: Optional[Tensor]) -> Optional[Tensor]:
        """A tile of *complete* rows: every reduction pass for them at once and, when
        ``g_row`` is given, their gradient (returned). Only called when
        :attr:`fuses_rows` is True; otherwise the drivers run :meth:`reduce` per
        pass, then :meth:`grad`."""
        raise NotImplementedError

    def row_factor(self, st: Any, tile: Tile) -> Optional[Tensor]:
        """With :attr:`factored_rows`: the factor of each of the tile's rows that the
        tile returned by :meth:`grad` / :meth:`rows_fused` leaves out, (rows,); None
        (without it): the tiles carry every factor."""
        return None

    def release(self, st: Any) -> None:
        """Drops the buffers the head keeps in ``st`` between tiles; called when a pass
        over the tiles ends (the state itself lives on until the backward)."""

    # ------------------------------------------------------------ dense form
    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        """The per-row (and per-column) losses from the whole score matrix ``s``, by
        differentiable torch ops: the dense backend, and second derivatives.
        ``params``: the head's learnable tensors (none for most heads)."""
        raise NotImplementedError

    def param_grads(self, st: Any, n: int) -> Tuple[Optional[Tensor], ...]:
        """d loss / d (each of the head's ``n`` learnable tensors), accumulated by
        :meth:`grad` / :meth:`rows_fused`; heads without any: ``n`` Nones."""
        return (None,) * n


# ---------------------------------------------------------------------- capabilities
# What only some drivers ask of a head, each a class of its own beside Head's core: the
# Triton kernels (KernelHead), a head's own symmetric panels (PanelHead), a positive
# term the head computes itself (PivotHead). A driver asks with isinstance (or the
# functions below); a head without the capability runs on the other drivers.


class KernelHead(Head):
    """A head the Triton kernels implement (:attr:`kernel`): what the Triton driver
    and the stripe kernels ask of it.

    Attributes:
        kernel: the Triton tile function that implements it; None on an instance the
            kernels cannot compute (masks from the data), whose :meth:`kernel_args` says why.
    """

    kernel: Optional[KernelId] = None

    def kernel_args(self) -> KernelArgs:
        """The kernels' arguments for this head; a ValueError that says what to use
        when the kernels cannot compute it."""
        raise NotImplementedError

    def kernel_state(self, st: Any, first: Tensor, second: Optional[Tensor]) -> None:
        """Takes the reductions as the row kernel computed them (``second``: the
        columns' logsumexp for a head with columns, or the softplus head's sigmoid sums)."""
        raise NotImplementedError

    def kernel_weights(self, st: Any) -> Tuple[Tensor, Optional[Tensor]]:
        """(weight of each row's tiles, of each column's) for the gradient kernels."""
        raise NotImplementedError

    def kernel_column_lse(self, st: Any) -> Optional[Tensor]:
        """The columns' logsumexp the gradient kernels need (a head with columns), or None."""
        return None

    def kernel_rows(
        self, st: Any, rows: slice, first: Tensor, second: Optional[Tensor], g_row: Optional[Tensor]
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """A stripe's rows ``rows`` (complete) reduced by the stripe kernels
        (:mod:`flashcl.triton.stripe`): ``first`` their logsumexps without the pivots
        (the softmax head) or their softplus sums (``second``: their sigmoid sums). Returns
        (the logsumexps the gradient subtracts, or None; each row's factor of its
        gradient tile for the upstream ``g_row``, or None without it)."""
        raise NotImplementedError


def kernel_of(head: Head) -> Optional[KernelId]:
    """The Triton tile function that implements ``head``, or None."""
    return head.kernel if isinstance(head, KernelHead) else None


def kernel_args(head: Head) -> KernelArgs:
    """``head``'s kernel arguments; a ValueError that says what to use when the kernels
    cannot compute it."""
    if not isinstance(head, KernelHead):
        raise ValueError(
            f"the triton backend has kernels for the softmax and softplus heads only, not for "
            f"{type(head).__name__}: use backend='tiled'"
        )
    return head.kernel_args()


class PanelHead(Head):
    """A head with symmetric tiles (:attr:`~Head.symmetric_tiles`) that visits the
    self-contrast driver's panels itself, in one pass over each (the driver otherwise
    reduces a panel's rows and, transposed, its columns by :meth:`~Head.reduce` and
    :meth:`~Head.grad`)."""

    def reduce_panel(self, s: Tensor, tile: Tile, st: Any, p: int, buf: Tensor) -> None:
        """Self-contrast panel ``S[r0:r1, r0:]``: its rows' contributions and, through
        ``s_ji = s_ij``, those of the rows right of the diagonal block. ``buf``: a free
        buffer of the panel's size."""
        raise NotImplementedError

    def grad_panel(self, s: Tensor, tile: Tile, st: Any, buf: Tensor) -> Tensor:
        """``H = G + G^T`` on the panel (the gradient of its rows plus, transposed, that
        of the rows it stands for below the diagonal), in ``s``."""
        raise NotImplementedError


def reduce_panel(head: Head, s: Tensor, tile: Tile, st: Any, p: int, buf: Tensor) -> None:
    """Pass ``p`` over the self-contrast panel ``S[r0:r1, r0:]`` (see
    :meth:`PanelHead.reduce_panel`): the head's own, or its rows and, through
    ``s_ji = s_ij``, the rows right of the diagonal block by :meth:`Head.reduce`."""
    if isinstance(head, PanelHead):
        head.reduce_panel(s, tile, st, p, buf)
        return
    b = tile.r1 - tile.r0
    rest = None
    if tile.c1 > tile.r1:
        rest = scratch(buf, s)[:, b:]
        rest.copy_(s[:, b:])
    head.reduce(s, tile, st, p)
    if rest is not None:
        head.reduce(rest.T, Tile(tile.r1, tile.c1, tile.r0, tile.r1, -tile.offset), st, p)


def grad_panel(head: Head, s: Tensor, tile: Tile, st: Any, buf: Tensor) -> Tensor:
    """``H = G + G^T`` on the panel (see :meth:`PanelHead.grad_panel`): the head's own,
    or by :meth:`Head.grad` on the panel and on its transpose."""
    if isinstance(head, PanelHead):
        return head.grad_panel(s, tile, st, buf)
    other = scratch(buf, s)
    other.copy_(s)
    g = head.grad(s, tile, st)
    gt = head.grad(other.T, tile.transposed(), st)
    return g.add_(gt.T)


class PivotHead(Head):
    """A head that computes the value of a positive term itself (its pivots: see
    :class:`SoftmaxHead`'s ``pivot``): what the engine asks before the tiles and when
    it adds the linear terms."""

    def prepare(self, st: Any, pivots: Tuple[Optional[Tensor], Optional[Tensor]]) -> None:
        """Before the tiles: the scores of the positive term the head takes in (each
        row's, each column's; see :class:`SoftmaxHead`'s ``pivot``), when it does."""

    def takes_in(self, target: str) -> bool:
        """Whether the head computes the value of the positive term of ``target``
        (``"row"`` / ``"col"``) itself, on the rows where it has one (the engine then
        leaves it out of the value and takes its gradient's weight from
        :meth:`linear_grad_weight`)."""
        return False

    def linear_value_weight(self, target: str, weight: Tensor) -> Tensor:
        """The weight of the positive term of ``target`` (own weight ``weight``) in the
        value: 0 on the rows whose term the head takes in."""
        return weight

    def linear_grad_weight(self, st: Any, target: str, weight: Tensor, rows: slice = slice(None)) -> Tensor:
        """The weight of the positive term of ``target`` in the gradient, once reduced,
        of the rows (or columns) ``rows``."""
        return weight[rows]


class ReportingHead(Head):
    """A head with results besides its losses (which rows a mean counts, how many pairs
    were mined): formed in its state, returned by the engine beside the losses
    (:func:`flashcl.engine.engine.run`), never written on the head itself."""

    def report(self, st: Any) -> Tuple[Tensor, ...]:
        """The results, once the rows are reduced (tensors without gradient)."""
        raise NotImplementedError

    def dense_reported(
        self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()
    ) -> Tuple[Tuple[Tensor, Optional[Tensor]], Tuple[Tensor, ...]]:
        """:meth:`~Head.dense`'s losses and the results :meth:`report` gives, from the
        whole score matrix."""
        raise NotImplementedError

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        return self.dense_reported(s, tile, params)[0]


class _RowLosses:
    """An :class:`AutogradHead`'s state: each row's loss, the columns' count."""

    def __init__(self, m: int, n: int, like: Tensor) -> None:
        self.rows, self.n = like.new_zeros(m), n
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None


class AutogradHead(Head):
    """A head written as its forward alone: :meth:`~Head.dense` on a block of complete rows
    (every column) gives their losses, and the block's gradient is autograd's through it,
    as Liger-Kernel's chunked losses take each chunk's. The drivers that hand over complete
    rows run it (row blocks, stripes); a tile of part of its rows' columns (the ring, the
    symmetric panels) is a ValueError. No learnable tensors (``params``), no per-column
    losses. A head whose hand-written gradient measured faster writes :class:`Head`'s
    methods instead (:class:`SoftmaxHead`)."""

    fuses_rows = True

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _RowLosses:
        return _RowLosses(m, n, like)

    def _check(self, tile: Tile, st: _RowLosses) -> slice:
        if tile.c0 != 0 or tile.c1 != st.n:
            raise ValueError(
                f"{type(self).__name__} takes tiles of complete rows (the row blocks' driver): columns "
                f"{tile.c0}:{tile.c1} of {st.n} (round the ring: strategy='all_gather')"
            )
        return slice(tile.r0, tile.r1)

    def reduce(self, s: Tensor, tile: Tile, st: _RowLosses, p: int = 0) -> None:
        st.rows[self._check(tile, st)] = self.dense(s, tile)[0]

    def values(self, st: _RowLosses) -> Tuple[Tensor, Optional[Tensor]]:
        return st.rows, None

    def grad(self, s: Tensor, tile: Tile, st: _RowLosses, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        return self._through(s, tile, st, st.g_row)

    def rows_fused(self, s: Tensor, tile: Tile, st: _RowLosses, g_row: Optional[Tensor]) -> Optional[Tensor]:
        if g_row is None:
            self.reduce(s, tile, st)
            return None
        return self._through(s, tile, st, g_row)

    def _through(self, s: Tensor, tile: Tile, st: _RowLosses, g_row: Tensor) -> Tensor:
        """The block's losses into the state, their gradient returned."""
        rows = self._check(tile, st)
        st.rows[rows], g = self.block_grad(s, tile, g_row[rows])
        return g

    def block_grad(self, s: Tensor, tile: Tile, g_row: Tensor) -> Tuple[Tensor, Tensor]:
        """A block of complete rows' losses (without gradient) and ``dL/ds`` for their
        upstream gradients ``g_row`` (the block's rows'): autograd's through
        :meth:`~Head.dense`; a subclass whose own gradient measured faster overrides it."""
        with torch.enable_grad():
            leaf = s.detach().requires_grad_(True)
            out = self.dense(leaf, tile)[0]
            (g,) = torch.autograd.grad(out, leaf, g_row.to(out.dtype))
        return out.detach(), s.copy_(g)


def takes_in(head: Head, target: str) -> bool:
    """Whether ``head`` computes the positive term of ``target`` itself (:class:`PivotHead`)."""
    return isinstance(head, PivotHead) and head.takes_in(target)


def value_weight(head: Head, target: str, weight: Tensor) -> Tensor:
    """The weight of the positive term of ``target`` in the value (see
    :meth:`PivotHead.linear_value_weight`): ``weight`` for a head without pivots."""
    return head.linear_value_weight(target, weight) if isinstance(head, PivotHead) else weight


def grad_weight(head: Head, st: Any, target: str, weight: Tensor, rows: slice = slice(None)) -> Tensor:
    """The weight of the positive term of ``target`` in the gradient of ``rows`` (see
    :meth:`PivotHead.linear_grad_weight`): ``weight[rows]`` for a head without pivots."""
    return head.linear_grad_weight(st, target, weight, rows) if isinstance(head, PivotHead) else weight[rows]


class _SoftmaxState:
    """Row (and column) logsumexp accumulators: exact running logsumexps, or, with
    a fixed shift ``c >= max |s|`` (``summing``), plain sums of ``exp(s - c)``: one
    exp per entry serves a row and a column sum. The shift is kept after
    :meth:`SoftmaxHead.finish` for the gradient (one exp per entry there too)."""

    def __init__(self, m: int, n: int, like: Tensor, shift: Optional[float], columns: bool) -> None:
        self.shift: Optional[float] = shift
        self.summing = shift is not None
        self.row = like.new_zeros(m) if self.summing else like.new_full((m,), float("-inf"))
        self.col = None
        if columns:
            self.col = like.new_zeros(n) if self.summing else like.new_full((n,), float("-inf"))
        self.alpha: Optional[Tensor] = None
        self.beta: Optional[Tensor] = None
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None
        # the pivots' scores (rows', columns') and, once reduced, the logsumexps without them less them
        self.p: Optional[Tensor] = None
        self.pc: Optional[Tensor] = None
        self.x: Optional[Tensor] = None
        self.y: Optional[Tensor] = None

    @property
    def fixed_shift(self) -> float:
        """The fixed shift, where the state sums ``exp(s - shift)`` (``summing``, or a
        gradient formed from it)."""
        assert self.shift is not None
        return self.shift


class SoftmaxHead(KernelHead, PanelHead, PivotHead):
    """The masked softmax: per row ``c_i * LSE_{j in Den(i)} s_ij`` and, with
    ``columns``, per column ``LSE_i s_ij`` (CLIP's column direction).

    Args:
        row_weight: ``c`` (m,), the weight of each row's logsumexp.
        exclude_self: drop the self entry from row ``i``'s denominator: column
            ``i + offset``, or ``self_index[i]`` when given.
        offset: column of anchor 0.
        columns: add the column direction (every row in each column's denominator).
        self_index: (m,) the column of each anchor itself (a queue's slot of the
            anchor), instead of ``i + offset``; -1 for none.
        exclude: further entries out of the denominator (:class:`Exclusions`).
        boost: ``(f, fn)``: the entries of ``fn(tile)`` (a boolean mask) count as
            ``s + f * stop_grad(s)`` in the logsumexp (a hardness weighting of
            negatives: their logit grows with their score, their gradient does not).
        pivot: ``(index, weight)``: each row's one positive column (M,) (-1: none) and
            the weight ``w_i`` of its positive term ``-w_i s_ij*``, which the head then
            takes in (the row's pivot): with ``x_i = LSE_{j != j*} s_ij - s_ij*`` (the
            pivot left out of the sums), the row's loss is ``c_i softplus(x_i) + (c_i -
            w_i) s_ij*`` and the pivot's gradient ``(c_i - w_i) - c_i sigmoid(x_i)``, so
            that a row whose positive dominates (a tiny loss near collapse) keeps its
            relative precision, where ``c_i LSE - w_i s_ij*`` subtracts two numbers of
            the scores' size. The pivot's score comes from its positive term
            (:meth:`prepare`), its gradient goes through it (:meth:`linear_grad_weight`).
        col_pivot: the same for the column direction: each column's one positive row
            (N,) and its weight; the same entries as the rows' pivots.
    """

    kernel: Optional[KernelId] = KernelId.SOFTMAX

    def __init__(
        self,
        row_weight: Tensor,
        exclude_self: bool = False,
        offset: int = 0,
        columns: bool = False,
        self_index: Optional[Tensor] = None,
        exclude: Optional[Exclusions] = None,
        boost: Optional[Tuple[float, Any]] = None,
        pivot: Optional[Tuple[Tensor, Tensor]] = None,
        col_pivot: Optional[Tuple[Tensor, Tensor]] = None,
    ) -> None:
        if columns and (exclude_self or exclude is not None or boost is not None):
            raise ValueError("the column direction takes every row: exclusions are for the rows only")
        if col_pivot is not None and (pivot is None or not columns):
            raise ValueError("a column pivot needs the column direction and the rows' pivots on the same entries")
        self.pivot, self.col_pivot = pivot, col_pivot
        self.boost = boost
        self.row_weight = row_weight
        self.exclude_self = exclude_self
        self.offset = offset
        self.self_index = self_index
        self.exclude = exclude
        self.has_columns = columns
        # the upper-panel driver needs the masks symmetric: the self entry on the diagonal, and the pivots
        # in pairs (row i's pivot is j and row j's is i: the other view of NT-Xent)
        self.symmetric_tiles = (
            not columns and self_index is None and exclude is None and boost is None and _paired(pivot, offset)
        )
        self.fuses_rows = not columns  # the column direction needs every row's scores first
        self.kernel = self.kernel_for(exclude_self, columns, self_index, exclude, boost, pivot is not None)

    @staticmethod
    def kernel_for(
        exclude_self: bool,
        columns: bool,
        self_index: Optional[Tensor],
        exclude: Optional[Exclusions],
        boost: Optional[Tuple[float, Any]],
        pivots: bool,
    ) -> Optional[KernelId]:
        """The Triton kernel of a head made with these options (``pivots``: with rows'
        pivots), or None: before the head is made (a backend chosen first)."""
        if (exclude is not None and exclude.fn is not None) or boost is not None:
            return None  # masks computed by a function: no Triton kernel for them
        if pivots and (columns or exclude is not None or (exclude_self and self_index is not None)):
            return None  # the kernels leave out one indexed column per row (the pivot), of the rows only
        return KernelId.SOFTMAX

    def _boost_(self, s: Tensor, tile: Tile) -> None:
        """In place: the boosted entries' logits ``s (1 + f)``."""
        if self.boost is not None:
            f, fn = self.boost
            s.mul_(fn(tile).to(s.dtype).mul_(f).add_(1.0))

    def _mask_(self, s: Tensor, tile: Tile, value: float) -> None:
        """The entries out of the rows' denominators take ``value``."""
        if self.exclude_self:
            if self.self_index is None:
                mask_self_(s, tile, value)
            else:
                mask_columns_(s, tile, self.self_index, value)
        if self.exclude is not None:
            if self.exclude.index is not None:
                mask_columns_(s, tile, self.exclude.index, value)
            if self.exclude.fn is not None:
                s.masked_fill_(self.exclude.fn(tile), value)

    @property
    def masks(self) -> bool:
        return self.exclude_self or self.exclude is not None

    @staticmethod
    def usable_shift(bound: Optional[float], dtype: torch.dtype) -> Optional[float]:
        """The fixed shift: ``bound`` when ``exp(s - bound)`` cannot underflow, i.e.
        ``2 * bound`` within the exponent range (for unit-norm embeddings: temperature
        above ~0.025, or a CLIP logit scale below 40, in float32); else None."""
        if bound is None or bound != bound:
            return None
        limit = 80.0 if dtype == torch.float32 else 700.0
        return bound if 2.0 * bound <= limit else None

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _SoftmaxState:
        if bound is not None and self.boost is not None:
            bound = bound * (1.0 + abs(self.boost[0]))
        return _SoftmaxState(m, n, like, self.usable_shift(bound, like.dtype), self.has_columns)

    def _pivots_(self, s: Tensor, tile: Tile, value: float) -> None:
        """The pivots' entries (out of the rows' and the columns' sums) take ``value``."""
        if self.pivot is not None:
            mask_columns_(s, tile, self.pivot[0], value)

    def reduce(self, s: Tensor, tile: Tile, st: _SoftmaxState, p: int = 0) -> None:
        rows, cols = slice(tile.r0, tile.r1), slice(tile.c0, tile.c1)
        self._boost_(s, tile)
        if st.summing:
            s.sub_(st.fixed_shift).exp_()
            self._pivots_(s, tile, 0.0)
            if st.col is not None:
                st.col[cols] += s.sum(0)
            if self.masks:
                self._mask_(s, tile, 0.0)
            st.row[rows] += s.sum(1)
            return
        self._pivots_(s, tile, float("-inf"))
        if st.col is not None:
            torch.logaddexp(st.col[cols], torch.logsumexp(s, dim=0), out=st.col[cols])
        if self.masks:
            self._mask_(s, tile, float("-inf"))
        torch.logaddexp(st.row[rows], torch.logsumexp(s, dim=1), out=st.row[rows])

    def finish(self, st: _SoftmaxState, p: int = 0) -> None:
        if st.summing:
            st.row = st.row.log_().add_(st.fixed_shift)
            if st.col is not None:
                st.col = st.col.log_().add_(st.fixed_shift)
            st.summing = False
        self._take_in(st)

    # ------------------------------------------------------------------ pivots
    def prepare(self, st: _SoftmaxState, pivots: Tuple[Optional[Tensor], Optional[Tensor]]) -> None:
        st.p, st.pc = pivots
        if st.p is not None:
            st.x = torch.zeros_like(st.p)  # filled as the rows are reduced (none: a rank with no rows)

    def takes_in(self, target: str) -> bool:
        return (self.pivot if target == "row" else self.col_pivot) is not None

    def _take_in(self, st: _SoftmaxState, rows: slice = slice(None)) -> None:
        """The logsumexps without the pivots (``st.row`` / ``st.col`` of ``rows``) into
        those with them, ``p + softplus(LSE - p)``, keeping ``x = LSE - p``."""
        if self.pivot is not None:
            assert st.p is not None and st.x is not None, "the pivots' scores are prepared before the tiles"
            on = self.pivot[0][rows] >= 0
            p = st.p[rows]
            st.x[rows] = x = st.row[rows] - p
            st.row[rows] = torch.where(on, p + softplus(x), st.row[rows])
        if self.col_pivot is not None and st.col is not None:
            assert st.pc is not None
            st.y = st.col - st.pc
            st.col = torch.where(self.col_pivot[0] >= 0, st.pc + softplus(st.y), st.col)

    def linear_value_weight(self, target: str, weight: Tensor) -> Tensor:
        pivot = self.pivot if target == "row" else self.col_pivot
        return weight if pivot is None else torch.where(pivot[0] >= 0, torch.zeros_like(weight), weight)

    def linear_grad_weight(self, st: _SoftmaxState, target: str, weight: Tensor, rows: slice = slice(None)) -> Tensor:
        pivot = self.pivot if target == "row" else self.col_pivot
        x = st.x if target == "row" else st.y
        if pivot is None:
            return weight[rows]
        assert x is not None, "the pivots' logsumexps are reduced before the gradient"
        w = weight[rows]
        c = self.row_weight[rows] if target == "row" else torch.ones_like(w)
        # -(d loss / d s_ij*) = w - c + c sigmoid(x): small where the positive dominates, and no 1 - 1 in it
        return torch.where(pivot[0][rows] >= 0, (w - c) + c * torch.sigmoid(x[rows]), w)

    def values(self, st: _SoftmaxState) -> Tuple[Tensor, Optional[Tensor]]:
        rows, cols = self.row_weight * st.row, st.col
        if self.pivot is not None and st.x is not None and st.p is not None:
            c, w = self.row_weight, self.pivot[1]
            rows = torch.where(self.pivot[0] >= 0, c * softplus(st.x) + (c - w) * st.p, rows)
        if self.col_pivot is not None and st.y is not None and st.pc is not None and cols is not None:
            cols = torch.where(self.col_pivot[0] >= 0, softplus(st.y) + (1 - self.col_pivot[1]) * st.pc, cols)
        return rows, cols

    def begin_grad(self, st: _SoftmaxState, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.g_row, st.g_col = g_row * self.row_weight, g_col
        empty = st.row == float("-inf")
        if bool(empty.any()):
            # a row with an empty denominator (every entry masked) has no gradient: its
            # logsumexp taken as 0 keeps exp(-inf - lse) = 0 instead of NaN
            st.row = st.row.masked_fill(empty, 0.0)
            st.g_row = st.g_row.masked_fill(empty, 0.0)
        st.alpha = st.beta = None
        if st.shift is not None:
            # G_ij = exp(s_ij - shift) (alpha_i + beta_j): one exp per entry
            st.alpha = st.g_row * torch.exp(st.shift - st.row)
            if st.col is not None and g_col is not None:
                st.beta = g_col * torch.exp(st.shift - st.col)

    def grad(self, s: Tensor, tile: Tile, st: _SoftmaxState, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        rows, cols = slice(tile.r0, tile.r1), slice(tile.c0, tile.c1)
        self._boost_(s, tile)  # the softmax of the boosted logits; d logit / d s = 1 (stop-grad)
        out = None if buf is None else scratch(buf, s)
        colpart = None
        if st.alpha is not None:
            s.sub_(st.fixed_shift).exp_()
            self._pivots_(s, tile, 0.0)  # the pivots' gradient goes through their positive terms
            if st.beta is not None:
                colpart = torch.mul(s, st.beta[cols].unsqueeze(0), out=out)
            if self.masks:
                self._mask_(s, tile, 0.0)
            s.mul_(st.alpha[rows].unsqueeze(1))
        else:
            self._pivots_(s, tile, float("-inf"))
            if st.col is not None and st.g_col is not None:
                colpart = torch.sub(s, st.col[cols].unsqueeze(0), out=out).exp_().mul_(st.g_col[cols].unsqueeze(0))
            if self.masks:
                self._mask_(s, tile, float("-inf"))
            s.sub_(st.row[rows].unsqueeze(1)).exp_().mul_(st.g_row[rows].unsqueeze(1))
        if colpart is not None:
            s.add_(colpart)
        return s

    def rows_fused(self, s: Tensor, tile: Tile, st: _SoftmaxState, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        self._boost_(s, tile)
        self._pivots_(s, tile, float("-inf"))
        if self.masks:
            self._mask_(s, tile, float("-inf"))
        lse, total = lse_inplace(s)  # s: exp(s - the rows' maxima)
        st.row[rows] = lse
        st.summing = False
        factor = 1.0 / total.squeeze(1)
        if self.pivot is not None:  # the softmax with the pivots: exp(s - LSE_without) * exp(LSE_without - LSE)
            self._take_in(st, rows)
            factor = torch.where(total.squeeze(1) > 0, torch.exp(lse - st.row[rows]) * factor, 0.0)
        if g_row is None:
            return None
        return s.mul_(((g_row * self.row_weight)[rows] * factor).unsqueeze(1))

    # ------------------------------------------------------ symmetric panels
    def reduce_panel(self, s: Tensor, tile: Tile, st: _SoftmaxState, p: int, buf: Tensor) -> None:
        b = tile.r1 - tile.r0
        right = tile.c1 > tile.r1
        if st.summing:
            # the accumulators hold sums of exp(s - shift); masked entries are exact zeros
            s.sub_(st.fixed_shift).exp_()
            if self.exclude_self:
                s[:, :b].diagonal().fill_(0.0)
            self._pivots_(s, tile, 0.0)  # in pairs: also the entries of the rows below that the panel stands for
            st.row[tile.r0 : tile.r1] += s.sum(1)
            if right:
                st.row[tile.r1 : tile.c1] += s[:, b:].sum(0)
            return
        if self.exclude_self:
            s[:, :b].diagonal().fill_(float("-inf"))
        self._pivots_(s, tile, float("-inf"))
        if right:
            torch.logaddexp(st.row[tile.r1 : tile.c1], torch.logsumexp(s[:, b:], dim=0), out=st.row[tile.r1 : tile.c1])
        torch.logaddexp(st.row[tile.r0 : tile.r1], torch.logsumexp(s, dim=1), out=st.row[tile.r0 : tile.r1])

    def grad_panel(self, s: Tensor, tile: Tile, st: _SoftmaxState, buf: Tensor) -> Tensor:
        assert st.g_row is not None
        b, r0, c1 = tile.r1 - tile.r0, tile.r0, tile.c1
        other = scratch(buf, s)
        if st.alpha is not None:
            s.sub_(st.fixed_shift).exp_()
            if self.exclude_self:
                s[:, :b].diagonal().fill_(0.0)
            self._pivots_(s, tile, 0.0)
            transposed = torch.mul(s, st.alpha[r0:c1].unsqueeze(0), out=other)
            return s.mul_(st.alpha[r0 : tile.r1].unsqueeze(1)).add_(transposed)
        if self.exclude_self:
            s[:, :b].diagonal().fill_(float("-inf"))
        self._pivots_(s, tile, float("-inf"))
        transposed = torch.sub(s, st.row[r0:c1].unsqueeze(0), out=other).exp_().mul_(st.g_row[r0:c1].unsqueeze(0))
        return (
            s.sub_(st.row[r0 : tile.r1].unsqueeze(1)).exp_().mul_(st.g_row[r0 : tile.r1].unsqueeze(1)).add_(transposed)
        )

    # -------------------------------------------------------- kernel helpers
    def kernel_args(self) -> KernelArgs:
        if self.kernel is None:
            raise ValueError(
                "the triton kernels take no masks computed from the data (same-label keys, a guide "
                "model's false negatives): use backend='tiled'"
            )
        index = self.exclude.index if self.exclude is not None else None
        if self.pivot is not None:  # no other indexed column (the constructor saw to it): the pivots
            index = self.pivot[0]
        if index is not None and index.dim() == 2:
            if index.shape[1] != 1:
                raise ValueError(
                    "the triton kernels leave out at most one column per row besides the anchor "
                    "itself: use backend='tiled'"
                )
            index = index[:, 0]
        if self.exclude_self and self.self_index is not None:
            if index is not None:
                raise ValueError("the triton kernels leave out one indexed column per row: use backend='tiled'")
            return KernelArgs(KernelId.SOFTMAX, False, self.offset, 0.0, self.self_index.contiguous())
        return KernelArgs(
            KernelId.SOFTMAX, self.exclude_self, self.offset, 0.0, None if index is None else index.contiguous()
        )

    def kernel_column_lse(self, st: _SoftmaxState) -> Optional[Tensor]:
        return st.col

    def kernel_state(self, st: _SoftmaxState, row_lse: Tensor, col_lse: Optional[Tensor]) -> None:
        """The reductions as the Triton kernels computed them."""
        st.row, st.col, st.summing = row_lse, col_lse, False
        self._take_in(st)

    def kernel_weights(self, st: _SoftmaxState) -> Tuple[Tensor, Optional[Tensor]]:
        """(weight of each row's softmax, of each column's) for the gradient kernels."""
        assert st.g_row is not None
        return st.g_row, st.g_col

    def kernel_rows(
        self, st: _SoftmaxState, rows: slice, first: Tensor, second: Optional[Tensor], g_row: Optional[Tensor]
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        st.row[rows] = first.to(st.row.dtype)  # complete rows: final (as rows_fused leaves them)
        st.summing = False
        self._take_in(st, rows)  # the pivots taken in: the softmax with them
        return st.row[rows], None if g_row is None else (g_row * self.row_weight)[rows]

    # ------------------------------------------------------------ dense form
    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        lse_in = s
        if self.boost is not None:
            f, fn = self.boost
            lse_in = s + f * torch.where(fn(tile), s.detach(), torch.zeros((), dtype=s.dtype, device=s.device))
        if self.masks or self.pivot is not None:
            mask = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
            self._pivots_(mask, tile, True)  # type: ignore[arg-type]
            pivots = mask.clone()
            if self.masks:
                self._mask_(mask, tile, True)  # type: ignore[arg-type]
            lse_in = lse_in.masked_fill(mask, float("-inf"))
        c = self.row_weight[tile.r0 : tile.r1]
        rows = c * logsumexp_safe(lse_in, 1)
        cols = logsumexp_safe(s, 0) if self.has_columns else None
        if self.pivot is None:
            return rows, cols
        index, w = self.pivot[0][tile.r0 : tile.r1], self.pivot[1][tile.r0 : tile.r1]
        on = index >= 0
        p = s.gather(1, (index - tile.c0).clamp_min(0).unsqueeze(1)).squeeze(1)
        rows = torch.where(on, c * softplus(logsumexp_safe(lse_in, 1) - p) + (c - w) * p, rows)
        if self.col_pivot is not None:
            cin = s.masked_fill(pivots, float("-inf"))
            ci, cw = self.col_pivot
            pc = s.gather(0, ci.clamp_min(0).unsqueeze(0)).squeeze(0)
            cols = torch.where(ci >= 0, softplus(logsumexp_safe(cin, 0) - pc) + (1 - cw) * pc, logsumexp_safe(s, 0))
        return rows, cols


def scattered_lse(x: Tensor, rows: Tensor, m: int) -> Tensor:
    """Each of ``m`` rows' logsumexp of the entries ``x`` that belong to it (``rows``: the
    row of each entry); -inf for a row with none."""
    top = x.new_full((m,), float("-inf")).scatter_reduce_(0, rows, x, "amax")
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = x.new_zeros(m).index_add_(0, rows, (x - safe[rows]).exp_())
    return total.log_().add_(safe)


def softplus(t: Tensor) -> Tensor:
    """``log(1 + exp(t))`` as ``max(t, 0) + log1p(exp(-|t|))``: no overflow, no cut-off,
    exactly 0 (and its gradient 0) at ``-inf``."""
    return t.clamp_min(0) + torch.log1p(torch.exp(-t.abs()))


def logsumexp_safe(t: Tensor, dim: int) -> Tensor:
    """``torch.logsumexp`` whose gradient stays finite where every entry is ``-inf`` (the
    result -inf there, its gradient 0, not NaN)."""
    empty = torch.isneginf(t).all(dim, keepdim=True)
    out = torch.logsumexp(t.masked_fill(empty, 0.0), dim)
    return out.masked_fill(empty.squeeze(dim), float("-inf"))


def _paired(pivot: Optional[Tuple[Tensor, Tensor]], offset: int) -> bool:
    """No pivots, or pivots in pairs over the anchors themselves: row ``i``'s pivot is
    column ``j + offset`` where row ``j``'s is ``i + offset`` (self-contrast's symmetric
    tiles then mask both by one entry)."""
    if pivot is None:
        return True
    index = pivot[0]
    rows = (index >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return True
    if offset != 0 or bool((index[rows] >= index.shape[0]).any()):
        return False
    return bool((index[index[rows]] == rows).all())


def softplus_rows_(t: Tensor, work: Tensor) -> Tuple[Tensor, Tensor]:
    """Row sums of ``softplus(t)`` and ``sigmoid(t)``; leaves ``sigmoid(t)`` in ``t``.
    ``softplus(t) = max(t, 0) + log1p(exp(-|t|))``: no overflow, and no cut-off
    (``F.softplus`` returns ``t`` past 20, an error of ``exp(-20)``). ``work``: a
    free buffer of ``t``'s shape; nothing else of that size is allocated."""
    sp = torch.clamp(t, min=0, out=work).sum(1)
    sp += torch.abs(t, out=work).neg_().exp_().log1p_().sum(1)
    t.sigmoid_()
    return sp, t.sum(1)


class _SoftplusState:
    def __init__(self, m: int, like: Tensor) -> None:
        self.row = like.new_zeros(m)  # sum_j softplus(s_ij + b)
        self.sig = like.new_zeros(m)  # sum_j sigmoid(s_ij + b): the bias's gradient
        self.work = WorkBuffer()
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None


class SoftplusHead(KernelHead):
    """SigLIP's sigmoid loss over pairs: per row ``sum_j softplus(s_ij + b) - b |Pos(i)|``.

    With the positive term ``-sum_{j in Pos(i)} s_ij`` (a :class:`~flashcl.engine.positives.PositiveTerm`
    of the same positives), row ``i``'s loss is ``sum_j -log sigmoid(z_ij (s_ij + b))``,
    ``z_ij = +1`` on the positive pairs and -1 elsewhere, since
    ``softplus(t) - softplus(-t) = t``: the head itself needs no mask, only the bias
    ``b`` and the positive counts. One pass; ``dL/ds_ij = sigmoid(s_ij + b)``
    (weighted) and ``dL/db = sum_ij sigmoid(s_ij + b) - sum_i |Pos(i)|``. Written out: it
    serves the symmetric panels and the ring, and on blocks of complete rows autograd
    through :meth:`dense` took 1.3-1.5x as long (B = 8,192, D = 256, 2-core CPU;
    ``scripts/written_out.py``).

    Args:
        bias: ``b`` (SigLIP's learnable logit bias, as a float).
        counts: ``|Pos(i)|`` (m,).
    """

    kernel: Optional[KernelId] = KernelId.SOFTPLUS
    fuses_rows = True
    symmetric_tiles = True  # no mask: for self-contrast the tile values are symmetric

    def __init__(self, bias: float, counts: Tensor) -> None:
        self.bias = bias
        self.counts = counts

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _SoftplusState:
        return _SoftplusState(m, like)

    def reduce(self, s: Tensor, tile: Tile, st: _SoftplusState, p: int = 0) -> None:
        sp, sig = softplus_rows_(s.add_(self.bias), st.work.like(s))
        st.row[tile.r0 : tile.r1] += sp
        st.sig[tile.r0 : tile.r1] += sig

    def values(self, st: _SoftplusState) -> Tuple[Tensor, Optional[Tensor]]:
        return st.row - self.bias * self.counts.to(st.row.dtype), None

    def begin_grad(self, st: _SoftplusState, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.g_row, st.g_col = g_row, g_col

    def grad(self, s: Tensor, tile: Tile, st: _SoftplusState, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        return torch.sigmoid(s.add_(self.bias), out=s).mul_(st.g_row[tile.r0 : tile.r1].unsqueeze(1))

    def rows_fused(self, s: Tensor, tile: Tile, st: _SoftplusState, g_row: Optional[Tensor]) -> Optional[Tensor]:
        st.row[tile.r0 : tile.r1], st.sig[tile.r0 : tile.r1] = softplus_rows_(s.add_(self.bias), st.work.like(s))
        if g_row is None:
            return None
        st.g_row = g_row  # for param_grads
        return s.mul_(g_row[tile.r0 : tile.r1].unsqueeze(1))  # s now holds sigmoid(s + b)

    def param_grads(self, st: _SoftplusState, n: int) -> Tuple[Optional[Tensor], ...]:
        if n == 0:
            return ()
        if st.g_row is None:
            return (None,)
        return ((st.g_row * (st.sig - self.counts.to(st.sig.dtype))).sum(),)

    def kernel_args(self) -> KernelArgs:
        return KernelArgs(KernelId.SOFTPLUS, bias=self.bias)

    def kernel_state(self, st: _SoftplusState, row: Tensor, sig: Optional[Tensor]) -> None:
        """The row sums as the Triton kernels computed them."""
        assert sig is not None
        st.row, st.sig = row, sig

    def kernel_weights(self, st: _SoftplusState) -> Tuple[Tensor, Optional[Tensor]]:
        assert st.g_row is not None
        return st.g_row, None

    def kernel_rows(
        self, st: _SoftplusState, rows: slice, first: Tensor, second: Optional[Tensor], g_row: Optional[Tensor]
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        assert second is not None
        st.row[rows], st.sig[rows] = first.to(st.row.dtype), second.to(st.sig.dtype)
        if g_row is not None:
            st.g_row = g_row  # for param_grads
        return None, None if g_row is None else g_row[rows]

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        b = params[0].to(s.dtype) if params else torch.tensor(self.bias, dtype=s.dtype, device=s.device)
        t = s + b
        sp = t.clamp_min(0) + torch.log1p(torch.exp(-t.abs()))
        return sp.sum(1) - b * self.counts[tile.r0 : tile.r1].to(s.dtype), None
