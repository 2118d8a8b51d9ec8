"""A new loss takes two files (tests/toy_loss.py and this test): every backend equals
the plain formula, its Module twin stores its options, and across 2 and 3 gloo
processes, on both strategies, the loss and its gradients equal one process's."""

from __future__ import annotations

import datetime
import os
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import assert_close, close_group, spawn
from toy_loss import InterleavedLoss, interleaved_loss

TOL = (1e-10, 1e-9)


def _formula(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The loss as plain torch: cross-entropy over the scaled cosine matrix, the diagonal masked."""
    z = F.normalize(x, dim=1)
    s = (z @ z.T / t).masked_fill(torch.eye(x.shape[0], dtype=torch.bool), float("-inf"))
    return F.cross_entropy(s, torch.arange(x.shape[0]) ^ 1)


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_every_backend_equals_the_formula(backend: str) -> None:
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    t = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    got = interleaved_loss(x, temperature=t, backend=backend, block_size=3)
    want = _formula(x, t)
    assert_close(got, want, f"{backend}: value", *TOL)
    for g, w, name in zip(torch.autograd.grad(got, [x, t]), torch.autograd.grad(want, [x, t]), ["x", "t"]):
        assert_close(g, w, f"{backend}: grad {name}", *TOL)


def test_module_twin_and_errors() -> None:
    x = torch.randn(6, 4, dtype=torch.float64)
    assert_close(
        InterleavedLoss(temperature=0.3, reduction="sum")(x),
        interleaved_loss(x, temperature=0.3, reduction="sum"),
        "module vs function",
        *TOL,
    )
    with pytest.raises(ValueError, match="pairs"):
        interleaved_loss(torch.randn(5, 4))
    with pytest.raises(ValueError, match="reduction"):
        interleaved_loss(torch.randn(4, 4), reduction="avg")


SIZES = {2: [4, 2], 3: [2, 6, 4]}


def _worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    sizes = SIZES[world]
    x = torch.randn(sum(sizes), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    start = sum(sizes[:rank])
    out: List[torch.Tensor] = []
    for strategy in ("all_gather", "ring"):
        xl = x[start : start + sizes[rank]].clone().requires_grad_(True)
        t = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
        loss = interleaved_loss(xl, temperature=t, process_group=dist.group.WORLD, strategy=strategy, grad_scale="sum")
        out += [loss.detach(), *torch.autograd.grad(loss, [xl, t])]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    x = torch.randn(sum(sizes), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    t = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    want = _formula(x, t)
    gx, gt = torch.autograd.grad(want, [x, t])
    for s, strategy in enumerate(("all_gather", "ring")):
        value, t_grad = (sum(r[3 * s + i] for r in ranks) for i in (0, 2))
        assert_close(value, want, f"{strategy}: sum of the ranks' values", *TOL)
        assert_close(t_grad, gt, f"{strategy}: summed temperature grad", *TOL)
        for r in range(world):
            start = sum(sizes[:r])
            assert_close(ranks[r][3 * s + 1], gx[start : start + sizes[r]], f"{strategy}: rank {r} rows' grad", *TOL)
