"""cosface_loss / arcface_loss against pytorch-metric-learning's CosFaceLoss and
ArcFaceLoss (their own code) and insightface's margin formulas (written here from
its code), every backend: float64 values and gradients for the embeddings, the
class weights and a learnable scale; the ArcFace branch past theta > pi - m;
easy_margin; reductions; frozen class weights; half precision; bad input; the PML
adapters; across 2 and 3 gloo processes."""

from __future__ import annotations

import math
import os
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]


def _data(b=9, d=6, c=13, seed=0, far=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(c, d, dtype=torch.float64, generator=g)
    y = torch.randint(0, c, (b,), generator=g)
    e = torch.randn(b, d, dtype=torch.float64, generator=g)
    if far:  # half of the samples pointing away from their class: theta > pi - m
        e[: b // 2] = -w[y[: b // 2]] + 0.05 * e[: b // 2]
    return e, y, w


def _insightface(e, y, w, s, m, easy, arc):
    """insightface's CombinedMarginLoss / ArcMarginProduct arithmetic (cosine, then the
    target's margin, then s, then cross-entropy)."""
    cosine = F.linear(F.normalize(e), F.normalize(w))
    one_hot = F.one_hot(y, w.shape[0]).to(cosine.dtype)
    if not arc:
        return F.cross_entropy(s * (cosine - one_hot * m), y)
    sine = torch.sqrt((1.0 - cosine**2).clamp(0, 1))
    phi = cosine * math.cos(m) - sine * math.sin(m)
    if easy:
        phi = torch.where(cosine > 0, phi, cosine)
    else:
        phi = torch.where(cosine > math.cos(math.pi - m), phi, cosine - math.sin(math.pi - m) * m)
    return F.cross_entropy(s * (one_hot * phi + (1.0 - one_hot) * cosine), y)


def _grads(fn, *xs):
    leaves = [x.clone().requires_grad_(True) for x in xs]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arc", [False, True], ids=["cosface", "arcface"])
@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
def test_equals_pytorch_metric_learning(backend: str, arc: bool, far: bool) -> None:
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    e, y, w = _data(far=far)
    m = 0.5 if arc else 0.35
    peer = (
        pml.ArcFaceLoss(13, 6, margin=math.degrees(m), scale=8.0)
        if arc
        else pml.CosFaceLoss(13, 6, margin=m, scale=8.0)
    ).double()

    ee = e.clone().requires_grad_(True)
    peer.W.data = w.T.contiguous()
    want = peer(ee, y)
    want_e, want_w = torch.autograd.grad(want, [ee, peer.W])
    fn = flashcl.arcface_loss if arc else flashcl.cosface_loss
    s = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
    leaves = [e.clone().requires_grad_(True), w.clone().requires_grad_(True), s]
    got = fn(leaves[0], y, leaves[1], margin=m, scale=leaves[2], backend=backend, block_size=4)
    got_e, got_w, got_s = torch.autograd.grad(got, leaves)
    assert_close(got, want, f"{backend}: value", *TOL)
    assert_close(got_e, want_e, f"{backend}: embedding gradient", *TOL)
    assert_close(got_w, want_w.T, f"{backend}: class-weight gradient", *TOL)
    # the scale's gradient against the dense backend's autograd
    s2 = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
    (want_s,) = torch.autograd.grad(fn(e, y, w, margin=m, scale=s2, backend="dense"), s2)
    assert_close(got_s, want_s, f"{backend}: scale gradient", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arc, easy", [(False, False), (True, False), (True, True)])
def test_equals_insightface_formula(backend: str, arc: bool, easy: bool) -> None:
    e, y, w = _data(b=12, c=7, seed=3, far=True)
    m = 0.5 if arc else 0.35
    fn = flashcl.arcface_loss if arc else flashcl.cosface_loss
    kw = {"easy_margin": easy} if arc else {}
    want = _grads(lambda e_, w_: _insightface(e_, y, w_, 16.0, m, easy, arc), e, w)
    got = _grads(lambda e_, w_: fn(e_, y, w_, margin=m, scale=16.0, backend=backend, block_size=3, **kw), e, w)
    assert_close(got[0], want[0], "value", *TOL)
    for i in range(2):
        assert_close(got[1][i], want[1][i], f"gradient {i}", 1e-9, 1e-8)


@pytest.mark.parametrize("arc", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_with_a_non_uniform_upstream_gradient(arc: bool, reduction: str) -> None:
    e, y, w = _data(b=10, c=50, seed=5)
    weights = torch.rand(10, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
    fn = flashcl.arcface_loss if arc else flashcl.cosface_loss
    out = []
    for backend in BACKENDS:
        got = _grads(
            lambda e_, w_, b=backend: (
                fn(e_, y, w_, scale=10.0, reduction=reduction, backend=b, block_size=7)
                * (weights if reduction == "none" else 1.0)
            ).sum(),
            e,
            w,
        )
        out.append(got)
    for backend, got in zip(BACKENDS[1:], out[1:]):
        assert_close(got[0], out[0][0], f"{backend}: value", *TOL)
        for i in range(2):
            assert_close(got[1][i], out[0][1][i], f"{backend}: gradient {i}", *TOL)


def test_frozen_class_weights_and_inputs_unmodified() -> None:
    e, y, w = _data(seed=6)
    e0, w0 = e.clone(), w.clone()
    x = e.clone().requires_grad_(True)
    (g_frozen,) = torch.autograd.grad(flashcl.cosface_loss(x, y, w, backend="tiled", block_size=5), x)
    _, (g_both, _) = _grads(lambda e_, w_: flashcl.cosface_loss(e_, y, w_, backend="dense"), e, w)
    assert_close(g_frozen, g_both, "embedding gradient with frozen class weights", *TOL)
    assert torch.equal(e, e0) and torch.equal(w, w0)
    module = flashcl.ArcFaceLoss(margin=0.3, scale=30.0)
    assert_close(module(e, y, w), flashcl.arcface_loss(e, y, w, margin=0.3, scale=30.0), "module", *TOL)


def test_second_derivatives_equal_dense() -> None:
    e, y, w = _data(b=5, c=6, seed=8)
    out = []
    for backend in ("dense", "tiled"):
        x = e.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(
            flashcl.arcface_loss(x, y, w, scale=4.0, backend=backend, block_size=4), x, create_graph=True
        )
        out.append(torch.autograd.grad(g.square().sum(), x)[0])
    assert_close(out[1], out[0], "second derivative", *TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_no_worse_than_dense(dtype: torch.dtype) -> None:
    e, y, w = _data(b=32, d=16, c=300, seed=9)
    exact = flashcl.cosface_loss(e, y, w, backend="dense")
    got = flashcl.cosface_loss(e.to(dtype), y, w.to(dtype), backend="tiled", block_size=64)
    dense = flashcl.cosface_loss(e.to(dtype), y, w.to(dtype), backend="dense")
    assert got.dtype == torch.float32
    assert abs(got.double() - exact) <= abs(dense.double() - exact) + 1e-5 * abs(exact)


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (flashcl.cosface_loss, {"labels": torch.zeros(4, dtype=torch.long)}, "labels"),
        (flashcl.cosface_loss, {"labels": torch.full((6,), 9)}, r"\[0, 5\)"),
        (flashcl.cosface_loss, {"class_weights": torch.randn(0, 3)}, "empty"),
        (flashcl.cosface_loss, {"class_weights": torch.randn(5, 4)}, "D = 3"),
        (flashcl.cosface_loss, {"margin": -0.1}, "margin"),
        (flashcl.arcface_loss, {"margin": 3.2}, "pi"),
        (flashcl.arcface_loss, {"scale": 0.0}, "scale"),
        (flashcl.cosface_loss, {"backend": "triton"}, "backend"),
    ],
)
def test_bad_input_is_a_clear_error(fn, kwargs, match: str) -> None:
    call = {"embeddings": torch.randn(6, 3), "labels": torch.randint(0, 5, (6,)), "class_weights": torch.randn(5, 3)}
    call.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        fn(call.pop("embeddings"), call.pop("labels"), call.pop("class_weights"), **call)


@pytest.mark.parametrize("name", ["CosFaceLoss", "ArcFaceLoss"])
def test_pml_adapters(name: str) -> None:
    pml = pytest.importorskip("pytorch_metric_learning")
    from flashcl.integrations import pytorch_metric_learning as fpml

    e, y, _ = _data(b=10, d=5, c=11, seed=10)
    torch.manual_seed(3)
    ours = getattr(fpml, name)(num_classes=11, embedding_size=5, block_size=4).double()
    torch.manual_seed(3)
    theirs = getattr(pml.losses, name)(num_classes=11, embedding_size=5).double()
    assert isinstance(ours, getattr(pml.losses, name))
    for loss in (ours, theirs):
        loss(e, y).backward()
    assert_close(ours.W.grad, theirs.W.grad, f"{name}: W gradient", *TOL)
    assert_close(ours(e, y), theirs(e, y), f"{name}: value", *TOL)
    # PML's reducers and weight regularizers apply to flashcl's per-sample losses
    from pytorch_metric_learning import reducers, regularizers

    kw = {"reducer": reducers.SumReducer(), "weight_regularizer": regularizers.RegularFaceRegularizer()}
    torch.manual_seed(3)
    ours = getattr(fpml, name)(num_classes=11, embedding_size=5, **kw).double()
    torch.manual_seed(3)
    theirs = getattr(pml.losses, name)(num_classes=11, embedding_size=5, **kw).double()
    assert_close(ours(e, y), theirs(e, y), f"{name}: with a reducer and a regularizer", *TOL)


@pytest.mark.parametrize("name", ["CosFaceLoss", "ArcFaceLoss", "SubCenterArcFaceLoss"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pml_adapters_return_the_embeddings_dtype(name: str, dtype: torch.dtype) -> None:
    """Half-precision embeddings (the classes' weights cast to them, as PML does): the loss
    comes back in their dtype, as PML's does, and within its rounding of PML's value."""
    pml = pytest.importorskip("pytorch_metric_learning")
    from flashcl.integrations import pytorch_metric_learning as fpml

    e, y, _ = _data(b=10, d=5, c=11, seed=11)
    e = e.to(dtype)
    torch.manual_seed(4)
    ours = getattr(fpml, name)(num_classes=11, embedding_size=5)
    torch.manual_seed(4)
    theirs = getattr(pml.losses, name)(num_classes=11, embedding_size=5)
    got = ours(e.clone().requires_grad_(True), y)
    assert got.dtype == dtype, f"{name}: {got.dtype}"
    want = theirs(e.float(), y)  # PML's own formula, in float32 on the half inputs
    if dtype == torch.float16:  # where PML itself runs in the half dtype, its dtype too
        assert theirs(e, y).dtype == dtype
    assert abs(float(got.detach()) - float(want)) <= 2e-2 * abs(float(want)), (name, float(got.detach()), float(want))


SIZES = {2: [5, 8], 3: [4, 1, 7]}


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    e, y, w = _data(b=sum(sizes), c=17, seed=world)
    sl = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out: List = []
    for fn in (flashcl.cosface_loss, flashcl.arcface_loss):
        for reduction in ("mean", "sum"):
            x, wt = e[sl].clone().requires_grad_(True), w.clone().requires_grad_(True)
            loss = fn(
                x,
                y[sl],
                wt,
                scale=6.0,
                reduction=reduction,
                process_group=dist.group.WORLD,
                grad_scale="sum",
                block_size=5,
            )
            out.append((loss.detach(), torch.autograd.grad(loss, [x, wt])))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    e, y, w = _data(b=sum(SIZES[world]), c=17, seed=world)
    i = 0
    for fn in (flashcl.cosface_loss, flashcl.arcface_loss):
        for reduction in ("mean", "sum"):
            want = _grads(
                lambda e_, w_, fn=fn, r=reduction: fn(e_, y, w_, scale=6.0, reduction=r, backend="reference"), e, w
            )
            name = f"{fn.__name__}/{reduction}"
            assert_close(sum(r[i][0] for r in ranks), want[0], f"{name}: sum of rank values", *TOL)
            assert_close(torch.cat([r[i][1][0] for r in ranks]), want[1][0], f"{name}: embedding rows", *TOL)
            assert_close(sum(r[i][1][1] for r in ranks), want[1][1], f"{name}: class-weight gradient summed", *TOL)
            i += 1


def _along(e, y, w, rows, sign, delta):
    """``e`` with ``rows`` set to ``2 w_y`` rotated by ``delta`` radians towards a fixed
    direction orthogonal to ``w_y`` (``sign = -1``: exactly opposite, rotated the same way)."""
    e = e.clone()
    g = torch.Generator().manual_seed(11)
    for i in rows:
        wy = w[y[i]] / w[y[i]].norm()
        v = torch.randn(w.shape[1], dtype=torch.float64, generator=g)
        v = v - (v @ wy) * wy
        v = v / v.norm()
        e[i] = 2.0 * (sign * wy * math.cos(delta) + v * math.sin(delta))
    return e


ALL_BACKENDS = BACKENDS + ["auto"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sign", [1, -1], ids=["cos=1", "cos=-1"])
@pytest.mark.parametrize("arc", [True, False], ids=["arcface", "cosface"])
def test_at_the_edges_of_arccos_the_gradient_is_the_mean_of_both_sides(arc, sign, dtype) -> None:
    """Embeddings exactly along (or against) their class weight: at the tip of the
    cone the gradient is that of either side without the margin term's direction,
    which rounding cannot tell: the mean of insightface's gradients at +-delta (each
    finite there), on every backend; never NaN or huge."""
    e, y, w = _data(b=8, d=5, c=6, seed=12)
    rows = [0, 3, 5]
    m = 0.5 if arc else 0.35
    fn = flashcl.arcface_loss if arc else flashcl.cosface_loss
    oracle = {
        d: _grads(lambda e_, w_: _insightface(e_, y, w_, 8.0, m, False, arc), _along(e, y, w, rows, sign, d), w)[1]
        for d in (1e-4, -1e-4, 2e-4, -2e-4)
    }
    # the mean of the two sides is the tip's gradient plus O(delta) (the margin term's
    # direction turns with the embedding): extrapolated from delta and 2 delta, O(delta^2)
    mean = [(oracle[1e-4][i] + oracle[-1e-4][i]) - (oracle[2e-4][i] + oracle[-2e-4][i]) / 2 for i in range(2)]
    tip = _along(e, y, w, rows, sign, 0.0)
    value = _insightface(tip, y, w, 8.0, m, False, arc)  # finite at the tip; its gradient is not
    tip = tip.to(dtype)
    tol = (1e-7, 1e-6) if dtype == torch.float64 else (2e-5, 1e-4)
    for backend in ALL_BACKENDS:
        got = _grads(
            lambda e_, w_, b=backend: fn(e_, y, w_, margin=m, scale=8.0, backend=b, block_size=4), tip, w.to(dtype)
        )
        assert all(torch.isfinite(g).all() for g in got[1]), backend
        assert_close(got[0], value, f"{backend}: value", 1e-6 if dtype == torch.float64 else 1e-5, 1e-6)
        assert_close(got[1][0], mean[0], f"{backend}: embedding gradient", *tol)
        assert_close(got[1][1], mean[1], f"{backend}: class-weight gradient", *tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("easy", [False, True])
def test_one_dimensional_embeddings_have_zero_gradient(dtype, easy) -> None:
    """D = 1: every cosine is +-1 whatever the inputs' sizes, so the exact gradient is 0."""
    g = torch.Generator().manual_seed(13)
    e = torch.randn(7, 1, dtype=dtype, generator=g)
    w = torch.randn(4, 1, dtype=dtype, generator=g)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    for backend in ALL_BACKENDS:
        for fn, kw in ((flashcl.arcface_loss, {"easy_margin": easy}), (flashcl.cosface_loss, {})):
            s = torch.tensor(4.0, dtype=dtype, requires_grad=True)
            leaves = [e.clone().requires_grad_(True), w.clone().requires_grad_(True)]
            out = fn(leaves[0], y, leaves[1], scale=s, backend=backend, block_size=3, **kw)
            ge, gw, gs = torch.autograd.grad(out, leaves + [s])
            assert torch.isfinite(out) and torch.isfinite(gs), (backend, fn.__name__)
            # zero up to rounding (w * (1 / |w|) is not always exactly +-1)
            tol = 100 * torch.finfo(dtype).eps
            assert float(ge.abs().max()) <= tol and float(gw.abs().max()) <= tol, (backend, fn.__name__, ge, gw)


@pytest.mark.parametrize("arc", [False, True], ids=["cosface", "arcface"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_embeddings_and_class_weights_of_different_dtypes(arc, dtypes) -> None:
    """float32 embeddings with float64 class weights (and the reverse): the same value
    and gradients on every backend, each gradient in its input's dtype, within the
    narrower dtype's accuracy of the float64 oracle."""
    e, y, w = _data(b=9, d=6, c=13, seed=14)
    m = 0.5 if arc else 0.35
    fn = flashcl.arcface_loss if arc else flashcl.cosface_loss
    want = _grads(lambda e_, w_: _insightface(e_, y, w_, 8.0, m, False, arc), e, w)
    for backend in ALL_BACKENDS:
        leaves = [e.to(dtypes[0]).requires_grad_(True), w.to(dtypes[1]).requires_grad_(True)]
        out = fn(leaves[0], y, leaves[1], margin=m, scale=8.0, backend=backend, block_size=4)
        ge, gw = torch.autograd.grad(out, leaves)
        assert ge.dtype == dtypes[0] and gw.dtype == dtypes[1], backend
        assert_close(out, want[0], f"{backend}: value", 1e-5, 1e-5)
        assert_close(ge, want[1][0], f"{backend}: embedding gradient", 1e-5, 1e-4)
        assert_close(gw, want[1][1], f"{backend}: class-weight gradient", 1e-5, 1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_margin_head_on_the_engine_equals_its_dense_form(k: int) -> None:
    """MarginHead as any head: run by the engine on column blocks (its target logits a
    learnable input) and by its dense form, the rows and the gradients of the rows,
    the proxies, the scale and the target logits agree; the target logits' gradient is
    ``g (p_iy - 1)``."""
    from flashcl import engine
    from flashcl.engine.columns import ColumnBlocks
    from flashcl.losses.margin_blocks import MarginHead

    g = torch.Generator().manual_seed(21)
    e = torch.randn(9, 5, dtype=torch.float64, generator=g)
    w = torch.randn(7 * k, 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 7, (9,), generator=g)
    u0 = torch.randn(9, dtype=torch.float64, generator=g)
    up = torch.linspace(0.5, 1.5, 9, dtype=torch.float64)
    out = []
    for driver in (ColumnBlocks(), None):
        leaves = [e.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        scale = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
        u = u0.clone().requires_grad_(True)
        problem = engine.Problem(MarginHead(y, u0, k, 6.0))
        rows = engine.run(leaves[0], leaves[1], scale, problem, driver, None, 2 * k, (u,))[0]
        out.append((rows.detach(), torch.autograd.grad((rows * up).sum(), [*leaves, scale, u])))
    (got, got_g), (want, want_g) = out
    assert_close(got, want, "rows", 1e-12, 1e-10)
    for name, a, b in zip(("embeddings", "proxies", "scale", "target logits"), got_g, want_g):
        assert_close(a, b, f"{name}' gradient", 1e-12, 1e-10)
    logits = (F.normalize(e, dim=1) @ F.normalize(w, dim=1).T * 6.0).view(9, 7, k).amax(2)
    logits[torch.arange(9), y] = u0
    p_y = torch.softmax(logits, dim=1)[torch.arange(9), y]
    assert_close(got_g[3], up * (p_y - 1), "d rows / d u", 1e-12, 1e-10)
