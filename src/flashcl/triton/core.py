"""The triton backend's driver: the softmax head's row (and CLIP column)
logsumexp and its gradient in Triton kernels (:mod:`flashcl.triton.kernels`);
the engine (:mod:`flashcl.engine`) does the rest, as for every backend."""
from __future__ import annotations

import os
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import triton
from torch import Tensor

from ..engine import Driver, Operands
from ..heads import Head, SoftmaxHead
from ..linear import raw_rows
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


def _grads(q: Tensor, k: Tensor, iq: Tensor, ik: Tensor, scale: float, exclude_self: bool, offset: int,
           lse_r: Tensor, g_r: Tensor, lse_c: Optional[Tensor], g_c: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    m, d = q.shape
    n = k.shape[0]
    cfg = _config(d, q.dtype)
    has_col = lse_c is not None
    lse_c_ = lse_c if lse_c is not None else lse_r
    g_c_ = g_c if g_c is not None else g_r
    dq = torch.empty(m, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(n, d, dtype=torch.float32, device=q.device)
    common = dict(EXCLUDE_SELF=exclude_self, HAS_COL=has_col, **cfg.launch())
    args = (lse_r, g_r, lse_c_, g_c_, m, n, d, q.stride(0), k.stride(0))
    _dq_kernel[(triton.cdiv(m, cfg.block_m),)](q, k, iq, ik, dq, *args, dq.stride(0), scale, offset, **common)
    _dk_kernel[(triton.cdiv(n, cfg.block_n),)](q, k, iq, ik, dk, *args, dk.stride(0), scale, offset, **common)
    return dq, dk


class TritonDriver(Driver):
    """The engine's driver on Triton kernels, for the heads they implement
    (:attr:`~flashcl.heads.Head.kernel` ``"softmax"``): the row (and column)
    logsumexp in one kernel, the gradients ``dQ^ = G K^`` and ``dK^ = G^T Q^``
    in two, every tile rebuilt on chip from the embeddings and the saved LSE.
    The embeddings reach the kernels in their own dtype (float32, float16 or
    bfloat16) with float32 row scales (1/|row| when normalising), so that half
    inputs are rounded once, as given; the positive terms and the
    normalisation's backward run in float32 (the engine's)."""

    lazy = True

    def __init__(self, head: Head) -> None:
        if head.kernel != "softmax":
            raise ValueError(f"the triton backend has kernels for the softmax head only, not for "
                             f"{type(head).__name__}: use backend='tiled'")

    @staticmethod
    def _inputs(ops: Operands) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        assert ops.q_in is not None
        qc = ops.q_in.contiguous()
        if qc.dtype not in _SUPPORTED:
            raise TypeError(f"the triton backend takes float32, float16 or bfloat16 embeddings, got {qc.dtype}")
        kc = qc if ops.same else ops.k_in.contiguous()  # type: ignore[union-attr]
        ones = torch.ones(qc.shape[0], dtype=torch.float32, device=qc.device)
        iq = ones if ops.q_norms is None else (1.0 / ops.q_norms).float()
        ik = iq if ops.same else (torch.ones(kc.shape[0], dtype=torch.float32, device=kc.device)
                                  if ops.k_norms is None else (1.0 / ops.k_norms).float())
        return qc, kc, iq, ik

    def forward(self, ops: Operands, head: Head, st: Any, g_row: Optional[Tensor], dq: Optional[Tensor],
                dk: Optional[Tensor]) -> Optional[Tensor]:
        assert isinstance(head, SoftmaxHead)
        qc, kc, iq, ik = self._inputs(ops)
        lse_r = _lse(qc, kc, iq, ik, ops.scale, head.exclude_self, head.offset)
        lse_c = _lse(kc, qc, ik, iq, ops.scale, False, 0) if head.has_columns else None
        head.kernel_state(st, lse_r.to(raw_rows(ops.q)[0].dtype),
                          None if lse_c is None else lse_c.to(raw_rows(ops.q)[0].dtype))
        return None

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        assert isinstance(head, SoftmaxHead)
        qc, kc, iq, ik = self._inputs(ops)
        g_row, g_col = head.kernel_weights(st)
        lse_c = st.col
        gq, gk = _grads(qc, kc, iq, ik, ops.scale, head.exclude_self, head.offset, st.row.float(),
                        g_row.float().contiguous(), None if lse_c is None else lse_c.float(),
                        None if g_col is None else g_col.float().contiguous())
        # sum_ij G_ij q^_i.k^_j = sum(q^ * G K^), and gq = scale G K^
        m = gq.shape[0]
        dscale = sum((gq[r0:r0 + ops.block] * ops.q[r0:r0 + ops.block]).sum()
                     for r0 in range(0, m, ops.block)) / ops.scale
        dq.add_(gq.to(dq.dtype))
        dk.add_(gk.to(dk.dtype))
        return dscale
