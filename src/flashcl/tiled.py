"""The tiled backend: the core without ever holding the M x N matrix.

The anchors are processed in blocks of ``block`` rows. Each block's scores
``S = scale * Q_blk K^T`` (block x N) live in one buffer that is reused for
every block: a fresh allocation per block would cost page faults that on a
CPU take longer than the block's arithmetic. Per block:

* forward: the row logsumexp over ``Den(i)`` (masked to ``-inf``, never
  subtracted), and for CLIP a running column logsumexp merged with
  ``logaddexp`` across blocks (as Inf-CL does);
* backward: the block is rebuilt from ``Q``, ``K`` and the saved LSE, turned
  into ``G = dloss/dS`` in place, and ``dQ_blk = G K``, ``dK += G^T Q_blk``.

Positives never need the matrix: ``sum_j m_ij s_ij`` is bilinear in the
embeddings, so it is computed, and differentiated, in embedding space
(class sums of K for labels, a gather of K rows for indices) in O((M + N) D).

When the loss is reduced to a scalar and a gradient will be needed, the
gradient is formed during the forward pass (as Liger-Kernel's fused linear
cross-entropy does): each block's softmax is at hand right after its LSE, so
a loss over rows costs three GEMMs (S, G K, G^T Q) instead of four (the
recomputation of S in backward). Measured on the 2-core CPU (InfoNCE,
B = 8192, D = 768, alternating with the three-GEMM bound): 1.19x fused
against 1.57x for the same loss through ``reduction="none"`` (unfused).
Backward then only scales the stored gradients by ``grad_output``.
CLIP needs the column LSE of the whole matrix before any column's softmax is
known, so its fused path is two passes (four GEMMs, the floor).
Self-contrast (SupCon, NT-Xent) takes the symmetric path (``_self_lse``,
``_self_grad_pass``): two GEMM units, fused or not.

L2 normalisation happens inside the Function, and its backward is applied to
the stored gradient in place, so that neither the normalised embeddings nor
their gradient outlive the forward pass.

The score-matrix variant (:class:`TiledScores`, ``neighbor_loss``) writes the
gradient block by block into the one n x n tensor it returns, so that it
allocates nothing else of that size.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import dense
from .core import CoreSpec, autocast_off, compute_dtype, differentiable_grads

_NORM_EPS = 1e-12  # F.normalize's default


def auto_block(m: int, n: int, dtype: torch.dtype = torch.float32, self_contrast: bool = False) -> int:
    """Rows per block, from measurements on the 2-core CPU at B = 8192, D = 768.

    Self-contrast (SupCon, NT-Xent: the symmetric upper-panel path): buffers
    near 8 MB, at least 128 rows. Its GEMM work is already two thirds of the
    unsymmetric path's, 256-row panels ran as fast as 512 (0.82-0.94x of the
    three-GEMM bound) with half the buffer memory.
    Otherwise (CLIP, InfoNCE): buffers near 16 MB, at least 256 rows: the block
    GEMMs (inner dimension = block rows for ``G^T Q_blk``) lose ~30% of their
    speed at 256 rows and CLIP went from ~1.65x to ~1.4x of the bound at 512.
    """
    budget, floor = (8 * 2**20, 128) if self_contrast else (16 * 2**20, 256)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = max(budget // max(1, n * itemsize), floor)
    return int(max(1, min(m, rows)))


class _RowScaled:
    """Rows of ``x`` times ``s``, made on demand (``rows[i:j]``, ``rows[index]``):
    the normalised embeddings of the self-contrast path without a copy of E."""

    def __init__(self, x: Tensor, s: Tensor) -> None:
        self.x, self.s, self.shape = x, s, x.shape

    def __getitem__(self, idx: Any) -> Tensor:
        return self.x[idx] * self.s[idx].unsqueeze(-1)


Rows = Any  # a Tensor or a _RowScaled


def _prepare(x: Tensor, normalize: bool, dtype: torch.dtype, lazy: bool = False) -> Tuple[Rows, Optional[Tensor]]:
    """Cast (never in place) and optionally L2-normalise rows; returns (rows, norms).
    ``lazy``: the normalised rows as a :class:`_RowScaled` view of x (no copy)."""
    x = x.detach().to(dtype)
    if not normalize:
        return x, None
    norms = torch.linalg.vector_norm(x, dim=1).clamp_min(_NORM_EPS)
    if lazy:
        return _RowScaled(x, 1.0 / norms), norms
    return x / norms.unsqueeze(1), norms


def _raw(rows: Rows) -> Tuple[Tensor, Optional[Tensor]]:
    """(the tensor behind rows, the row scale or None)."""
    return (rows.x, rows.s) if isinstance(rows, _RowScaled) else (rows, None)


def _normalize_backward_(grad: Tensor, y: Tensor, norms: Tensor, block: int) -> None:
    """In place: d(x / max(|x|, eps))/dx applied to ``grad``, given y = x/|x|."""
    projected = norms > _NORM_EPS
    for r0 in range(0, grad.shape[0], block):
        g, yb = grad[r0:r0 + block], y[r0:r0 + block]
        dot = (g * yb).sum(1) * projected[r0:r0 + block]
        g.sub_(yb * dot.unsqueeze(1)).div_(norms[r0:r0 + block].unsqueeze(1))


def _mask_self_(s_blk: Tensor, r0: int, offset: int, value: float) -> None:
    s_blk.diagonal(offset=r0 + offset).fill_(value)


def _lse_inplace(s_blk: Tensor) -> Tuple[Tensor, Tensor]:
    """Row logsumexp of ``s_blk``; leaves ``exp(s - rowmax)`` in it, returns (lse, rowsum)."""
    mx = s_blk.amax(1, keepdim=True)
    s_blk.sub_(mx).exp_()
    total = s_blk.sum(1, keepdim=True)
    return (mx + total.log()).squeeze(1), total


def _class_sums(x: Tensor, ids: Tensor, num_classes: int, block: int, weight: Optional[Tensor] = None) -> Tensor:
    """sum of the rows of x (times weight) per class id: (num_classes, D), in row blocks
    so that no temporary of x's size is made."""
    out = _raw(x)[0].new_zeros(num_classes, x.shape[1])
    for r0 in range(0, x.shape[0], block):
        rows = x[r0:r0 + block]
        out.index_add_(0, ids[r0:r0 + block], rows if weight is None else rows * weight[r0:r0 + block].unsqueeze(1))
    return out


def _self_rows(r0: int, r1: int, offset: int, n: int) -> Tuple[int, int]:
    """Rows [a, b) of the block [r0, r1) whose own column i + offset lies in [0, n)."""
    a = min(max(r0, -offset), r1)
    b = max(min(r1, n - offset), a)
    return a, b


def _positive_raw(q: Tensor, k: Tensor, spec: CoreSpec, block: int) -> Tensor:
    """sum_j m_ij q_i . k_j per anchor (M,), without the M x N matrix."""
    m, n = q.shape[0], k.shape[0]
    out = _raw(q)[0].new_empty(m)
    sums = None
    if spec.index is None:
        assert spec.row_labels is not None and spec.col_labels is not None
        sums = _class_sums(k, spec.col_labels, spec.num_classes, block)
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        qb = q[r0:r1]
        if sums is None:
            out[r0:r1] = torch.einsum("bd,bkd->b", qb, k[spec.index[r0:r1]])
            continue
        out[r0:r1] = (qb * sums[spec.row_labels[r0:r1]]).sum(1)
        if spec.self_pairs:
            a, b = _self_rows(r0, r1, spec.offset, n)
            out[a:b] -= (q[a:b] * k[a + spec.offset:b + spec.offset]).sum(1)
    return out


def _positive_grad_(q: Tensor, k: Tensor, scale: float, spec: CoreSpec, w: Tensor,
                    dq: Tensor, dk: Tensor, block: int) -> None:
    """Adds the gradient of ``-sum_i w_i sum_j m_ij s_ij`` to dq, dk (s = scale q.k)."""
    m, n = q.shape[0], k.shape[0]
    if spec.index is not None:
        kk = spec.index.shape[1]
        for r0 in range(0, m, block):
            r1 = min(r0 + block, m)
            idx = spec.index[r0:r1]
            wb = (w[r0:r1] * -scale).unsqueeze(1)
            dq[r0:r1].add_(k[idx].sum(1) * wb)
            dk.index_add_(0, idx.reshape(-1), (q[r0:r1] * wb).repeat_interleave(kk, dim=0))
        return
    assert spec.row_labels is not None and spec.col_labels is not None
    k_sums = _class_sums(k, spec.col_labels, spec.num_classes, block)
    wq_sums = _class_sums(q, spec.row_labels, spec.num_classes, block, weight=w)
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        dq[r0:r1].sub_(k_sums[spec.row_labels[r0:r1]] * (w[r0:r1] * scale).unsqueeze(1))
    for c0 in range(0, n, block):
        c1 = min(c0 + block, n)
        dk[c0:c1].sub_(wq_sums[spec.col_labels[c0:c1]], alpha=scale)
    if spec.self_pairs:
        for r0 in range(0, m, block):
            a, b = _self_rows(r0, min(r0 + block, m), spec.offset, n)
            ws = (w[a:b] * scale).unsqueeze(1)
            dq[a:b].add_(k[a + spec.offset:b + spec.offset] * ws)
            dk[a + spec.offset:b + spec.offset].add_(q[a:b] * ws)


class _Workspace:
    """Block buffers allocated once per call and reused for every block."""

    def __init__(self, block: int, n: int, d: int, like: Tensor, two: bool):
        self.s = like.new_empty(block, n)
        self.s2 = like.new_empty(block, n) if two else None
        self.gk = like.new_empty(block, d)


def _accumulate(g: Tensor, r0: int, q: Tensor, k: Tensor, scale: float, dq: Tensor, dk: Tensor,
                ws: _Workspace) -> Tensor:
    """dq_blk += scale G K, dk += scale G^T Q_blk; returns sum_ij G_ij q_i.k_j (for d scale)."""
    b = g.shape[0]
    qb = q[r0:r0 + b]
    gk = torch.mm(g, k, out=ws.gk[:b])
    dscale = torch.dot(gk.reshape(-1), qb.reshape(-1))
    dq[r0:r0 + b].add_(gk, alpha=scale)
    dk.addmm_(g.T, qb, alpha=scale)
    return dscale


def _grad_pass(q: Tensor, k: Tensor, scale: float, spec: CoreSpec, row_lse: Tensor,
               col_lse: Optional[Tensor], g_row: Tensor, g_col: Optional[Tensor],
               dq: Tensor, dk: Tensor, block: int) -> Tensor:
    """The LSE terms' gradient, rebuilding every block from Q, K and the saved LSE.

    ``G_ij = g_row_i exp(s_ij - lse_i) [j in Den(i)] + g_col_j exp(s_ij - lse'_j)``.
    Returns sum_ij G_ij q_i.k_j.
    """
    m, n, d = q.shape[0], k.shape[0], q.shape[1]
    ws = _Workspace(min(block, m), n, d, q, two=col_lse is not None)
    dscale = q.new_zeros(())
    shift = _bound_shift(q, k, scale)
    if shift is not None:
        # G_ij = exp(s_ij - shift) (alpha_i + beta_j): one exp per element
        alpha = g_row * torch.exp(shift - row_lse)
        beta = g_col * torch.exp(shift - col_lse) if col_lse is not None and g_col is not None else None
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        s = torch.mm(q[r0:r1] * scale, k.T, out=ws.s[:r1 - r0])
        if shift is not None:
            s.sub_(shift).exp_()
            if beta is not None:
                assert ws.s2 is not None
                colpart = torch.mul(s, beta.unsqueeze(0), out=ws.s2[:r1 - r0])
            if spec.exclude_self:
                _mask_self_(s, r0, spec.offset, 0.0)
            s.mul_(alpha[r0:r1].unsqueeze(1))
            if beta is not None:
                s.add_(colpart)
            dscale += _accumulate(s, r0, q, k, scale, dq, dk, ws)
            continue
        if col_lse is not None:
            assert g_col is not None and ws.s2 is not None
            colpart = torch.sub(s, col_lse.unsqueeze(0), out=ws.s2[:r1 - r0]).exp_().mul_(g_col.unsqueeze(0))
        if spec.exclude_self:
            _mask_self_(s, r0, spec.offset, float("-inf"))
        s.sub_(row_lse[r0:r1].unsqueeze(1)).exp_().mul_(g_row[r0:r1].unsqueeze(1))
        if col_lse is not None:
            s.add_(colpart)
        dscale += _accumulate(s, r0, q, k, scale, dq, dk, ws)
    return dscale


def _forward_pass(q: Tensor, k: Tensor, scale: float, spec: CoreSpec, block: int,
                  g_row: Optional[Tensor], dq: Optional[Tensor], dk: Optional[Tensor]
                  ) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """Row LSE (M,), column LSE (N,) for CLIP, and, when ``g_row`` is given and
    there is no column term, the LSE gradient accumulated into dq, dk in the same
    pass. Returns (row_lse, col_lse, dscale)."""
    m, n, d = q.shape[0], k.shape[0], q.shape[1]
    ws = _Workspace(min(block, m), n, d, q, two=False)
    row_lse = q.new_empty(m)
    col_lse = q.new_full((n,), float("-inf")) if spec.symmetric else None
    dscale = q.new_zeros(())
    # CLIP's column sums: with a bound shift, the row and column sums of one exp
    col_shift = _bound_shift(q, k, scale) if col_lse is not None and g_row is None else None
    col_sum = q.new_zeros(n) if col_shift is not None else None
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        s = torch.mm(q[r0:r1] * scale, k.T, out=ws.s[:r1 - r0])
        if col_shift is not None and col_sum is not None and not spec.exclude_self:
            s.sub_(col_shift).exp_()
            col_sum += s.sum(0)
            row_lse[r0:r1] = s.sum(1).log_().add_(col_shift)
            continue
        if col_lse is not None:
            torch.logaddexp(col_lse, torch.logsumexp(s, dim=0), out=col_lse)
        if spec.exclude_self:
            _mask_self_(s, r0, spec.offset, float("-inf"))
        lse, total = _lse_inplace(s)
        row_lse[r0:r1] = lse
        if g_row is not None:
            assert dq is not None and dk is not None
            s.mul_(g_row[r0:r1].unsqueeze(1) / total)
            dscale += _accumulate(s, r0, q, k, scale, dq, dk, ws)
    if col_sum is not None and col_shift is not None:
        col_lse = col_sum.log_().add_(col_shift)
    return row_lse, col_lse, dscale


def _panel(buf: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous (rows, cols) view at the start of a flat buffer."""
    return buf[:rows * cols].view(rows, cols)


def _uses_symmetry(k_in: Optional[Tensor], spec: CoreSpec) -> bool:
    """Self-contrast with the self mask on the diagonal: S = s E E^T is symmetric,
    so only the blocks on and above the diagonal need computing."""
    return k_in is None and spec.offset == 0 and not spec.symmetric


def _max_row_norm(rows: Rows) -> float:
    raw, inv = _raw(rows)
    norms = torch.linalg.vector_norm(raw, dim=1)
    return float((norms if inv is None else norms * inv).max())


def _bound_shift(q: Rows, k: Optional[Rows], scale: float) -> Optional[float]:
    """A shift ``c >= max |s_ij|`` (Cauchy-Schwarz: scale * max |q_i| * max |k_j|)
    when ``exp(s - c)`` cannot underflow, i.e. ``2c`` is within the dtype's
    exponent range; else None. With it, the row and the column sums of one
    ``exp(S - c)`` block give both directions' LSE, and a gradient block is one
    exp and two scalings: one exp per element instead of two (for unit-norm
    embeddings: temperature above ~0.025, or a CLIP logit scale below 40, in
    float32)."""
    limit = 80.0 if _raw(q)[0].dtype == torch.float32 else 700.0
    qmax = _max_row_norm(q)
    kmax = qmax if k is None or k is q else _max_row_norm(k)
    c = scale * qmax * kmax
    return c if math.isfinite(c) and 2.0 * c <= limit else None


def _self_buffers(e: Rows, block: int) -> Tuple[Tensor, Tensor]:
    """The two flat panel buffers of the self-contrast passes, shared by both
    passes of one call (one set of block buffers per call, not per pass)."""
    size = min(block, e.shape[0]) * e.shape[0]
    raw = _raw(e)[0]
    return raw.new_empty(size), raw.new_empty(size)


def _self_panel(raw: Tensor, inv: Optional[Tensor], scale: float, r0: int, r1: int, buf: Tensor) -> Tensor:
    """S[r0:r1, r0:] = scale * inv_i inv_j e_i . e_j into buf (inv None: no row scale)."""
    m = raw.shape[0]
    left = raw[r0:r1] * (scale if inv is None else (inv[r0:r1] * scale).unsqueeze(1))
    s = torch.mm(left, raw[r0:].T, out=_panel(buf, r1 - r0, m - r0))
    if inv is not None:
        s.mul_(inv[r0:].unsqueeze(0))
    return s


def _self_lse(e: Rows, scale: float, spec: CoreSpec, block: int, shift: Optional[float], buf: Tensor) -> Tensor:
    """Row LSE of S = scale E E^T from the upper panels only: each panel
    ``S[I, I:]`` gives its rows' partial LSE and, transposed, the columns' right
    of the diagonal block."""
    m = e.shape[0]
    raw, inv = _raw(e)
    acc = raw.new_zeros(m) if shift is not None else raw.new_full((m,), float("-inf"))
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        b = r1 - r0
        s = _self_panel(raw, inv, scale, r0, r1, buf)
        if shift is not None:
            # acc holds sums of exp(s - shift); masked entries are exact zeros
            s.sub_(shift).exp_()
            if spec.exclude_self:
                s[:, :b].diagonal().fill_(0.0)
            acc[r0:r1] += s.sum(1)
            if r1 < m:
                acc[r1:] += s[:, b:].sum(0)
            continue
        if spec.exclude_self:
            s[:, :b].diagonal().fill_(float("-inf"))
        if r1 < m:
            torch.logaddexp(acc[r1:], torch.logsumexp(s[:, b:], dim=0), out=acc[r1:])
        torch.logaddexp(acc[r0:r1], torch.logsumexp(s, dim=1), out=acc[r0:r1])
    return acc.log_().add_(shift) if shift is not None else acc


def _self_grad_pass(e: Rows, scale: float, spec: CoreSpec, lse: Tensor, g: Tensor, de: Tensor,
                    block: int, shift: Optional[float], bufs: Tuple[Tensor, Tensor]) -> Tensor:
    """The LSE terms' gradient for self-contrast from the upper panels only.

    With ``G_ij = g_i exp(s_ij - lse_i)`` (masked), d loss/dE = scale (G + G^T) E.
    ``H = G + G^T`` is symmetric and each upper panel gives both ``H[I, I:]`` and
    ``H[I:, I]``, so the whole gradient costs one S recomputation over half the
    matrix and two GEMMs over half of it: one GEMM of B^2 D in all, where the
    unsymmetric path needs two. With a ``shift``,
    ``H_ij = exp(s_ij - shift) (alpha_i + alpha_j)``, ``alpha = g exp(shift - lse)``:
    one exp per element. Returns sum_ij G_ij e_i.e_j (for d scale).

    With lazily normalised rows (``e`` a :class:`_RowScaled` of raw rows x with
    scale inv), the GEMMs use x and ``diag(inv) H diag(inv)``, and ``de``
    receives ``diag(inv) dE``: the caller multiplies its rows by the norms.
    """
    m = e.shape[0]
    raw, inv = _raw(e)
    buf, buf2 = bufs
    gk = raw.new_empty(min(block, m), raw.shape[1])
    dscale = raw.new_zeros(())
    alpha = g * torch.exp(shift - lse) if shift is not None else None
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        b = r1 - r0
        er = raw[r0:r1]
        h = _self_panel(raw, inv, scale, r0, r1, buf)
        if alpha is not None:
            h.sub_(shift).exp_()
            if spec.exclude_self:
                h[:, :b].diagonal().fill_(0.0)
            transposed = torch.mul(h, alpha[r0:].unsqueeze(0), out=_panel(buf2, b, m - r0))
            h.mul_(alpha[r0:r1].unsqueeze(1)).add_(transposed)
        else:
            if spec.exclude_self:
                h[:, :b].diagonal().fill_(float("-inf"))
            transposed = torch.sub(h, lse[r0:].unsqueeze(0), out=_panel(buf2, b, m - r0))
            transposed.exp_().mul_(g[r0:].unsqueeze(0))
            h.sub_(lse[r0:r1].unsqueeze(1)).exp_().mul_(g[r0:r1].unsqueeze(1)).add_(transposed)
        if inv is not None:
            h.mul_(inv[r0:r1].unsqueeze(1)).mul_(inv[r0:].unsqueeze(0))
        # diagonal block: H_II = G_II + G_II^T, counted once
        part = torch.mm(h[:, :b], er, out=gk[:b])
        dscale += 0.5 * torch.dot(part.reshape(-1), er.reshape(-1))
        de[r0:r1].add_(part, alpha=scale)
        if r1 < m:
            rest = h[:, b:]
            part = torch.mm(rest, raw[r1:], out=gk[:b])
            dscale += torch.dot(part.reshape(-1), er.reshape(-1))
            de[r0:r1].add_(part, alpha=scale)
            de[r1:].addmm_(rest.T, er, alpha=scale)
    return dscale


class TiledCore(torch.autograd.Function):
    """Core losses of embeddings in blocks; see the module docstring.

    ``apply(q, k, scale, spec, reduce_weights, block)``: ``k=None`` means the
    candidates are the anchors (one gradient). ``reduce_weights=None`` returns the
    per-row losses, with the column losses appended for CLIP: shape (M,) or
    (M + N,). ``reduce_weights=(r, u)`` returns ``sum r * row_loss + sum u * col_loss``
    and, when a gradient is needed, computes it during the forward pass.
    """

    @staticmethod
    def forward(ctx: Any, q_in: Tensor, k_in: Optional[Tensor], scale: Tensor, spec: CoreSpec,
                reduce_weights: Optional[Tuple[Tensor, Optional[Tensor]]], block: int) -> Tensor:
        dtype = compute_dtype(q_in.dtype)
        symmetric_scores = _uses_symmetry(k_in, spec)
        q, q_norms = _prepare(q_in, spec.normalize, dtype, lazy=symmetric_scores)
        k, k_norms = (q, q_norms) if k_in is None else _prepare(k_in, spec.normalize, dtype)
        s = float(scale)
        m = q.shape[0]
        c, a = spec.weights(m, dtype)
        needs_grad = any(ctx.needs_input_grad[:3])
        fused = reduce_weights is not None and needs_grad

        dq = dk = None
        g_row = None
        if fused:
            r, u = reduce_weights
            dk = torch.zeros_like(_raw(k)[0])
            dq = dk if k_in is None else torch.zeros_like(q)
            g_row = None if spec.symmetric else r * c
        if symmetric_scores:
            shift = _bound_shift(q, None, s)
            bufs = _self_buffers(q, block)
            row_lse, col_lse = _self_lse(q, s, spec, block, shift, bufs[0]), None
            dscale = row_lse.new_zeros(())
            if fused:
                assert dq is not None and g_row is not None
                dscale = _self_grad_pass(q, s, spec, row_lse, g_row, dq, block, shift, bufs)
                _unscale_(dq, q_norms, q)
            del bufs
        else:
            row_lse, col_lse, dscale = _forward_pass(q, k, s, spec, block, g_row, dq, dk)

        raw_pos = _positive_raw(q, k, spec, block)
        row_loss = c * row_lse - a * (s * raw_pos)
        losses = row_loss
        raw_diag = None
        if spec.symmetric:
            raw_diag = (q * k).sum(1)
            losses = torch.cat([row_loss, col_lse - s * raw_diag])

        ctx.spec, ctx.block, ctx.same = spec, block, k_in is None
        ctx.reduce_weights = reduce_weights
        ctx.grads = None
        if needs_grad:
            ctx.save_for_backward(q_in, k_in, scale, row_lse, col_lse, raw_pos, raw_diag)
        if reduce_weights is None:
            return losses
        r, u = reduce_weights
        out = (r * row_loss).sum()
        if spec.symmetric:
            assert u is not None and col_lse is not None and raw_diag is not None
            out = out + (u * (col_lse - s * raw_diag)).sum()
        if fused:
            assert dq is not None and dk is not None
            if spec.symmetric:
                dscale += _grad_pass(q, k, s, spec, row_lse, col_lse, r * c, u, dq, dk, block)
            ctx.grads = _finish_grads(q, k, q_norms, k_norms, q_in, k_in, s, spec, dq, dk, dscale,
                                      raw_pos, raw_diag, r * a, u, block)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor):  # type: ignore[override]
        q_in, k_in, scale, row_lse, col_lse, raw_pos, raw_diag = ctx.saved_tensors
        spec, block = ctx.spec, ctx.block
        need_q, need_k, need_s = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: a gradient that can be differentiated again
            ctx.grads = None
            dq, dk, dscale = differentiable_grads(
                lambda q, k, sc: dense.core_output(q, k, sc, spec, ctx.reduce_weights),
                (q_in, k_in, scale), (need_q, need_k, need_s), grad_out)
            return dq, dk, dscale, None, None, None
        with autocast_off(q_in.device.type):
            dq, dk, dscale = TiledCore._backward(ctx, grad_out, q_in, k_in, scale, row_lse, col_lse, raw_pos,
                                                 raw_diag)
        return (dq if need_q else None, dk if need_k else None,
                dscale.to(scale.dtype) if need_s else None, None, None, None)

    @staticmethod
    def _backward(ctx: Any, grad_out: Tensor, q_in: Tensor, k_in: Optional[Tensor], scale: Tensor,
                  row_lse: Tensor, col_lse: Optional[Tensor], raw_pos: Tensor, raw_diag: Optional[Tensor]
                  ) -> Tuple[Tensor, Optional[Tensor], Tensor]:
        spec, block = ctx.spec, ctx.block
        if ctx.grads is not None:
            # Stored by the fused forward; handed over (not copied) the first time.
            dq, dk, dscale = ctx.grads
            ctx.grads = None
            if not bool((grad_out == 1).all()):
                dq.mul_(grad_out)
                if dk is not None:
                    dk.mul_(grad_out)
                dscale = dscale * grad_out
        else:
            m = q_in.shape[0]
            dtype = compute_dtype(q_in.dtype)
            if ctx.reduce_weights is not None:
                r, u = ctx.reduce_weights
                g_row = r * grad_out
                g_col = None if u is None else u * grad_out
            else:
                g_row = grad_out[:m].to(dtype)
                g_col = grad_out[m:].to(dtype) if spec.symmetric else None
            symmetric_scores = _uses_symmetry(k_in, spec)
            q, q_norms = _prepare(q_in, spec.normalize, dtype, lazy=symmetric_scores)
            k, k_norms = (q, q_norms) if ctx.same else _prepare(k_in, spec.normalize, dtype)
            c, a = spec.weights(m, dtype)
            s = float(scale)
            dk = torch.zeros_like(_raw(k)[0])
            dq = dk if ctx.same else torch.zeros_like(q)
            if symmetric_scores:
                dscale = _self_grad_pass(q, s, spec, row_lse, g_row * c, dq, block, _bound_shift(q, None, s),
                                         _self_buffers(q, block))
                _unscale_(dq, q_norms, q)
            else:
                dscale = _grad_pass(q, k, s, spec, row_lse, col_lse, g_row * c, g_col, dq, dk, block)
            dq, dk, dscale = _finish_grads(q, k, q_norms, k_norms, q_in, k_in, s, spec, dq, dk, dscale,
                                           raw_pos, raw_diag, g_row * a, g_col, block)
        return dq, dk, dscale


def _unscale_(d: Tensor, norms: Optional[Tensor], rows: Rows) -> None:
    """diag(inv) dE -> dE for lazily normalised rows (see _self_grad_pass)."""
    if isinstance(rows, _RowScaled):
        assert norms is not None
        d.mul_(norms.unsqueeze(1))


def _finish_grads(q: Tensor, k: Tensor, q_norms: Optional[Tensor], k_norms: Optional[Tensor],
                  q_in: Tensor, k_in: Optional[Tensor], scale: float, spec: CoreSpec,
                  dq: Tensor, dk: Tensor, dscale: Tensor, raw_pos: Tensor, raw_diag: Optional[Tensor],
                  w_pos: Tensor, g_col: Optional[Tensor], block: int
                  ) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """Adds the positive terms to the LSE gradient, applies the normalisation's
    backward and casts back: returns (d q_in, d k_in or None when k is q, d scale)."""
    _positive_grad_(q, k, scale, spec, w_pos, dq, dk, block)
    dscale = dscale - (w_pos * raw_pos).sum()
    if spec.symmetric:
        assert g_col is not None and raw_diag is not None
        dq.sub_(k * (g_col * scale).unsqueeze(1))
        dk.sub_(q * (g_col * scale).unsqueeze(1))
        dscale = dscale - (g_col * raw_diag).sum()
    same = k_in is None
    if q_norms is not None:
        _normalize_backward_(dq, q, q_norms, block)
        if not same:
            assert k_norms is not None
            _normalize_backward_(dk, k, k_norms, block)
    dq_out = dq.to(q_in.dtype)
    dk_out = None if same else dk.to(k_in.dtype)  # type: ignore[union-attr]
    return dq_out, dk_out, dscale


class TiledScores(torch.autograd.Function):
    """Core losses of a given score matrix (the neighbour loss), in row blocks.

    ``apply(scores, spec, reduce_weights, block)``: ``reduce_weights=None`` returns
    the per-row losses (n,); a weight vector ``r`` returns ``sum r * row_loss`` and
    computes the gradient during the forward pass, straight into the one n x n
    tensor that becomes ``scores.grad``.
    """

    @staticmethod
    def forward(ctx: Any, scores: Tensor, spec: CoreSpec, reduce_weights: Optional[Tensor],
                block: int) -> Tensor:
        assert spec.index is not None
        dtype = compute_dtype(scores.dtype)
        n, ncol = scores.shape
        c, a = spec.weights(n, dtype)
        pos = scores.detach().gather(1, spec.index).to(dtype).sum(1)
        needs_grad = ctx.needs_input_grad[0]
        fused = reduce_weights is not None and needs_grad
        grad = torch.empty_like(scores) if fused else None
        # The block is worked on in the gradient itself where dtypes allow: no
        # second buffer, and each row is read from the input once.
        direct = grad is not None and grad.dtype == dtype
        buf = None if direct else scores.new_empty(min(block, n), ncol, dtype=dtype)
        lse = scores.new_empty(n, dtype=dtype)
        for r0 in range(0, n, block):
            r1 = min(r0 + block, n)
            blk = grad[r0:r1] if direct else buf[:r1 - r0]  # type: ignore[index]
            lse[r0:r1], total = _masked_exp_into(blk, scores[r0:r1].detach(), r0, spec)
            if grad is not None:
                _scores_grad_block(blk, r0, spec, (reduce_weights[r0:r1] * c[r0:r1]).unsqueeze(1) / total,
                                   reduce_weights[r0:r1] * a[r0:r1])
                if not direct:
                    grad[r0:r1].copy_(blk)
        row_loss = c * lse - a * pos
        ctx.spec, ctx.block, ctx.reduce_weights = spec, block, reduce_weights
        ctx.grad = grad
        if needs_grad:
            ctx.save_for_backward(scores, lse)
        if reduce_weights is None:
            return row_loss
        return (reduce_weights * row_loss).sum()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor):  # type: ignore[override]
        scores, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a gradient that can be differentiated again
            ctx.grad = None
            (grad,) = differentiable_grads(lambda x: dense.scores_output(x, ctx.spec, ctx.reduce_weights),
                                           (scores,), (True,), grad_out)
            return grad, None, None, None
        with autocast_off(scores.device.type):
            return TiledScores._backward(ctx, grad_out, scores, lse), None, None, None

    @staticmethod
    def _backward(ctx: Any, grad_out: Tensor, scores: Tensor, lse: Tensor) -> Tensor:
        spec, block = ctx.spec, ctx.block
        if ctx.grad is not None:
            grad = ctx.grad
            ctx.grad = None
            if not bool((grad_out == 1).all()):
                grad.mul_(grad_out)
            return grad
        dtype = compute_dtype(scores.dtype)
        n = scores.shape[0]
        g = ctx.reduce_weights * grad_out if ctx.reduce_weights is not None else grad_out.to(dtype)
        c, a = spec.weights(n, dtype)
        grad = torch.empty_like(scores)
        buf = scores.new_empty(min(block, n), scores.shape[1], dtype=dtype)
        for r0 in range(0, n, block):
            r1 = min(r0 + block, n)
            blk = torch.sub(scores[r0:r1], lse[r0:r1].unsqueeze(1), out=buf[:r1 - r0])
            if spec.exclude_self:
                _mask_self_(blk, r0, spec.offset, float("-inf"))
            blk.exp_()
            _scores_grad_block(blk, r0, spec, (g[r0:r1] * c[r0:r1]).unsqueeze(1), g[r0:r1] * a[r0:r1])
            grad[r0:r1].copy_(blk)
        return grad


def _masked_exp_into(dst: Tensor, src: Tensor, r0: int, spec: CoreSpec) -> Tuple[Tensor, Tensor]:
    """``dst <- exp(src - c)`` with the self column masked (0), and the rows'
    (logsumexp, sum) over the unmasked columns.

    The shift ``c`` is the row maximum of ``src`` including the self column, so
    the shift and the copy out of the input are one pass. ``c`` is at least the
    masked maximum, so nothing overflows; a row whose unmasked terms all lie far
    below its self score (sum under ``finfo.tiny ** 0.75``, where the largest
    term would near the subnormals), or whose self score is NaN or infinite, is
    redone with its masked maximum."""
    mx = src.amax(1, keepdim=True).to(dst.dtype)
    torch.sub(src, mx, out=dst)
    if spec.exclude_self:
        _mask_self_(dst, r0, spec.offset, float("-inf"))
    total = dst.exp_().sum(1, keepdim=True)
    if spec.exclude_self:
        # ``not >=``: a NaN or inf in the excluded entry makes the shift (and the
        # sum) NaN; the masked redo keeps it out of the loss and the gradient
        redo = (~(total.squeeze(1) >= torch.finfo(dst.dtype).tiny ** 0.75)).nonzero().squeeze(1)
        if redo.numel():
            rows = src[redo].to(dst.dtype)
            cols = redo + (r0 + spec.offset)
            inside = (cols >= 0) & (cols < src.shape[1])
            rows[inside.nonzero().squeeze(1), cols[inside]] = float("-inf")
            mx[redo] = rows.amax(1, keepdim=True)
            rows = (rows - mx[redo]).exp_()
            dst[redo] = rows
            total[redo] = rows.sum(1, keepdim=True)
    return (mx + total.log()).squeeze(1), total


def _scores_grad_block(blk: Tensor, r0: int, spec: CoreSpec, lse_coef: Tensor, pos_coef: Tensor) -> None:
    """In place: ``blk`` (the block's masked exp) becomes ``lse_coef * blk - pos_coef * m``."""
    assert spec.index is not None
    idx = spec.index[r0:r0 + blk.shape[0]]
    blk.mul_(lse_coef)
    blk.scatter_add_(1, idx, (-pos_coef).unsqueeze(1).expand_as(idx).to(blk.dtype))
