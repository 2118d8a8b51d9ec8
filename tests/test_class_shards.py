"""Class proxies at scale: sub-centers against pytorch-metric-learning's
SubCenterArcFaceLoss (its own code, and the adapter), sampled classes (Partial FC)
against the dense formula on the kept classes, and the class weights sharded across
2 and 3 gloo processes (uneven class slices, one rank with a single class, uneven
batches) against one process holding the whole W, float64: values, every rank's
embedding gradient and weight-slice gradient, a learnable scale."""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]


def _data(b=10, d=6, c=7, k=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(c * k, d, dtype=torch.float64, generator=g)
    y = torch.randint(0, c, (b,), generator=g)
    e = torch.randn(b, d, dtype=torch.float64, generator=g)
    return e, y, w


def _grads(fn, *xs):
    leaves = [x.clone().requires_grad_(True) for x in xs]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves)


@pytest.mark.parametrize("backend", BACKENDS)
def test_subcenters_equal_pytorch_metric_learning(backend: str) -> None:
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    e, y, w = _data(c=7, k=3)
    peer = pml.SubCenterArcFaceLoss(num_classes=7, embedding_size=6, margin=28.6, scale=8.0, sub_centers=3).double()
    peer.W.data = w.T.contiguous()
    ee = e.clone().requires_grad_(True)
    want = peer(ee, y)
    want_e, want_w = torch.autograd.grad(want, [ee, peer.W])
    got = _grads(
        lambda e_, w_: flashcl.arcface_loss(
            e_, y, w_, margin=math.radians(28.6), scale=8.0, subcenters=3, backend=backend, block_size=2
        ),
        e,
        w,
    )
    assert_close(got[0], want, f"{backend}: value", *TOL)
    assert_close(got[1][0], want_e, f"{backend}: embedding gradient", *TOL)
    assert_close(got[1][1], want_w.T, f"{backend}: proxies' gradient", *TOL)


def test_subcenter_adapter_and_cosface_subcenters() -> None:
    pml = pytest.importorskip("pytorch_metric_learning")
    from flashcl.integrations import pytorch_metric_learning as fpml

    e, y, _ = _data(b=9, d=5, c=4, seed=1)
    torch.manual_seed(3)
    ours = fpml.SubCenterArcFaceLoss(num_classes=4, embedding_size=5, sub_centers=2, block_size=3).double()
    torch.manual_seed(3)
    theirs = pml.losses.SubCenterArcFaceLoss(num_classes=4, embedding_size=5, sub_centers=2).double()
    assert isinstance(ours, pml.losses.SubCenterArcFaceLoss)
    for loss in (ours, theirs):
        loss(e, y).backward()
    assert_close(ours(e, y), theirs(e, y), "adapter value", *TOL)
    assert_close(ours.W.grad, theirs.W.grad, "adapter W gradient", *TOL)
    # CosFace with sub-centers: the dense formula on the closest proxies
    e, y, w = _data(c=5, k=2, seed=2)
    for backend in BACKENDS:
        got = flashcl.cosface_loss(e, y, w, subcenters=2, scale=10.0, backend=backend, block_size=2)
        closest = torch.nn.functional.normalize(e, dim=1) @ torch.nn.functional.normalize(w, dim=1).T
        cos = closest.view(10, 5, 2).amax(2)
        one_hot = torch.nn.functional.one_hot(y, 5).to(cos.dtype)
        want = torch.nn.functional.cross_entropy(10.0 * (cos - 0.35 * one_hot), y)
        assert_close(got, want, f"{backend}: CosFace sub-centers", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arc", [False, True], ids=["cosface", "arcface"])
def test_sampled_classes_equal_the_dense_formula_on_the_kept_classes(backend: str, arc: bool) -> None:
    e, y, w = _data(b=8, c=40, seed=4)
    kept = flashcl.sample_classes(y, 40, 0.3, generator=torch.Generator().manual_seed(5))
    assert kept.numel() == max(12, torch.unique(y).numel())
    assert bool(torch.isin(y, kept).all()), "every labelled class is kept"
    assert bool((kept[1:] > kept[:-1]).all())
    fn = flashcl.arcface_loss if arc else flashcl.cosface_loss
    remapped = torch.searchsorted(kept, y)
    want = _grads(lambda e_, w_: fn(e_, remapped, w_[kept], scale=8.0, backend="reference"), e, w)
    got = _grads(lambda e_, w_: fn(e_, y, w_, scale=8.0, classes=kept, backend=backend, block_size=5), e, w)
    assert_close(got[0], want[0], "value", *TOL)
    assert_close(got[1][0], want[1][0], "embedding gradient", *TOL)
    assert_close(got[1][1], want[1][1], "class weights' gradient (zero off the kept rows)", *TOL)
    assert float(got[1][1][~torch.isin(torch.arange(40), kept)].abs().max()) == 0.0
    # sample_rate = 1 keeps every class: the full loss
    every = flashcl.sample_classes(y, 40, 1.0)
    assert torch.equal(every, torch.arange(40))
    full = fn(e, y, w, scale=8.0, backend=backend)
    assert_close(fn(e, y, w, scale=8.0, classes=every, backend=backend), full, "sample_rate = 1", *TOL)


BAD: List[Any] = [
    ({"classes": torch.tensor([0, 2])}, ValueError, "keep every labelled class"),
    ({"classes": torch.tensor([3, 1, 0, 2, 4, 5, 6])}, ValueError, "sorted"),
    ({"classes": torch.tensor([0.0])}, TypeError, "integer"),
    ({"classes": torch.tensor([0, 99])}, ValueError, r"\[0, 7\)"),
    ({"subcenters": 0}, ValueError, "subcenters"),
    ({"subcenters": 2}, ValueError, "rows per class"),
    ({"shard_classes": True}, ValueError, "process_group"),
    ({"shard_classes": "yes"}, TypeError, "shard_classes"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD)
def test_bad_options_are_clear_errors(kwargs: Dict[str, Any], error: type, match: str) -> None:
    e, y, w = _data()
    with pytest.raises(error, match=match):
        flashcl.cosface_loss(e, y, w, **kwargs)


def test_sample_classes_bad_input() -> None:
    y = torch.tensor([1, 2])
    for rate in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="sample_rate"):
            flashcl.sample_classes(y, 10, rate)
    with pytest.raises(ValueError, match="num_classes"):
        flashcl.sample_classes(y, 0, 0.5)
    with pytest.raises(TypeError, match="labels"):
        flashcl.sample_classes(y.float(), 10, 0.5)


# rank r's class slice and batch: rank 1 of 3 holds a single class, and no sample of it;
# the second layouts leave one rank without any class (fewer classes than ranks, an uneven split)
LAYOUTS = {2: [[3, 6], [0, 9]], 3: [[4, 1, 5], [5, 0, 5]]}
SLICES = {world: layouts[0] for world, layouts in LAYOUTS.items()}
BATCHES = {2: [5, 8], 3: [4, 1, 7]}
CASES = [
    ("cosface", {}),
    ("arcface", {}),
    ("arcface", {"easy_margin": True}),
    ("arcface", {"subcenters": 2}),
    ("cosface", {"subcenters": 3}),
    ("arcface", {"learn_scale": True}),
    ("arcface", {"learn_scale": True, "grad_scale": "ddp"}),
    ("cosface", {"reduction": "sum", "learn_scale": True}),
    ("arcface", {"reduction": "none", "learn_scale": True}),
    ("cosface", {"grad_scale": "ddp"}),
    ("cosface", {"grad_scale": "ddp", "reduction": "sum"}),
]


def _global(world: int, k: int):
    c = sum(SLICES[world])
    e, y, w = _data(b=sum(BATCHES[world]), c=c, k=k, seed=20 + world)
    if world == 3:  # no sample of rank 1's single class (class 4)
        y = torch.where(y == 4, torch.zeros_like(y), y)
    return e, y, w


def _edges(e: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``e`` with its first row exactly along its class proxy (cos = 1) and its second
    exactly against it (cos = -1)."""
    e = e.clone()
    e[0], e[1] = 2.0 * w[y[0]], -3.0 * w[y[1]]
    return e


def _call(name: str, e, y, w, opts: Dict[str, Any], scale, **kw):
    fn = flashcl.arcface_loss if name == "arcface" else flashcl.cosface_loss
    extra = {k: v for k, v in opts.items() if k not in ("learn_scale", "grad_scale")}
    return fn(e, y, w, scale=scale, block_size=2, **extra, **kw)


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    out = []
    for (name, opts), layout in [(case, layout) for layout in LAYOUTS[world] for case in CASES]:
        k = opts.get("subcenters", 1)
        e, y, w = _global(world, k)
        rows = slice(sum(BATCHES[world][:rank]), sum(BATCHES[world][: rank + 1]))
        classes = slice(k * sum(layout[:rank]), k * sum(layout[: rank + 1]))
        x, wt = e[rows].clone().requires_grad_(True), w[classes].clone().requires_grad_(True)
        s = torch.tensor(6.0, dtype=torch.float64, requires_grad=bool(opts.get("learn_scale")))
        loss = _call(
            name,
            x,
            y[rows],
            wt,
            opts,
            s,
            shard_classes=True,
            process_group=dist.group.WORLD,
            grad_scale=opts.get("grad_scale", "sum"),
        )
        leaves = [x, wt] + ([s] if s.requires_grad else [])
        upstream = torch.arange(1.0, loss.numel() + 1, dtype=torch.float64).view(loss.shape)  # non-uniform
        out.append((loss.detach(), torch.autograd.grad(loss, leaves, upstream)))
    # at the edges of arccos (embeddings exactly along and against their class proxy) and in
    # half precision: the same as one process (whose edges tests/test_margin.py checks)
    e, y, w = _global(world, 1)
    e = _edges(e, y, w)
    rows = slice(sum(BATCHES[world][:rank]), sum(BATCHES[world][: rank + 1]))
    lo, n = sum(SLICES[world][:rank]), SLICES[world][rank]
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        x, wt = e[rows].to(dtype).requires_grad_(True), w[lo : lo + n].to(dtype).requires_grad_(True)
        loss = flashcl.arcface_loss(
            x, y[rows], wt, scale=6.0, shard_classes=True, process_group=dist.group.WORLD, grad_scale="sum"
        )
        out.append((loss.detach(), torch.autograd.grad(loss, [x, wt])))
    # sampled classes, sharded: each rank draws among its own slice (an empty slice draws none)
    for layout in LAYOUTS[world]:
        e, y, w = _global(world, 1)
        rows = slice(sum(BATCHES[world][:rank]), sum(BATCHES[world][: rank + 1]))
        lo = sum(layout[:rank])
        kept = flashcl.sample_classes(
            y[rows],
            layout[rank],
            0.5,
            first_class=lo,
            process_group=dist.group.WORLD,
            generator=torch.Generator().manual_seed(rank),
        )
        x, wt = e[rows].clone().requires_grad_(True), w[lo : lo + layout[rank]].clone().requires_grad_(True)
        loss = flashcl.arcface_loss(
            x, y[rows], wt, scale=6.0, classes=kept, shard_classes=True, process_group=dist.group.WORLD, block_size=2
        )
        out.append((loss.detach(), torch.autograd.grad(loss, [x, wt]), kept + lo))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    # blocks of classes: the tiled backend alone, a clear error for another on every rank
    try:
        flashcl.cosface_loss(x, y[rows], wt, shard_classes=True, process_group=dist.group.WORLD, backend="dense")
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    with open(os.path.join(out_dir, f"refused{rank}.txt"), "w") as f:
        f.write(refused)
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_classes_equal_one_process_with_the_whole_weights(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        refused = (tmp_path / f"refused{r}.txt").read_text()
        assert "shard_classes=True" in refused and "backend='dense'" in refused and "'tiled'" in refused, refused
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    bounds = [sum(BATCHES[world][:r]) for r in range(world + 1)]
    for i, ((name, opts), layout) in enumerate([(case, layout) for layout in LAYOUTS[world] for case in CASES]):
        k = opts.get("subcenters", 1)
        e, y, w = _global(world, k)
        s = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
        leaves = [e.clone().requires_grad_(True), w.clone().requires_grad_(True), s]
        want = _call(name, leaves[0], y, leaves[1], opts, leaves[2], backend="reference")
        upstream = torch.arange(1.0, want.numel() + 1, dtype=torch.float64).view(want.shape)
        if want.dim():  # each rank's upstream gradient of its own rows, as the workers give it
            upstream = torch.cat([torch.arange(1.0, n + 1, dtype=torch.float64) for n in BATCHES[world]])
        ge, gw, gs = torch.autograd.grad(want, leaves, upstream)
        ddp = opts.get("grad_scale") == "ddp"
        factor = world if ddp else 1
        what = f"{name} {opts}, class slices {layout}"
        scale_grads = []
        for r in range(world):
            value, grads = ranks[r][i]
            rows = slice(bounds[r], bounds[r + 1])
            classes = slice(k * sum(layout[:r]), k * sum(layout[: r + 1]))
            if opts.get("reduction") == "none":
                assert_close(value, want.detach()[rows], f"{what}: rank {r}'s rows", *TOL)
            elif ddp:  # world size x this rank's share: the global loss on every rank
                assert_close(value, want.detach(), f"{what}: rank {r}'s value (the global loss)", *TOL)
            assert_close(grads[0], factor * ge[rows], f"{what}: rank {r}'s embedding gradient", *TOL)
            assert_close(grads[1], gw[classes], f"{what}: rank {r}'s weight-slice gradient", *TOL)
            if opts.get("learn_scale"):
                scale_grads.append(grads[2])
                if ddp:
                    assert_close(grads[2], gs, f"{what}: rank {r}'s scale gradient (the global one)", *TOL)
        if not ddp and opts.get("reduction") != "none":  # "sum": the ranks' shares add up to the loss
            total = sum(ranks[r][i][0] for r in range(world))
            assert_close(total, want.detach(), f"{what}: the sum of the ranks' values", *TOL)
        if not ddp and scale_grads:  # a replicated parameter: the shares of its gradient add up
            assert_close(sum(scale_grads), gs, f"{what}: the sum of the ranks' scale gradients", *TOL)
    e, y, w = _global(world, 1)
    e = _edges(e, y, w)
    want = _grads(lambda e_, w_: flashcl.arcface_loss(e_, y, w_, scale=6.0, backend="tiled"), e, w)
    edges = len(CASES) * len(LAYOUTS[world])
    for j, (dtype, tol) in enumerate(
        ((torch.float64, TOL), (torch.bfloat16, (3e-2, 3e-2)), (torch.float16, (4e-3, 4e-3)))
    ):
        values = []
        for r in range(world):
            value, grads = ranks[r][edges + j]
            rows = slice(sum(BATCHES[world][:r]), sum(BATCHES[world][: r + 1]))
            lo, n = sum(SLICES[world][:r]), SLICES[world][r]
            if dtype != torch.float64:
                assert value.dtype == torch.float32, "half precision accumulates in float32"
            assert all(bool(torch.isfinite(g).all()) for g in grads), (dtype, r)
            values.append(value.double())
            assert_close(grads[0].double(), want[1][0][rows], f"edges {dtype}: rank {r}'s embedding gradient", *tol)
            assert_close(grads[1].double(), want[1][1][lo : lo + n], f"edges {dtype}: rank {r}'s weight slice", *tol)
        assert_close(sum(values), want[0], f"edges {dtype}: the sum of the ranks' values", *tol)
    # sampled classes: the union of the kept slices, one process
    for j, layout in enumerate(LAYOUTS[world]):
        e, y, w = _global(world, 1)
        at = edges + 3 + j
        kept = torch.cat([ranks[r][at][2] for r in range(world)])
        assert bool(torch.isin(y, kept).all())
        remapped = torch.searchsorted(kept, y)
        want = _grads(
            lambda e_, w_, y_=remapped, k_=kept: flashcl.arcface_loss(e_, y_, w_[k_], scale=6.0, backend="reference"),
            e,
            w,
        )
        for r in range(world):
            value, grads, _ = ranks[r][at]
            rows = slice(bounds[r], bounds[r + 1])
            lo = sum(layout[:r])
            assert_close(value, want[0], f"sampled {layout}: rank {r}'s value", *TOL)
            # grad_scale="ddp" (the default): the world size times the global loss's gradient
            assert_close(grads[0], world * want[1][0][rows], f"sampled {layout}: rank {r}'s embedding gradient", *TOL)
            assert_close(grads[1], want[1][1][lo : lo + layout[r]], f"sampled {layout}: rank {r}'s weight slice", *TOL)


def _ddp_worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    e, y, w = _global(world, 1)
    x = torch.randn(e.shape[0], 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    encoder = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, e.shape[1]).double())
    rows = slice(sum(BATCHES[world][:rank]), sum(BATCHES[world][: rank + 1]))
    lo, n = sum(SLICES[world][:rank]), SLICES[world][rank]
    classifier = torch.nn.Parameter(w[lo : lo + n].clone())  # not a DDP parameter
    loss = flashcl.arcface_loss(
        encoder(x[rows]), y[rows], classifier, scale=6.0, shard_classes=True, process_group=dist.group.WORLD
    )
    loss.backward()
    grads = [p.grad for p in encoder.parameters()]
    torch.save((loss.detach(), grads, classifier.grad), os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_a_ddp_encoder_with_a_sharded_classifier_gets_the_full_batch_gradients(world: int, tmp_path) -> None:
    spawn(_ddp_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    e, y, w = _global(world, 1)
    x = torch.randn(e.shape[0], 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    encoder = torch.nn.Linear(4, e.shape[1]).double()
    classifier = torch.nn.Parameter(w.clone())
    want = flashcl.arcface_loss(encoder(x), y, classifier, scale=6.0, backend="reference")
    want.backward()
    for r in range(world):
        value, grads, slice_grad = torch.load(tmp_path / f"rank{r}.pt")
        lo, n = sum(SLICES[world][:r]), SLICES[world][r]
        assert_close(value, want.detach(), f"rank {r}: value", *TOL)
        for i, (g, p) in enumerate(zip(grads, encoder.parameters())):
            assert_close(g, p.grad, f"rank {r}: encoder parameter {i} (DDP-averaged)", *TOL)
        assert_close(slice_grad, classifier.grad[lo : lo + n], f"rank {r}: classifier slice", *TOL)


def test_a_class_not_kept_holds_anything_and_frozen_inputs_get_no_gradient() -> None:
    """NaN in a class weight row the sample left out changes no value and no other
    gradient; frozen embeddings or weights get none (every backend)."""
    e, y, w = _data(b=8, c=40, seed=6)
    kept = flashcl.sample_classes(y, 40, 0.25, generator=torch.Generator().manual_seed(1))
    dropped = int(torch.arange(40)[~torch.isin(torch.arange(40), kept)][0])
    w_nan = w.clone()
    w_nan[dropped] = float("nan")
    for backend in BACKENDS:
        want = _grads(lambda e_, w_, b=backend: flashcl.arcface_loss(e_, y, w_, classes=kept, backend=b), e, w)
        got = _grads(lambda e_, w_, b=backend: flashcl.arcface_loss(e_, y, w_, classes=kept, backend=b), e, w_nan)
        assert_close(got[0], want[0], f"{backend}: value", 0.0, 0.0)
        assert_close(got[1][0], want[1][0], f"{backend}: embedding gradient", 0.0, 0.0)
        assert float(got[1][1][dropped].abs().max()) == 0.0
        frozen = e.clone().requires_grad_(False)
        ww = w.clone().requires_grad_(True)
        flashcl.cosface_loss(frozen, y, ww, subcenters=1, classes=kept, backend=backend).backward()
        assert frozen.grad is None and ww.grad is not None
