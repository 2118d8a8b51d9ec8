"""The registry of losses: each family's module registers its loss function and its
Module twin where it defines them (:func:`loss`, :func:`module`), and the public
namespaces (``flashcl``, ``flashcl.functional``, ``flashcl.modules``,
``flashcl.distributed``) take their names from here (:func:`publish`): a loss is
present in each once it is registered, also when it is registered after those
namespaces were made (a loss of a user's own, the tests' toy loss).

In ``flashcl.distributed`` every registered function that takes ``process_group``
gets its alias: ``flashcl.distributed.<name>(..., group=None)`` is
``flashcl.<name>(..., process_group=group or the world)``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Tuple, TypeVar

__all__ = ["loss", "module", "remove", "publish", "lookup", "functions", "modules", "takes_process_group"]

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=type)

_FUNCTIONS: Dict[str, Callable[..., Any]] = {}
_MODULES: Dict[str, type] = {}
#: (namespace, kinds, make): each registered object of a kind in ``kinds`` is set on
#: ``namespace`` as ``make(name, obj)`` (None: not there) and its name added to its ``__all__``
_TARGETS: List[Tuple[Any, Tuple[str, ...], Callable[[str, Any], Any]]] = []


def _same(name: str, obj: Any) -> Any:
    return obj


def _put(
    namespace: Any, kinds: Tuple[str, ...], make: Callable[[str, Any], Any], kind: str, name: str, obj: Any
) -> None:
    if kind not in kinds:
        return
    value = make(name, obj)
    if value is None:
        return
    setattr(namespace, name, value)
    names = getattr(namespace, "__all__", None)
    if isinstance(names, list) and name not in names:
        names.append(name)


def _register(kind: str, table: Dict[str, Any], name: str, obj: Any) -> None:
    if table.get(name, obj) is not obj:
        raise ValueError(f"flashcl.registry: {kind} {name!r} is registered already (by {table[name].__module__})")
    table[name] = obj
    for namespace, kinds, make in _TARGETS:
        _put(namespace, kinds, make, kind, name, obj)


def loss(fn: F) -> F:
    """Registers a loss function (a decorator, above the others)."""
    _register("function", _FUNCTIONS, fn.__name__, fn)
    return fn


def module(cls: M) -> M:
    """Registers a loss's Module twin (a class decorator)."""
    _register("module", _MODULES, cls.__name__, cls)
    return cls


def remove(name: str) -> None:
    """Takes a registered loss or Module out of the registry and of every namespace
    it was published in (a loss registered for a while, as the tests' toy loss)."""
    obj = _FUNCTIONS.pop(name, None) or _MODULES.pop(name, None)
    if obj is None:
        raise KeyError(f"flashcl.registry: nothing registered as {name!r}")
    for namespace, _, _ in _TARGETS:
        if name in vars(namespace):
            delattr(namespace, name)
        names = getattr(namespace, "__all__", None)
        if isinstance(names, list) and name in names:
            names.remove(name)


def publish(namespace: Any, kinds: Tuple[str, ...], make: Callable[[str, Any], Any] = _same) -> None:
    """Sets every registered object of ``kinds`` (``"function"``, ``"module"``) on
    ``namespace`` (a module), now and whenever one is registered later."""
    _TARGETS.append((namespace, kinds, make))
    for kind, table in (("function", _FUNCTIONS), ("module", _MODULES)):
        for name, obj in list(table.items()):
            _put(namespace, kinds, make, kind, name, obj)


def lookup(namespace: str, name: str, kinds: Tuple[str, ...]) -> Any:
    """A registered object of ``kinds`` named ``name``, for a namespace's module
    ``__getattr__`` (an AttributeError that names ``namespace`` otherwise)."""
    for kind, table in (("function", _FUNCTIONS), ("module", _MODULES)):
        if kind in kinds and name in table:
            return table[name]
    raise AttributeError(f"module {namespace!r} has no attribute {name!r}")


def functions() -> Dict[str, Callable[..., Any]]:
    """The registered loss functions, by name."""
    return dict(_FUNCTIONS)


def modules() -> Dict[str, type]:
    """The registered Module twins, by name."""
    return dict(_MODULES)


def takes_process_group(fn: Callable[..., Any]) -> bool:
    """Whether a loss function takes ``process_group=`` (then it has a distributed alias)."""
    try:
        return "process_group" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False
