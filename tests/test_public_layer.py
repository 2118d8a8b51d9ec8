"""The public layer: every Module twin stores its function's options; options a
loss does not take across processes are errors, not ignored."""

from __future__ import annotations

import inspect
from typing import Any, List, Tuple

import pytest
import torch

import flashcl


def _twins() -> List[Tuple[Any, Any]]:
    """Each public loss function with its Module twin: ``supcon_loss`` and ``SupConLoss``
    (the names without ``_loss`` / ``Loss``, underscores and case)."""
    key = lambda name: name.lower().replace("_", "").removesuffix("loss")  # noqa: E731
    modules = {key(n): getattr(flashcl, n) for n in flashcl.__all__ if n.endswith("Loss")}
    functions = {key(n): getattr(flashcl, n) for n in flashcl.__all__ if n.endswith("_loss")}
    assert set(modules) == set(functions), set(modules) ^ set(functions)
    return [(modules[k], functions[k]) for k in sorted(functions)]


TWINS = _twins()


def test_every_public_loss_has_a_module_twin_and_takes_a_process_group() -> None:
    assert len(TWINS) >= 18
    for module, fn in TWINS:
        assert issubclass(module, flashcl.base.LossModule), module
        assert "process_group" in inspect.signature(fn).parameters, fn.__name__


@pytest.mark.parametrize("module,fn", TWINS, ids=[m.__name__ for m, _ in TWINS])
def test_every_loss_has_a_twin_with_its_options(module: Any, fn: Any) -> None:
    """Each keyword option of the function is a constructor argument of its Module
    with the same default (the inputs and the per-call tensors are the call's)."""
    options = {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is p.KEYWORD_ONLY and p.default is not p.empty
    }
    per_call = {"ref", "ref_labels", "ref_self", "negatives", "query_labels", "key_labels", "labels", "guide"}
    per_call |= {"query_mask", "doc_mask", "classes", "teacher_prototypes", "center", "masks", "queue"}
    per_call |= {"rows", "cols", "block_mask", "scores"}  # a flex loss's data, block mask, given scores
    twin = {name: p.default for name, p in inspect.signature(module).parameters.items() if p.kind is not p.VAR_KEYWORD}
    for name, default in options.items():
        if name in per_call:
            continue
        assert name in twin, f"{module.__name__} lacks {name}"
        assert twin[name] == default, f"{module.__name__}.{name}: {twin[name]!r} != {default!r}"
    # options the function requires (a triplet margin) the twin requires too
    required = [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and name in twin
    ]
    for name in required:
        assert twin[name] is inspect.Parameter.empty, f"{module.__name__}.{name} should be required"
    assert set(module(**{name: 1.0 for name in required}).loss_options()) == set(twin)


UNSUPPORTED = [
    # every loss takes every backend across processes (test_backends_across.py); a bad strategy or
    # grad_scale is an error before any collective
    (
        "strategy",
        lambda g: flashcl.siglip_loss(
            torch.randn(4, 3), torch.randn(4, 3), 10.0, -10.0, strategy="tree", process_group=g
        ),
    ),
    (
        "grad_scale",
        lambda g: flashcl.clip_loss(torch.randn(4, 3), torch.randn(4, 3), 10.0, grad_scale="mean", process_group=g),
    ),
]


@pytest.mark.parametrize("option,call", UNSUPPORTED, ids=[o for o, _ in UNSUPPORTED])
def test_options_not_taken_across_processes_are_errors(option: str, call: Any) -> None:
    # checked before any collective: no process group is needed to see the error
    with pytest.raises(ValueError, match=option):
        call(object())
