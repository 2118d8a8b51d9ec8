"""cosent_loss against sentence-transformers' own CoSENTLoss and AnglELoss and a
plain loop over the ordered pairs: every backend, float64 values and gradients
(embeddings and a learnable scale), ties, degenerate batches, half precision, bad
input, and across 2 and 3 gloo processes."""

from __future__ import annotations

import os
from typing import List

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled", "auto"]


def _pairs_formula(a, b, y, scale, angle=False):
    """log(1 + sum over ordered pairs with y_i < y_j of exp(scale (s_i - s_j))), written
    out pair by pair (independent of flashcl)."""
    an, bn = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(b, dim=1)
    s = (an * bn).sum(1)
    if angle:
        if an.shape[1] % 2:
            an, bn = torch.nn.functional.pad(an, (0, 1)), torch.nn.functional.pad(bn, (0, 1))
        h = an.shape[1] // 2
        s = (s + (an[:, h:] * bn[:, :h] - an[:, :h] * bn[:, h:]).sum(1)).abs()
    terms = [torch.zeros((), dtype=a.dtype)]
    for i in range(len(y)):
        for j in range(len(y)):
            if y[i] < y[j]:
                terms.append(scale * (s[i] - s[j]))
    return torch.logsumexp(torch.stack(terms), 0)


def _data(b=11, d=6, seed=0, ties=True):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(b, d, dtype=torch.float64, generator=g)
    bb = torch.randn(b, d, dtype=torch.float64, generator=g)
    y = torch.randint(0, 4, (b,), generator=g).double() / 3 if ties else torch.rand(b, dtype=torch.float64, generator=g)
    return a, bb, y


def _st_losses():
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer import losses
    except ImportError:  # sentence-transformers < 6
        losses = st.losses
    return losses


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("similarity", ["cosine", "angle"])
@pytest.mark.parametrize("d", [6, 5])
def test_equals_sentence_transformers(backend: str, similarity: str, d: int) -> None:
    losses = _st_losses()
    peer = (losses.CoSENTLoss if similarity == "cosine" else losses.AnglELoss)(model=None, scale=17.0)
    a, b, y = _data(d=d)
    xs = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    want = peer.compute_loss_from_embeddings(xs, y)
    want_grads = torch.autograd.grad(want, xs)
    ys = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    scale = torch.tensor(17.0, dtype=torch.float64, requires_grad=True)
    got = flashcl.cosent_loss(*ys, y, scale=scale, similarity=similarity, backend=backend)
    assert_close(got, want, f"{backend}/{similarity}: value", *TOL)
    got_grads = torch.autograd.grad(got, [*ys, scale])
    for i in range(2):
        assert_close(got_grads[i], want_grads[i], f"{backend}/{similarity}: grad {i}", *TOL)
    zs = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    t = torch.tensor(17.0, dtype=torch.float64, requires_grad=True)
    oracle = _pairs_formula(*zs, y, t, angle=similarity == "angle")
    assert_close(got, oracle, f"{backend}/{similarity}: the pair formula", *TOL)
    assert_close(got_grads[2], torch.autograd.grad(oracle, t)[0], f"{backend}/{similarity}: scale grad", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_and_degenerate_batches(backend: str) -> None:
    a, b, _ = _data(b=7)
    same = torch.full((7,), 0.5, dtype=torch.float64)  # every label equal: no ordered pair
    x = a.clone().requires_grad_(True)
    loss = flashcl.cosent_loss(x, b, same, backend=backend)
    assert loss.item() == 0.0
    (g,) = torch.autograd.grad(loss, x)
    assert torch.count_nonzero(g) == 0
    one = flashcl.cosent_loss(a[:1], b[:1], same[:1], backend=backend)
    assert one.item() == 0.0
    # bool labels (as sentence-transformers takes them) and integer labels order the pairs alike
    yb = torch.tensor([True, False, True, True, False, False, True])
    assert_close(
        flashcl.cosent_loss(a, b, yb, backend=backend),
        _pairs_formula(a, b, yb.double(), 20.0),
        "bool labels",
        *TOL,
    )


def test_large_batch_sorted_equals_dense_and_memory_is_linear() -> None:
    a, b, y = _data(b=600, d=4, seed=3, ties=False)
    xs = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    ys = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    got, want = flashcl.cosent_loss(*xs, y, backend="tiled"), flashcl.cosent_loss(*ys, y, backend="dense")
    assert_close(got, want, "B=600 value", *TOL)
    for i, (g, w) in enumerate(zip(torch.autograd.grad(got, xs), torch.autograd.grad(want, ys))):
        assert_close(g, w, f"B=600 grad {i}", *TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_no_worse_than_dense(dtype: torch.dtype) -> None:
    a, b, y = _data(b=64, d=16, seed=5, ties=False)
    exact = flashcl.cosent_loss(a, b, y, backend="reference")
    got = flashcl.cosent_loss(a.to(dtype), b.to(dtype), y, backend="tiled")
    dense = flashcl.cosent_loss(a.to(dtype), b.to(dtype), y, backend="dense")
    assert got.dtype == torch.float32
    assert abs(got.double() - exact) <= abs(dense.double() - exact) + 1e-5 * abs(exact)


def test_module_and_inputs_unmodified() -> None:
    a, b, y = _data()
    a0, b0, y0 = a.clone(), b.clone(), y.clone()
    loss = flashcl.CoSENTLoss(scale=10.0, similarity="angle")(a, b, y)
    assert_close(loss, flashcl.cosent_loss(a, b, y, scale=10.0, similarity="angle"), "module", *TOL)
    assert torch.equal(a, a0) and torch.equal(b, b0) and torch.equal(y, y0)
    assert "similarity='angle'" in repr(flashcl.CoSENTLoss(similarity="angle"))
    # non-contiguous and expanded inputs
    at, bt = a.T.contiguous().T, b[:, None, :].expand(-1, 2, -1)[:, 0]
    assert_close(flashcl.cosent_loss(at, bt, y), flashcl.cosent_loss(a, b, y), "strided inputs", *TOL)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"labels": torch.rand(5)}, "labels"),
        ({"labels": torch.tensor([0.1, float("nan"), 0.3, 0.4, 0.5, 0.6])}, "finite"),
        ({"scale": 0.0}, "scale"),
        ({"scale": float("inf")}, "scale"),
        ({"similarity": "dot"}, "similarity"),
        ({"backend": "triton"}, "backend"),
        ({"b": torch.randn(6, 3)}, "shape"),
        ({"b": torch.randn(5, 4)}, "b"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match: str) -> None:
    call = {"a": torch.randn(6, 4), "b": torch.randn(6, 4), "labels": torch.rand(6), **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        flashcl.cosent_loss(call.pop("a"), call.pop("b"), call.pop("labels"), **call)


SIZES = {2: [5, 8], 3: [4, 1, 7]}


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    start = sum(sizes[:rank])
    a, b, y = _data(b=sum(sizes), seed=2)
    sl = slice(start, start + sizes[rank])
    out: List = []
    for strategy in ("all_gather", "ring"):
        for similarity in ("cosine", "angle"):
            xs = [a[sl].clone().requires_grad_(True), b[sl].clone().requires_grad_(True)]
            t = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
            loss = flashcl.cosent_loss(
                *xs,
                y[sl],
                scale=t,
                similarity=similarity,
                process_group=dist.group.WORLD,
                strategy=strategy,
                grad_scale="sum",
            )
            out.append((loss.detach(), torch.autograd.grad(loss, [*xs, t])))
    ddp = flashcl.cosent_loss(a[sl], b[sl], y[sl], scale=9.0, process_group=dist.group.WORLD)
    mismatch = ""
    try:
        flashcl.cosent_loss(a[sl], b[sl], y[sl], scale=9.0 + rank, process_group=dist.group.WORLD)
    except ValueError as e:
        mismatch = str(e)
    torch.save({"out": out, "ddp": ddp, "mismatch": mismatch}, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    a, b, y = _data(b=sum(SIZES[world]), seed=2)
    i = 0
    for strategy in ("all_gather", "ring"):
        for similarity in ("cosine", "angle"):
            xs = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
            t = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
            want = flashcl.cosent_loss(*xs, y, scale=t, similarity=similarity, backend="reference")
            grads = torch.autograd.grad(want, [*xs, t])
            name = f"{strategy}/{similarity}"
            assert_close(sum(r["out"][i][0] for r in ranks), want, f"{name}: sum of rank values", *TOL)
            for j in range(2):
                got = torch.cat([r["out"][i][1][j] for r in ranks])
                assert_close(got, grads[j], f"{name}: grad of input {j}", *TOL)
            assert_close(sum(r["out"][i][1][2] for r in ranks), grads[2], f"{name}: scale grad", *TOL)
            i += 1
    single = flashcl.cosent_loss(a, b, y, scale=9.0)
    for r in ranks:
        assert_close(r["ddp"], single, "ddp convention: every rank's value is the global loss", *TOL)
        assert "different calls" in r["mismatch"], r["mismatch"]
