"""The kernels: tiles of Q K^T in on-chip memory, never the M x N matrix.

Q and K are the raw embeddings in their own dtype; ``iq`` and ``ik`` are float32
row scales (1/|row| when the loss normalises, else 1), so a tile of scores is
``s_ij = scale * iq_i * ik_j * (q_i . k_j)``: the normalised rows are never
rounded to the input dtype.

* ``_lse_kernel``: per row block, an online logsumexp over column blocks, with
  the self column (``col == row + offset``) masked to -inf when asked.
* ``_dq_kernel``: per row block, recomputes each tile from Q, K and the saved
  LSE: ``G = g_row exp(s - lse_row) [+ g_col exp(s - lse_col)]``, and
  ``dQ^ += scale (G diag(ik)) K``: the gradient w.r.t. the normalised rows.
* ``_dk_kernel``: per column block, the same tiles transposed:
  ``dK^ += scale (diag(iq) G)^T Q``.
  It mirrors ``_dq_kernel`` (loop over rows instead of columns) rather than
  sharing it through flags: two plain kernels, as FlashAttention's backward has,
  each writing its own output with no atomics.

Scores are accumulated in float32 (``tl.dot``'s default). ``DOT_FP32`` casts
tiles to float32 before the dot: used for float32 inputs and under the CPU
interpreter, whose bfloat16 dot is wrong. The tile each program owns (Q's rows,
or K's for ``_dk_kernel``) is loaded once, before its loop.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_tile(ptr, idx, n, D, stride, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    """Rows ``idx`` of an (n, D) matrix, zero-padded to BLOCK_D columns."""
    dd = tl.arange(0, BLOCK_D)
    t = tl.load(ptr + idx[:, None] * stride + dd[None, :], mask=(idx[:, None] < n) & (dd[None, :] < D), other=0.0)
    if DOT_FP32:
        t = t.to(tl.float32)
    return t


@triton.jit
def _dot_t(a, b, DOT_FP32: tl.constexpr):
    """a @ b^T accumulated in float32 ("ieee" for float32: no TF32 rounding)."""
    if DOT_FP32:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    return tl.dot(a, tl.trans(b))


@triton.jit
def _lse_kernel(q_ptr, k_ptr, iq_ptr, ik_ptr, lse_ptr, M, N, D, stride_q, stride_k, scale, offset,
                EXCLUDE_SELF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_tile(q_ptr, rows, M, D, stride_q, BLOCK_D, DOT_FP32)
    iq = tl.load(iq_ptr + rows, mask=rows < M, other=0.0) * scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_tile(k_ptr, cols, N, D, stride_k, BLOCK_D, DOT_FP32)
        ik = tl.load(ik_ptr + cols, mask=cols < N, other=0.0)
        s = _dot_t(q, k, DOT_FP32) * iq[:, None] * ik[None, :]
        keep = cols[None, :] < N
        if EXCLUDE_SELF:
            keep = keep & (cols[None, :] != rows[:, None] + offset)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m_i = m_new
    tl.store(lse_ptr + rows, m_i + tl.log(l_i), mask=rows < M)


@triton.jit
def _grad_tile(s, rows, cols, M, N, offset, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr,
               EXCLUDE_SELF: tl.constexpr, HAS_COL: tl.constexpr):
    """dloss/ds of a tile: the row term (masked) and, for CLIP, the column term."""
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    keep_row = keep
    if EXCLUDE_SELF:
        keep_row = keep_row & (cols[None, :] != rows[:, None] + offset)
    lse_r = tl.load(lse_r_ptr + rows, mask=rows < M, other=0.0)
    g_r = tl.load(g_r_ptr + rows, mask=rows < M, other=0.0)
    g = tl.where(keep_row, tl.exp(s - lse_r[:, None]) * g_r[:, None], 0.0)
    if HAS_COL:
        lse_c = tl.load(lse_c_ptr + cols, mask=cols < N, other=0.0)
        g_c = tl.load(g_c_ptr + cols, mask=cols < N, other=0.0)
        g += tl.where(keep, tl.exp(s - lse_c[None, :]) * g_c[None, :], 0.0)
    return g


@triton.jit
def _dq_kernel(q_ptr, k_ptr, iq_ptr, ik_ptr, dq_ptr, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr, M, N, D,
               stride_q, stride_k,
               stride_dq, scale, offset, EXCLUDE_SELF: tl.constexpr, HAS_COL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_tile(q_ptr, rows, M, D, stride_q, BLOCK_D, DOT_FP32)
    iq = tl.load(iq_ptr + rows, mask=rows < M, other=0.0) * scale
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_tile(k_ptr, cols, N, D, stride_k, BLOCK_D, DOT_FP32)
        ik = tl.load(ik_ptr + cols, mask=cols < N, other=0.0)
        s = _dot_t(q, k, DOT_FP32) * iq[:, None] * ik[None, :]
        g = _grad_tile(s, rows, cols, M, N, offset, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr, EXCLUDE_SELF, HAS_COL)
        g = g * ik[None, :]
        if DOT_FP32:
            acc += tl.dot(g, k, input_precision="ieee")
        else:
            acc += tl.dot(g.to(k.dtype), k)
    dd = tl.arange(0, BLOCK_D)
    tl.store(dq_ptr + rows[:, None] * stride_dq + dd[None, :], acc * scale,
             mask=(rows[:, None] < M) & (dd[None, :] < D))


@triton.jit
def _dk_kernel(q_ptr, k_ptr, iq_ptr, ik_ptr, dk_ptr, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr, M, N, D,
               stride_q, stride_k,
               stride_dk, scale, offset, EXCLUDE_SELF: tl.constexpr, HAS_COL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_tile(k_ptr, cols, N, D, stride_k, BLOCK_D, DOT_FP32)
    ik = tl.load(ik_ptr + cols, mask=cols < N, other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q = _load_tile(q_ptr, rows, M, D, stride_q, BLOCK_D, DOT_FP32)
        iq = tl.load(iq_ptr + rows, mask=rows < M, other=0.0)
        s = _dot_t(q, k, DOT_FP32) * (iq * scale)[:, None] * ik[None, :]
        g = _grad_tile(s, rows, cols, M, N, offset, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr, EXCLUDE_SELF, HAS_COL)
        g = g * iq[:, None]
        if DOT_FP32:
            acc += tl.dot(tl.trans(g), q, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(g.to(q.dtype)), q)
    dd = tl.arange(0, BLOCK_D)
    tl.store(dk_ptr + cols[:, None] * stride_dk + dd[None, :], acc * scale,
             mask=(cols[:, None] < N) & (dd[None, :] < D))
