"""``TritonCore``: the core's row (and CLIP column) logsumexp and its gradient in
Triton kernels; the positive terms, bilinear in the embeddings, are computed in
embedding space with torch ops exactly as the tiled backend does."""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import torch
import triton
from torch import Tensor

from ..core import CoreSpec
from ..tiled import _finish_grads, _positive_raw
from .kernels import _dk_kernel, _dq_kernel, _lse_kernel

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def _config(d: int, dtype: torch.dtype) -> Tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, DOT_FP32). The whole embedding dim is one tile
    (BLOCK_D = next power of two >= D); wider embeddings take smaller row/column
    tiles. Not tuned on a GPU yet (none was lent to this work)."""
    block_d = max(16, triton.next_power_of_2(d))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    block = 64 if interpret or block_d <= 128 else 32
    return block, block, block_d, dtype == torch.float32 or interpret


def _lse(q: Tensor, k: Tensor, scale: float, exclude_self: bool, offset: int) -> Tensor:
    m, d = q.shape
    bm, bn, bd, fp32 = _config(d, q.dtype)
    out = torch.empty(m, dtype=torch.float32, device=q.device)
    _lse_kernel[(triton.cdiv(m, bm),)](q, k, out, m, k.shape[0], d, q.stride(0), k.stride(0), scale, offset,
                                       EXCLUDE_SELF=exclude_self, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
                                       DOT_FP32=fp32)
    return out


def _grads(q: Tensor, k: Tensor, scale: float, spec: CoreSpec, lse_r: Tensor, g_r: Tensor,
           lse_c: Optional[Tensor], g_c: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    m, d = q.shape
    n = k.shape[0]
    bm, bn, bd, fp32 = _config(d, q.dtype)
    has_col = lse_c is not None
    lse_c_ = lse_c if lse_c is not None else lse_r
    g_c_ = g_c if g_c is not None else g_r
    dq = torch.empty(m, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(n, d, dtype=torch.float32, device=q.device)
    common = dict(EXCLUDE_SELF=spec.exclude_self, HAS_COL=has_col, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
                  DOT_FP32=fp32)
    _dq_kernel[(triton.cdiv(m, bm),)](q, k, dq, lse_r, g_r, lse_c_, g_c_, m, n, d, q.stride(0), k.stride(0),
                                      dq.stride(0), scale, spec.offset, **common)
    _dk_kernel[(triton.cdiv(n, bn),)](q, k, dk, lse_r, g_r, lse_c_, g_c_, m, n, d, q.stride(0), k.stride(0),
                                      dk.stride(0), scale, spec.offset, **common)
    return dq, dk


class TritonCore(torch.autograd.Function):
    """``apply(q, k, scale, spec)``: per-row losses (M,), with the column losses
    appended for CLIP (M + N,). q and k are the (normalised) embeddings; ``k=None``
    means k = q. float32/float16/bfloat16, accumulated in float32."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k_in: Optional[Tensor], scale: Tensor, spec: CoreSpec) -> Tensor:
        if q.dtype not in _SUPPORTED:
            raise TypeError(f"the triton backend takes float32, float16 or bfloat16 embeddings, got {q.dtype}")
        qc = q.detach().contiguous()
        kc = qc if k_in is None else k_in.detach().contiguous()
        s = float(scale)
        m = qc.shape[0]
        lse_r = _lse(qc, kc, s, spec.exclude_self, spec.offset)
        lse_c = _lse(kc, qc, s, False, 0) if spec.symmetric else None
        q32, k32 = qc.float(), kc.float()
        raw_pos = _positive_raw(q32, k32, spec, 4096)
        c, a = spec.weights(m, torch.float32)
        out = c * lse_r - a * (s * raw_pos)
        raw_diag = None
        if spec.symmetric:
            assert lse_c is not None
            raw_diag = (q32 * k32).sum(1)
            out = torch.cat([out, lse_c - s * raw_diag])
        ctx.save_for_backward(q, k_in, scale, lse_r, lse_c, raw_pos, raw_diag)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        q, k_in, scale, lse_r, lse_c, raw_pos, raw_diag = ctx.saved_tensors
        spec: CoreSpec = ctx.spec
        qc = q.detach().contiguous()
        kc = qc if k_in is None else k_in.detach().contiguous()
        m = qc.shape[0]
        s = float(scale)
        c, a = spec.weights(m, torch.float32)
        g = grad.float()
        g_row = g[:m]
        g_col = g[m:] if spec.symmetric else None
        dq, dk = _grads(qc, kc, s, spec, lse_r, (g_row * c).contiguous(), lse_c,
                        None if g_col is None else g_col.contiguous())
        q32, k32 = qc.float(), kc.float()
        # d loss / d scale of the LSE terms: sum_ij G_ij q_i.k_j = sum(q * G K), and dq = scale G K
        dscale = (dq * q32).sum() / s
        if k_in is None:
            de = dq.add_(dk)
            dq_out, _, dscale = _finish_grads(q32, q32, None, None, q, None, s, spec, de, de, dscale,
                                              raw_pos, raw_diag, g_row * a, g_col, 4096)
            dk_out = None
        else:
            dq_out, dk_out, dscale = _finish_grads(q32, k32, None, None, q, k_in, s, spec, dq, dk, dscale,
                                                   raw_pos, raw_diag, g_row * a, g_col, 4096)
        need_q, need_k, need_s = ctx.needs_input_grad[:3]
        return (dq_out if need_q else None, dk_out if need_k else None,
                dscale.to(scale.dtype) if need_s else None, None)
