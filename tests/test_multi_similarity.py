"""flashcl.multi_similarity_loss against pytorch-metric-learning's MultiSimilarityLoss with
and without its MultiSimilarityMiner (float64, values and gradients, every backend, odd
blocks), PML's edge rules (nothing mined: 0), the per-anchor losses, the option errors,
and across 2 and 3 gloo processes, both strategies, equal to one process."""

from __future__ import annotations

import os
from typing import Any, List, Optional

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

pml = pytest.importorskip("pytorch_metric_learning")
from pytorch_metric_learning import losses, miners, reducers  # noqa: E402

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]


def _pml(x: torch.Tensor, y: torch.Tensor, epsilon: Optional[float], per_row: bool = False, **kw: Any) -> torch.Tensor:
    """PML's loss on x, mined by its own miner (``epsilon``) or on every pair (None)."""
    extra = {"reducer": reducers.DoNothingReducer()} if per_row else {}
    loss = losses.MultiSimilarityLoss(**kw, **extra)
    if epsilon is None:
        out = loss(x, y)
    else:
        out = loss(x, y, miners.MultiSimilarityMiner(epsilon=epsilon)(x, y))
    return out["loss"]["losses"].reshape(-1) if per_row else out  # DoNothingReducer: every anchor's loss


def _grad(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    g = torch.autograd.grad(out.sum(), x, allow_unused=True)[0]
    return torch.zeros_like(x) if g is None else g


CASES = [  # (rows, classes, seed): labels with several positives, a batch of two, many classes
    (29, 5, 0),
    (13, 3, 1),
    (40, 12, 2),
    (2, 1, 3),
    (9, 9, 4),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("epsilon", [0.1, None, 0.5])
@pytest.mark.parametrize("b,classes,seed", CASES)
def test_equals_pml_with_and_without_its_miner(backend: str, epsilon: Optional[float], b: int, classes: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 6, dtype=torch.float64, generator=g)
    y = torch.randint(0, classes, (b,), generator=g)
    hyper = {"alpha": 2.5, "beta": 40.0, "base": 0.2}
    xp = x.clone().requires_grad_(True)
    want = _pml(xp, y, epsilon, **hyper)
    xx = x.clone().requires_grad_(True)
    got = flashcl.multi_similarity_loss(xx, y, epsilon=epsilon, backend=backend, block_size=3, **hyper)
    assert_close(got, want, f"{backend}: value", *TOL)
    assert_close(_grad(got, xx), _grad(want, xp), f"{backend}: grad", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_anchor_losses_and_sum_equal_pml(backend: str) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(23, 8, dtype=torch.float64, generator=g)
    y = torch.randint(0, 4, (23,), generator=g)
    xp, xx = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = _pml(xp, y, 0.1, per_row=True)
    got = flashcl.multi_similarity_loss(xx, y, reduction="none", backend=backend, block_size=5)
    assert got.shape == (23,)
    assert_close(got, want, f"{backend}: rows", *TOL)
    up = torch.linspace(-1.0, 2.0, 23, dtype=torch.float64)  # a non-uniform upstream gradient
    gw = torch.autograd.grad((want * up).sum(), xp)[0]
    assert_close(torch.autograd.grad((got * up).sum(), xx)[0], gw, f"{backend}: rows' grad", *TOL)
    total = flashcl.multi_similarity_loss(x, y, reduction="sum", backend=backend)
    assert_close(total, want.sum(), f"{backend}: sum", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_mined_gives_zero_as_pml(backend: str) -> None:
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    for y in (torch.zeros(6, dtype=torch.long), torch.arange(6)):  # no negative pair / no positive pair
        got = flashcl.multi_similarity_loss(x, y, backend=backend)
        assert float(got.detach()) == 0.0 and float(_pml(x, y, 0.1).detach()) == 0.0
        assert torch.equal(_grad(got, x), torch.zeros_like(x))
    # one positive pair each way (two pairs) and no negative: PML computes it without a miner
    y = torch.tensor([0, 0])
    x2 = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    got = flashcl.multi_similarity_loss(x2, y, epsilon=None, backend=backend)
    assert_close(got, _pml(x2, y, None), f"{backend}: two rows", *TOL)


def test_inputs_kept_and_module_twin() -> None:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(12, 10, dtype=torch.float64, generator=g)
    x = base[:, ::2]  # not contiguous
    y = torch.randint(0, 3, (12,), generator=g)
    before = x.clone()
    want = flashcl.multi_similarity_loss(x.contiguous(), y, backend="reference")
    for backend in ("dense", "tiled"):
        assert_close(flashcl.multi_similarity_loss(x, y, backend=backend), want, backend, *TOL)
    assert torch.equal(x, before)
    module = flashcl.MultiSimilarityLoss(alpha=3.0, epsilon=None, reduction="sum")
    assert_close(
        module(x, y), flashcl.multi_similarity_loss(x, y, alpha=3.0, epsilon=None, reduction="sum"), "module", *TOL
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"alpha": 0.0}, "alpha"),
        ({"beta": float("nan")}, "beta"),
        ({"base": float("inf")}, "base"),
        ({"epsilon": "0.1"}, "epsilon"),
        ({"alpha": torch.tensor(2.0, requires_grad=True)}, "alpha"),
        ({"reduction": "avg"}, "reduction"),
        ({"backend": "triton"}, "triton"),
    ],
)
def test_bad_options_are_errors(kwargs: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        flashcl.multi_similarity_loss(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), **kwargs)


SIZES = {2: [7, 4], 3: [5, 0, 8]}  # uneven, a rank with no rows of its own


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(sizes), 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (sum(sizes),), generator=g)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    out: List[Any] = []
    for strategy in ("all_gather", "ring"):
        for epsilon in (0.1, None):
            xl = x[mine].clone().requires_grad_(True)
            loss = flashcl.multi_similarity_loss(
                xl, y[mine], epsilon=epsilon, process_group=dist.group.WORLD, strategy=strategy, grad_scale="sum"
            )
            out += [loss.detach(), _grad(loss, xl)]
    # grad_scale="ddp": each rank returns world x its share, its rows' gradient world x theirs
    xl = x[mine].clone().requires_grad_(True)
    loss = flashcl.multi_similarity_loss(xl, y[mine], process_group=dist.group.WORLD, grad_scale="ddp")
    out += [loss.detach(), _grad(loss, xl)]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(sizes), 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (sum(sizes),), generator=g)
    case = 0
    for strategy in ("all_gather", "ring"):
        for epsilon in (0.1, None):
            xx = x.clone().requires_grad_(True)
            want = _pml(xx, y, epsilon)
            gx = _grad(want, xx)
            value = sum(r[2 * case] for r in ranks)
            assert_close(value, want, f"{strategy}, epsilon {epsilon}: sum of the ranks' values", *TOL)
            for r in range(world):
                start = sum(sizes[:r])
                got = ranks[r][2 * case + 1]
                assert_close(got, gx[start : start + sizes[r]], f"{strategy}: rank {r}'s rows' grad", *TOL)
            case += 1
    xx = x.clone().requires_grad_(True)
    want = _pml(xx, y, 0.1)
    gx = _grad(want, xx)
    assert_close(sum(r[2 * case] for r in ranks) / world, want, "ddp: mean of the ranks' values", *TOL)
    for r in range(world):
        start = sum(sizes[:r])
        assert_close(ranks[r][2 * case + 1] / world, gx[start : start + sizes[r]], f"ddp: rank {r}'s grad", *TOL)


@pytest.mark.parametrize("fn", [flashcl.multi_similarity_loss, flashcl.circle_loss], ids=["ms", "circle"])
def test_second_derivatives_equal_the_dense_formula(fn: Any) -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(11, 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (11,), generator=g)
    v = torch.linspace(0.0, 1.0, 55, dtype=torch.float64).view(11, 5)
    hvp = []
    for backend in ("dense", "tiled", "reference"):
        xx = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(fn(xx, y, backend=backend), xx, create_graph=True)
        hvp.append(torch.autograd.grad((gx * v).sum(), xx)[0])
    scale = float(hvp[0].abs().max())
    assert_close(hvp[1] / scale, hvp[0] / scale, "tiled vs dense", *TOL)
    assert_close(hvp[2] / scale, hvp[0] / scale, "reference vs dense", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_row_is_mined_as_pml_mines_it(backend: str) -> None:
    """A NaN score is never the hardest positive and is the hardest negative, as the
    miner's sorts make it; the NaN pairs are mined by none: every anchor's loss as PML's."""
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(10, 4, dtype=torch.float64, generator=g)
        y = torch.randint(0, 3, (10,), generator=g)
        x[seed, seed % 4] = float("nan")
        for epsilon in (0.1, 0.5):
            want = _pml(x, y, epsilon, per_row=True)
            got = flashcl.multi_similarity_loss(x, y, epsilon=epsilon, reduction="none", backend=backend, block_size=3)
            assert torch.equal(torch.isnan(got), torch.isnan(want)), (seed, got, want)
            assert_close(got.nan_to_num(), want.nan_to_num(), f"seed {seed}, epsilon {epsilon}", *TOL)
