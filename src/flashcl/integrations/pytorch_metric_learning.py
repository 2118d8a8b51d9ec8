"""pytorch-metric-learning's call convention: ``loss_fn(embeddings, labels)``.

* :class:`SupConLoss`: flashcl's SupCon, whose default is exactly PML's
  ``SupConLoss`` (L_out, cosine similarity, anchors without positives left out).
* :class:`NTXentLoss`: PML's ``NTXentLoss`` formula exactly. It differs from
  :func:`flashcl.nt_xent_loss` / SupCon when a row has several positives: PML
  puts every positive pair (a, p) in its own softmax, against the pair's
  positive and all of a's negatives, and averages over the pairs::

      loss = mean_{(a, p): y_a = y_p, a != p} -log( e^{s_ap} / (e^{s_ap} + sum_{n: y_n != y_a} e^{s_an}) )
           = mean softplus( LSE_{n: y_n != y_a} s_an - s_ap )

  PML builds a (positive pairs x negative pairs) mask for it (654 GB at
  B = 1024 with 5 classes); here rows are processed in blocks and memory is
  O(B D + block x B).

``indices_tuple`` (PML's miners) is not supported: pass ``None``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as Fn
from ..core import compute_dtype
from ..tiled import auto_block


class SupConLoss(nn.Module):
    """``SupConLoss(temperature=0.1)(embeddings, labels)``, equal to PML's.

    Examples::

        >>> loss = SupConLoss(temperature=0.1)(torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    """

    def __init__(self, temperature: float = 0.1, backend: str = "auto") -> None:
        super().__init__()
        self.temperature, self.backend = temperature, backend

    def forward(self, embeddings: Tensor, labels: Tensor, indices_tuple: Optional[Any] = None) -> Tensor:
        _no_miner(indices_tuple)
        return Fn.supcon_loss(embeddings, labels, temperature=self.temperature, backend=self.backend)


def _no_miner(indices_tuple: Optional[Any]) -> None:
    if indices_tuple is not None:
        raise NotImplementedError("indices_tuple (PML's miners) is not supported by the flashcl adapters; "
                                  "pass None to use every pair of the batch")


class _PairNTXent(torch.autograd.Function):
    """PML's NT-Xent over row blocks; the gradient is formed in the forward pass."""

    @staticmethod
    def forward(ctx: Any, e_in: Tensor, labels: Tensor, scale: float, block: int) -> Tensor:
        dtype = compute_dtype(e_in.dtype)
        x = e_in.detach().to(dtype)
        norms = torch.linalg.vector_norm(x, dim=1).clamp_min(1e-12)
        e = x / norms.unsqueeze(1)
        b = e.shape[0]
        ids = torch.unique(labels, return_inverse=True)[1].reshape(-1)  # masks are made per row block
        counts = torch.bincount(ids)
        pairs = float((counts * (counts - 1)).sum())
        total = e.new_zeros(())
        de = torch.zeros_like(e)
        w = 1.0 / max(pairs, 1.0)
        for r0 in range(0, b, block):
            r1 = min(r0 + block, b)
            s = (e[r0:r1] * scale) @ e.T
            pos = ids[r0:r1].unsqueeze(1) == ids.unsqueeze(0)
            pos.diagonal(offset=r0).fill_(False)
            neg = ids[r0:r1].unsqueeze(1) != ids.unsqueeze(0)
            lse_neg = torch.logsumexp(s.masked_fill(~neg, float("-inf")), dim=1, keepdim=True)
            z = torch.where(pos, lse_neg - s, torch.zeros((), dtype=dtype))  # softplus(LSE_neg - s_ap)
            total += torch.where(pos, F.softplus(z), torch.zeros((), dtype=dtype)).sum()
            sig = torch.where(pos, torch.sigmoid(z), torch.zeros((), dtype=dtype))
            # d/ds_ap = -sigmoid(z); d/ds_an = sum_p sigmoid(z_ap) * softmax over negatives
            finite = torch.isfinite(lse_neg)
            soft = torch.where(neg & finite, torch.exp(s - torch.where(finite, lse_neg, 0.0)), 0.0)
            g = (soft * sig.sum(1, keepdim=True) - sig) * w
            gk = g @ e
            de[r0:r1] += gk * scale
            de += (g.T @ e[r0:r1]) * scale
        # the normalisation's backward
        de = (de - e * (de * e).sum(1, keepdim=True)) / norms.unsqueeze(1)
        ctx.grad = de.to(e_in.dtype)
        return total * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        if ctx.grad is None:
            raise RuntimeError("flashcl's PML NTXentLoss computes its gradient in forward: backward once")
        g, ctx.grad = ctx.grad, None
        return g * grad, None, None, None


class NTXentLoss(nn.Module):
    """``NTXentLoss(temperature=0.07)(embeddings, labels)``: PML's NTXentLoss exactly
    (see the module docstring), in O(B D + block x B) memory.

    Shape:
        - embeddings: (B, D); labels: (B,)
        - output: scalar (the mean over positive pairs; 0 if there are none)

    Examples::

        >>> loss = NTXentLoss(temperature=0.1)(torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    """

    def __init__(self, temperature: float = 0.07, block_size: Optional[int] = None) -> None:
        super().__init__()
        self.temperature, self.block_size = temperature, block_size

    def forward(self, embeddings: Tensor, labels: Tensor, indices_tuple: Optional[Any] = None) -> Tensor:
        _no_miner(indices_tuple)
        embeddings, labels = Fn._validate_supcon(embeddings, labels, (2,))
        scale = 1.0 / float(Fn._check_positive_scalar(self.temperature, "temperature", embeddings.device,
                                                      compute_dtype(embeddings.dtype)))
        b = embeddings.shape[0]
        block = self.block_size or auto_block(b, b, compute_dtype(embeddings.dtype))
        return _PairNTXent.apply(embeddings, labels, scale, block)
