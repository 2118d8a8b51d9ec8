"""distill_loss against open_clip's DistillClipLoss (its own loss.py) and
F.cross_entropy with the teacher's softmax as soft targets: every backend, the
student's and the teacher's gradients, across 2 and 3 gloo processes."""

from __future__ import annotations

import datetime
import os
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashcl
from flashcl.bench.peers import open_clip_loss_module
from helpers import assert_close, close_group, spawn

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]


def _data(b: int = 9, n: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, 5, dtype=torch.float64, generator=g),
        torch.randn(n, 5, dtype=torch.float64, generator=g),
        torch.randn(b, 7, dtype=torch.float64, generator=g),
        torch.randn(n, 7, dtype=torch.float64, generator=g),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("teacher_grad", [False, True])
def test_equals_cross_entropy_with_soft_targets(backend: str, teacher_grad: bool) -> None:
    q, k, tq, tk = (x.requires_grad_(True) for x in _data(6, 11))
    tq.requires_grad_(teacher_grad)
    tk.requires_grad_(teacher_grad)
    sc = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    tsc = torch.tensor(12.0, dtype=torch.float64, requires_grad=teacher_grad)
    got = flashcl.distill_loss(q, k, tq, tk, scale=sc, teacher_scale=tsc, backend=backend, block_size=4)
    s = sc * F.normalize(q, dim=1) @ F.normalize(k, dim=1).T
    t = tsc * F.normalize(tq, dim=1) @ F.normalize(tk, dim=1).T
    want = F.cross_entropy(s, t.softmax(1))
    assert_close(got, want, f"{backend}: value", *TOL)
    inputs = [q, k, sc] + ([tq, tk, tsc] if teacher_grad else [])
    for a, b, i in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs), range(6)):
        assert_close(a, b, f"{backend}: grad of input {i}", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_symmetric_equals_open_clip_distill_clip_loss(backend: str) -> None:
    oc, why = open_clip_loss_module()
    if oc is None:
        pytest.skip(why)
    img, txt, t_img, t_txt = (F.normalize(x, dim=1).requires_grad_(True) for x in _data())
    scale, t_scale = torch.tensor(10.0, dtype=torch.float64), torch.tensor(30.0, dtype=torch.float64)
    _, want = oc.DistillClipLoss()(img, txt, scale, t_img, t_txt, t_scale)
    got = flashcl.distill_loss(
        img,
        txt,
        t_img,
        t_txt,
        scale=scale,
        teacher_scale=t_scale,
        symmetric=True,
        normalize=False,
        backend=backend,
        block_size=4,
    )
    assert_close(got, want, f"{backend}: value", *TOL)
    inputs = [img, txt, t_img, t_txt]
    for a, b, i in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs), range(4)):
        assert_close(a, b, f"{backend}: grad of input {i}", *TOL)


def test_module_reductions_and_errors() -> None:
    q, k, tq, tk = _data(5, 8)
    rows = flashcl.distill_loss(q, k, tq, tk, scale=3.0, teacher_scale=4.0, reduction="none")
    assert rows.shape == (5,)
    assert_close(
        flashcl.DistillLoss(reduction="sum")(q, k, tq, tk, scale=3.0, teacher_scale=4.0), rows.sum(), "sum", *TOL
    )
    with pytest.raises(ValueError, match="symmetric"):
        flashcl.distill_loss(q, k, tq, tk, scale=3.0, teacher_scale=4.0, symmetric=True)
    with pytest.raises(ValueError, match="teacher"):
        flashcl.distill_loss(q, k, tq[:3], tk, scale=3.0, teacher_scale=4.0)
    with pytest.raises(ValueError, match="teacher_scale"):
        flashcl.distill_loss(q, k, tq, tk, scale=3.0, teacher_scale=-1.0)


SIZES = {2: [5, 3], 3: [2, 6, 1]}


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
    start = sum(sizes[:rank])
    out: List = []
    for strategy in ("all_gather", "ring"):
        xs = [x[start : start + sizes[rank]].clone().requires_grad_(True) for x in _data(sum(sizes), sum(sizes), 1)]
        loss = flashcl.distill_loss(
            *xs,
            scale=6.0,
            teacher_scale=9.0,
            symmetric=True,
            process_group=dist.group.WORLD,
            strategy=strategy,
            grad_scale="sum",
        )
        out += [loss.detach(), torch.autograd.grad(loss, xs)]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    xs = [x.requires_grad_(True) for x in _data(sum(sizes), sum(sizes), 1)]
    want = flashcl.distill_loss(*xs, scale=6.0, teacher_scale=9.0, symmetric=True, backend="reference")
    grads = torch.autograd.grad(want, xs)
    for s, strategy in enumerate(("all_gather", "ring")):
        assert_close(sum(r[2 * s] for r in ranks), want, f"{strategy}: value", *TOL)
        for i, g in enumerate(grads):
            got = torch.cat([r[2 * s + 1][i] for r in ranks])
            assert_close(got, g, f"{strategy}: grad of input {i}", *TOL)
