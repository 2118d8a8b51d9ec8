"""Helpers that every part of flashcl shares: the compute dtype, autocast, and
second derivatives for custom autograd Functions."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["compute_dtype", "autocast_off", "differentiable_grads", "normalize_rows"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half and bfloat16 inputs (accumulation precision), else unchanged."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@contextlib.contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """Autocast disabled for ``device_type``: every backend computes in the
    inputs' own dtype (float32 accumulation for half inputs), as torch's own
    losses do under autocast, so that the backends agree with each other and
    with the float64 reference whatever the caller's autocast state."""
    if torch.amp.is_autocast_available(device_type):
        with torch.autocast(device_type, enabled=False):
            yield
    else:
        yield


def differentiable_grads(fn: Callable[..., Tensor], inputs: Sequence[Optional[Tensor]], needs: Sequence[bool],
                         grad_out: Tensor) -> List[Optional[Tensor]]:
    """For the backward of a custom Function run with ``create_graph=True``:
    ``grad_out``-weighted gradients of ``fn(*inputs)`` with respect to the inputs
    that ``needs`` marks, built with a graph so that they can be differentiated
    again (second derivatives, gradient penalties, Hessian-vector products).

    The fast backwards form their gradients without a graph; rather than return
    a gradient whose own derivative would be silently wrong, they hand this path
    a differentiable formula of the same loss (the dense backend's: memory
    O(M N) on this path only)."""
    with torch.enable_grad():
        # one view per slot: when a tensor fills two slots (k is q), each slot's
        # gradient is its own part, as the Function's backward returns it
        inputs = [x.view_as(x) if x is not None else None for x in inputs]
        wrt = [x for x, need in zip(inputs, needs) if need and x is not None]
        out = fn(*inputs)
        grads = list(torch.autograd.grad(out, wrt, grad_out, create_graph=True, allow_unused=True)) if wrt else []
    result: List[Optional[Tensor]] = []
    for x, need in zip(inputs, needs):
        g = grads.pop(0) if need and x is not None else None
        if g is None and need and x is not None:
            g = torch.zeros_like(x)
        result.append(g)
    return result


class _NormalizeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.eps = eps
        return x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(eps)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        # differentiable ops on x: create_graph=True gives exact second derivatives
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        clamped = norms.clamp_min(ctx.eps)
        y = x / clamped
        dot = (grad * y).sum(1, keepdim=True) * (norms > ctx.eps)
        return (grad - y * dot) / clamped, None


def normalize_rows(x: Tensor, eps: float = 1e-12) -> Tensor:
    """``F.normalize(x, dim=1, eps=eps)`` whose backward projects before it divides,
    ``(g - (g . y) y) / |x|`` with ``y = x / |x|``: autograd of ``F.normalize`` forms
    ``g / |x| - x (g . x) / |x|^3``, two terms that cancel only up to rounding, an
    error of ``eps |g| / |x|`` that is large for short rows (a narrow prefix)."""
    return _NormalizeRows.apply(x, eps)
