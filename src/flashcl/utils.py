"""Helpers that every part of flashcl shares: the compute dtype, autocast, and
second derivatives for custom autograd Functions."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence

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


def differentiable_grads(
    fn: Callable[..., Tensor], inputs: Sequence[Optional[Tensor]], needs: Sequence[bool], grad_out: Tensor
) -> List[Optional[Tensor]]:
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


class FusedFunction(torch.autograd.Function):
    """The base of flashcl's autograd Functions (the tile engine's, Matryoshka's
    widths, a given score matrix's): its :meth:`backward` owns the rules they share,
    once:

    * a gradient formed during the forward pass (``ctx.grads``) is handed over,
      scaled by ``grad_out``, and dropped (never kept for a second backward);
    * otherwise the subclass's :meth:`recompute` forms it, with autocast off;
    * with ``create_graph=True`` (second derivatives), the gradient comes from the
      subclass's differentiable :meth:`dense` formula of the same output, or a
      RuntimeError says why there is none (:meth:`no_second_derivatives`);
    * each gradient is cast to its input's dtype, and inputs that need none get None.

    A subclass's ``forward`` calls :meth:`setup` with its differentiable inputs (the
    leading arguments of ``apply``, None allowed) and the other saved tensors.
    """

    @staticmethod
    def setup(
        ctx: Any,
        inputs: Sequence[Optional[Tensor]],
        extra: Sequence[Tensor] = (),
        grads: Optional[Sequence[Optional[Tensor]]] = None,
    ) -> None:
        """Saves the differentiable ``inputs`` (and ``extra`` tensors for
        :meth:`recompute`); ``grads``: their gradients, formed in the forward pass."""
        ctx.n_inputs = len(inputs)
        ctx.grads = None if grads is None else list(grads)
        ctx.save_for_backward(*inputs, *extra)

    @classmethod
    def dense(cls, ctx: Any, *inputs: Any) -> Tensor:
        """The output as a differentiable function of the inputs (create_graph)."""
        raise NotImplementedError

    @classmethod
    def recompute(cls, ctx: Any, grad_out: Tensor, saved: Sequence[Any]) -> Sequence[Optional[Tensor]]:
        """The inputs' gradients by a second visit (autocast off); ``saved``: the
        inputs, then the extra tensors."""
        raise NotImplementedError

    @classmethod
    def no_second_derivatives(cls, ctx: Any) -> Optional[str]:
        """Why this call has no second derivatives (a RuntimeError), or None."""
        return None

    @classmethod
    def backward(cls, ctx: Any, grad_out: Tensor, *non_differentiable: Any):  # type: ignore[override]
        # further outputs (counts) are marked non-differentiable: their gradients are None
        saved = ctx.saved_tensors
        n = ctx.n_inputs
        inputs = saved[:n]
        needs = ctx.needs_input_grad[:n]
        if torch.is_grad_enabled():  # create_graph=True: a gradient that can be differentiated again
            reason = cls.no_second_derivatives(ctx)
            if reason is not None:
                raise RuntimeError(reason)
            ctx.grads = None
            grads: Sequence[Optional[Tensor]] = differentiable_grads(
                lambda *xs: cls.dense(ctx, *xs), inputs, needs, grad_out
            )
        else:
            if ctx.grads is not None:  # formed by the forward pass; handed over (not copied) the first time
                grads, ctx.grads = ctx.grads, None
                if not bool((grad_out == 1).all()):
                    grads = [None if g is None else g.mul_(grad_out) for g in grads]
            else:
                device = next(x for x in inputs if x is not None).device
                with autocast_off(device.type):
                    grads = cls.recompute(ctx, grad_out, saved)
            grads = [None if g is None or x is None else g.to(x.dtype) for g, x in zip(grads, inputs)]
        out = tuple(g if need else None for g, need in zip(grads, needs))
        return out + (None,) * (len(ctx.needs_input_grad) - n)
