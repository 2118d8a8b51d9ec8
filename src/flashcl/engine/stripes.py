"""The tiled backend's driver for float16/bfloat16: stripes of rows, GEMMs of the
half-precision embeddings with float32 output (tensor cores on CUDA).

For each stripe of ``block`` rows (as Liger-Kernel's fused linear cross-entropy
does for its logits):

* scores ``S = scale * diag(iq) X_blk Y^T diag(ik)`` by one GEMM of the raw
  half-precision embeddings with float32 output (``iq``, ``ik``: float32 inverse
  row norms, so that the normalised rows are never rounded to half precision, and
  never copied: the engine hands the inputs as given, :attr:`~flashcl.engine.engine.Driver.raw_inputs`);
* the head reduces the stripe (complete rows) and turns it into ``G = dL/dS`` in
  the same visit (float32);
* ``dQ^_blk = scale (G diag(ik)) Y`` and ``dK^ += scale (diag(iq_blk) G)^T X_blk``
  by two GEMMs, ``G`` rounded once to the inputs' dtype, float32 output. ``dQ`` of a
  stripe is complete in it: it is finished there (the linear terms, the
  normalisation's backward) and written once in the inputs' dtype
  (:class:`~flashcl.engine.engine.RowsDone`); only ``dK`` accumulates in float32.

Three GEMMs for a row-only loss (four for CLIP, whose column reductions need a
second pass), no atomics: the same inputs give bitwise the same result. Memory
beyond the inputs and their gradients: ``dK``'s float32 accumulator and one stripe's
buffers, ``block x N`` x (4 + 2) bytes (``block_size`` sets it; default:
:func:`flashcl.backends.auto_block`). InfoNCE at B = 16,384, D = 768 in bfloat16 on
the 2-core CPU: 196-207 MB with float32 copies of the embeddings and both gradients'
accumulators, see docs/gpu.md for the figure after (``python scripts/stripe_memory.py
16384 768 bfloat16``). Off CUDA (tests, CPUs) the half GEMMs are emulated by float32
GEMMs of the same half values, a chunk of columns at a time (what tensor cores
compute, with no float32 copy of the keys).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .engine import Driver, Operands, RowsDone
from .heads import Head, KernelArgs, KernelHead, KernelId, Tile, kernel_args, kernel_of
from .positives import rows_dtype

__all__ = ["Stripes", "mm_f32"]


#: columns of the keys cast to float32 at a time where the half GEMMs are emulated
EMULATED_CHUNK = 2048


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with float32 output from half-precision inputs: tensor cores with
    float32 accumulation on CUDA (``torch.mm(out_dtype=...)``); on other devices
    the same half values multiplied in float32 (exact products, float32 sums).
    Other dtypes: a plain ``torch.mm``."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _emulated(x: Tensor) -> bool:
    """Half precision off CUDA: the GEMMs emulated in float32, by chunks."""
    return x.dtype in (torch.float16, torch.bfloat16) and not x.is_cuda


class Stripes(Driver):
    """See the module docstring. ``kernels``: a stripe's element-wise work by the fused
    stripe kernels (:mod:`flashcl.triton.stripe`) where its head has them (the masked
    softmax and the softplus heads, rows only, bfloat16 or float32 inputs); None: on CUDA
    where Triton is installed."""

    lazy = True
    raw_inputs = True
    completes_rows = True

    def __init__(self, kernels: Optional[bool] = None) -> None:
        self.kernels = kernels
        self._s: Optional[Tensor] = None  # the stripe's scores (float32), reused
        self._g: Optional[Tensor] = None  # G rounded to the inputs' dtype, reused
        self._dkt: Optional[Tensor] = None  # self-contrast: dK~ apart from dq

    def release(self) -> None:
        self._s = self._g = self._dkt = None

    def _buffers(self, rows: int, n: int, x: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        if self._s is None or self._g is None:
            self._s = torch.empty(rows, n, dtype=dtype, device=x.device)
            self._g = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        return self._s, self._g

    @staticmethod
    def _once(ops: Operands, x: Tensor) -> bool:
        """``G'' = diag(iq) G diag(ik)`` rounded once for both gradient GEMMs (not float16,
        whose range the two inverse norms' product could leave)."""
        return x.dtype != torch.float16

    def _keys_grad(self, ops: Operands, dk: Tensor) -> Tensor:
        """Where ``dK~`` accumulates (:meth:`_accumulate_once`): ``dk`` itself, or, for
        self-contrast (``dk`` is ``dq``, whose rows are final as they come), one of its own."""
        if not ops.same:
            return dk
        if self._dkt is None:
            self._dkt = torch.zeros_like(dk)
        return self._dkt

    def _rescale(self, ops: Operands, dk: Tensor) -> None:
        """``dK~``'s rows (accumulated as ``ik_j dK^_j``) times ``|k_j|``, into ``dk``."""
        tilde = self._keys_grad(ops, dk)
        if ops.k_norms is not None:
            tilde.mul_(ops.k_norms.to(dk.dtype).unsqueeze(1))
        if tilde is not dk:
            dk.add_(tilde)
        self._dkt = None

    def _kernel(self, ops: Operands, head: Head, x: Tensor) -> Optional[KernelArgs]:
        """The head's stripe kernels' arguments where they run here, else None."""
        if kernel_of(head) is None or head.has_columns or not self._once(ops, x):
            return None
        if x.dtype not in (torch.bfloat16, torch.float32):
            return None
        wanted = self.kernels
        if wanted is None:
            from ..triton import availability

            wanted = x.is_cuda and availability("cuda")[0]
        if not wanted:
            return None
        try:
            return kernel_args(head)
        except ValueError:  # masks the kernels do not take (a function of the data)
            return None

    @staticmethod
    def _inputs(ops: Operands) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """(X, Y in their own dtype, float32 row scales iq, ik: 1/|row| or 1)."""
        assert ops.q_in is not None
        x = ops.q_in.contiguous()
        y = x if ops.same else ops.k_in.contiguous()  # type: ignore[union-attr]
        dtype = rows_dtype(ops.q)  # float32 for half inputs
        iq = (1.0 / ops.q_norms).to(dtype) if ops.q_norms is not None else x.new_ones(x.shape[0], dtype=dtype)
        if ops.same:
            ik = iq
        else:
            ik = (1.0 / ops.k_norms).to(dtype) if ops.k_norms is not None else y.new_ones(y.shape[0], dtype=dtype)
        return x, y, iq, ik

    def _products(self, x: Tensor, y: Tensor, r0: int, r1: int) -> Tensor:
        """The stripe's raw products ``X_blk Y^T`` (float32 for half inputs), in the stripe
        buffer off CUDA (a fresh tensor from the allocator's cache on CUDA)."""
        xb = x[r0:r1]
        if x.is_cuda:
            return mm_f32(xb, y.T)
        assert self._s is not None
        s = self._s[: r1 - r0]
        if _emulated(x):  # the half values in float32, a chunk of the keys at a time
            xf = xb.float()
            for c0 in range(0, y.shape[0], EMULATED_CHUNK):
                c1 = min(c0 + EMULATED_CHUNK, y.shape[0])
                s[:, c0:c1] = torch.mm(xf, y[c0:c1].float().T)
            return s
        return torch.mm(xb, y.T, out=s)

    def _scores(self, ops: Operands, x: Tensor, y: Tensor, iq: Tensor, ik: Tensor, r0: int, r1: int) -> Tensor:
        """The stripe's scores ``scale diag(iq) X_blk Y^T diag(ik)``."""
        s = self._products(x, y, r0, r1)
        return s.mul_((iq[r0:r1] * ops.scale).unsqueeze(1)).mul_(ik.unsqueeze(0))

    @staticmethod
    def _times(g: Tensor, y: Tensor) -> Tensor:
        """``g @ y`` (float32; ``g`` rounded to the inputs' dtype): by chunks of ``y``'s rows
        where emulated."""
        if not _emulated(y):
            return mm_f32(g, y)
        out = torch.zeros(g.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        for c0 in range(0, y.shape[0], EMULATED_CHUNK):
            c1 = min(c0 + EMULATED_CHUNK, y.shape[0])
            out.addmm_(g[:, c0:c1].float(), y[c0:c1].float())
        return out

    @staticmethod
    def _add_transposed(dk: Tensor, g: Tensor, xb: Tensor, alpha: float) -> None:
        """``dk += alpha g^T xb`` (``g`` rounded to the inputs' dtype): by chunks of ``dk``'s
        rows where emulated."""
        if not _emulated(xb):
            dk.add_(mm_f32(g.T.contiguous(), xb), alpha=alpha)
            return
        xf = xb.float()
        for c0 in range(0, dk.shape[0], EMULATED_CHUNK):
            c1 = min(c0 + EMULATED_CHUNK, dk.shape[0])
            dk[c0:c1].addmm_(g[:, c0:c1].float().T, xf, alpha=alpha)

    def _accumulate(
        self, g: Tensor, r0: int, ops: Operands, x: Tensor, y: Tensor, iq: Tensor, ik: Tensor, dq: Any, dk: Tensor
    ) -> Tensor:
        """dq^_blk += scale G k^ (with :class:`RowsDone`: the stripe's rows finished there),
        dk^ += scale G^T q^_blk; returns sum_ij G_ij q^_i.k^_j. ``G`` is rounded once to the
        inputs' dtype for each product (in the reused buffer off CUDA)."""
        b = g.shape[0]
        xb = x[r0 : r0 + b]
        gb = (
            self._g[:b]
            if self._g is not None and not x.is_cuda
            else torch.empty(g.shape, dtype=x.dtype, device=x.device)
        )
        gk = self._times(torch.mul(g, ik.unsqueeze(0), out=gb), y)  # G k^ (float32)
        qb = xb.to(gk.dtype) * iq[r0 : r0 + b].unsqueeze(1)  # q^ rows (never in place: xb may be the input)
        dscale = torch.dot(gk.reshape(-1), qb.reshape(-1))
        if isinstance(dq, RowsDone):
            dq.finish(r0, gk.mul_(ops.scale))
        else:
            dq[r0 : r0 + b].add_(gk, alpha=ops.scale)
        self._add_transposed(dk, torch.mul(g, iq[r0 : r0 + b].unsqueeze(1), out=gb), xb, ops.scale)  # diag(iq) G
        return dscale

    def _accumulate_once(
        self, gpp: Tensor, r0: int, ops: Operands, x: Tensor, y: Tensor, dq: Any, dk: Tensor
    ) -> Tensor:
        """From ``G'' = diag(iq) G diag(ik)`` (rounded once, in ``gpp``): ``T = G'' Y =
        diag(iq) G k^``, so dQ^ = scale diag(|q|) T and ``sum_ij G_ij q^_i.k^_j = sum T x``;
        ``dK~ += scale G''^T X_blk = diag(ik) dK^``, rescaled once at the end
        (:meth:`_rescale`): both GEMMs read the raw embeddings and one ``G''``."""
        b = gpp.shape[0]
        xb = x[r0 : r0 + b]
        t = self._times(gpp, y)
        dscale = torch.dot(t.reshape(-1), xb.to(t.dtype).reshape(-1))
        if ops.q_norms is not None:
            t.mul_(ops.q_norms[r0 : r0 + b].to(t.dtype).unsqueeze(1))
        if isinstance(dq, RowsDone):
            dq.finish(r0, t.mul_(ops.scale))
        else:
            dq[r0 : r0 + b].add_(t, alpha=ops.scale)
        self._add_transposed(self._keys_grad(ops, dk), gpp, xb, ops.scale)
        return dscale

    def _gradient(
        self, g: Tensor, r0: int, ops: Operands, x: Tensor, y: Tensor, iq: Tensor, ik: Tensor, dq: Any, dk: Tensor
    ) -> Tensor:
        """A stripe's ``G`` (float32, overwritten) into the gradients; d scale's part."""
        if not self._once(ops, x):
            return self._accumulate(g, r0, ops, x, y, iq, ik, dq, dk)
        b = g.shape[0]
        gb = (
            self._g[:b]
            if self._g is not None and not x.is_cuda
            else torch.empty(g.shape, dtype=x.dtype, device=x.device)
        )
        gpp = torch.mul(g.mul_(iq[r0 : r0 + b].unsqueeze(1)), ik.unsqueeze(0), out=gb)
        return self._accumulate_once(gpp, r0, ops, x, y, dq, dk)

    def _kernel_rows(
        self,
        args: KernelArgs,
        ops: Operands,
        head: Head,
        st: Any,
        g_row: Optional[Tensor],
        x: Tensor,
        y: Tensor,
        iq: Tensor,
        ik: Tensor,
        r0: int,
        r1: int,
        backward: bool = False,
    ) -> Optional[Tensor]:
        """The stripe kernels' pass over rows ``r0 .. r1``: in the forward pass the head's
        reductions of them (:meth:`~flashcl.engine.heads.KernelHead.kernel_rows`) and, with
        ``g_row``, ``G''`` in the inputs' dtype; ``backward``: ``G''`` from the head's
        reduced state and its weights (after ``begin_grad``)."""
        from ..triton import stripe

        assert isinstance(head, KernelHead)
        p = self._products(x, y, r0, r1)
        iqb, rows = iq[r0:r1], slice(r0, r1)
        gb = self._g[: r1 - r0] if self._g is not None and not x.is_cuda else torch.empty_like(p, dtype=x.dtype)
        weights = head.kernel_weights(st)[0] if backward else g_row
        if args.kernel == KernelId.SOFTPLUS:
            coef = None if weights is None else weights[rows].float() * iqb
            sp, sig = stripe.softplus_rows(p, iqb, ik, ops.scale, args.bias, coef, gb)
            if not backward:
                head.kernel_rows(st, rows, sp, sig, g_row)
            return None if coef is None else gb
        if backward:
            lse, coef = st.row[rows], weights[rows]  # type: ignore[index]
        else:
            lse = stripe.softmax_rows(p, iqb, ik, ops.scale, r0, args.exclude_self, args.offset, args.excluded)
            lse, coef = head.kernel_rows(st, rows, lse, None, g_row)
        if coef is None:
            return None
        return stripe.softmax_grad(
            p, iqb, ik, ops.scale, r0, args.exclude_self, args.offset, args.excluded, lse.float(), coef * iqb, gb
        )

    def fuses(self, ops: Operands, head: Head) -> bool:
        return True  # every stripe holds its rows' every column

    def rows_fused(
        self, ops: Operands, head: Head, st: Any, g_row: Optional[Tensor], dq: Any, dk: Optional[Tensor]
    ) -> Optional[Tensor]:
        x, y, iq, ik = self._inputs(ops)
        m, n = x.shape[0], y.shape[0]
        self._buffers(min(ops.block, m), n, x, iq.dtype)
        args = self._kernel(ops, head, x)
        dscale = None if g_row is None else iq.new_zeros(())
        for r0 in range(0, m, ops.block):
            r1 = min(r0 + ops.block, m)
            if args is not None:
                gpp = self._kernel_rows(args, ops, head, st, g_row, x, y, iq, ik, r0, r1)
                if gpp is not None and dscale is not None:
                    assert dk is not None
                    dscale += self._accumulate_once(gpp, r0, ops, x, y, dq, dk)
                continue
            tile = Tile(r0, r1, 0, n, ops.offset)
            g = head.rows_fused(self._scores(ops, x, y, iq, ik, r0, r1), tile, st, g_row)
            if g is not None and dscale is not None:
                assert dq is not None and dk is not None
                dscale += self._gradient(g, r0, ops, x, y, iq, ik, dq, dk)
        if dscale is not None and self._once(ops, x):
            assert dk is not None
            self._rescale(ops, dk)
        return dscale

    def reduce(self, ops: Operands, head: Head, st: Any, p: int) -> None:
        x, y, iq, ik = self._inputs(ops)
        m, n = x.shape[0], y.shape[0]
        self._buffers(min(ops.block, m), n, x, iq.dtype)
        for r0 in range(0, m, ops.block):
            r1 = min(r0 + ops.block, m)
            head.reduce(self._scores(ops, x, y, iq, ik, r0, r1), Tile(r0, r1, 0, n, ops.offset), st, p)

    def backward(self, ops: Operands, head: Head, st: Any, dq: Any, dk: Tensor) -> Tensor:
        x, y, iq, ik = self._inputs(ops)
        m, n = x.shape[0], y.shape[0]
        self._buffers(min(ops.block, m), n, x, iq.dtype)
        args = self._kernel(ops, head, x)
        dscale = iq.new_zeros(())
        for r0 in range(0, m, ops.block):
            r1 = min(r0 + ops.block, m)
            if args is not None:
                gpp = self._kernel_rows(args, ops, head, st, None, x, y, iq, ik, r0, r1, backward=True)
                assert gpp is not None
                dscale += self._accumulate_once(gpp, r0, ops, x, y, dq, dk)
                continue
            g = head.grad(self._scores(ops, x, y, iq, ik, r0, r1), Tile(r0, r1, 0, n, ops.offset), st)
            dscale += self._gradient(g, r0, ops, x, y, iq, ik, dq, dk)
        if self._once(ops, x):
            self._rescale(ops, dk)
        return dscale
