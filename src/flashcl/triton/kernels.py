"""The kernels: tiles of Q K^T in on-chip memory, never the M x N matrix.

Q and K are the raw embeddings in their own dtype; ``iq`` and ``ik`` are float32
row scales (1/|row| when the loss normalises, else 1), so a tile of scores is
``s_ij = scale * iq_i * ik_j * (q_i . k_j)``: the normalised rows are never
rounded to the input dtype.

Every kernel computes its score tiles with one routine, :func:`_scores`: a loop
over the embedding dim in chunks of ``BLOCK_K`` (any D, masked at the ragged
end, no padding to a power of two), like a GEMM. The three kernels use the same
routine and the same tile sizes, so the scores the backward recomputes are the
forward's, bit for bit.

* ``lse_kernel``: per row tile, an online logsumexp over column tiles, with
  the self column (``col == row + offset``) and one more column per row
  (``excl[row]``: a queue's slot of the anchor, a positive kept out) masked to
  -inf when asked
  (``HEAD=0``, the softmax head); or (``HEAD=1``, SigLIP's softplus head) the
  row sums of ``softplus(s + bias)`` and of ``sigmoid(s + bias)``.
* ``dq_kernel``: per (row tile, chunk of ``BLOCK_DO`` output dims), recomputes
  each tile from Q, K and the saved LSE: ``G = g_row exp(s - lse_row)
  [+ g_col exp(s - lse_col)]``, and ``dQ^[:, chunk] += scale (G diag(ik)) K[:, chunk]``.
* ``dk_kernel``: per (column tile, output chunk), the same tiles transposed:
  ``dK^[:, chunk] += scale (diag(iq) G)^T Q[:, chunk]``.

Each program writes its own output block: no atomics, deterministic. With D
wider than ``BLOCK_DO`` the gradient kernels recompute the scores once per output
chunk: at wide D the stripe path of the tiled backend (cuBLAS GEMMs) is the
faster one, and ``auto`` picks it (see :mod:`flashcl.runner`).

``PRECISION``: 0 = float32 ("ieee" dot, no TF32), 1 = TF32 (float32 inputs, when
torch's ``float32_matmul_precision`` allows it), 2 = the inputs' own half
precision with float32 accumulation. Under the CPU interpreter, whose bfloat16
dot is wrong, tiles are cast to float32 (precision 0).
"""

# No ``from __future__ import annotations`` here: Triton 3.0 and 3.1 read a kernel's
# ``BLOCK: tl.constexpr`` from the annotation object, and a string annotation makes
# it an ordinary argument (``arange's arguments must be of type tl.constexpr``).
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in float32."""
    if PRECISION == 0:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif PRECISION == 1:
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _scores(
    q_ptr,
    k_ptr,
    rows,
    cols,
    M,
    N,
    D,
    stride_q,
    stride_k,
    row_scale,
    col_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) tile ``row_scale_i * col_scale_j * q_i . k_j``, over D in chunks."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for d0 in range(0, D, BLOCK_K):
        dd = d0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            q_ptr + rows[:, None] * stride_q + dd[None, :], mask=(rows[:, None] < M) & (dd[None, :] < D), other=0.0
        )
        b = tl.load(
            k_ptr + cols[:, None] * stride_k + dd[None, :], mask=(cols[:, None] < N) & (dd[None, :] < D), other=0.0
        )
        acc = _dot(a, tl.trans(b), acc, PRECISION)
    return acc * row_scale[:, None] * col_scale[None, :]


@triton.jit
def lse_kernel(
    q_ptr,
    k_ptr,
    iq_ptr,
    ik_ptr,
    lse_ptr,
    sig_ptr,
    excl_ptr,
    M,
    N,
    D,
    stride_q,
    stride_k,
    scale,
    offset,
    bias,
    EXCLUDE_SELF: tl.constexpr,
    HAS_EXCL: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    iq = tl.load(iq_ptr + rows, mask=rows < M, other=0.0) * scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    sig_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ik = tl.load(ik_ptr + cols, mask=cols < N, other=0.0)
        s = _scores(q_ptr, k_ptr, rows, cols, M, N, D, stride_q, stride_k, iq, ik, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        keep = cols[None, :] < N
        if EXCLUDE_SELF:
            keep = keep & (cols[None, :] != rows[:, None] + offset)
        if HAS_EXCL:
            keep = keep & (cols[None, :] != tl.load(excl_ptr + rows, mask=rows < M, other=-1)[:, None])
        if HEAD == 0:
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m_i = m_new
        else:
            t = s + bias
            softplus = tl.maximum(t, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(t)))
            l_i += tl.sum(tl.where(keep, softplus, 0.0), 1)
            sig_i += tl.sum(tl.where(keep, tl.sigmoid(t), 0.0), 1)
    if HEAD == 0:
        tl.store(lse_ptr + rows, m_i + tl.log(l_i), mask=rows < M)
    else:
        tl.store(lse_ptr + rows, l_i, mask=rows < M)
        tl.store(sig_ptr + rows, sig_i, mask=rows < M)


@triton.jit
def _grad_tile(
    s,
    rows,
    cols,
    M,
    N,
    offset,
    bias,
    lse_r_ptr,
    g_r_ptr,
    lse_c_ptr,
    g_c_ptr,
    excl_ptr,
    EXCLUDE_SELF: tl.constexpr,
    HAS_EXCL: tl.constexpr,
    HAS_COL: tl.constexpr,
    HEAD: tl.constexpr,
):
    """dloss/ds of a tile: the row term (masked) and, for CLIP, the column term;
    for the softplus head (HEAD=1), ``g_row sigmoid(s + bias)``."""
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    keep_row = keep
    if EXCLUDE_SELF:
        keep_row = keep_row & (cols[None, :] != rows[:, None] + offset)
    if HAS_EXCL:
        keep_row = keep_row & (cols[None, :] != tl.load(excl_ptr + rows, mask=rows < M, other=-1)[:, None])
    g_r = tl.load(g_r_ptr + rows, mask=rows < M, other=0.0)
    if HEAD == 1:
        return tl.where(keep_row, tl.sigmoid(s + bias) * g_r[:, None], 0.0)
    lse_r = tl.load(lse_r_ptr + rows, mask=rows < M, other=0.0)
    g = tl.where(keep_row, tl.exp(s - lse_r[:, None]) * g_r[:, None], 0.0)
    if HAS_COL:
        lse_c = tl.load(lse_c_ptr + cols, mask=cols < N, other=0.0)
        g_c = tl.load(g_c_ptr + cols, mask=cols < N, other=0.0)
        g += tl.where(keep, tl.exp(s - lse_c[None, :]) * g_c[None, :], 0.0)
    return g


@triton.jit
def dq_kernel(
    q_ptr,
    k_ptr,
    iq_ptr,
    ik_ptr,
    dq_ptr,
    lse_r_ptr,
    g_r_ptr,
    lse_c_ptr,
    g_c_ptr,
    excl_ptr,
    M,
    N,
    D,
    stride_q,
    stride_k,
    stride_dq,
    scale,
    offset,
    bias,
    EXCLUDE_SELF: tl.constexpr,
    HAS_EXCL: tl.constexpr,
    HAS_COL: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DO: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    iq = tl.load(iq_ptr + rows, mask=rows < M, other=0.0) * scale
    acc = tl.zeros([BLOCK_M, BLOCK_DO], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ik = tl.load(ik_ptr + cols, mask=cols < N, other=0.0)
        s = _scores(q_ptr, k_ptr, rows, cols, M, N, D, stride_q, stride_k, iq, ik, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        g = _grad_tile(
            s,
            rows,
            cols,
            M,
            N,
            offset,
            bias,
            lse_r_ptr,
            g_r_ptr,
            lse_c_ptr,
            g_c_ptr,
            excl_ptr,
            EXCLUDE_SELF,
            HAS_EXCL,
            HAS_COL,
            HEAD,
        )
        g = g * ik[None, :]
        kt = tl.load(
            k_ptr + cols[:, None] * stride_k + dd[None, :], mask=(cols[:, None] < N) & (dd[None, :] < D), other=0.0
        )
        acc = _dot(g.to(kt.dtype), kt, acc, PRECISION)
    tl.store(
        dq_ptr + rows[:, None] * stride_dq + dd[None, :], acc * scale, mask=(rows[:, None] < M) & (dd[None, :] < D)
    )


@triton.jit
def dk_kernel(
    q_ptr,
    k_ptr,
    iq_ptr,
    ik_ptr,
    dk_ptr,
    lse_r_ptr,
    g_r_ptr,
    lse_c_ptr,
    g_c_ptr,
    excl_ptr,
    M,
    N,
    D,
    stride_q,
    stride_k,
    stride_dk,
    scale,
    offset,
    bias,
    EXCLUDE_SELF: tl.constexpr,
    HAS_EXCL: tl.constexpr,
    HAS_COL: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DO: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # the same (BLOCK_M x BLOCK_N) tiles as the other kernels, in the same
    # orientation (rows of Q, columns of K), so that the scores are the same numbers
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    ik = tl.load(ik_ptr + cols, mask=cols < N, other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_DO], tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        iq = tl.load(iq_ptr + rows, mask=rows < M, other=0.0)
        s = _scores(
            q_ptr, k_ptr, rows, cols, M, N, D, stride_q, stride_k, iq * scale, ik, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION
        )
        g = _grad_tile(
            s,
            rows,
            cols,
            M,
            N,
            offset,
            bias,
            lse_r_ptr,
            g_r_ptr,
            lse_c_ptr,
            g_c_ptr,
            excl_ptr,
            EXCLUDE_SELF,
            HAS_EXCL,
            HAS_COL,
            HEAD,
        )
        g = g * iq[:, None]
        qt = tl.load(
            q_ptr + rows[:, None] * stride_q + dd[None, :], mask=(rows[:, None] < M) & (dd[None, :] < D), other=0.0
        )
        acc = _dot(tl.trans(g.to(qt.dtype)), qt, acc, PRECISION)
    tl.store(
        dk_ptr + cols[:, None] * stride_dk + dd[None, :], acc * scale, mask=(cols[:, None] < N) & (dd[None, :] < D)
    )
