"""flashcl.integrations.open_clip against open_clip's own loss.py (loaded from its
file), float64: every constructor combination of ClipLoss, DistillClipLoss and
CoCaLoss (local_loss x gather_with_grad) and SigLipLoss (every dist_impl), on 1, 2 and 3
gloo processes: each rank's value, its features' gradients and the logit scale's
(and bias's) gradient, with and without output_dict; uneven batches against one
process; horovod refused."""

from __future__ import annotations

import itertools
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

from flashcl.bench.peers import open_clip_loss_module
from flashcl.integrations import open_clip as ours
from helpers import assert_close, close_group, init_gloo, spawn

oc, WHY = open_clip_loss_module()
pytestmark = pytest.mark.skipif(oc is None, reason=f"open_clip's loss.py: {WHY}")

TOL = (1e-10, 1e-9)
B, D = 5, 6
COMBOS = list(itertools.product([False, True], [False, True]))  # (local_loss, gather_with_grad)


def _features(world: int, n: int = 4) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(world)
    return [F.normalize(torch.randn(world * B, D, dtype=torch.float64, generator=g), dim=1) for _ in range(n)]


def _run(loss: Any, kind: str, feats: List[torch.Tensor], output_dict: bool) -> Dict[str, Any]:
    """Each output's value and the gradients of their sum w.r.t. every input."""
    xs = [f.clone().requires_grad_(True) for f in feats]
    s = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    if kind == "clip":
        args = [xs[0], xs[1], s]
    elif kind == "siglip":
        bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
        args = [xs[0], xs[1], s, bias]
    elif kind == "siglip without bias":  # open_clip adds no bias for None
        args = [xs[0], xs[1], s, None]
    else:
        args = [xs[0], xs[1], s, xs[2], xs[3], torch.tensor(11.0, dtype=torch.float64)]
    out = loss(*args, output_dict=output_dict)
    values = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, tuple) else [out]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(sum(values), leaves)
    return {
        "values": [v.detach() for v in values],
        "grads": [g.detach() for g in grads],
        "keys": sorted(out) if isinstance(out, dict) else None,
    }


def _run_coca(loss: Any, feats: List[torch.Tensor], logits: torch.Tensor, tokens: torch.Tensor) -> Dict[str, Any]:
    xs = [f.clone().requires_grad_(True) for f in feats[:2]] + [logits.clone().requires_grad_(True)]
    s = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    out = loss(xs[0], xs[1], xs[2], tokens, s, output_dict=True)
    grads = torch.autograd.grad(sum(out.values()), [*xs, s])
    return {"values": [out[k].detach() for k in sorted(out)], "grads": list(grads), "keys": sorted(out)}


def _cases(rank: int, world: int) -> Dict[Any, Any]:
    feats = [f[rank * B : (rank + 1) * B] for f in _features(world)]
    results = {}
    for local_loss, gwg in COMBOS:
        for kind, cls_ours, cls_theirs in [
            ("clip", ours.ClipLoss, oc.ClipLoss),
            ("distill", ours.DistillClipLoss, oc.DistillClipLoss),
        ]:
            kw = dict(local_loss=local_loss, gather_with_grad=gwg, rank=rank, world_size=world)
            for output_dict in (False, True):
                results[(kind, local_loss, gwg, output_dict)] = (
                    _run(cls_ours(**kw), kind, feats, output_dict),
                    _run(cls_theirs(**kw), kind, feats, output_dict),
                )
    g = torch.Generator().manual_seed(world)
    logits = torch.randn(world * B, 7, 11, dtype=torch.float64, generator=g)[rank * B : (rank + 1) * B]
    tokens = torch.randint(0, 11, (world * B, 7), generator=g)[rank * B : (rank + 1) * B]  # 0: padding
    for local_loss, gwg in COMBOS:
        kw = dict(
            caption_loss_weight=2.0,
            clip_loss_weight=1.5,
            local_loss=local_loss,
            gather_with_grad=gwg,
            rank=rank,
            world_size=world,
        )
        results[("coca", local_loss, gwg)] = tuple(
            _run_coca(cls(**kw), feats, logits, tokens) for cls in (ours.CoCaLoss, oc.CoCaLoss)
        )
    for impl in ("bidir", "shift", "reduce", "gather"):
        kw = dict(rank=rank, world_size=world, dist_impl=impl)
        results[("siglip", impl)] = (
            _run(ours.SigLipLoss(**kw), "siglip", feats[:2], False),
            _run(oc.SigLipLoss(**kw), "siglip", feats[:2], False),
        )
    kw = dict(rank=rank, world_size=world)
    results[("siglip", "logit_bias=None")] = (
        _run(ours.SigLipLoss(**kw), "siglip without bias", feats[:2], True),
        _run(oc.SigLipLoss(**kw), "siglip without bias", feats[:2], True),
    )
    return results


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    torch.save(_cases(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def _compare(results: Dict[Any, Any], where: str) -> None:
    for key, (got, want) in results.items():
        name = f"{where} {key}"
        assert got["keys"] == want["keys"], name
        assert len(got["values"]) == len(want["values"]), name
        for i, (a, e) in enumerate(zip(got["values"], want["values"])):
            assert_close(a, e, f"{name}: value {i}", *TOL)
        assert len(got["grads"]) == len(want["grads"]), name
        for i, (a, e) in enumerate(zip(got["grads"], want["grads"])):
            assert_close(a, e, f"{name}: gradient {i}", *TOL)


def test_one_process_equals_open_clip() -> None:
    _compare(_cases(0, 1), "world 1")


@pytest.mark.parametrize("world", [2, 3])
def test_every_combination_equals_open_clip_on_every_rank(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        _compare(torch.load(tmp_path / f"rank{rank}.pt"), f"world {world} rank {rank}")


SIZES = [4, 1, 6]


def _uneven_worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    g = torch.Generator().manual_seed(9)
    img, txt = (F.normalize(torch.randn(sum(SIZES), D, dtype=torch.float64, generator=g), dim=1) for _ in range(2))
    sl = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    x, y = img[sl].clone().requires_grad_(True), txt[sl].clone().requires_grad_(True)
    loss = ours.ClipLoss(gather_with_grad=True, rank=rank, world_size=world)(x, y, 8.0)
    torch.save((loss.detach(), torch.autograd.grad(loss, [x, y])), os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def test_uneven_batches_give_the_global_loss(tmp_path) -> None:
    """open_clip needs equal batches; flashcl's gather_with_grad=True takes uneven ones:
    every rank's value is the global loss, its gradient world x the global loss's."""
    world = len(SIZES)
    spawn(_uneven_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    g = torch.Generator().manual_seed(9)
    img, txt = (F.normalize(torch.randn(sum(SIZES), D, dtype=torch.float64, generator=g), dim=1) for _ in range(2))
    xs = [img.clone().requires_grad_(True), txt.clone().requires_grad_(True)]
    want = oc.ClipLoss()(*xs, 8.0)
    grads = torch.autograd.grad(want, xs)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, (value, _) in enumerate(ranks):
        assert_close(value, want, f"rank {r}: value", *TOL)
    for i in range(2):
        got = torch.cat([rank[1][i] for rank in ranks])
        assert_close(got, world * grads[i], f"gradient {i}", *TOL)


@pytest.mark.parametrize("chunk_size", [0, 1, 2, 7])
def test_siglip_chunk_size_is_accepted_and_changes_nothing(chunk_size: int) -> None:
    """open_clip's newer ``chunk_size`` keyword (rows of logits at a time): the same
    loss as open_clip's (with the keyword where its version has it)."""
    import inspect

    feats = _features(1)[:2]
    theirs_kw = {"chunk_size": chunk_size} if "chunk_size" in inspect.signature(oc.SigLipLoss).parameters else {}
    for kind in ("siglip", "siglip without bias"):
        _compare(
            {
                (kind, chunk_size): (
                    _run(ours.SigLipLoss(chunk_size=chunk_size), kind, feats, False),
                    _run(oc.SigLipLoss(**theirs_kw), kind, feats, False),
                )
            },
            "world 1",
        )
    with pytest.raises(TypeError, match="chunk_size"):
        ours.SigLipLoss(chunk_size=2.5)  # type: ignore[arg-type]


def test_horovod_and_a_wrong_world_are_clear_errors() -> None:
    f = _features(1)
    with pytest.raises(ValueError, match="horovod"):
        ours.ClipLoss(use_horovod=True)(f[0], f[1], 5.0)
    with pytest.raises(RuntimeError, match="process group"):
        ours.ClipLoss(world_size=2, rank=0)(f[0], f[1], 5.0)
    with pytest.raises(ValueError, match="dist_impl"):
        ours.SigLipLoss(dist_impl="ring")
