"""The one masked-softmax core that every flashcl loss is a configuration of.

For anchors ``Q`` (M x D) and candidates ``K`` (N x D), scores
``s_ij = scale * q_i . k_j`` (rows L2-normalised when ``normalize``), and for
every anchor row ``i``::

    loss_i = c_i * LSE_{j in Den(i)} s_ij  -  a_i * sum_{j in Pos(i)} m_ij * s_ij

* ``Den(i)`` is every column, or every column but ``i + offset`` (``exclude_self``).
* ``Pos(i)`` comes from class ids (``labels``: same class, never the anchor
  itself when ``self_pairs``) or from explicit column indices (``index``,
  repeats count as multiplicities ``m_ij``).
* ``c_i, a_i`` follow from ``pos_mode`` and ``|Pos(i)|`` (with multiplicity):

  ============  =========  ===========  ==========================================
  pos_mode      c_i        a_i          used by
  ============  =========  ===========  ==========================================
  ``"mean"``    1          1/|Pos(i)|   SupCon L_out (anchors with no positive: 0)
  ``"sum"``     1          1            the second seed's supervised SimCSE
  ``"pairs"``   |Pos(i)|   1            one cross-entropy per positive pair (seed 1)
  ============  =========  ===========  ==========================================

``symmetric`` adds the column direction of CLIP: for every column ``j``,
``col_loss_j = LSE_i s_ij - s_jj`` (diagonal positives, M == N).

Every backend (reference, dense, tiled) returns ``(row_loss (M,), col_loss (N,)
or None)`` for the same :class:`CoreSpec`, so that the losses in
:mod:`flashcl.functional` differ only in how they build the spec and reduce.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

POS_MODES = ("mean", "sum", "pairs")


@dataclass(frozen=True, eq=False)
class CoreSpec:
    """Configuration of the core; tensors in it are constants (never differentiated).

    Attributes:
        exclude_self: drop column ``i + offset`` from the denominator of row ``i``.
        self_pairs: column ``i + offset`` is anchor ``i`` itself, so it is never a
            positive of row ``i``.
        offset: column of anchor 0 (non-zero when the anchors are a slice of the
            candidates, as on one rank of a distributed batch).
        row_labels, col_labels: class ids in ``[0, num_classes)``, shapes (M,), (N,).
        num_classes: number of distinct ids when labels are given.
        index: (M, k) int64 positive columns, or None.
        pos_mode: ``"mean"``, ``"sum"`` or ``"pairs"`` (see the module docstring).
        symmetric: add the column direction (CLIP); requires ``index`` to be the diagonal.
        normalize: L2-normalise the rows of Q and K first.
    """

    exclude_self: bool = False
    self_pairs: bool = False
    offset: int = 0
    row_labels: Optional[Tensor] = None
    col_labels: Optional[Tensor] = None
    num_classes: int = 0
    index: Optional[Tensor] = None
    pos_mode: str = "sum"
    symmetric: bool = False
    normalize: bool = True

    def self_mask(self, m: int, n: int, device: torch.device) -> Tensor:
        """(m, n) bool: True at column ``i + offset`` of row ``i``."""
        rows = torch.arange(m, device=device).unsqueeze(1) + self.offset
        return rows == torch.arange(n, device=device).unsqueeze(0)

    def positive_counts(self, m: int) -> Tensor:
        """|Pos(i)| with multiplicity, shape (m,), int64; computed in O(M + N)."""
        if self.index is not None:
            return torch.full((m,), self.index.shape[1], dtype=torch.int64, device=self.index.device)
        assert self.row_labels is not None and self.col_labels is not None
        per_class = torch.bincount(self.col_labels, minlength=self.num_classes)
        counts = per_class[self.row_labels]
        if self.self_pairs:
            n = self.col_labels.shape[0]
            cols = torch.arange(m, device=counts.device) + self.offset
            inside = (cols >= 0) & (cols < n)
            counts = counts - inside.to(counts.dtype)
        return counts

    def weights(self, m: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """The per-row weights ``(c, a)`` of the LSE term and of the positive sum."""
        counts = self.positive_counts(m).to(dtype)
        ones = torch.ones_like(counts)
        if self.pos_mode == "mean":
            has = counts > 0
            return has.to(dtype), torch.where(has, 1.0 / counts.clamp_min(1), torch.zeros_like(counts))
        if self.pos_mode == "pairs":
            return counts, ones
        return ones, ones

    def valid_rows(self, m: int) -> Tensor:
        """Rows that take part in a ``"mean"`` reduction: all, except rows without
        a positive under ``pos_mode="mean"`` (their term is undefined)."""
        if self.pos_mode == "mean":
            return self.positive_counts(m) > 0
        return torch.ones(m, dtype=torch.bool, device=self._device())

    def _device(self) -> torch.device:
        for t in (self.index, self.row_labels):
            if t is not None:
                return t.device
        return torch.device("cpu")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half and bfloat16 inputs (accumulation precision), else unchanged."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def prepare(q: Tensor, k: Optional[Tensor], normalize: bool) -> Tuple[Tensor, Tensor]:
    """Cast to the compute dtype and L2-normalise rows (autograd-tracked, never in
    place); ``k=None`` means ``k = q`` (normalised once)."""
    dtype = compute_dtype(q.dtype)
    q = q.to(dtype)
    same = k is None
    k = q if k is None else k.to(dtype)
    if normalize:
        q = F.normalize(q, dim=1)
        k = q if same else F.normalize(k, dim=1)
    return q, k


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


def differentiable_grads(fn: Callable[..., Tensor], inputs: Sequence[Optional[Tensor]], needs: Sequence[bool],
                         grad_out: Tensor) -> List[Optional[Tensor]]:
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
