"""flashcl.circle_loss against pytorch-metric-learning's CircleLoss (float64, values and
gradients, every backend, odd blocks), its per-anchor losses, PML's edge rules (an anchor
without a positive or a negative: out of the mean; at most one pair of each kind: 0), the
option errors, and across 2 and 3 gloo processes, both strategies, equal to one process."""

from __future__ import annotations

import os
from typing import Any, List

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

pml = pytest.importorskip("pytorch_metric_learning")
from pytorch_metric_learning import losses, reducers  # noqa: E402

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]


def _grad(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    g = torch.autograd.grad(out.sum(), x, allow_unused=True)[0]
    return torch.zeros_like(x) if g is None else g


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal to float64's rounding of exponents up to gamma (80): relative to the largest entry."""
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    assert_close(got / scale, want / scale, what, *TOL)


CASES = [(29, 5, 0), (13, 3, 1), (40, 12, 2), (2, 1, 3), (9, 9, 4), (3, 3, 5)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,gamma", [(0.4, 80.0), (0.25, 16.0)])
@pytest.mark.parametrize("b,classes,seed", CASES)
def test_equals_pml(backend: str, m: float, gamma: float, b: int, classes: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 6, dtype=torch.float64, generator=g)
    y = torch.randint(0, classes, (b,), generator=g)
    xp, xx = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = losses.CircleLoss(m=m, gamma=gamma)(xp, y)
    got = flashcl.circle_loss(xx, y, m=m, gamma=gamma, backend=backend, block_size=3)
    _close(got, want, f"{backend}: value")
    _close(_grad(got, xx), _grad(want, xp), f"{backend}: grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_anchor_losses_and_sum_equal_pml(backend: str) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(23, 8, dtype=torch.float64, generator=g)
    y = torch.randint(0, 4, (23,), generator=g)
    y[0] = 9  # an anchor alone in its class: no positive, no loss
    xp, xx = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = losses.CircleLoss(gamma=32.0, reducer=reducers.DoNothingReducer())(xp, y)["loss"]["losses"].reshape(-1)
    got = flashcl.circle_loss(xx, y, gamma=32.0, reduction="none", backend=backend, block_size=5)
    assert got.shape == (23,) and float(got[0].detach()) == 0.0
    _close(got, want, f"{backend}: rows")
    up = torch.linspace(-1.0, 2.0, 23, dtype=torch.float64)  # a non-uniform upstream gradient
    _close(
        torch.autograd.grad((got * up).sum(), xx)[0], torch.autograd.grad((want * up).sum(), xp)[0], f"{backend}: grad"
    )
    _close(flashcl.circle_loss(x, y, gamma=32.0, reduction="sum", backend=backend), want.sum(), f"{backend}: sum")


@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_without_pairs_give_zero_as_pml(backend: str) -> None:
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    for y in (torch.zeros(6, dtype=torch.long), torch.arange(6)):  # no negative / no positive anywhere
        got = flashcl.circle_loss(x, y, backend=backend)
        assert float(got.detach()) == 0.0 and float(losses.CircleLoss()(x, y).detach()) == 0.0
        assert torch.equal(_grad(got, x), torch.zeros_like(x))


def test_module_twin_and_bad_options() -> None:
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    _close(flashcl.CircleLoss(m=0.3, reduction="sum")(x, y), flashcl.circle_loss(x, y, m=0.3, reduction="sum"), "twin")
    for kwargs, match in (({"gamma": 0.0}, "gamma"), ({"m": float("nan")}, "m"), ({"backend": "triton"}, "triton")):
        with pytest.raises(ValueError, match=match):
            flashcl.circle_loss(x, y, **kwargs)


SIZES = {2: [7, 4], 3: [5, 0, 8]}  # uneven, a rank with no rows of its own


def _data() -> Any:
    g = torch.Generator().manual_seed(12)
    n = 16
    return torch.randn(n, 5, dtype=torch.float64, generator=g), torch.randint(0, 3, (n,), generator=g)


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    x, y = _data()
    x, y = x[: sum(sizes)], y[: sum(sizes)]
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out: List[Any] = []
    for strategy in ("all_gather", "ring"):
        xl = x[mine].clone().requires_grad_(True)
        loss = flashcl.circle_loss(
            xl, y[mine], gamma=24.0, process_group=dist.group.WORLD, strategy=strategy, grad_scale="sum"
        )
        out += [loss.detach(), _grad(loss, xl)]
    xl = x[mine].clone().requires_grad_(True)  # grad_scale="ddp": world x the share, world x the rows' grad
    loss = flashcl.circle_loss(xl, y[mine], gamma=24.0, process_group=dist.group.WORLD, grad_scale="ddp")
    out += [loss.detach(), _grad(loss, xl)]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    x, y = _data()
    x, y = x[: sum(sizes)], y[: sum(sizes)]
    xx = x.clone().requires_grad_(True)
    want = losses.CircleLoss(gamma=24.0)(xx, y)
    gx = _grad(want, xx)
    for case, strategy in enumerate(("all_gather", "ring", "ddp")):
        factor = world if strategy == "ddp" else 1
        _close(sum(r[2 * case] for r in ranks) / factor, want, f"{strategy}: the ranks' values")
        for r in range(world):
            start = sum(sizes[:r])
            _close(ranks[r][2 * case + 1] / factor, gx[start : start + sizes[r]], f"{strategy}: rank {r}'s rows' grad")
