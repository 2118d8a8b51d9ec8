"""flashcl.proxy_anchor_loss against pytorch-metric-learning's ProxyAnchorLoss (float64:
the value, the rows' and the proxies' gradients, every backend, odd blocks, classes
absent from the batch), the option errors, and across 2 and 3 gloo processes (the
proxies split between the ranks), both strategies, equal to one process."""

from __future__ import annotations

import os
from typing import Any, List

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

pml = pytest.importorskip("pytorch_metric_learning")
from pytorch_metric_learning import losses  # noqa: E402

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]


def _pml(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, **kw: Any) -> Any:
    """PML's loss and its gradients (rows, proxies)."""
    loss = losses.ProxyAnchorLoss(w.shape[0], w.shape[1], **kw)
    loss.proxies.data = w.clone()
    xx = x.clone().requires_grad_(True)
    value = loss(xx, y)
    return (value, *torch.autograd.grad(value, [xx, loss.proxies]))


def _ours(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, **kw: Any) -> Any:
    xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    value = flashcl.proxy_anchor_loss(xx, y, ww, **kw)
    return (value, *torch.autograd.grad(value, [xx, ww]))


def _close(got: Any, want: Any, what: str) -> None:
    scale = max(1.0, float(want[0].detach().abs()))
    for g, w, name in zip(got, want, ("value", "rows' grad", "proxies' grad")):
        assert_close(g / scale, w / scale, f"{what}: {name}", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b,classes,seed", [(29, 9, 0), (13, 4, 1), (2, 2, 2), (40, 40, 3)])
def test_equals_pml(backend: str, b: int, classes: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 6, dtype=torch.float64, generator=g)
    y = torch.randint(0, classes, (b,), generator=g)  # classes absent from the batch, too
    w = torch.randn(classes, 6, dtype=torch.float64, generator=g)
    for kw in ({}, {"margin": 0.2, "alpha": 16.0}):
        _close(_ours(x, y, w, backend=backend, block_size=3, **kw), _pml(x, y, w, **kw), f"{backend} {kw}")


def test_reductions_module_and_errors() -> None:
    g = torch.Generator().manual_seed(4)
    x, y, w = torch.randn(10, 5, generator=g), torch.randint(0, 6, (10,), generator=g), torch.randn(6, 5, generator=g)
    rows = flashcl.proxy_anchor_loss(x, y, w, reduction="none")
    assert rows.shape == (6,)
    assert_close(rows.mean(), flashcl.proxy_anchor_loss(x, y, w), "mean of the proxies' terms", 1e-6, 1e-5)
    assert_close(flashcl.proxy_anchor_loss(x, y, w, reduction="sum"), rows.sum(), "sum", 1e-5, 1e-5)
    assert_close(
        flashcl.ProxyAnchorLoss(alpha=8.0)(x, y, w), flashcl.proxy_anchor_loss(x, y, w, alpha=8.0), "twin", 0, 0
    )
    for kwargs, match in (({"alpha": 0.0}, "alpha"), ({"margin": float("inf")}, "margin")):
        with pytest.raises(ValueError, match=match):
            flashcl.proxy_anchor_loss(x, y, w, **kwargs)
    with pytest.raises(ValueError, match="labels"):
        flashcl.proxy_anchor_loss(x, y + 6, w)
    with pytest.raises(ValueError, match="proxies"):
        flashcl.proxy_anchor_loss(x, y, w[:, :3])


SIZES = {2: [7, 4], 3: [5, 0, 8]}  # uneven, a rank with no rows of its own
CLASSES = 5


def _data() -> Any:
    g = torch.Generator().manual_seed(13)
    return (
        torch.randn(13, 5, dtype=torch.float64, generator=g),
        torch.randint(0, CLASSES, (13,), generator=g),
        torch.randn(CLASSES, 5, dtype=torch.float64, generator=g),
    )


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    x, y, w = _data()
    x, y = x[: sum(sizes)], y[: sum(sizes)]
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out: List[Any] = []
    for strategy in ("all_gather", "ring"):
        xl, ww = x[mine].clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = flashcl.proxy_anchor_loss(
            xl, y[mine], ww, alpha=8.0, process_group=dist.group.WORLD, strategy=strategy, grad_scale="sum"
        )
        out += [loss.detach(), *torch.autograd.grad(loss, [xl, ww])]
    # grad_scale="ddp": world x the share; DDP's mean of the proxies' gradients is then the whole one
    xl, ww = x[mine].clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = flashcl.proxy_anchor_loss(xl, y[mine], ww, alpha=8.0, process_group=dist.group.WORLD, grad_scale="ddp")
    out += [loss.detach(), *torch.autograd.grad(loss, [xl, ww])]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    x, y, w = _data()
    want = _pml(x[: sum(sizes)], y[: sum(sizes)], w, alpha=8.0)
    for case, strategy in enumerate(("all_gather", "ring", "ddp")):
        factor = world if strategy == "ddp" else 1
        value = sum(r[3 * case] for r in ranks) / factor
        proxies = sum(r[3 * case + 2] for r in ranks) / factor  # each rank's part of the proxies' gradient
        rows = torch.cat([r[3 * case + 1] for r in ranks]) / factor
        _close((value, rows, proxies), want, f"{strategy}, {world} processes")
        assert rows.shape[0] == sum(sizes)


def test_second_derivatives_equal_the_dense_formula() -> None:
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(11, 5, dtype=torch.float64, generator=g), torch.randint(0, 4, (11,), generator=g)
    w = torch.randn(4, 5, dtype=torch.float64, generator=g)
    got = []
    for backend in ("dense", "tiled", "reference"):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        gx, gw = torch.autograd.grad(
            flashcl.proxy_anchor_loss(xx, y, ww, alpha=8.0, backend=backend), [xx, ww], create_graph=True
        )
        got.append(torch.autograd.grad(gx.sum() + gw.pow(2).sum(), [xx, ww]))
    for other, name in ((got[1], "tiled"), (got[2], "reference")):
        for a, b in zip(other, got[0]):
            assert_close(a, b, f"{name} vs dense", *TOL)


def test_rows_and_proxies_of_two_dtypes_give_one_answer() -> None:
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(9, 4, generator=g), torch.randint(0, 3, (9,), generator=g)
    w = torch.randn(3, 4, dtype=torch.float64, generator=g)
    got = []
    for backend in BACKENDS:
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        value = flashcl.proxy_anchor_loss(xx, y, ww, backend=backend)
        gx, gw = torch.autograd.grad(value, [xx, ww])
        assert value.dtype == gw.dtype == torch.float64 and gx.dtype == torch.float32
        got.append((value, gx, gw))
    for other, backend in zip(got[1:], BACKENDS[1:]):
        for a, b in zip(other, got[0]):
            assert_close(a, b, f"{backend} vs reference", 1e-6, 1e-6)
