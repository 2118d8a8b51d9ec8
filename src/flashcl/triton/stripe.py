"""A stripe's element-wise work in one or two passes: the fused stripe kernels.

The stripes of :mod:`flashcl.engine.stripes` compute each stripe's raw products
``P = X_blk Y^T`` (float32, cuBLAS) and its gradients by two more GEMMs; between them,
the head's element-wise work ran as about ten eager passes over the stripe (two
scalings, the masks, max, exp, sums, logs, the gradient, two casts). These kernels do it
as Liger-Kernel's cross-entropy kernel does for logits: one program per row, a loop over
the row's columns in blocks, the scale and both inverse norms folded in
(``s_ij = scale iq_i ik_j P_ij``):

* :func:`softmax_rows`: the masked softmax's row statistics in one read of the stripe
  (an online max and sum: each row's logsumexp, the anchor itself and one indexed column
  per row left out); then :func:`softmax_grad` writes ``G' = G diag(ik)``,
  ``G_ij = coef_i exp(s_ij - L_i)`` (0 where left out), in the inputs' dtype in a second
  read: the gradient GEMMs take it as it is (``dQ = scale G' Y``, ``dK`` from ``G'^T``
  rescaled by the keys' norms).
* :func:`softplus_rows`: SigLIP's row sums of ``softplus(s + b)`` and ``sigmoid(s + b)``
  and, with a row weight, ``G' = coef sigmoid(s + b) diag(ik)``, in one read.

Traffic per score entry: the GEMM's float32 write, two float32 reads (one for the
softplus head), a 2-byte ``G'`` written once and read by the two GEMMs: about 18 bytes,
against about 80 for the eager passes. Under Triton's CPU interpreter (tests) the kernels
run as written, one program after another.
"""

# No ``from __future__ import annotations``: Triton reads ``tl.constexpr`` from the annotations.
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["softmax_rows", "softmax_grad", "softplus_rows", "BLOCK_N"]

#: columns a program reads at a time
BLOCK_N = 1024


@triton.jit
def _scaled(p_ptr, row, cols, n, stride_p, ik_ptr, a):
    """A block of row ``row``'s scores ``a ik_j P_ij`` (``a = scale iq_i``), and ``ik_j``."""
    inside = cols < n
    p = tl.load(p_ptr + row * stride_p + cols, mask=inside, other=0.0).to(tl.float32)
    ik = tl.load(ik_ptr + cols, mask=inside, other=0.0)
    return p * (a * ik), ik


@triton.jit
def _left_out(cols, n, row_global, offset, excl_ptr, row, EXCL_SELF: tl.constexpr, HAS_EXCL: tl.constexpr):
    """The columns out of the row's denominator: past the end, the anchor itself
    (``row_global + offset``), the row's indexed column (``excl[row]``, -1: none)."""
    out = cols >= n
    if EXCL_SELF:
        out = out | (cols == row_global + offset)
    if HAS_EXCL:
        e = tl.load(excl_ptr + row)
        out = out | (cols == e)
    return out


@triton.jit
def _softmax_rows_kernel(
    p_ptr,
    stride_p,
    iq_ptr,
    ik_ptr,
    excl_ptr,
    lse_ptr,
    n,
    r0,
    offset,
    scale,
    EXCL_SELF: tl.constexpr,
    HAS_EXCL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    a = scale * tl.load(iq_ptr + row)
    m = -float("inf")
    total = 0.0
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        s, ik = _scaled(p_ptr, row, cols, n, stride_p, ik_ptr, a)
        out = _left_out(cols, n, r0 + row, offset, excl_ptr, row, EXCL_SELF, HAS_EXCL)
        s = tl.where(out, -float("inf"), s)
        top = tl.maximum(m, tl.max(s, 0))
        # an all-masked prefix keeps (m, total) = (-inf, 0): no exp(-inf - -inf)
        keep = tl.where(top == -float("inf"), 0.0, tl.exp(m - top))
        e = tl.where(out, 0.0, tl.exp(s - top))
        total = total * keep + tl.sum(e, 0)
        m = top
    lse = tl.where(total > 0, m + tl.log(total), -float("inf"))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _softmax_grad_kernel(
    p_ptr,
    stride_p,
    iq_ptr,
    ik_ptr,
    excl_ptr,
    lse_ptr,
    coef_ptr,
    g_ptr,
    stride_g,
    n,
    r0,
    offset,
    scale,
    EXCL_SELF: tl.constexpr,
    HAS_EXCL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    a = scale * tl.load(iq_ptr + row)
    lse = tl.load(lse_ptr + row)
    c = tl.load(coef_ptr + row)
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        s, ik = _scaled(p_ptr, row, cols, n, stride_p, ik_ptr, a)
        # a row whose lse is -inf has every column out: where() keeps its exp(s + inf) out of G
        out = _left_out(cols, n, r0 + row, offset, excl_ptr, row, EXCL_SELF, HAS_EXCL)
        g = tl.where(out, 0.0, c * tl.exp(s - lse) * ik)
        tl.store(g_ptr + row * stride_g + cols, g.to(g_ptr.dtype.element_ty), mask=cols < n)


@triton.jit
def _softplus_rows_kernel(
    p_ptr,
    stride_p,
    iq_ptr,
    ik_ptr,
    coef_ptr,
    sp_ptr,
    sig_ptr,
    g_ptr,
    stride_g,
    n,
    scale,
    bias,
    WRITE_G: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    a = scale * tl.load(iq_ptr + row)
    c = 0.0
    if WRITE_G:
        c = tl.load(coef_ptr + row)
    sp_sum = 0.0
    sig_sum = 0.0
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < n
        s, ik = _scaled(p_ptr, row, cols, n, stride_p, ik_ptr, a)
        t = s + bias
        e = tl.exp(-tl.abs(t))
        sp = tl.maximum(t, 0.0) + tl.log(1.0 + e)  # softplus(t), no overflow
        sig = tl.where(t >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        sp_sum += tl.sum(tl.where(inside, sp, 0.0), 0)
        sig_sum += tl.sum(tl.where(inside, sig, 0.0), 0)
        if WRITE_G:
            tl.store(g_ptr + row * stride_g + cols, (c * sig * ik).to(g_ptr.dtype.element_ty), mask=inside)
    tl.store(sp_ptr + row, sp_sum)
    tl.store(sig_ptr + row, sig_sum)


def _excl(excluded: Optional[Tensor], r0: int, r1: int, like: Tensor) -> Tuple[Tensor, bool]:
    """The stripe's rows' indexed columns (int64), or a placeholder."""
    if excluded is None:
        return like.new_zeros(1, dtype=torch.int64), False
    return excluded[r0:r1].contiguous(), True


def softmax_rows(
    p: Tensor,
    iq: Tensor,
    ik: Tensor,
    scale: float,
    r0: int,
    exclude_self: bool,
    offset: int,
    excluded: Optional[Tensor],
) -> Tensor:
    """Each row's logsumexp of ``s = scale iq_i ik_j p_ij`` over the columns in its
    denominator (the anchor itself out with ``exclude_self``: column ``r0 + i + offset``;
    ``excluded``: one more column per row of the whole batch, -1 for none), float32;
    ``-inf`` where every column is out. ``p``: the stripe's raw products (rows r0 .. r0 +
    len(p)), ``iq``: those rows' inverse norms, ``ik``: every column's."""
    b, n = p.shape
    lse = torch.empty(b, dtype=torch.float32, device=p.device)
    excl, has = _excl(excluded, r0, r0 + b, lse)
    if b:
        _softmax_rows_kernel[(b,)](p, p.stride(0), iq, ik, excl, lse, n, r0, offset, scale, exclude_self, has, BLOCK_N)
    return lse


def softmax_grad(
    p: Tensor,
    iq: Tensor,
    ik: Tensor,
    scale: float,
    r0: int,
    exclude_self: bool,
    offset: int,
    excluded: Optional[Tensor],
    lse: Tensor,
    coef: Tensor,
    out: Tensor,
) -> Tensor:
    """``out = G diag(ik)``, ``G_ij = coef_i exp(s_ij - lse_i)`` (0 on the columns out of
    row ``i``'s denominator, and on a row whose ``lse`` is ``-inf``), written in ``out``'s
    dtype (the inputs'), for the stripe of :func:`softmax_rows`."""
    b, n = p.shape
    excl, has = _excl(excluded, r0, r0 + b, lse)
    if b:
        _softmax_grad_kernel[(b,)](
            p,
            p.stride(0),
            iq,
            ik,
            excl,
            lse.contiguous(),
            coef.to(torch.float32).contiguous(),
            out,
            out.stride(0),
            n,
            r0,
            offset,
            scale,
            exclude_self,
            has,
            BLOCK_N,
        )
    return out


def softplus_rows(
    p: Tensor, iq: Tensor, ik: Tensor, scale: float, bias: float, coef: Optional[Tensor], out: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    """Each row's sums of ``softplus(s + bias)`` and ``sigmoid(s + bias)`` (float32), and
    with ``coef`` (the rows' weights) ``out = coef_i sigmoid(s_ij + bias) ik_j`` written
    in ``out``'s dtype, in one read of the stripe."""
    b, n = p.shape
    sp = torch.empty(b, dtype=torch.float32, device=p.device)
    sig = torch.empty_like(sp)
    write = coef is not None and out is not None
    if b:
        _softplus_rows_kernel[(b,)](
            p,
            p.stride(0),
            iq,
            ik,
            coef.to(torch.float32).contiguous() if write else sp,  # type: ignore[union-attr]
            sp,
            sig,
            out if write else sp,
            out.stride(0) if write else 0,  # type: ignore[union-attr]
            n,
            scale,
            bias,
            write,
            BLOCK_N,
        )
    return sp, sig
