"""The triton backend's driver: the softmax head's row (and CLIP column)
logsumexp and its gradient in Triton kernels (:mod:`flashcl.triton.kernels`);
the engine (:mod:`flashcl.engine`) does the rest, as for every backend."""

from __future__ import annotations

import os
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import triton
from torch import Tensor

from ..engine.engine import Driver, KernelFailure, Operands
from ..engine.heads import Head, KernelHead, kernel_args
from ..engine.positives import raw_rows
from . import HALF_MIN_WIDTH
from .kernels import dk_kernel, dq_kernel, lse_kernel

__all__ = ["Config", "HEADS", "default_config", "precision", "row_lse", "gradients", "TritonDriver"]

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)

#: the cause of the kernels' first failure in this process (then every call falls back)
_FAILED: Optional[str] = None


class Config(NamedTuple):
    """A launch configuration: score tiles of ``block_m x block_n``, the embedding
    dim in chunks of ``block_k``, gradient outputs in chunks of ``block_do`` dims,
    Triton's ``num_warps`` / ``num_stages``. All three kernels take the same one."""

    block_m: int
    block_n: int
    block_k: int
    block_do: int
    num_warps: int
    num_stages: int

    def launch(self) -> Dict[str, Any]:
        return dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_K=self.block_k,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def precision(dtype: torch.dtype) -> int:
    """The kernels' ``PRECISION``: 2 for float16/bfloat16 (their own dot, float32
    accumulation); for float32, 1 (TF32) where torch allows TF32 matmuls
    (``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision``
    other than "highest") and 0 (IEEE float32) otherwise, as cuBLAS through torch
    would; 0 under the CPU interpreter, whose half-precision dot is wrong."""
    if _interpreted():
        return 0
    if dtype in (torch.float16, torch.bfloat16):
        return 2
    return 1 if torch.get_float32_matmul_precision() != "highest" else 0


def default_config(d: int, dtype: torch.dtype) -> Config:
    """Tile sizes for embedding dim ``d``: any width (the kernels loop over D in
    ``block_k`` chunks). The H200 sweep of these kernels (``scripts/triton_configs.py``,
    bfloat16, B = 32,768, forward + backward against the three cuBLAS GEMMs,
    docs/bench/triton-configs.json): at D = 256 every candidate took 7.6-10.1x (InfoNCE)
    and 8.5-11.5x (CLIP), this one 7.6x / 9.1x; at D = 768 (where ``auto`` takes the
    stripes, 8.2x) 128 x 64 tiles with 8 warps and 3 stages took 9.8x / 11.2x against this
    one's 14.2x / 15.9x, checked on the loss only, so the default stays until the tests
    have run on it."""
    block_do = max(16, min(triton.next_power_of_2(d), 128 if dtype == torch.float32 else 256))
    if _interpreted():
        return Config(64, 64, 64, block_do, 4, 1)
    block_k = 32 if dtype == torch.float32 else 64
    return Config(64, 64, block_k, block_do, 4, 2)


#: the heads the kernels implement (``KernelHead.kernel``), as the kernels' ``HEAD``
HEADS = {"softmax": 0, "softplus": 1}


def row_lse(
    q: Tensor,
    k: Tensor,
    iq: Tensor,
    ik: Tensor,
    scale: float,
    exclude_self: bool,
    offset: int,
    cfg: Config,
    head: str = "softmax",
    bias: float = 0.0,
    excl: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor], Any]:
    """The rows' reductions of ``s = scale * iq_i ik_j q_i . k_j`` (self column masked
    when asked): the softmax head's logsumexp, or the softplus head's sums of
    ``softplus(s + bias)`` and ``sigmoid(s + bias)``. Returns (float32 (M,), the
    second (M,) or None, the compiled kernel or None under the interpreter)."""
    m, d = q.shape
    out = torch.empty(m, dtype=torch.float32, device=q.device)
    second = torch.empty(m, dtype=torch.float32, device=q.device) if head == "softplus" else out
    compiled = lse_kernel[(triton.cdiv(m, cfg.block_m),)](
        q,
        k,
        iq,
        ik,
        out,
        second,
        out if excl is None else excl,
        m,
        k.shape[0],
        d,
        q.stride(0),
        k.stride(0),
        scale,
        offset,
        bias,
        EXCLUDE_SELF=exclude_self,
        HAS_EXCL=excl is not None,
        HEAD=HEADS[head],
        PRECISION=precision(q.dtype),
        **cfg.launch(),
    )
    return out, (second if head == "softplus" else None), compiled


def gradients(
    q: Tensor,
    k: Tensor,
    iq: Tensor,
    ik: Tensor,
    scale: float,
    exclude_self: bool,
    offset: int,
    lse_r: Tensor,
    g_r: Tensor,
    lse_c: Optional[Tensor],
    g_c: Optional[Tensor],
    cfg: Config,
    head: str = "softmax",
    bias: float = 0.0,
    excl: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Dict[str, Any]]:
    """``dQ^`` and ``dK^`` (float32) of the softmax head's tiles, and the compiled
    kernels by name."""
    m, d = q.shape
    n = k.shape[0]
    has_col = lse_c is not None
    lse_c_ = lse_c if lse_c is not None else lse_r
    g_c_ = g_c if g_c is not None else g_r
    dq = torch.empty(m, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(n, d, dtype=torch.float32, device=q.device)
    common = dict(
        EXCLUDE_SELF=exclude_self,
        HAS_EXCL=excl is not None,
        HAS_COL=has_col,
        HEAD=HEADS[head],
        BLOCK_DO=cfg.block_do,
        PRECISION=precision(q.dtype),
        **cfg.launch(),
    )
    args = (lse_r, g_r, lse_c_, g_c_, lse_r if excl is None else excl, m, n, d, q.stride(0), k.stride(0))
    chunks = triton.cdiv(d, cfg.block_do)
    kq = dq_kernel[(triton.cdiv(m, cfg.block_m), chunks)](
        q, k, iq, ik, dq, *args, dq.stride(0), scale, offset, bias, **common
    )
    kk = dk_kernel[(triton.cdiv(n, cfg.block_n), chunks)](
        q, k, iq, ik, dk, *args, dk.stride(0), scale, offset, bias, **common
    )
    return dq, dk, {"dq": kq, "dk": kk}


class TritonDriver(Driver):
    """The engine's driver on Triton kernels, for the heads they implement
    (:attr:`~flashcl.engine.heads.KernelHead.kernel` in :data:`HEADS`: the softmax and SigLIP's
    softplus): the rows' (and CLIP's columns') reductions in one kernel, the
    gradients ``dQ^ = G K^`` and ``dK^ = G^T Q^`` in two, every tile rebuilt on
    chip from the embeddings and the saved reductions.
    The embeddings reach the kernels in their own dtype (float32, float16 or
    bfloat16) with float32 row scales (1/|row| when normalising), so that half
    inputs are rounded once, as given; the positive terms and the
    normalisation's backward run in float32 (the engine's).

    A kernel that fails to compile or launch on the device (too little shared memory,
    a Triton or driver version that cannot build it) raises :class:`KernelFailure`:
    the engine then computes the call with ``fallback`` (the tiled backend), with one
    warning naming the cause, and this process does not try the kernels again.

    Args:
        head: the problem's head.
        config: the launch configuration; None picks :func:`default_config`.
        fallback: the driver used when the kernels fail (None: the failure is raised).
    """

    lazy = True

    def __init__(self, head: Head, config: Optional[Config] = None, fallback: Optional[Driver] = None) -> None:
        kernel_args(head)  # the head's ValueError when the kernels cannot compute it
        self.config = config
        self.fallback = fallback

    @staticmethod
    def _refuse_known_bad(q: Tensor) -> None:
        """A :class:`KernelFailure` (the tiled backend then computes the call) for the
        inputs the kernels are known to fail on: half precision narrower than
        :data:`HALF_MIN_WIDTH`."""
        if not _interpreted() and q.dtype in (torch.float16, torch.bfloat16) and q.shape[1] < HALF_MIN_WIDTH:
            raise KernelFailure(
                f"the Triton kernels' half-precision gradient tiles narrower than {HALF_MIN_WIDTH} "
                f"(D = {q.shape[1]}) read out of bounds on an H200 (Triton 3.6)"
            )

    @staticmethod
    def _launch(kernels: Any, *args: Any) -> Any:
        """``kernels(*args)``; a failure of Triton's (compiling, launching) as a
        :class:`KernelFailure` naming its cause, and remembered: later calls in this
        process fall back at once."""
        global _FAILED
        if _FAILED is not None:
            raise KernelFailure(_FAILED)
        try:
            return kernels(*args)
        except Exception as e:  # Triton's compile and launch errors have no common base class
            _FAILED = f"{type(e).__name__}: {e}"
            raise KernelFailure(_FAILED) from e

    def _cfg(self, d: int, dtype: torch.dtype) -> Config:
        return self.config if self.config is not None else default_config(d, dtype)

    @staticmethod
    def _inputs(ops: Operands) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        assert ops.q_in is not None
        qc = ops.q_in.contiguous()
        if qc.dtype not in _SUPPORTED:
            raise TypeError(f"the triton backend takes float32, float16 or bfloat16 embeddings, got {qc.dtype}")
        kc = qc if ops.same else ops.k_in.contiguous()  # type: ignore[union-attr]
        ones = torch.ones(qc.shape[0], dtype=torch.float32, device=qc.device)
        iq = ones if ops.q_norms is None else (1.0 / ops.q_norms).float()
        ik = (
            iq
            if ops.same
            else (
                torch.ones(kc.shape[0], dtype=torch.float32, device=kc.device)
                if ops.k_norms is None
                else (1.0 / ops.k_norms).float()
            )
        )
        return qc, kc, iq, ik

    def forward(
        self, ops: Operands, head: Head, st: Any, g_row: Optional[Tensor], dq: Optional[Tensor], dk: Optional[Tensor]
    ) -> Optional[Tensor]:
        assert isinstance(head, KernelHead)
        qc, kc, iq, ik = self._inputs(ops)
        self._refuse_known_bad(qc)
        cfg = self._cfg(qc.shape[1], qc.dtype)
        like = raw_rows(ops.q)[0]
        args = head.kernel_args()
        first, second, _ = self._launch(
            row_lse,
            qc,
            kc,
            iq,
            ik,
            ops.scale,
            args.exclude_self,
            args.offset,
            cfg,
            args.kernel,
            args.bias,
            args.excluded,
        )
        if head.has_columns:
            second = self._launch(row_lse, kc, qc, ik, iq, ops.scale, False, 0, cfg)[0]
        head.kernel_state(st, first.to(like.dtype), None if second is None else second.to(like.dtype))
        return None

    def backward(self, ops: Operands, head: Head, st: Any, dq: Tensor, dk: Tensor) -> Tensor:
        assert isinstance(head, KernelHead)
        qc, kc, iq, ik = self._inputs(ops)
        self._refuse_known_bad(qc)
        cfg = self._cfg(qc.shape[1], qc.dtype)
        g_row, g_col = head.kernel_weights(st)
        args = head.kernel_args()
        lse_c = head.kernel_column_lse(st)
        gq, gk, _ = self._launch(
            gradients,
            qc,
            kc,
            iq,
            ik,
            ops.scale,
            args.exclude_self,
            args.offset,
            st.row.float(),
            g_row.float().contiguous(),
            None if lse_c is None else lse_c.float(),
            None if g_col is None else g_col.float().contiguous(),
            cfg,
            args.kernel,
            args.bias,
            args.excluded,
        )
        # sum_ij G_ij q^_i.k^_j = sum(q^ * G K^), and gq = scale G K^
        m = gq.shape[0]
        dscale = (
            sum((gq[r0 : r0 + ops.block] * ops.q[r0 : r0 + ops.block]).sum() for r0 in range(0, m, ops.block))
            / ops.scale
        )
        dq.add_(gq.to(dq.dtype))
        dk.add_(gk.to(dk.dtype))
        return dscale
