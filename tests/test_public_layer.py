"""The public layer: every Module twin stores its function's options; options a
loss does not take across processes are errors, not ignored."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import flashcl

TWINS = [
    (flashcl.SupConLoss, flashcl.supcon_loss),
    (flashcl.NTXentLoss, flashcl.nt_xent_loss),
    (flashcl.InfoNCELoss, flashcl.info_nce_loss),
    (flashcl.ClipLoss, flashcl.clip_loss),
    (flashcl.SigLipLoss, flashcl.siglip_loss),
    (flashcl.GistLoss, flashcl.gist_loss),
    (flashcl.NeighborLoss, flashcl.neighbor_loss),
    (flashcl.DistillLoss, flashcl.distill_loss),
    (flashcl.CoSENTLoss, flashcl.cosent_loss),
    (flashcl.TripletLoss, flashcl.triplet_loss),
    (flashcl.CosFaceLoss, flashcl.cosface_loss),
    (flashcl.ArcFaceLoss, flashcl.arcface_loss),
    (flashcl.MaxSimLoss, flashcl.maxsim_loss),
    (flashcl.MaxSimDistillLoss, flashcl.maxsim_distill_loss),
    (flashcl.DINOLoss, flashcl.dino_loss),
    (flashcl.SwAVLoss, flashcl.swav_loss),
    (flashcl.KoLeoLoss, flashcl.koleo_loss),
    (flashcl.FlexLoss, flashcl.flex_loss),
]


def test_every_public_loss_is_in_the_twin_table() -> None:
    functions = {name for name in flashcl.__all__ if name.endswith("_loss")}
    assert functions == {fn.__name__ for _, fn in TWINS}


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


def test_every_registered_loss_is_in_every_namespace() -> None:
    """flashcl, flashcl.functional, flashcl.modules and flashcl.distributed take their
    names from the registry (flashcl.registry): each registered function and Module
    is in each that should hold it, nothing else ends in _loss / Loss there."""
    import flashcl.functional
    import flashcl.modules
    from flashcl import registry

    fns, mods = registry.functions(), registry.modules()
    assert len(fns) == len(mods) == 18
    for name, fn in fns.items():
        assert getattr(flashcl, name) is fn and getattr(flashcl.functional, name) is fn, name
        assert name in flashcl.__all__ and name in flashcl.functional.__all__, name
        assert registry.takes_process_group(fn) and name in flashcl.distributed.__all__, name
        assert flashcl.distributed.__dict__[name].__name__ == name
    for name, cls in mods.items():
        assert getattr(flashcl, name) is cls and getattr(flashcl.modules, name) is cls, name
        assert name in flashcl.__all__ and name in flashcl.modules.__all__, name
    public = {n for n in flashcl.__all__ if n.endswith(("_loss", "Loss"))}
    assert public == set(fns) | set(mods)
    assert {n for n in flashcl.distributed.__all__ if n.endswith("_loss")} == set(fns)
