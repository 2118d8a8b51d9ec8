"""``TritonCore``: the core's row (and CLIP column) logsumexp and its gradient in
Triton kernels; the positive terms, bilinear in the embeddings, are computed in
embedding space with torch ops exactly as the tiled backend does."""
from __future__ import annotations

import os
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import triton
from torch import Tensor

from .. import dense
from ..core import CoreSpec, autocast_off, differentiable_grads
from ..tiled import _finish_grads, _positive_raw, _prepare
from . import MAX_WIDTH
from .kernels import _dk_kernel, _dq_kernel, _lse_kernel

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


class Config(NamedTuple):
    """A launch configuration: tile sizes, whether tiles are cast to float32
    before the dot, and Triton's num_warps / num_stages."""

    block_m: int
    block_n: int
    block_d: int
    dot_fp32: bool
    num_warps: int
    num_stages: int

    def launch(self) -> Dict[str, Any]:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_D=self.block_d, DOT_FP32=self.dot_fp32,
                    num_warps=self.num_warps, num_stages=self.num_stages)


# (block_m, block_n, num_warps, num_stages) by BLOCK_D, for 2-byte (float16 /
# bfloat16) tiles, from scripts/triton_configs.py on an H200 (bfloat16, B = 32768):
# at D = 256, (64, 64, 4, 2) took 4.4x the three cuBLAS GEMMs for CLIP and 3.2x for
# InfoNCE, against 11.3x / 8.9x for the (32, 32, 4, 1) used before; at D = 768
# (BLOCK_D = 1024), (32, 32, 8, 1) took 24x / 19x against 258x / 239x with 4 warps,
# and 64-row tiles ran out of shared memory (232448 bytes). The failures fit one
# model: a kernel holds its own tile once and the other operand twice (once per
# dot, in two layouts), so (max(bm + 2 bn, bn + 2 bm)) x BLOCK_D x element size
# must stay under 227 KiB; the 512 and 2048 rows, and float32 (below), are sized
# by it, not timed.
_HALF = {512: (32, 64, 4, 1), 1024: (32, 32, 8, 1), 2048: (16, 16, 4, 1)}


def _config(d: int, dtype: torch.dtype) -> Config:
    """The whole embedding dim is one tile (BLOCK_D = next power of two >= D);
    wider embeddings take smaller row/column tiles so that a Q and a K tile fit
    in shared memory. float32 tiles are cast for an "ieee" float32 dot (no TF32),
    as are all tiles under the CPU interpreter (whose bfloat16 dot is wrong)."""
    block_d = max(16, triton.next_power_of_2(d))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    fp32 = dtype == torch.float32 or interpret
    if d > MAX_WIDTH[dtype]:
        raise ValueError(f"the triton backend takes embeddings up to {MAX_WIDTH[dtype]} wide in {dtype} "
                         f"(got {d}); use backend='tiled'")
    if interpret:
        return Config(64, 64, block_d, True, 4, 1)
    if block_d <= 128:
        return Config(64, 64, block_d, fp32, 4, 1)
    if fp32:  # twice the bytes of a half tile: the half table's tile for twice the width
        bm, bn, warps, stages = _HALF.get(block_d * 2, (64, 64, 4, 1))
        return Config(bm, bn, block_d, True, warps, 1)
    bm, bn, warps, stages = _HALF.get(block_d, (64, 64, 4, 2))
    return Config(bm, bn, block_d, False, warps, stages)


def _lse(q: Tensor, k: Tensor, iq: Tensor, ik: Tensor, scale: float, exclude_self: bool, offset: int) -> Tensor:
    m, d = q.shape
    cfg = _config(d, q.dtype)
    out = torch.empty(m, dtype=torch.float32, device=q.device)
    _lse_kernel[(triton.cdiv(m, cfg.block_m),)](q, k, iq, ik, out, m, k.shape[0], d, q.stride(0), k.stride(0),
                                                scale, offset, EXCLUDE_SELF=exclude_self, **cfg.launch())
    return out


def _grads(q: Tensor, k: Tensor, iq: Tensor, ik: Tensor, scale: float, spec: CoreSpec, lse_r: Tensor, g_r: Tensor,
           lse_c: Optional[Tensor], g_c: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    m, d = q.shape
    n = k.shape[0]
    cfg = _config(d, q.dtype)
    has_col = lse_c is not None
    lse_c_ = lse_c if lse_c is not None else lse_r
    g_c_ = g_c if g_c is not None else g_r
    dq = torch.empty(m, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(n, d, dtype=torch.float32, device=q.device)
    common = dict(EXCLUDE_SELF=spec.exclude_self, HAS_COL=has_col, **cfg.launch())
    args = (lse_r, g_r, lse_c_, g_c_, m, n, d, q.stride(0), k.stride(0))
    _dq_kernel[(triton.cdiv(m, cfg.block_m),)](q, k, iq, ik, dq, *args, dq.stride(0), scale, spec.offset, **common)
    _dk_kernel[(triton.cdiv(n, cfg.block_n),)](q, k, iq, ik, dk, *args, dk.stride(0), scale, spec.offset, **common)
    return dq, dk


def _rows(x: Tensor, normalize: bool) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """(x contiguous in its dtype, its rows normalised in float32, their norms or
    None, the float32 row scale the kernels apply: 1/norm, or 1)."""
    xc = x.detach().contiguous()
    x32, norms = _prepare(xc, normalize, torch.float32)
    inv = (1.0 / norms) if norms is not None else torch.ones(xc.shape[0], dtype=torch.float32, device=xc.device)
    return xc, x32, norms, inv


class TritonCore(torch.autograd.Function):
    """``apply(q, k, scale, spec)``: per-row losses (M,), with the column losses
    appended for CLIP (M + N,). ``k=None`` means k = q. float32/float16/bfloat16
    embeddings reach the kernels as given; with ``spec.normalize`` the kernels
    scale each score by the rows' float32 inverse norms, and the normalisation's
    backward runs in float32, so half-precision inputs are rounded once (as
    given), not again after normalising."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k_in: Optional[Tensor], scale: Tensor, spec: CoreSpec) -> Tensor:
        if q.dtype not in _SUPPORTED:
            raise TypeError(f"the triton backend takes float32, float16 or bfloat16 embeddings, got {q.dtype}")
        qc, q32, _, iq = _rows(q, spec.normalize)
        kc, k32, _, ik = (qc, q32, None, iq) if k_in is None else _rows(k_in, spec.normalize)
        s = float(scale)
        m = qc.shape[0]
        lse_r = _lse(qc, kc, iq, ik, s, spec.exclude_self, spec.offset)
        lse_c = _lse(kc, qc, ik, iq, s, False, 0) if spec.symmetric else None
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
        need_q, need_k, need_s = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: a gradient that can be differentiated again
            dq, dk, dscale = differentiable_grads(lambda a, b, sc: dense.core_output(a, b, sc, spec, None),
                                                  (q, k_in, scale), (need_q, need_k, need_s), grad)
            return dq, dk, dscale, None
        with autocast_off(q.device.type):
            return TritonCore._backward(ctx, grad, q, k_in, scale, lse_r, lse_c, raw_pos, raw_diag)

    @staticmethod
    def _backward(ctx: Any, grad: Tensor, q: Tensor, k_in: Optional[Tensor], scale: Tensor, lse_r: Tensor,
                  lse_c: Optional[Tensor], raw_pos: Tensor, raw_diag: Optional[Tensor]) -> Tuple[Any, ...]:
        spec: CoreSpec = ctx.spec
        need_q, need_k, need_s = ctx.needs_input_grad[:3]
        qc, q32, q_norms, iq = _rows(q, spec.normalize)
        kc, k32, k_norms, ik = (qc, q32, q_norms, iq) if k_in is None else _rows(k_in, spec.normalize)
        m = qc.shape[0]
        s = float(scale)
        c, a = spec.weights(m, torch.float32)
        g = grad.float()
        g_row = g[:m]
        g_col = g[m:] if spec.symmetric else None
        # gradients w.r.t. the normalised rows (float32)
        dq, dk = _grads(qc, kc, iq, ik, s, spec, lse_r, (g_row * c).contiguous(), lse_c,
                        None if g_col is None else g_col.contiguous())
        # d loss / d scale of the LSE terms: sum_ij G_ij q^_i.k^_j = sum(q^ * G K^), and dq = scale G K^
        dscale = (dq * q32).sum() / s
        if k_in is None:
            de = dq.add_(dk)
            dq_out, _, dscale = _finish_grads(q32, q32, q_norms, None, q, None, s, spec, de, de, dscale,
                                              raw_pos, raw_diag, g_row * a, g_col, 4096)
            dk_out = None
        else:
            dq_out, dk_out, dscale = _finish_grads(q32, k32, q_norms, k_norms, q, k_in, s, spec, dq, dk, dscale,
                                                   raw_pos, raw_diag, g_row * a, g_col, 4096)
        return (dq_out if need_q else None, dk_out if need_k else None,
                dscale.to(scale.dtype) if need_s else None, None)
