"""The kernels: tiles of Q K^T in on-chip memory, never the M x N matrix.

* ``_lse_kernel``: per row block, an online logsumexp over column blocks, with
  the self column (``col == row + offset``) masked to -inf when asked.
* ``_dq_kernel``: per row block, recomputes each tile from Q, K and the saved
  LSE: ``G = g_row exp(s - lse_row) [+ g_col exp(s - lse_col)]``, ``dQ += G K``.
* ``_dk_kernel``: per column block, the same tiles transposed: ``dK += G^T Q``.
  It mirrors ``_dq_kernel`` (loop over rows instead of columns) rather than
  sharing it through flags: two plain kernels, as FlashAttention's backward has,
  each writing its own output with no atomics.

Scores are accumulated in float32 (``tl.dot``'s default). ``DOT_FP32`` casts
tiles to float32 before the dot: used for float32 inputs and under the CPU
interpreter, whose bfloat16 dot is wrong.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scores(q_ptr, k_ptr, rows, cols, M, N, D, stride_q, stride_k, scale,
            BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    dd = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + rows[:, None] * stride_q + dd[None, :], mask=(rows[:, None] < M) & (dd[None, :] < D),
                other=0.0)
    k = tl.load(k_ptr + cols[:, None] * stride_k + dd[None, :], mask=(cols[:, None] < N) & (dd[None, :] < D),
                other=0.0)
    if DOT_FP32:
        # "ieee": no TF32 rounding of float32 inputs
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        return tl.dot(q, tl.trans(k), input_precision="ieee") * scale, q, k
    return tl.dot(q, tl.trans(k)) * scale, q, k


@triton.jit
def _lse_kernel(q_ptr, k_ptr, lse_ptr, M, N, D, stride_q, stride_k, scale, offset,
                EXCLUDE_SELF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        s, q, k = _scores(q_ptr, k_ptr, rows, cols, M, N, D, stride_q, stride_k, scale, BLOCK_D, DOT_FP32)
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
def _dq_kernel(q_ptr, k_ptr, dq_ptr, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr, M, N, D, stride_q, stride_k,
               stride_dq, scale, offset, EXCLUDE_SELF: tl.constexpr, HAS_COL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        s, q, k = _scores(q_ptr, k_ptr, rows, cols, M, N, D, stride_q, stride_k, scale, BLOCK_D, DOT_FP32)
        g = _grad_tile(s, rows, cols, M, N, offset, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr, EXCLUDE_SELF, HAS_COL)
        if DOT_FP32:
            acc += tl.dot(g, k, input_precision="ieee")
        else:
            acc += tl.dot(g.to(k.dtype), k)
    dd = tl.arange(0, BLOCK_D)
    tl.store(dq_ptr + rows[:, None] * stride_dq + dd[None, :], acc * scale,
             mask=(rows[:, None] < M) & (dd[None, :] < D))


@triton.jit
def _dk_kernel(q_ptr, k_ptr, dk_ptr, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr, M, N, D, stride_q, stride_k,
               stride_dk, scale, offset, EXCLUDE_SELF: tl.constexpr, HAS_COL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        s, q, k = _scores(q_ptr, k_ptr, rows, cols, M, N, D, stride_q, stride_k, scale, BLOCK_D, DOT_FP32)
        g = _grad_tile(s, rows, cols, M, N, offset, lse_r_ptr, g_r_ptr, lse_c_ptr, g_c_ptr, EXCLUDE_SELF, HAS_COL)
        if DOT_FP32:
            acc += tl.dot(tl.trans(g), q, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(g.to(q.dtype)), q)
    dd = tl.arange(0, BLOCK_D)
    tl.store(dk_ptr + cols[:, None] * stride_dk + dd[None, :], acc * scale,
             mask=(cols[:, None] < N) & (dd[None, :] < D))
