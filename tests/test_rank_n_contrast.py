"""flashcl.rank_n_contrast_loss against Rank-N-Contrast's formula (Zha et al. 2023, eq. 2),
written out here as loops over each anchor's positives and their denominators, in float64:
every backend and block size, views and single rows, labels of several dimensions with
ties, every reduction, duplicate features; a second backward, second derivatives; 2 and 3 gloo processes
(uneven, a rank with none), both grad_scale conventions; bad arguments named."""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn
from rnc_forms import rnc_published

F64 = torch.float64
TOL = (1e-10, 1e-9)
BACKENDS = [("reference", None), ("dense", None), ("tiled", 1), ("tiled", 4), ("tiled", None)]


def rnc_formula(features: torch.Tensor, labels: torch.Tensor, t: float) -> torch.Tensor:
    """Each anchor's mean over its positives of ``-log(exp(s_ij) / sum_{k != i, |y_i - y_k|_1 >=
    |y_i - y_j|_1} exp(s_ik))``, ``s = -||z_i - z_j||_2 / t`` (the views stacked view-major)."""
    z = features if features.dim() == 2 else torch.cat(list(features.unbind(1)), 0)
    v = 1 if features.dim() == 2 else features.shape[1]
    y = (labels if labels.dim() == 2 else labels[:, None]).repeat(v, 1)
    n = z.shape[0]
    out = []
    for i in range(n):
        terms = []
        for j in range(n):
            if j == i:
                continue
            dij = (y[i] - y[j]).abs().sum()
            den = [k for k in range(n) if k != i and (y[i] - y[k]).abs().sum() >= dij]
            s_ij = -torch.linalg.vector_norm(z[i] - z[j]) / t
            s_ik = torch.stack([-torch.linalg.vector_norm(z[i] - z[k]) / t for k in den])
            terms.append(torch.logsumexp(s_ik, 0) - s_ij)
        out.append(torch.stack(terms).mean())
    return torch.stack(out)


def _data(seed: int, b: int = 9, v: int = 2, d: int = 5, dims: int = 1) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "f": torch.randn(b, v, d, generator=g, dtype=F64),
        "y": torch.randint(0, 4, (b, dims), generator=g).to(F64),  # integer-valued: ties everywhere
    }


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend,block", BACKENDS)
def test_equals_the_formula(backend: str, block: Any, reduction: str) -> None:
    d = _data(1)
    a, b = d["f"].clone().requires_grad_(True), d["f"].clone().requires_grad_(True)
    got = flashcl.rank_n_contrast_loss(
        a, d["y"], temperature=0.7, reduction=reduction, backend=backend, block_size=block
    )
    rows = rnc_formula(b, d["y"], 0.7)
    want = {"mean": rows.mean(), "sum": rows.sum(), "none": rows.reshape(2, 9).T}[reduction]
    up = torch.linspace(0.5, 1.5, got.numel(), dtype=F64).reshape(got.shape)
    assert_close(got, want, f"{backend}/{reduction}: value", *TOL)
    assert_close(
        torch.autograd.grad((got * up).sum(), a)[0],
        torch.autograd.grad((want * up).sum(), b)[0],
        f"{backend}/{reduction}: gradient",
        *TOL,
    )


@pytest.mark.parametrize("t", [2.0, 0.5])
@pytest.mark.parametrize("backend,block", BACKENDS)
def test_equals_the_published_code(backend: str, block: Any, t: float) -> None:
    """The published RnCLoss's own steps (its row maximum subtracted, its mask per positive
    column), label ties included, in float64: value and gradient."""
    d = _data(3, b=11, dims=1)
    a, b = d["f"].clone().requires_grad_(True), d["f"].clone().requires_grad_(True)
    got = flashcl.rank_n_contrast_loss(a, d["y"], temperature=t, backend=backend, block_size=block)
    want = rnc_published(b, d["y"], t)
    assert_close(got, want, f"{backend}: value", *TOL)
    assert_close(torch.autograd.grad(got, a)[0], torch.autograd.grad(want, b)[0], f"{backend}: gradient", *TOL)


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_rows_labels_of_two_dimensions_and_duplicates(backend: str, block: Any) -> None:
    """(B, D) rows, labels of two dimensions, two samples with the same features (distance
    0: the norm's subgradient 0, a finite gradient) and the same labels."""
    g = torch.Generator().manual_seed(2)
    f = torch.randn(8, 4, generator=g, dtype=F64)
    f[6] = f[2]
    y = torch.rand(8, 2, generator=g, dtype=F64)
    y[6] = y[2]
    a, b = f.clone().requires_grad_(True), f.clone().requires_grad_(True)
    got = flashcl.rank_n_contrast_loss(a, y, temperature=2.0, backend=backend, block_size=block)
    want = rnc_formula(b, y, 2.0).mean()
    assert_close(got, want, f"{backend}: value", *TOL)
    ga = torch.autograd.grad(got, a)[0]
    assert bool(torch.isfinite(ga).all())
    zero = f.clone().requires_grad_(True)
    rows = rnc_formula(zero, y, 2.0).mean()  # the formula's own gradient at the duplicates: torch's norm at 0
    gz = torch.autograd.grad(rows, zero)[0]
    assert_close(ga, torch.nan_to_num(gz), f"{backend}: gradient", *TOL)


def test_a_second_backward_and_inputs_untouched() -> None:
    d = _data(3)
    x = d["f"].clone().requires_grad_(True)
    before = x.detach().clone()
    loss = flashcl.rank_n_contrast_loss(x, d["y"], backend="tiled", block_size=4)
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    second = torch.autograd.grad(loss, x)[0]
    assert_close(second, first, "second backward", *TOL)
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_second_derivatives_equal_the_formula(backend: str) -> None:
    """A Hessian-vector product (create_graph=True): the formula's, by autograd through its loops."""
    d = _data(4, b=6)
    v = torch.randn(d["f"].shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    hvps = []
    for loss_of in (
        lambda z: flashcl.rank_n_contrast_loss(z, d["y"], temperature=0.7, backend=backend, block_size=4),
        lambda z: rnc_formula(z, d["y"], 0.7).mean(),
    ):
        z = d["f"].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_of(z), z, create_graph=True)
        hvps.append(torch.autograd.grad((g * v).sum(), z)[0])
    assert_close(hvps[0], hvps[1], f"{backend}: Hessian-vector product", *TOL)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(labels=torch.arange(9)), "labels"),
        (dict(labels=torch.rand(8)), "one target per sample"),
        (dict(backend="triton"), "backend"),
    ],
)
def test_bad_arguments_are_named(kwargs: Dict[str, Any], match: str) -> None:
    d = _data(4)
    args = dict(labels=d["y"][:, 0])
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        flashcl.rank_n_contrast_loss(d["f"], **args)


SIZES = {2: [4, 6], 3: [3, 0, 5]}


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    import torch.distributed as dist

    sizes = SIZES[world]
    d = _data(world, b=sum(sizes))
    sl = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out = {}
    for backend in ("reference", "tiled"):
        for grad_scale in ("sum", "ddp"):
            x = d["f"][sl].clone().requires_grad_(True)
            loss = flashcl.rank_n_contrast_loss(
                x, d["y"][sl], backend=backend, block_size=2, process_group=dist.group.WORLD, grad_scale=grad_scale
            )
            out[(backend, grad_scale)] = (loss.detach(), torch.autograd.grad(loss, x)[0])
    try:
        flashcl.rank_n_contrast_loss(d["f"][sl], d["y"][sl], process_group=dist.group.WORLD, strategy="ring")
        out["ring"] = "no error"
    except ValueError as e:
        out["ring"] = str(e)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path: Any) -> None:
    """Each rank's views against every rank's (the labels travel with them): the sum of the
    ranks' values and each rank's gradient equal one process on the concatenated batch."""
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    d = _data(world, b=sum(sizes))
    # across processes the views are stacked rank by rank: each rank's (b_r, 2, D) view-major
    x = d["f"].clone().requires_grad_(True)
    parts = [x[sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(world)]
    z = torch.cat([torch.cat([p[:, 0], p[:, 1]]) for p in parts])
    ys = torch.cat([torch.cat([d["y"][sum(sizes[:r]) : sum(sizes[: r + 1])]] * 2) for r in range(world)])
    want = rnc_formula(z, ys, 2.0).mean()
    want_grad = torch.autograd.grad(want, x)[0]
    for key in [k for k in ranks[0] if k != "ring"]:
        scale = world if key[1] == "ddp" else 1
        assert_close(sum(r[key][0] for r in ranks) / scale, want, f"{key}: value", *TOL)
        for r in range(world):
            sl = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
            assert_close(ranks[r][key][1] / scale, want_grad[sl], f"{key}: rank {r} gradient", *TOL)
    assert all("all_gather" in r["ring"] for r in ranks)
