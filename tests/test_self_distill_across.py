"""The prototype losses across 2 and 3 gloo processes with uneven batches (a rank with
one row): each rank's loss with ``grad_scale="sum"`` and its rows' gradients are its
share of one process's loss on the concatenated batch, the prototypes' gradients sum
to one process's; Sinkhorn-Knopp's sums, the center, SwAV's queues and KoLeo's
neighbours span every rank; ``"ddp"`` returns world size x the share. Every backend."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import pytest
import torch

import flashcl
from helpers import assert_close

SIZES: Dict[Any, List[int]] = {2: [4, 9], 3: [5, 1, 7], "3-empty": [5, 0, 7]}  # "3-empty": a rank with no rows
BACKENDS = ["reference", "dense", "tiled"]
TOL = (1e-11, 1e-10)
K, D = 17, 5


def _batch(world: Any) -> Dict[str, Any]:
    """The global batch, the same on every rank (each takes its rows)."""
    ranks = len(SIZES[world])
    g = torch.Generator().manual_seed(ranks)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    n = sum(SIZES[world])
    masks = [torch.rand(2, 6, generator=g) > 0.5 for _ in range(ranks)]  # two images per rank
    masks[0][0] = False  # an image without a masked patch
    for rank, size in enumerate(SIZES[world]):
        if not size:  # no rows: no masked patch either
            masks[rank][:] = False
    p = sum(int(m.sum()) for m in masks)
    return {
        "x": r(3, n, D),
        "y": r(2, n, D),
        "w": r(K, D),
        "wt": r(K, D),
        "c": r(K),
        "queue": [r(2, 3, D) for _ in range(ranks)],
        "masks": masks,
        "px": r(p, D),
        "py": r(p, D),
    }


def _cases(data: Dict[str, Any], rows: slice, patches: slice, rank: int, world: int) -> List[Tuple[str, Any]]:
    """(name, fn(leaves) -> loss) on this rank's part; ``rank=None``: the whole batch in one process."""
    whole = rank < 0
    queue = torch.cat(data["queue"], 1) if whole else data["queue"][rank]
    masks = torch.cat(data["masks"]) if whole else data["masks"][rank]
    out: List[Tuple[str, Any]] = []
    for backend in BACKENDS:
        kw: Dict[str, Any] = {"backend": backend, "block_size": 4 if backend == "tiled" else None}
        out += [
            (
                f"dino-softmax-{backend}",
                lambda x, w, kw=kw, rows=rows, **g: flashcl.dino_loss(
                    x[:, rows],
                    data["y"][:, rows],
                    w,
                    teacher_prototypes=data["wt"],
                    center=data["c"],
                    pairs="cross",
                    **kw,
                    **g,
                ),
            ),
            (
                f"dino-sinkhorn-{backend}",
                lambda x, w, kw=kw, rows=rows, **g: flashcl.dino_loss(
                    x[:, rows], data["y"][:, rows], w, targets="sinkhorn", **kw, **g
                ),
            ),
            (
                f"ibot-{backend}",
                lambda x, w, kw=kw, **g: flashcl.dino_loss(
                    data["px"][patches] + 0 * x.sum(), data["py"][patches], w, masks=masks, center=data["c"], **kw, **g
                ),
            ),
            (
                f"swav-queue-{backend}",
                lambda x, w, kw=kw, rows=rows, **g: flashcl.swav_loss(
                    x[:, rows], w, high_resolution=2, queue=queue, **kw, **g
                ),
            ),
            (
                f"koleo-{backend}",
                lambda x, w, kw=kw, rows=rows, **g: flashcl.koleo_loss(x[0, rows], **kw, **g),
            ),
            (  # above every product: each row is its own neighbour, at its global column (its gradient
                # 0 in exact arithmetic: an eps of 0.1 keeps the rounding left of it small)
                f"koleo-self-score-{backend}",
                lambda x, w, kw=kw, rows=rows, **g: flashcl.koleo_loss(x[0, rows], eps=0.1, self_score=2.0, **kw, **g),
            ),
        ]
    return out


def _slices(world: Any, rank: int, data: Dict[str, Any]) -> Tuple[slice, slice]:
    ranks = len(SIZES[world])
    bounds = [sum(SIZES[world][:r]) for r in range(ranks + 1)]
    counts = [int(m.sum()) for m in data["masks"]]
    pb = [sum(counts[:r]) for r in range(ranks + 1)]
    return slice(bounds[rank], bounds[rank + 1]), slice(pb[rank], pb[rank + 1])


def _worker(rank: int, world: Any, out_dir: str) -> None:
    import torch.distributed as dist

    from helpers import close_group, init_gloo

    init_gloo(rank, len(SIZES[world]), out_dir)
    data = _batch(world)
    rows, patches = _slices(world, rank, data)
    results = {}
    for name, fn in _cases(data, rows, patches, rank, world):
        for scale in ("sum", "ddp"):
            x, w = data["x"].clone().requires_grad_(True), data["w"].clone().requires_grad_(True)
            loss = fn(x, w, process_group=dist.group.WORLD, grad_scale=scale)
            gx, gw = torch.autograd.grad(loss, [x, w], allow_unused=True)
            results[(name, scale)] = (loss.detach(), gx, gw)
    center = flashcl.prototype_center(data["y"][:, rows], data["wt"], process_group=dist.group.WORLD)
    torch.save((results, center), os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3, "3-empty"])
def test_prototype_losses_across_processes_equal_one_process(world: Any, tmp_path) -> None:
    """``"3-empty"``: a rank with no rows (nor masked patches) takes part with nothing of its own."""
    from helpers import spawn

    n = len(SIZES[world])
    spawn(_worker, args=(world, str(tmp_path)), nprocs=n)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]
    data = _batch(world)
    for name, fn in _cases(data, slice(None), slice(None), -1, world):
        x, w = data["x"].clone().requires_grad_(True), data["w"].clone().requires_grad_(True)
        want = fn(x, w)
        gx, gw = torch.autograd.grad(want, [x, w], allow_unused=True)
        got = [r[0][(name, "sum")] for r in ranks]
        assert_close(sum(v[0] for v in got), want.detach(), f"{name}: the ranks' losses summed", *TOL)
        for r, v in enumerate(got):
            rows, _ = _slices(world, r, data)
            if gx is not None:
                assert_close(v[1][:, rows], gx[:, rows], f"{name}: rank {r}'s rows' gradient", *TOL)
        if gw is not None:
            assert_close(sum(v[2] for v in got), gw, f"{name}: the prototypes' gradients summed", *TOL)
        ddp = [r[0][(name, "ddp")][0] for r in ranks]
        assert_close(sum(ddp) / n, want.detach(), f"{name}: ddp's mean over the ranks", *TOL)
    want_center = flashcl.prototype_center(data["y"], data["wt"])
    for r in ranks:
        assert_close(r[1], want_center, "the center over every rank's rows", *TOL)


def _mismatch_worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    from helpers import close_group, init_gloo

    init_gloo(rank, world, out_dir)
    x, w = torch.randn(3, 4 + rank, D), torch.randn(K, D)
    try:
        flashcl.dino_loss(x, x[:2], w, pairs="cross" if rank == 0 else "all", process_group=dist.group.WORLD)
        outcome = "no error"
    except ValueError as e:
        outcome = str(e)
    torch.save(outcome, os.path.join(out_dir, f"mismatch{rank}.pt"))
    close_group()


def test_ranks_with_different_options_get_an_error_each(tmp_path) -> None:
    """Different ``pairs`` on two ranks (uneven batches of views, which alone are fine):
    a ValueError on every rank, no hang."""
    from helpers import spawn

    spawn(_mismatch_worker, args=(2, str(tmp_path)), nprocs=2)
    for r in range(2):
        assert "different calls" in torch.load(tmp_path / f"mismatch{r}.pt")
