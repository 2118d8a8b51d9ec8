"""Flex losses across processes: the same functions on 2 and 3 gloo processes (uneven
batches, a rank with no samples of its own), every backend that takes a process group,
both strategies and both ``grad_scale`` conventions, equal in float64 to one process on
the concatenated batch: the data of ``cols`` travels with the keys and ``.index`` is
global, the user never gathers."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import flex_oracle
import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn


@pytest.fixture(autouse=True, params=["as_needed", "sparse"])
def _positives_form(request: Any, monkeypatch: Any) -> None:
    """Every test with the binary positives in their default form and always sparse."""
    flex_oracle.positives_forms(request, monkeypatch)


F64 = torch.float64
SIZES = {2: [5, 8], 3: [4, 0, 7]}  # queries per rank; three ranks: one with none
RUNS = [  # (strategy, backend, grad_scale)
    ("all_gather", "reference", "sum"),
    ("all_gather", "dense", "sum"),
    ("all_gather", "tiled", "sum"),
    ("all_gather", "tiled", "ddp"),
    ("ring", "tiled", "sum"),
    ("ring", "tiled", "ddp"),
    ("ring", "auto", "sum"),  # round the ring "auto" is the tiled backend
]
TOL = (1e-10, 1e-9)
GAP = 0.05  # the circle case's margin between two anchors' hardest negatives


def data(total: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(total + 7)
    return {
        "q": torch.randn(total, 6, dtype=F64, generator=g),
        "k": torch.randn(2 * total, 6, dtype=F64, generator=g),
        "p": torch.randn(total, 6, dtype=F64, generator=g),  # each query's own key (two towers)
        "y": torch.randint(0, 3, (total,), generator=g),
        "ky": torch.randint(0, 3, (2 * total,), generator=g),
        "t": torch.randn(total, generator=g, dtype=F64).cumsum(0),
        "doc": torch.randint(0, 4, (total,), generator=g),
        "kdoc": torch.randint(0, 4, (2 * total,), generator=g),
        "soft": torch.rand(total, 3, generator=g, dtype=F64),
    }


def shard(sizes: List[int], rank: int, per: int = 1) -> slice:
    return slice(per * sum(sizes[:rank]), per * sum(sizes[: rank + 1]))


Case = Tuple[Callable[..., torch.Tensor], List[torch.Tensor]]


def cases(d: Dict[str, torch.Tensor], sl: slice, sl2: slice, kw: Dict[str, Any]) -> Dict[str, Case]:
    """The calls, each rank's slice ``sl`` of the queries and ``sl2`` of the keys; the
    learnable scalars (temperature, margin, bias) every rank holds alike."""
    q, p, k = d["q"][sl], d["p"][sl], d["k"][sl2]
    rows = {"y": d["y"][sl], "t": d["t"][sl], "doc": d["doc"][sl], "soft": d["soft"][sl]}
    cols = {"ky": d["ky"][sl2], "kdoc": d["kdoc"][sl2]}
    t = torch.tensor(0.3, dtype=F64)
    margin = torch.tensor(0.2, dtype=F64)
    bias = torch.tensor(-1.0, dtype=F64)
    return {
        "labels": (
            lambda e, tt: flashcl.flex_loss(e, rows=rows, positive=lambda a, b: a.y == b.y, temperature=tt, **kw),
            [q, t],
        ),
        "time window, duplicates out, sum": (
            lambda e, tt: flashcl.flex_loss(
                e,
                rows=rows,
                positive=lambda a, b: (a.t - b.t).abs() <= 1.5,
                exclude=lambda a, b: (a.doc == b.doc) & ((a.t - b.t).abs() > 1.5),
                temperature=tt,
                reduction="sum",
                **kw,
            ),
            [q, t],
        ),
        "learnable margin, symmetric": (
            lambda e, mg: flashcl.flex_loss(
                e,
                rows=rows,
                positive=lambda a, b: a.y == b.y,
                score_mod=lambda s, a, b: s - mg * (a.y == b.y),
                symmetric=True,
                **kw,
            ),
            [q, margin],
        ),
        "soft weights, index exclusion": (
            lambda e: flashcl.flex_loss(
                e,
                rows=rows,
                positive=lambda a, b: (a.soft * b.soft).sum(-1),
                exclude=lambda a, b: (a.index - b.index).abs() == 1,
                positives="weighted_mean",
                weight=lambda a, b: torch.where(a.doc == b.doc, 0.5, 1.0),
                **kw,
            ),
            [q],
        ),
        "sigmoid, learnable bias": (
            lambda e, bb, tt: flashcl.flex_loss(
                e, rows=rows, positive=lambda a, b: a.y == b.y, kind="sigmoid", bias=bb, temperature=tt, **kw
            ),
            [q, bias, t],
        ),
        "two towers, key labels, none": (
            lambda e, kk: flashcl.flex_loss(
                e,
                kk,
                rows=rows,
                cols=cols,
                positive=lambda a, b: a.y == b.ky,
                exclude=lambda a, b: a.doc == b.kdoc,
                reduction="none",
                **kw,
            ),
            [q, k],
        ),
        "two towers, diagonal, both directions": (
            lambda e, pp, tt: flashcl.flex_loss(e, pp, both_directions=True, temperature=tt, **kw),
            [q, p, t],
        ),
        "two towers, false-negative margin, both directions": (
            lambda e, pp: flashcl.flex_loss(
                e, pp, exclude=lambda a, b, s: s > a.positive_score + 0.5, both_directions=True, temperature=0.2, **kw
            ),
            [q, p],
        ),
        "multi-similarity, mined by the row statistics": (
            lambda e: flashcl.flex_loss(
                e,
                rows=rows,
                positive=lambda a, b: a.y == b.y,
                exclude=lambda a, b, s: torch.where(
                    a.y == b.y, s >= a.hardest_negative + 0.1, s <= a.hardest_positive - 0.1
                ),
                kind="multi_similarity",
                temperature=1.0,
                **kw,
            ),
            [q],
        ),
        "circle, the keys' statistics, learnable margin": (
            lambda e, mg: flashcl.flex_loss(
                e,
                rows=rows,
                positive=lambda a, b: a.y == b.y,
                # a margin: mutual hardest negatives tie in exact arithmetic (rounding would decide)
                weight=lambda a, b: torch.where(b.hardest_negative > a.hardest_negative + GAP, 0.5, 1.0),
                neg_mod=lambda s, a, b: 16.0 * (s - mg),
                kind="circle",
                temperature=1.0,
                **kw,
            ),
            [q, margin],
        ),
    }


def _grads(loss: torch.Tensor, leaves: List[torch.Tensor]) -> List[torch.Tensor]:
    if loss.dim() > 0:
        loss = (loss * torch.linspace(0.5, 1.5, loss.shape[0], dtype=loss.dtype)).sum()
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g.detach() for g, x in zip(got, leaves)]


def worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    d = data(sum(sizes))
    results: Dict[Any, Any] = {}
    for strategy, backend, grad_scale in RUNS:
        kw = dict(
            backend=backend, process_group=dist.group.WORLD, strategy=strategy, grad_scale=grad_scale, block_size=3
        )
        for name, (fn, inputs) in cases(d, shard(sizes, rank), shard(sizes, rank, 2), kw).items():
            if "both directions" in name and strategy == "ring":
                continue  # the column direction gathers the queries
            leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
            loss = fn(*leaves)
            results[(strategy, backend, grad_scale, name)] = (loss.detach(), _grads(loss, leaves))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_the_data_decides_no_comparison_by_rounding(world: int) -> None:
    """The circle case compares two anchors' hardest negatives with a margin: in its data no
    difference lies within 1e-6 of the margin, so that no backend's rounding (the dot products'
    order differs by backend, strategy and machine) can turn a verdict."""
    d = data(sum(SIZES[world]))
    rows = {"y": d["y"]}
    q = torch.nn.functional.normalize(d["q"], dim=-1)
    a, b = flex_oracle.views(rows, rows, q.shape[0], q.shape[0])
    s = q @ q.T
    hn = flex_oracle.statistics(s, lambda a, b: a.y == b.y, a, b, torch.eye(q.shape[0], dtype=torch.bool))
    gaps = hn["hardest_negative"][None, :] - hn["hardest_negative"][:, None] - GAP
    assert float(gaps.abs().min()) > 1e-6, float(gaps.abs().min())


@pytest.mark.parametrize("world", [2, 3])
def test_flex_across_processes_equals_one_process(world: int, tmp_path: Any) -> None:
    spawn(worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    d = data(sum(sizes))
    # the per-row weights of reduction="none" (each rank's own rows' slice of the whole batch's)
    for name, (fn, inputs) in cases(d, slice(None), slice(None), {"backend": "reference"}).items():
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        want = fn(*leaves)
        per_row = want.dim() > 0
        want_grads = _grads(want, leaves) if not per_row else None
        for strategy, backend, grad_scale in RUNS:
            key = (strategy, backend, grad_scale, name)
            if key not in ranks[0]:
                continue
            what = f"{strategy}/{backend}/{grad_scale}/{name}"
            scale = world if grad_scale == "ddp" else 1  # "ddp": each rank's value is world x its share
            got = [r[key] for r in ranks]
            if per_row:
                value = torch.cat([v for v, _ in got])
                assert_close(value, want, f"{what}: rows", *TOL)
                continue
            assert_close(sum(v for v, _ in got) / scale, want, f"{what}: sum of the ranks' values", *TOL)
            assert want_grads is not None
            for i, g in enumerate(want_grads):
                if g.dim() == 0:
                    assert_close(sum(r[1][i] for r in got) / scale, g, f"{what}: summed scalar grad {i}", *TOL)
                    continue
                per = 1 if g.shape[0] == sum(sizes) else 2
                for r in range(world):
                    assert_close(got[r][1][i] / scale, g[shard(sizes, r, per)], f"{what}: rank {r} grad {i}", *TOL)


def test_the_per_row_gradients_of_none_across_processes(tmp_path: Any) -> None:
    """reduction="none" across processes: each rank's rows, and their gradients with any
    upstream weights, equal the whole batch's rows of that rank (with ``grad_scale="sum"``)."""
    world, sizes = 2, SIZES[2]
    spawn(_none_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    d = data(sum(sizes))
    fn, inputs = cases(d, slice(None), slice(None), {"backend": "reference"})["two towers, key labels, none"]
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    want = fn(*leaves)
    up = torch.cat([torch.linspace(0.5, 1.5, s, dtype=F64) for s in sizes])
    want_grads = torch.autograd.grad((want * up).sum(), leaves)
    for i, (g, per) in enumerate(zip(want_grads, (1, 2))):  # queries, keys
        for r in range(world):
            assert_close(ranks[r][i], g[shard(sizes, r, per)], f"rank {r} grad {i}", *TOL)


def _none_worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    d = data(sum(sizes))
    kw = dict(backend="tiled", process_group=dist.group.WORLD, grad_scale="sum", block_size=3)
    fn, inputs = cases(d, shard(sizes, rank), shard(sizes, rank, 2), kw)["two towers, key labels, none"]
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    loss = fn(*leaves)
    up = torch.linspace(0.5, 1.5, loss.shape[0], dtype=F64)
    grads = torch.autograd.grad((loss * up).sum(), leaves)
    torch.save([g.detach() for g in grads], os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


QUEUE = 6  # the shared keys' rows (a queue every rank holds alike)


def _queue_calls(d: Dict[str, torch.Tensor], sl: slice, sl2: slice, kw: Dict[str, Any]) -> Dict[str, Case]:
    """Keys without gradient: a queue every rank holds alike (shared: once), and a frozen
    tower's keys, each rank its own (``shared_keys=False``: gathered)."""
    rows = {"y": d["y"][sl]}
    queue, queue_y = d["k"][:QUEUE], d["ky"][:QUEUE]
    frozen, frozen_y = d["k"][sl2], d["ky"][sl2]
    t = torch.tensor(0.3, dtype=F64)
    return {
        "a queue": (
            lambda e, tt: flashcl.flex_loss(
                e, queue, rows=rows, cols={"ky": queue_y}, positive=lambda a, b: a.y == b.ky, temperature=tt, **kw
            ),
            [d["q"][sl], t],
        ),
        "a queue, sigmoid, sum": (
            lambda e: flashcl.flex_loss(
                e,
                queue,
                rows=rows,
                cols={"ky": queue_y},
                positive=lambda a, b: a.y == b.ky,
                kind="sigmoid",
                reduction="sum",
                **kw,
            ),  # fmt: skip
            [d["q"][sl]],
        ),
        "a frozen tower": (
            lambda e: flashcl.flex_loss(
                e,
                frozen,
                rows=rows,
                cols={"ky": frozen_y},
                positive=lambda a, b: a.y == b.ky,
                shared_keys=False,
                **kw,
            ),  # fmt: skip
            [d["q"][sl]],
        ),
    }


def _queue_worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    d = data(sum(sizes))
    results: Dict[Any, Any] = {}
    for strategy, backend, grad_scale in RUNS:
        kw = dict(
            backend=backend, process_group=dist.group.WORLD, strategy=strategy, grad_scale=grad_scale, block_size=3
        )
        for name, (fn, inputs) in _queue_calls(d, shard(sizes, rank), shard(sizes, rank, 2), kw).items():
            leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
            loss = fn(*leaves)
            results[(strategy, backend, grad_scale, name)] = (loss.detach(), _grads(loss, leaves))
    # a queue that differs between the ranks: a ValueError on every rank, both strategies
    for strategy in ("all_gather", "ring"):
        q = d["q"][shard(sizes, rank)]
        try:
            flashcl.flex_loss(
                q, d["k"][rank : rank + QUEUE], rows={"y": d["y"][shard(sizes, rank)]},
                cols={"ky": d["ky"][:QUEUE]}, positive=lambda a, b: a.y == b.ky, process_group=dist.group.WORLD,
                strategy=strategy, backend="tiled",
            )  # fmt: skip
            results[("different", strategy)] = "no error"
        except ValueError as e:
            results[("different", strategy)] = str(e)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_keys_without_gradient_enter_once(world: int, tmp_path: Any) -> None:
    """A queue every rank holds alike (keys without gradient) enters the global loss once, on
    every backend and strategy, both ``grad_scale`` values: the sum of the ranks' values and
    their gradients equal one process on the concatenated queries with the queue once; a
    frozen tower's keys (``shared_keys=False``) are every rank's; a queue that differs between
    the ranks is a ValueError on every rank."""
    spawn(_queue_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    d = data(sum(sizes))
    for name, (fn, inputs) in _queue_calls(d, slice(None), slice(None), {"backend": "reference"}).items():
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        want = fn(*leaves)
        want_grads = _grads(want, leaves)
        for strategy, backend, grad_scale in RUNS:
            what = f"{strategy}/{backend}/{grad_scale}/{name}"
            scale = world if grad_scale == "ddp" else 1
            got = [r[(strategy, backend, grad_scale, name)] for r in ranks]
            assert_close(sum(v for v, _ in got) / scale, want, f"{what}: sum of the ranks' values", *TOL)
            for i, g in enumerate(want_grads):
                if g.dim() == 0:
                    assert_close(sum(r[1][i] for r in got) / scale, g, f"{what}: summed scalar grad {i}", *TOL)
                    continue
                for r in range(world):
                    assert_close(got[r][1][i] / scale, g[shard(sizes, r)], f"{what}: rank {r} grad {i}", *TOL)
    for strategy in ("all_gather", "ring"):
        for r in range(world):
            message = ranks[r][("different", strategy)]
            assert "differ" in message and "shared_keys=False" in message, (strategy, r, message)


def test_shared_keys_refused_where_it_cannot_hold() -> None:
    """``shared_keys`` checked on one process too: True takes keys without gradient and
    not both directions, and keys at all; any other value than a bool or None refused."""
    q, k = torch.randn(5, 4), torch.randn(7, 4)
    with pytest.raises(ValueError, match="without gradient"):
        flashcl.flex_loss(q, k.requires_grad_(), shared_keys=True)
    with pytest.raises(ValueError, match="both_directions"):
        flashcl.flex_loss(q, torch.randn(5, 4), shared_keys=True, both_directions=True)
    with pytest.raises(ValueError, match="shared_keys takes keys"):
        flashcl.flex_loss(q, positive=lambda a, b: a.index == b.index, shared_keys=True)
    with pytest.raises((TypeError, ValueError), match="shared_keys"):
        flashcl.flex_loss(q, torch.randn(7, 4), shared_keys="yes")
