"""A rank with nothing of its own (no rows, no image, no class slice) in every loss that
takes a ``process_group``: it takes part in the collectives with its empty part, and
every rank's values and gradients are one process's on the concatenated batch, with
both strategies (``"all_gather"``, ``"ring"``) and both ``grad_scale`` conventions, on
2 processes (the empty rank first) and 3 (the empty rank in the middle, a rank with
one row). Where a loss has no ring, every rank gets the same ValueError (never a hang,
never one rank alone). ``python tests/test_empty_rank.py`` prints the table."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from test_backends_across import cases, data, shard

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

SIZES = {2: [0, 7], 3: [4, 0, 1]}
STRATEGIES = ("all_gather", "ring")
TOL = (1e-10, 1e-9)
Case = Tuple[Callable[..., torch.Tensor], List[torch.Tensor]]


def more_cases(
    d: Dict[str, torch.Tensor], sizes: List[int], rank: int, kw: Dict[str, Any], single: bool
) -> Dict[str, Case]:
    """The losses beyond the core's table: CoSENT, late interaction, the prototype
    losses, the sharded margin losses (a rank may hold no class either)."""
    sl = slice(None) if single else shard(sizes, rank)
    emb, views, labels = d["emb"][sl], d["views"][sl], d["labels"][sl]
    total = sum(sizes)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randn(total, 3, 6, dtype=torch.float64, generator=g)
    doc_tokens = torch.randn(total, 4, 6, dtype=torch.float64, generator=g)
    cand = torch.randn(total, 2, 4, 6, dtype=torch.float64, generator=g)
    teacher = torch.randn(total, 2, dtype=torch.float64, generator=g)
    protos, t_rows = (
        torch.randn(9, 6, dtype=torch.float64, generator=g),
        torch.randn(2, total, 6, dtype=torch.float64, generator=g),
    )
    scores = torch.rand(total, dtype=torch.float64, generator=g)
    classes = d["classes"]  # 4 classes, split over the ranks (one holds none with 3 ranks)
    bounds = {2: [(0, 1), (1, 4)], 3: [(0, 2), (2, 2), (2, 4)]}[len(sizes)]
    lo, hi = (0, 4) if single else bounds[rank]
    rest = {k: v for k, v in kw.items() if k != "backend"}
    shards = {} if single else {"shard_classes": True}
    stack = torch.stack
    # iBOT: each image's masked patches (an image with none among them); a rank with no image holds no rows
    masks = _ibot_masks(total)
    rows = _patch_rows(masks, sl)
    patches = torch.randn(int(masks.sum()), 6, dtype=torch.float64, generator=g)
    t_patches = torch.randn(int(masks.sum()), 6, dtype=torch.float64, generator=g)
    return {
        "ibot": (
            lambda x, w: flashcl.dino_loss(
                x, t_patches[rows], w, masks=masks[sl], **{k: v for k, v in kw.items() if k != "strategy"}
            ),
            [patches[rows], protos],
        ),
        "cosent": (lambda a, b: flashcl.cosent_loss(a, b, scores[sl], scale=5.0, **rest), [emb, views]),
        "maxsim": (lambda q, dd: flashcl.maxsim_loss(q, dd, temperature=0.5, **kw), [tokens[sl], doc_tokens[sl]]),
        "maxsim_distill": (
            lambda q, dd: flashcl.maxsim_distill_loss(
                q, dd, teacher[sl], temperature=0.5, **{k: v for k, v in kw.items() if k != "strategy"}
            ),
            [tokens[sl], cand[sl]],
        ),
        "dino": (
            lambda x, w: flashcl.dino_loss(
                stack([x, x.flip(1)]), t_rows[:, sl], w, **{k: v for k, v in kw.items() if k != "strategy"}
            ),
            [emb, protos],
        ),
        "swav": (
            lambda x, w: flashcl.swav_loss(
                stack([x, views, x.flip(1)]), w, high_resolution=2, **{k: v for k, v in kw.items() if k != "strategy"}
            ),
            [emb, protos],
        ),
        "koleo": (lambda x: flashcl.koleo_loss(x, **{k: v for k, v in kw.items() if k != "strategy"}), [emb]),
        "cosface_sharded": (
            lambda e, w: flashcl.cosface_loss(e, labels, w, margin=0.2, scale=3.0, **shards, **kw),
            [emb, classes[lo:hi]],
        ),
        "arcface_sharded_sum": (
            lambda e, w: flashcl.arcface_loss(e, labels, w, margin=0.3, scale=3.0, reduction="sum", **shards, **kw),
            [emb, classes[lo:hi]],
        ),
    }


def _ibot_masks(total: int) -> torch.Tensor:
    masks = torch.rand(total, 3, generator=torch.Generator().manual_seed(8)) > 0.4
    masks[1] = False
    return masks


def _patch_rows(masks: torch.Tensor, images: slice) -> slice:
    """The rows (masked patches, in order) of the images ``images``."""
    ends = torch.cat([torch.zeros(1, dtype=torch.long), masks.sum(1).cumsum(0)])
    return slice(int(ends[images.start or 0]), int(ends[images.stop if images.stop is not None else masks.shape[0]]))


def all_cases(
    d: Dict[str, torch.Tensor], sizes: List[int], rank: int, kw: Dict[str, Any], single: bool
) -> Dict[str, Case]:
    return {**cases(d, sizes, rank, kw, single), **more_cases(d, sizes, rank, kw, single)}


#: (input, case): inputs every rank holds alike (class weights, prototypes): their gradients summed over the ranks
REPLICATED = {(1, "cosface"), (1, "arcface_sum"), (1, "dino"), (1, "swav"), (1, "ibot")}
#: inputs each rank holds its own slice of, not by rows (the sharded classes): (case, input) -> the slices
SLICED = {("cosface_sharded", 1), ("arcface_sharded_sum", 1)}


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    d = data(sum(sizes))
    results: Dict[Any, Any] = {}
    for strategy in STRATEGIES:
        for grad_scale in ("sum", "ddp"):
            kw = {"backend": "tiled", "process_group": dist.group.WORLD, "grad_scale": grad_scale, "strategy": strategy}
            for name, (fn, inputs) in all_cases(d, sizes, rank, kw, single=False).items():
                leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
                try:
                    loss = fn(*leaves)
                    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                except ValueError as err:
                    results[(strategy, grad_scale, name)] = str(err)
                    continue
                grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
                results[(strategy, grad_scale, name)] = (loss.detach(), [g.detach() for g in grads])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def _run(world: int, out_dir: str) -> List[Dict[Any, Any]]:
    spawn(_worker, args=(world, out_dir), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def _table(world: int, ranks: List[Dict[Any, Any]]) -> Dict[Tuple[str, str], str]:
    """(case, strategy) -> "ok" or the error every rank gave, checked against one process."""
    sizes = SIZES[world]
    d = data(sum(sizes))
    out: Dict[Tuple[str, str], str] = {}
    for name, (fn, inputs) in all_cases(d, sizes, 0, {"backend": "reference"}, single=True).items():
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        want = fn(*leaves)
        want_grads = [
            torch.zeros_like(x) if g is None else g
            for g, x in zip(torch.autograd.grad(want, leaves, allow_unused=True), leaves)
        ]
        for strategy in STRATEGIES:
            got = {gs: [r[(strategy, gs, name)] for r in ranks] for gs in ("sum", "ddp")}
            if any(isinstance(v, str) for vs in got.values() for v in vs):
                errors = {v for vs in got.values() for v in vs}
                assert len(errors) == 1 and isinstance(next(iter(errors)), str), f"{name} {strategy}: {errors}"
                assert strategy == "ring", f"{name} with all_gather refused: {errors}"
                out[(name, strategy)] = "error on every rank: " + next(iter(errors))[:90]
                continue
            what = f"{world} ranks, {name}, {strategy}"
            # "sum": the ranks' values and their replicated inputs' gradients add up to one process's; "ddp": the
            # world size times those (its values: world x the share, or the global loss on every rank for the
            # sharded classes; either way their mean over the ranks is the global loss)
            assert_close(sum(v for v, _ in got["sum"]), want, f"{what}: the ranks' values", *TOL)
            assert_close(sum(v for v, _ in got["ddp"]) / world, want, f"{what}: the ddp values' mean", *TOL)
            for i, g in enumerate(want_grads):
                if g.dim() == 0 or (i, name) in REPLICATED:
                    for gs, factor in (("sum", 1), ("ddp", world)):
                        total = sum(v[1][i] for v in got[gs])
                        assert_close(total, factor * g, f"{what}: input {i} summed ({gs})", *TOL)
                elif (name, i) in SLICED:  # each rank's class slice: its exact gradient either way
                    bounds = {2: [(0, 1), (1, 4)], 3: [(0, 2), (2, 2), (2, 4)]}[world]
                    for r, (lo, hi) in enumerate(bounds):
                        for gs in ("sum", "ddp"):
                            assert_close(got[gs][r][1][i], g[lo:hi], f"{what}: rank {r} class slice ({gs})", *TOL)
                else:
                    per = g.shape[0] // sum(sizes)
                    for r in range(world):
                        rows = _patch_rows(_ibot_masks(sum(sizes)), shard(sizes, r)) if name == "ibot" else None
                        for gs, factor in (("sum", 1), ("ddp", world)):
                            part = factor * g[rows if rows is not None else shard(sizes, r, per)]
                            assert_close(got[gs][r][1][i], part, f"{what}: rank {r} input {i} ({gs})", *TOL)
            out[(name, strategy)] = "ok"
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_with_nothing_of_its_own_takes_part(world: int, tmp_path: Any) -> None:
    table = _table(world, _run(world, str(tmp_path)))
    assert all(v == "ok" for (name, strategy), v in table.items() if strategy == "all_gather")


if __name__ == "__main__":  # the table of the closing note
    import tempfile

    for w in (2, 3):
        for (name, strategy), v in _table(w, _run(w, tempfile.mkdtemp())).items():
            print(f"| {name} | {strategy} | {w} ranks {SIZES[w]} | {v} |")
    sys.exit(0)
