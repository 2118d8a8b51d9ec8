"""flashcl's losses inside ``torch.compile``: one opaque operator per loss call.

The tiled engine runs Python loops over blocks of the score matrix, with sizes and
counts read from the data (positives per row, the labels' classes); traced by
dynamo, each of those would break the graph. Under compilation a loss therefore
enters the graph as one call of its own custom operator ``flashcl::<loss name>``
(registered with :func:`torch.library.custom_op` when the loss is defined, with a fake
implementation that gives the output's shape and dtype and a registered backward),
and its whole eager computation (option checks included: a bad input still raises its
``ValueError`` when the compiled step runs) runs inside that call. The operator's
schema is the loss's signature, typed (:class:`_Slot`: tensors, lists of tensors,
numbers or tensors, ints, lists of numbers, booleans, strings), as flash-attention's
operators are. A scalar loss's gradients are formed in the same call, as the eager
engine forms them in its forward pass; the backward only scales them by the upstream
gradient. A per-row loss (``reduction="none"``) is differentiated by a second
operator, ``flashcl::<loss name>_backward``, which recomputes it.

With ``process_group=`` the operator takes the group's name (read while dynamo traces
the call, a constant of the graph) and finds the group again by it: the loss's
collectives, and the check that every rank makes the same call, run inside the
operator as they run eagerly, so that a step compiled with ``fullgraph=True`` holds the
loss whole, and a scalar loss's gradients (their collectives included) are formed in
the same call. Not available compiled, with an error that says so: an option whose
value its slot does not take (a Python object where the loss takes numbers, strings
or tensors). Second derivatives through
a compiled loss are refused by torch's AOTAutograd; they keep working eagerly.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import inspect
import typing
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed.distributed_c10d as c10d
from torch import Tensor

from .core import compute_dtype
from .parallel import collectives

__all__ = ["compiles", "operator", "operator_args", "LOSSES"]

F = TypeVar("F", bound=Callable[..., Any])

#: The public losses by name, as the operators find them.
LOSSES: Dict[str, Callable[..., Tensor]] = {}
_ROWS: Dict[str, Callable[[Tensor], Sequence[Any]]] = {}
_SLOTS: Dict[str, List[_Slot]] = {}
_DEFAULT_REDUCTION: Dict[str, str] = {}
_BATCH_DIMS: Dict[str, Optional[Dict[str, int]]] = {}

_NUMBER_KINDS = ("none", "tensor", "float", "int")


class _Slot:
    """One parameter of a loss as its operator takes it: ``kind`` is ``"tensor"``
    (``Tensor?``), ``"tensors"`` (``Tensor[]``), ``"number"`` (a float or a 0-dim tensor:
    ``Tensor?`` and a ``str`` that says which, a number travelling as a 0-dim tensor:
    under ``dynamic=True`` dynamo holds a Python number as a symbol), ``"int"``
    (``SymInt?``), ``"ints"`` (``SymInt[]?``), ``"floats"`` (``float[]?``), ``"bool"``,
    ``"str"`` (``str?``) or ``"group"`` (``process_group``: ``str?``, the group's name,
    the group found again by it inside the operator)."""

    __slots__ = ("name", "kind")

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind

    def schema(self) -> str:
        n = self.name
        return {
            "tensor": f"Tensor? {n}",
            "tensors": f"Tensor[] {n}",
            "number": f"Tensor? {n}, str {n}__kind",
            "int": f"SymInt? {n}",
            "ints": f"SymInt[]? {n}",
            "floats": f"float[]? {n}",
            "bool": f"bool {n}",
            "str": f"str? {n}",
            "group": f"str? {n}",
        }[self.kind]


def _slot(name: str, hint: Any) -> _Slot:
    """The slot of a parameter from its type hint."""
    if name == "process_group":
        return _Slot(name, "group")
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    if base is Tensor:
        return _Slot(name, "tensor")
    if base in (float, typing.Any) or (typing.get_origin(hint) is typing.Union and Tensor in args):
        return _Slot(name, "number")
    if base is bool:
        return _Slot(name, "bool")
    if base is int:
        return _Slot(name, "int")
    if base is str:
        return _Slot(name, "str")
    inner = typing.get_args(base)
    if typing.get_origin(base) in (tuple, collections.abc.Sequence, list) and inner:
        if inner[0] is Tensor:
            return _Slot(name, "tensors")
        if inner[0] is int:
            return _Slot(name, "ints")
        if inner[0] is float:
            return _Slot(name, "floats")
    raise TypeError(f"{name}: no operator slot for the type {hint!r}")


def _slots(fn: Callable[..., Any]) -> List[_Slot]:
    hints = typing.get_type_hints(fn)
    return [_slot(p, hints.get(p, typing.Any)) for p in inspect.signature(fn).parameters]


def _encode(slot: _Slot, value: Any, loss: str) -> List[Any]:
    """The operator's arguments for one parameter's ``value``."""

    def refuse(accepted: str) -> TypeError:
        return TypeError(
            f"{loss}: {slot.name} of type {type(value).__name__} cannot enter a compiled flashcl loss "
            f"(it takes {accepted}); call the loss outside torch.compile"
        )

    kind = slot.kind
    if kind == "group":
        return [None if value is None else _group_name(value, loss)]
    if kind == "number":
        if value is None or isinstance(value, Tensor):
            return [value, "none" if value is None else "tensor"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse("a number or a tensor")
        is_float = isinstance(value, float)
        return [torch.tensor(value, dtype=torch.float64 if is_float else torch.int64), "float" if is_float else "int"]
    if kind == "tensor" and not (value is None or isinstance(value, Tensor)):
        raise refuse("a tensor or None")
    if kind == "tensors":
        if not isinstance(value, (tuple, list)) or not all(isinstance(t, Tensor) for t in value):
            raise refuse("a sequence of tensors")
        return [list(value)]
    if kind in ("ints", "floats") and value is not None:
        if not isinstance(value, (tuple, list)):
            raise refuse("a sequence of numbers or None")
        return [list(value)]
    if kind == "bool" and not isinstance(value, bool):
        raise refuse("a bool")
    if kind == "int" and not (value is None or (isinstance(value, int) and not isinstance(value, bool))):
        raise refuse("an int or None")
    if kind == "str" and not (value is None or isinstance(value, str)):
        raise refuse("a string or None")
    return [value]


def _tensors(slots: Sequence[_Slot], values: Sequence[Any]) -> List[Tensor]:
    """The tensors among the operator's arguments, in order (those a gradient may be for)."""
    out: List[Tensor] = []
    i = 0
    for slot in slots:
        value = values[i]
        if slot.kind in ("tensor", "number") and isinstance(value, Tensor):
            out.append(value)
        elif slot.kind == "tensors":
            out.extend(value)
        i += 2 if slot.kind == "number" else 1
    return out


def _call(name: str, values: Sequence[Any], tensors: Sequence[Tensor]) -> Tensor:
    """``LOSSES[name]`` on the operator's arguments, its tensors replaced by ``tensors``."""
    kwargs: Dict[str, Any] = {}
    replaced = iter(tensors)
    i = 0
    for slot in _SLOTS[name]:
        value = values[i]
        if slot.kind == "number":  # a tensor, or a number travelling as one
            kind = values[i + 1]
            if kind != "none":
                value = next(replaced)
            if kind in ("float", "int"):
                number = value.item()
                value = float(number) if kind == "float" else int(number)
            i += 2
        else:
            if slot.kind == "tensor" and value is not None:
                value = next(replaced)
            elif slot.kind == "tensors":
                value = tuple(next(replaced) for _ in value)
            elif slot.kind in ("ints", "floats") and value is not None:
                value = tuple(value)
            elif slot.kind == "group" and value is not None:
                value = c10d._resolve_process_group(value)
            i += 1
        kwargs[slot.name] = value
    if kwargs.get("process_group") is not None:  # as the eager call checks it
        collectives.same_call(LOSSES[name], (), kwargs, _BATCH_DIMS[name])
    return LOSSES[name](**kwargs)


def _group_name(group: Any, loss: str) -> str:
    """The name of ``process_group`` (a ``ProcessGroup``), by which the operator finds it;
    read while dynamo traces the call (the name is a constant of the graph)."""
    if not isinstance(group, c10d.ProcessGroup):
        raise TypeError(
            f"{loss}: process_group of type {type(group).__name__} cannot enter a compiled flashcl loss "
            "(it takes a torch.distributed ProcessGroup); call the loss outside torch.compile"
        )
    return str(group.group_name)


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


def _register(name: str) -> None:
    """The operators ``flashcl::<name>`` (the loss, and a scalar loss's gradients in the
    same call) and ``flashcl::<name>_backward`` (a per-row loss's gradient, recomputed),
    their schemas typed from the loss's signature (:class:`_Slot`), their fake
    implementations and the first one's backward."""
    slots = _SLOTS[name]
    params = ", ".join(slot.schema() for slot in slots)
    first = next(i for i, slot in enumerate(slots) if slot.kind == "tensor")
    count = sum(2 if slot.kind == "number" else 1 for slot in slots)

    def loss(*args: Any) -> List[Tensor]:
        values, needs_grad, fused = args[:count], args[count], args[count + 1]
        tensors = _tensors(_SLOTS[name], values)
        leaves = _leaves(tensors, needs_grad)
        with _eager_autograd():
            out = _call(name, values, leaves)
            grads = _gradients(out, leaves, needs_grad, None) if fused else []
        return _unaliased([out.detach(), *grads], tensors)

    def loss_fake(*args: Any) -> List[Tensor]:
        values, needs_grad, fused = args[:count], args[count], args[count + 1]
        x = _first_tensor(values, slots, first)
        dtype = compute_dtype(x.dtype)
        if not fused:  # reduction="none": one loss per row
            return [x.new_empty(_ROWS[name](x), dtype=dtype)]
        tensors = _tensors(_SLOTS[name], values)
        return [x.new_empty((), dtype=dtype), *[_contiguous_like(t) for t, need in zip(tensors, needs_grad) if need]]

    def backward_op(*args: Any) -> List[Tensor]:
        values, needs_grad, grad_out = args[:count], args[count], args[count + 1]
        tensors = _tensors(_SLOTS[name], values)
        leaves = _leaves(tensors, needs_grad)
        with _eager_autograd():
            grads = _gradients(_call(name, values, leaves), leaves, needs_grad, grad_out)
        return _unaliased(grads, [*tensors, grad_out])

    def backward_fake(*args: Any) -> List[Tensor]:
        values, needs_grad = args[:count], args[count]
        return [_contiguous_like(t) for t, need in zip(_tensors(_SLOTS[name], values), needs_grad) if need]

    op = torch.library.custom_op(
        f"flashcl::{name}", loss, mutates_args=(), schema=f"({params}, bool[] needs_grad, bool fused) -> Tensor[]"
    )
    op.register_fake(loss_fake)
    back = torch.library.custom_op(
        f"flashcl::{name}_backward",
        backward_op,
        mutates_args=(),
        schema=f"({params}, bool[] needs_grad, Tensor grad_out) -> Tensor[]",
    )
    back.register_fake(backward_fake)

    def setup(ctx: Any, inputs: Tuple[Any, ...], output: List[Tensor]) -> None:
        values, needs_grad, fused = inputs[:count], inputs[count], inputs[count + 1]
        ctx.needs_grad, ctx.fused = needs_grad, fused
        ctx.layout, ctx.values = _layout(slots, values), _without_tensors(slots, values)
        ctx.save_for_backward(*(output[1:] if fused else _tensors(_SLOTS[name], values)))

    def backward(ctx: Any, grads: List[Tensor]) -> Tuple[Any, ...]:
        saved = list(ctx.saved_tensors)
        if ctx.fused:
            parts = [g * grads[0].to(g.dtype) for g in saved]
        else:
            values = _with_tensors(slots, ctx.values, ctx.layout, saved)
            parts = list(getattr(torch.ops.flashcl, f"{name}_backward")(*values, ctx.needs_grad, grads[0]))
        per_tensor = [parts.pop(0) if need else None for need in ctx.needs_grad]
        return (*_per_argument(slots, ctx.layout, per_tensor), None, None)

    op.register_autograd(backward, setup_context=setup)


def _first_tensor(values: Sequence[Any], slots: Sequence[_Slot], first: int) -> Tensor:
    """The loss's first tensor parameter's value (its rows give a per-row loss's shape)."""
    i = sum(2 if slot.kind == "number" else 1 for slot in slots[:first])
    return values[i]


def _layout(slots: Sequence[_Slot], values: Sequence[Any]) -> List[int]:
    """How many of the call's tensors each slot holds (0 or 1; a list's length)."""
    out, i = [], 0
    for slot in slots:
        value = values[i]
        if slot.kind == "tensors":
            out.append(len(value))
        else:
            out.append(int(slot.kind in ("tensor", "number") and isinstance(value, Tensor)))
        i += 2 if slot.kind == "number" else 1
    return out


def _without_tensors(slots: Sequence[_Slot], values: Sequence[Any]) -> List[Any]:
    """The operator's arguments with each tensor left out (None, or an empty list)."""
    out, i = list(values), 0
    for slot in slots:
        if slot.kind in ("tensor", "number"):
            out[i] = None if isinstance(out[i], Tensor) else out[i]
        elif slot.kind == "tensors":
            out[i] = []
        i += 2 if slot.kind == "number" else 1
    return out


def _with_tensors(slots: Sequence[_Slot], values: Sequence[Any], layout: Sequence[int], tensors: Any) -> List[Any]:
    """:func:`_without_tensors`'s arguments with ``tensors`` put back where ``layout`` says."""
    out, given, i = list(values), iter(tensors), 0
    for slot, n in zip(slots, layout):
        if slot.kind == "tensors":
            out[i] = [next(given) for _ in range(n)]
        elif n:
            out[i] = next(given)
        i += 2 if slot.kind == "number" else 1
    return out


def _per_argument(slots: Sequence[_Slot], layout: Sequence[int], per_tensor: Sequence[Any]) -> List[Any]:
    """The backward's results, one per operator argument, from one per tensor."""
    out: List[Any] = []
    given = iter(per_tensor)
    for slot, n in zip(slots, layout):
        if slot.kind == "tensors":
            out.append([next(given) for _ in range(n)])
            continue
        out.append(next(given) if n else None)
        if slot.kind == "number":
            out.append(None)  # its kind
    return out


def compiles(
    rows: Callable[[Tensor], Sequence[Any]] = lambda x: x.shape[:-1], batch_dims: Optional[Dict[str, int]] = None
) -> Callable[[F], F]:
    """Decorates a public loss so that under ``torch.compile`` it is one call of its
    operator ``flashcl::<name>``. ``rows``: the shape of its ``reduction="none"`` output
    from its first tensor argument (default: that tensor's shape without its last
    dimension). ``batch_dims``: the arguments whose batch dimension is not the first
    (the ranks' calls are compared without it: :func:`flashcl.parallel.same_call`)."""

    def wrap(fn: F) -> F:
        name = fn.__name__
        LOSSES[name], _ROWS[name], _DEFAULT_REDUCTION[name] = fn, rows, _default_reduction(fn)
        _BATCH_DIMS[name] = batch_dims
        _SLOTS[name] = _slots(fn)
        _register(name)

        @functools.wraps(fn)
        def loss(*args: Any, **kwargs: Any) -> Tensor:
            if not torch.compiler.is_compiling():
                if kwargs.get("process_group") is not None:
                    collectives.same_call(fn, args, kwargs, batch_dims)
                return fn(*args, **kwargs)
            return operator(name)(*operator_args(name, args, kwargs))[0]

        return loss  # type: ignore[return-value]

    return wrap


def operator(name: str) -> Any:
    """The operator of the loss ``name`` (``torch.ops.flashcl.<name>.default``)."""
    return getattr(torch.ops.flashcl, name).default


def operator_args(name: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    """The arguments of :func:`operator` ``(name)`` for the call ``LOSSES[name](*args,
    **kwargs)``: each parameter's value in its typed slot (the defaults filled in), which
    of the call's tensors the gradient is for, and whether the loss is a scalar (its
    gradients formed in the same call)."""
    fn = LOSSES[name]
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    values: List[Any] = []
    for slot in _SLOTS[name]:
        values.extend(_encode(slot, bound.arguments[slot.name], name))
    grad_mode = torch.is_grad_enabled()  # under no_grad no gradient is formed
    tensors = _tensors(_SLOTS[name], values)
    needs_grad = [grad_mode and t.requires_grad and (t.is_floating_point() or t.is_complex()) for t in tensors]
    fused = bound.arguments.get("reduction", _DEFAULT_REDUCTION[name]) != "none"
    return (*values, needs_grad, fused)


def _default_reduction(fn: Callable[..., Any]) -> str:
    """The loss's default reduction ("mean" for a loss without the option); the
    option must be keyword-only, so that a call names it when it differs."""
    param = inspect.signature(fn).parameters.get("reduction")
    if param is None:
        return "mean"
    assert param.kind is inspect.Parameter.KEYWORD_ONLY, f"{fn.__name__}: reduction must be keyword-only"
    return str(param.default)
