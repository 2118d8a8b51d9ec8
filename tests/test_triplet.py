"""triplet_loss against sentence-transformers' four batch triplet losses and
pytorch-metric-learning's TripletMarginLoss (their own code), every backend,
float64 values and gradients: every mining and distance, the degenerate batches
(one sample, one label, every label distinct), reductions with a non-uniform
upstream gradient, second derivatives, half precision, bad input, and across 2
and 3 gloo processes."""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]
LABELS = {
    "mixed": torch.tensor([0, 0, 1, 2, 2, 2, 3, 1, 5, 1, 0]),  # a singleton class: an anchor without positives
    "one_label": torch.zeros(7, dtype=torch.long),  # no negatives
    "all_distinct": torch.arange(6),  # no positives
    "one_sample": torch.tensor([4]),
}


def _st():
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.sentence_transformer.losses.batch_hard_triplet import (
        BatchHardTripletLossDistanceFunction as distance_functions,
    )

    return losses, {
        "euclidean": distance_functions.euclidean_distance,
        "squared": lambda e: distance_functions.euclidean_distance(e, squared=True),
        "cosine": distance_functions.cosine_distance,
    }


def _st_loss(mining: str, soft: bool, distance: str, margin: float):
    losses, fns = _st()
    if soft:
        peer = losses.BatchHardSoftMarginTripletLoss(model=None, distance_metric=fns[distance])
        return peer.batch_hard_triplet_soft_margin_loss
    cls, method = {
        "all": (losses.BatchAllTripletLoss, "batch_all_triplet_loss"),
        "hard": (losses.BatchHardTripletLoss, "batch_hard_triplet_loss"),
        "semi-hard": (losses.BatchSemiHardTripletLoss, "batch_semi_hard_triplet_loss"),
    }[mining]
    return getattr(cls(model=None, distance_metric=fns[distance], margin=margin), method)


def _value_and_grad(fn, x):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    if not out.requires_grad:  # a peer's constant zero
        return out.detach(), torch.zeros_like(x)
    (g,) = torch.autograd.grad(out, x, allow_unused=True)
    return out.detach(), torch.zeros_like(x) if g is None else g


PEER_CASES = [(m, False) for m in ("all", "hard", "semi-hard")] + [("hard", True)]


@pytest.mark.parametrize("mining, soft", PEER_CASES, ids=[f"{m}{'-soft' if s else ''}" for m, s in PEER_CASES])
@pytest.mark.parametrize("distance", ["euclidean", "squared", "cosine"])
@pytest.mark.parametrize("labels", list(LABELS), ids=list(LABELS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_sentence_transformers(mining: str, soft: bool, distance: str, labels: str, backend: str) -> None:
    y = LABELS[labels]
    x = torch.randn(len(y), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(len(y)))
    margin = 0.0 if soft else 1.5
    want, want_grad = _value_and_grad(lambda e: _st_loss(mining, soft, distance, margin)(y, e), x)
    got, got_grad = _value_and_grad(
        lambda e: flashcl.triplet_loss(
            e, y, margin=margin, mining=mining, soft_margin=soft, distance=distance, backend=backend, block_size=3
        ),
        x,
    )
    assert_close(got, want, f"{backend}: value", *TOL)
    assert_close(got_grad, want_grad, f"{backend}: gradient", *TOL)


@pytest.mark.parametrize("labels", list(LABELS), ids=list(LABELS))
@pytest.mark.parametrize("margin", [0.05, 0.4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_pml_triplet_margin_loss(labels: str, margin: float, backend: str) -> None:
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    y = LABELS[labels]
    x = torch.randn(len(y), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    want, want_grad = _value_and_grad(lambda e: pml.TripletMarginLoss(margin=margin)(e, y), x)
    got, got_grad = _value_and_grad(
        lambda e: flashcl.triplet_loss(e, y, margin=margin, normalize=True, backend=backend, block_size=2), x
    )
    assert_close(got, want, f"{backend}: value", *TOL)
    assert_close(got_grad, want_grad, f"{backend}: gradient", *TOL)


def _pml_configs():
    from pytorch_metric_learning import distances, reducers, regularizers

    return {
        "default": {},
        "squared": {"distance": distances.LpDistance(power=2)},
        "raw euclidean": {"distance": distances.LpDistance(normalize_embeddings=False)},
        "cosine": {"distance": distances.CosineSimilarity()},
        "mean": {"reducer": reducers.MeanReducer()},
        "cosine mean": {"distance": distances.CosineSimilarity(), "reducer": reducers.MeanReducer()},
        "sum": {
            "reducer": reducers.SumReducer(),
            "distance": distances.LpDistance(power=2, normalize_embeddings=False),
        },
        "regularized": {"embedding_regularizer": regularizers.LpRegularizer()},
    }


PML_CONFIGS = ["default", "squared", "raw euclidean", "cosine", "mean", "cosine mean", "sum", "regularized"]


@pytest.mark.parametrize("config", PML_CONFIGS)
@pytest.mark.parametrize("labels", list(LABELS), ids=list(LABELS))
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_pml_triplet_margin_loss_adapter_equals_pml(config: str, labels: str, backend: str) -> None:
    """flashcl.integrations.pytorch_metric_learning.TripletMarginLoss against PML's own
    class: every distance and reducer flashcl serves, a regularizer, the degenerate
    batches; values and gradients, no fallback."""
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    from flashcl.integrations.pytorch_metric_learning import TripletMarginLoss

    y = LABELS[labels]
    x = torch.randn(len(y), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    kw = _pml_configs()[config]
    want, want_grad = _value_and_grad(lambda e: pml.TripletMarginLoss(margin=0.3, **kw)(e, y), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # flashcl computes it
        ours = TripletMarginLoss(margin=0.3, backend=backend, block_size=3, **_pml_configs()[config])
        got, got_grad = _value_and_grad(lambda e: ours(e, y), x)
    assert_close(got, want, f"{config}: value", *TOL)
    assert_close(got_grad, want_grad, f"{config}: gradient", *TOL)


def test_pml_triplet_margin_loss_adapter_names_what_it_leaves_to_pml() -> None:
    """The cases flashcl leaves to PML's own code: a warning that names each, PML's value."""
    pml = pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning import distances, miners, reducers

    from flashcl.integrations.pytorch_metric_learning import TripletMarginLoss

    x = torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    y = LABELS["mixed"][:12].repeat(2)[:12]
    triplets = miners.TripletMarginMiner(margin=0.5)(x, y)
    cases = [
        ({"swap": True}, {}, "swap=True"),
        ({"smooth_loss": True}, {}, "smooth_loss=True"),
        ({"distance": distances.DotProductSimilarity()}, {}, "distance=DotProductSimilarity"),
        ({"distance": distances.LpDistance(p=1)}, {}, "p=1"),
        ({"reducer": reducers.ThresholdReducer(low=0.1)}, {}, "reducer=ThresholdReducer"),
        ({}, {"indices_tuple": triplets}, "indices_tuple"),
        ({}, {"ref_emb": x[:5], "ref_labels": y[:5]}, "ref_emb"),
    ]
    for ctor, call, match in cases:
        want = pml.losses.TripletMarginLoss(margin=0.3, **ctor)(x, y, **call)
        with pytest.warns(UserWarning, match=match):
            got = TripletMarginLoss(margin=0.3, **ctor)(x, y, **call)
        assert_close(got, want, match, *TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pml_triplet_margin_loss_adapter_in_half_precision(dtype: torch.dtype) -> None:
    """Half inputs: the loss in their dtype as PML returns it, accumulated in float32:
    no further from the float64 value than PML's own in that dtype."""
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    from flashcl.integrations.pytorch_metric_learning import TripletMarginLoss

    y = torch.randint(0, 4, (40,), generator=torch.Generator().manual_seed(10))
    x = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    exact = pml.TripletMarginLoss(margin=0.2)(x, y)
    got = TripletMarginLoss(margin=0.2)(x.to(dtype), y)
    assert got.dtype == dtype
    theirs = pml.TripletMarginLoss(margin=0.2)(x.to(dtype).float(), y).to(dtype)  # PML's cdist has no half on CPU
    assert abs(float(got) - float(exact)) <= abs(float(theirs) - float(exact)) + 2 * float(torch.finfo(dtype).eps)


@pytest.mark.parametrize("mining", ["all", "hard", "semi-hard"])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_with_a_non_uniform_upstream_gradient(mining: str, reduction: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(23, 6, dtype=torch.float64, generator=g)
    y = torch.randint(0, 4, (23,), generator=g)
    w = torch.rand(23, dtype=torch.float64, generator=g) + 0.5
    results = []
    for backend in BACKENDS:
        xs = x.clone().requires_grad_(True)
        out = flashcl.triplet_loss(xs, y, margin=0.7, mining=mining, reduction=reduction, backend=backend, block_size=5)
        weighted = (out * w).sum() if reduction == "none" else out
        results.append((out.detach(), torch.autograd.grad(weighted, xs)[0]))
    for backend, (value, grad) in zip(BACKENDS[1:], results[1:]):
        assert_close(value, results[0][0], f"{backend}: value", *TOL)
        assert_close(grad, results[0][1], f"{backend}: gradient", *TOL)


def test_batch_all_at_a_larger_batch_equals_dense_and_counts_triplets() -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, 8, dtype=torch.float64, generator=g)
    y = torch.randint(0, 6, (300,), generator=g)
    got, got_grad = _value_and_grad(lambda e: flashcl.triplet_loss(e, y, margin=0.5, backend="tiled"), x)
    want, want_grad = _value_and_grad(lambda e: flashcl.triplet_loss(e, y, margin=0.5, backend="dense"), x)
    assert_close(got, want, "value", *TOL)
    assert_close(got_grad, want_grad, "gradient", *TOL)
    # the mean's divisor: the triplets with a positive loss, counted by brute force
    d = torch.cdist(x, x)
    same = y.unsqueeze(0) == y.unsqueeze(1)
    pos = same & ~torch.eye(300, dtype=torch.bool)
    cube = (d.unsqueeze(2) - d.unsqueeze(1) + 0.5) * (pos.unsqueeze(2) & ~same.unsqueeze(1))
    assert_close(got, cube.clamp_min(0).sum() / (cube > 0).sum(), "the B^3 formula", 1e-9, 1e-9)


def test_second_derivatives_equal_dense() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 3, dtype=torch.float64, generator=g)
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2, 0, 1])
    out = []
    for backend in ("dense", "tiled"):
        xs = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(
            flashcl.triplet_loss(xs, y, margin=3.0, mining="semi-hard", backend=backend), xs, create_graph=True
        )
        out.append(torch.autograd.grad(gx.square().sum(), xs)[0])
    assert_close(out[1], out[0], "second derivative", *TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_no_worse_than_dense(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 16, dtype=torch.float64, generator=g)
    y = torch.randint(0, 5, (64,), generator=g)
    exact = flashcl.triplet_loss(x, y, margin=1.0, backend="dense")
    got = flashcl.triplet_loss(x.to(dtype), y, margin=1.0, backend="tiled")
    dense = flashcl.triplet_loss(x.to(dtype), y, margin=1.0, backend="dense")
    assert got.dtype == torch.float32
    assert abs(got.double() - exact) <= abs(dense.double() - exact) + 1e-5 * abs(exact)


def test_module_inputs_unmodified_and_strided() -> None:
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    x0 = x.clone()
    module = flashcl.TripletLoss(margin=0.3, mining="hard", distance="cosine")
    assert_close(module(x, y), flashcl.triplet_loss(x, y, margin=0.3, mining="hard", distance="cosine"), "module", *TOL)
    assert torch.equal(x, x0)
    wide = torch.randn(10, 8)[:, ::2]
    assert_close(
        flashcl.triplet_loss(wide, y, margin=0.3),
        flashcl.triplet_loss(wide.contiguous(), y, margin=0.3),
        "strided input",
        1e-6,
        1e-6,
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"labels": torch.zeros(5, dtype=torch.long)}, "labels"),
        ({"margin": -0.1}, "margin"),
        ({"margin": float("nan")}, "margin"),
        ({"margin": "1"}, "margin"),
        ({"mining": "easy"}, "mining"),
        ({"distance": "manhattan"}, "distance"),
        ({"backend": "triton"}, "backend"),
        ({"soft_margin": True}, "soft_margin"),
        ({"reduction": "avg"}, "reduction"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match: str) -> None:
    call = {"embeddings": torch.randn(6, 4), "labels": torch.randint(0, 2, (6,)), "margin": 0.5, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        flashcl.triplet_loss(call.pop("embeddings"), call.pop("labels"), **call)


def test_sentence_transformers_drop_ins() -> None:
    losses, _ = _st()
    from flashcl.integrations import sentence_transformers as fst

    g = torch.Generator().manual_seed(8)
    x = torch.randn(12, 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (12,), generator=g)
    for name, method in [
        ("BatchAllTripletLoss", "batch_all_triplet_loss"),
        ("BatchHardTripletLoss", "batch_hard_triplet_loss"),
        ("BatchSemiHardTripletLoss", "batch_semi_hard_triplet_loss"),
        ("BatchHardSoftMarginTripletLoss", "batch_hard_triplet_soft_margin_loss"),
    ]:
        ours, theirs = getattr(fst, name)(None), getattr(losses, name)(None)
        assert isinstance(ours, getattr(losses, name))
        ours_fn, theirs_fn = getattr(ours, method), getattr(theirs, method)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _value_and_grad(lambda e, f=ours_fn: f(y, e), x)
        want = _value_and_grad(lambda e, f=theirs_fn: f(y, e), x)
        assert_close(got[0], want[0], f"{name}: value", *TOL)
        assert_close(got[1], want[1], f"{name}: gradient", *TOL)


SIZES = {2: [5, 8], 3: [4, 1, 7]}
# (strategy, options): every mining and distance on both strategies, the soft margin, every reduction
ACROSS = [
    (strategy, {"mining": mining, "distance": distance, **extra})
    for strategy in ("all_gather", "ring")
    for mining in ("all", "hard", "semi-hard")
    for distance, extra in [
        ("euclidean", {}),
        ("squared", {"reduction": "sum"}),
        ("cosine", {"reduction": "none"}),
        ("euclidean", {"normalize": True, "grad_scale": "ddp"}),
    ]
    + ([("euclidean", {"soft_margin": True, "margin": 0.0})] if mining != "all" else [])
]


def _data(n: int, ties: bool = False):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 4, dtype=torch.float64, generator=g)
    if ties:  # small integer coordinates: equal distances everywhere, duplicated rows across ranks
        x = torch.randint(-1, 2, (n, 3), generator=g).double()
        x[n - 1] = x[0]
    return x, torch.randint(0, 3, (n,), generator=g)


def _across_call(x, y, opts: Dict[str, Any], **kw):
    options = {"margin": 1.0, **opts}
    options.pop("grad_scale", None)
    return flashcl.triplet_loss(x, y, **options, **kw)


def _upstream(loss: torch.Tensor, offset: int) -> torch.Tensor:
    """A non-uniform upstream gradient: 1, 2, ... over the global rows."""
    return torch.arange(1.0, loss.numel() + 1, dtype=loss.dtype).view(loss.shape) + (offset if loss.dim() else 0)


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    sl = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out: List = []
    for strategy, opts in ACROSS:
        x, y = _data(sum(sizes))
        xs = x[sl].clone().requires_grad_(True)
        loss = _across_call(
            xs, y[sl], opts, process_group=dist.group.WORLD, strategy=strategy, grad_scale=opts.get("grad_scale", "sum")
        )
        out.append((loss.detach(), torch.autograd.grad(loss, xs, _upstream(loss, sl.start))[0]))
    ties = []
    for mining in ("all", "hard", "semi-hard"):
        for distance in ("euclidean", "squared"):
            x, y = _data(sum(sizes), ties=True)
            xs = x[sl].clone().requires_grad_(True)
            loss = flashcl.triplet_loss(
                xs,
                y[sl],
                margin=1.0,
                mining=mining,
                distance=distance,
                process_group=dist.group.WORLD,
                strategy="ring",
                grad_scale="sum",
                block_size=2,
            )
            ties.append((loss.detach(), torch.autograd.grad(loss, xs)[0]))
    errors = {}
    x, y = _data(sum(sizes))
    try:
        flashcl.triplet_loss(x[sl], y[sl], margin=1.0 + rank, process_group=dist.group.WORLD, strategy="ring")
    except ValueError as e:
        errors["mismatch"] = str(e)
    try:
        flashcl.triplet_loss(x[sl], y[sl], margin=1.0, process_group=dist.group.WORLD, strategy="ring", backend="dense")
    except ValueError as e:
        errors["backend"] = str(e)
    torch.save({"out": out, "ties": ties, "errors": errors}, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    """Both strategies (the ring: no rank holds the global batch), every mining and
    distance, the soft margin, every reduction (a non-uniform upstream gradient of the
    per-row losses), both grad_scale values, uneven batches (a rank with one row):
    equal to one process in float64, values and every rank's gradient."""
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    bounds = [sum(SIZES[world][:r]) for r in range(world + 1)]
    x, y = _data(sum(SIZES[world]))
    for i, (strategy, opts) in enumerate(ACROSS):
        e = x.clone().requires_grad_(True)
        want = _across_call(e, y, opts, backend="reference")
        want_grad = torch.autograd.grad(want, e, _upstream(want, 0))[0]
        factor = world if opts.get("grad_scale") == "ddp" else 1
        name = f"{strategy} {opts}"
        if want.dim():
            got = torch.cat([r["out"][i][0] for r in ranks])
        else:  # "sum": the ranks' shares add up; "ddp": world x each share
            got = sum(r["out"][i][0] for r in ranks) / factor
        assert_close(got, want.detach(), f"{name}: values", *TOL)
        for r in range(world):
            rows = slice(bounds[r], bounds[r + 1])
            assert_close(ranks[r]["out"][i][1], factor * want_grad[rows], f"{name}: rank {r}'s gradient", *TOL)
    # ties everywhere (integer coordinates, a duplicated row): the ring gives each tie's
    # gradient to the column one process gives it to
    x, y = _data(sum(SIZES[world]), ties=True)
    i = 0
    for mining in ("all", "hard", "semi-hard"):
        for distance in ("euclidean", "squared"):
            want, want_grad = _value_and_grad(
                lambda e, m=mining, d=distance: flashcl.triplet_loss(
                    e, y, margin=1.0, mining=m, distance=d, backend="tiled", block_size=3
                ),
                x,
            )
            got = sum(r["ties"][i][0] for r in ranks)
            assert_close(got, want, f"ties {mining} {distance}: value", *TOL)
            assert_close(torch.cat([r["ties"][i][1] for r in ranks]), want_grad, f"ties {mining} {distance}", *TOL)
            i += 1
    for r in ranks:
        assert "different calls" in r["errors"]["mismatch"]
        assert "backend='dense' with strategy='ring'" in r["errors"]["backend"]
