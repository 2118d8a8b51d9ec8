"""flashcl's losses inside ``torch.compile``: one opaque operator per loss call.

The tiled engine runs Python loops over blocks of the score matrix, with sizes and
counts read from the data (positives per row, the labels' classes); traced by
dynamo, each of those would break the graph. Under compilation a loss therefore
enters the graph as one call of the custom operator ``flashcl::loss`` (registered
with :func:`torch.library.custom_op`, with a fake implementation that gives the
output's shape and dtype and a registered backward), and its whole eager
computation (option checks included: a bad input still raises its ``ValueError``
when the compiled step runs) runs inside that call. A scalar loss's gradients are
formed in the same call, as the eager engine forms them in its forward pass; the
backward only scales them by the upstream gradient. A per-row loss
(``reduction="none"``) is differentiated by a second operator,
``flashcl::loss_backward``, which recomputes it.

Not available compiled, each with an error that says so: ``process_group`` (the
collectives run outside the graph: compile the encoder, not the loss, or call
the loss eagerly), and options that are Python objects rather than numbers,
strings or tensors. Second derivatives through a compiled loss are refused by
torch's AOTAutograd; they keep working eagerly.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

from .core import compute_dtype
from .parallel import collectives

__all__ = ["compiles", "operator_args", "LOSSES"]

F = TypeVar("F", bound=Callable[..., Any])

#: The public losses by name, as the operators find them.
LOSSES: Dict[str, Callable[..., Tensor]] = {}
_ROWS: Dict[str, Callable[[Tensor], Sequence[Any]]] = {}
_DEFAULT_REDUCTION: Dict[str, str] = {}

_TENSOR = "__flashcl_tensor__"
_NUMBER = "__flashcl_number__"
_PLAIN = (bool, int, float, str, type(None))


def _encode(value: Any, tensors: List[Tensor], name: str) -> Any:
    """``value`` with each tensor replaced by a marker holding its place in ``tensors``."""
    if isinstance(value, Tensor):
        tensors.append(value)
        return (_TENSOR, len(tensors) - 1)
    if isinstance(value, (tuple, list)):
        items = [_encode(v, tensors, name) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # A number travels as a 0-dim tensor, read back inside the operator: under
        # dynamic=True dynamo holds it as a symbol, which has no text form.
        tensors.append(torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64))
        return (_NUMBER, len(tensors) - 1, "float" if isinstance(value, float) else "int")
    if isinstance(value, _PLAIN):
        return value
    raise TypeError(
        f"{name}: an option of type {type(value).__name__} cannot enter a compiled flashcl loss "
        "(options must be numbers, strings, None, tensors or tuples of them); call the loss outside "
        "torch.compile, or pass the tensor the object holds"
    )


def _decode(value: Any, tensors: Sequence[Tensor]) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _TENSOR:
        return tensors[value[1]]
    if isinstance(value, tuple) and len(value) == 3 and value[0] == _NUMBER:
        number = tensors[value[1]].item()
        return float(number) if value[2] == "float" else int(number)
    if isinstance(value, (tuple, list)):
        items = [_decode(v, tensors) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _decode(v, tensors) for k, v in value.items()}
    return value


def _call(name: str, spec: str, tensors: Sequence[Tensor]) -> Tensor:
    args, kwargs = ast.literal_eval(spec)
    return LOSSES[name](*_decode(args, tensors), **_decode(kwargs, tensors))


_AUTOCAST = functools.reduce(
    lambda keys, name: keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name)),
    [name for name in dir(torch._C.DispatchKey) if name.startswith("Autocast")],
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU),
)


@contextlib.contextmanager
def _eager_autograd() -> Any:
    """Autograd recording again, as in eager mode, inside an operator's kernel.

    A custom operator's kernel runs below the autograd dispatch keys (and, on the
    first call of a compiled graph, below functionalization and the in-place
    version counters too): the loss's eager code would build no graph, and its
    gradients would silently be zero. Like torch's own ``leaf_function``, the
    kernel restores the dispatch state of eager code, excluding only the autocast
    keys that were excluded (the losses turn autocast off themselves)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() & _AUTOCAST
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _leaves(tensors: Sequence[Tensor], needs_grad: Sequence[bool]) -> List[Tensor]:
    """Fresh leaves of the inputs (the caller's tensors are never touched), marked
    for the gradient where ``needs_grad`` says."""
    return [t.detach().requires_grad_(True) if need else t.detach() for t, need in zip(tensors, needs_grad)]


def _gradients(out: Tensor, leaves: Sequence[Tensor], needs_grad: Sequence[bool], grad_out: Any) -> List[Tensor]:
    wrt = [t for t, need in zip(leaves, needs_grad) if need]
    if not wrt:
        return []
    if not out.requires_grad:
        raise RuntimeError("flashcl::loss: the loss built no autograd graph inside its operator")
    got = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, got)]


def _unaliased(outputs: List[Tensor], inputs: Sequence[Tensor]) -> List[Tensor]:
    """``outputs`` contiguous (the strides the fake implementation promises), with
    a copy of each one that shares memory with an input or an earlier output (an
    operator's outputs may not alias; two inputs' gradients can be views of one
    buffer, as NT-Xent's two views are of one batch)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    result = []
    for t in outputs:
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        result.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return result


def _contiguous_like(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@torch.library.custom_op("flashcl::loss", mutates_args=())
def _loss_op(name: str, spec: str, tensors: List[Tensor], needs_grad: List[bool], fused: bool) -> List[Tensor]:
    leaves = _leaves(tensors, needs_grad)
    with _eager_autograd():
        out = _call(name, spec, leaves)
        grads = _gradients(out, leaves, needs_grad, None) if fused else []
    return _unaliased([out.detach(), *grads], tensors)


@_loss_op.register_fake
def _loss_fake(name: str, spec: str, tensors: List[Tensor], needs_grad: List[bool], fused: bool) -> List[Tensor]:
    first = tensors[0]
    dtype = compute_dtype(first.dtype)
    if not fused:  # reduction="none": one loss per row
        return [first.new_empty(_ROWS[name](first), dtype=dtype)]
    return [first.new_empty((), dtype=dtype), *[_contiguous_like(t) for t, need in zip(tensors, needs_grad) if need]]


@torch.library.custom_op("flashcl::loss_backward", mutates_args=())
def _loss_backward_op(
    name: str, spec: str, tensors: List[Tensor], needs_grad: List[bool], grad_out: Tensor
) -> List[Tensor]:
    leaves = _leaves(tensors, needs_grad)
    with _eager_autograd():
        return _unaliased(_gradients(_call(name, spec, leaves), leaves, needs_grad, grad_out), [*tensors, grad_out])


@_loss_backward_op.register_fake
def _loss_backward_fake(
    name: str, spec: str, tensors: List[Tensor], needs_grad: List[bool], grad_out: Tensor
) -> List[Tensor]:
    return [_contiguous_like(t) for t, need in zip(tensors, needs_grad) if need]


def _setup(ctx: Any, inputs: Tuple[Any, ...], output: List[Tensor]) -> None:
    name, spec, tensors, needs_grad, fused = inputs
    ctx.name, ctx.spec, ctx.needs_grad, ctx.fused, ctx.count = name, spec, needs_grad, fused, len(tensors)
    ctx.save_for_backward(*(output[1:] if fused else tensors))


def _backward(ctx: Any, grads: List[Tensor]) -> Tuple[Any, ...]:
    saved = ctx.saved_tensors
    if ctx.fused:
        parts = [g * grads[0].to(g.dtype) for g in saved]
    else:
        parts = list(torch.ops.flashcl.loss_backward(ctx.name, ctx.spec, list(saved), ctx.needs_grad, grads[0]))
    per_input = [parts.pop(0) if need else None for need in ctx.needs_grad]
    return None, None, per_input, None, None


_loss_op.register_autograd(_backward, setup_context=_setup)


def compiles(
    rows: Callable[[Tensor], Sequence[Any]] = lambda x: x.shape[:-1], batch_dims: Optional[Dict[str, int]] = None
) -> Callable[[F], F]:
    """Decorates a public loss so that under ``torch.compile`` it is one call of
    ``flashcl::loss``. ``rows``: the shape of its ``reduction="none"`` output from
    its first tensor argument (default: that tensor's shape without its last
    dimension). ``batch_dims``: the arguments whose batch dimension is not the first
    (the ranks' calls are compared without it: :func:`flashcl.parallel.same_call`)."""

    def wrap(fn: F) -> F:
        name = fn.__name__
        LOSSES[name], _ROWS[name], _DEFAULT_REDUCTION[name] = fn, rows, _default_reduction(fn)

        @functools.wraps(fn)
        def loss(*args: Any, **kwargs: Any) -> Tensor:
            if not torch.compiler.is_compiling():
                if kwargs.get("process_group") is not None:
                    collectives.same_call(fn, args, kwargs, batch_dims)
                return fn(*args, **kwargs)
            if kwargs.get("process_group") is not None:
                raise RuntimeError(
                    f"{name}: process_group cannot run inside torch.compile (its collectives run outside "
                    "the graph); compile the encoder and call the loss eagerly"
                )
            out = torch.ops.flashcl.loss(*operator_args(name, args, kwargs))
            return out[0]

        return loss  # type: ignore[return-value]

    return wrap


def operator_args(name: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    """The arguments of ``flashcl::loss`` for the call ``LOSSES[name](*args, **kwargs)``:
    the options as text with each tensor and number replaced by its place in a list
    of tensors, which of those the gradient is for, and whether the loss is a
    scalar (its gradients formed in the same call)."""
    tensors: List[Tensor] = []
    spec = repr((_encode(list(args), tensors, name), {k: _encode(v, tensors, name) for k, v in kwargs.items()}))
    grad_mode = torch.is_grad_enabled()  # under no_grad no gradient is formed
    needs_grad = [grad_mode and t.requires_grad and (t.is_floating_point() or t.is_complex()) for t in tensors]
    fused = kwargs.get("reduction", _DEFAULT_REDUCTION[name]) != "none"
    return name, spec, tensors, needs_grad, fused


def _default_reduction(fn: Callable[..., Any]) -> str:
    """The loss's default reduction ("mean" for a loss without the option); the
    option must be keyword-only, so that a call names it when it differs."""
    param = inspect.signature(fn).parameters.get("reduction")
    if param is None:
        return "mean"
    assert param.kind is inspect.Parameter.KEYWORD_ONLY, f"{fn.__name__}: reduction must be keyword-only"
    return str(param.default)
