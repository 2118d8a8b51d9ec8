"""flashcl.contrastive_loss and the pair-sum kind of flex losses against pytorch-metric-learning
2.9's own ContrastiveLoss (its distances, margins and reducers, ref_emb) in float64, values and
every gradient, on every backend; the corners (one sample, one label, duplicate rows, half
precision, bad arguments); 2 and 3 gloo processes (uneven, a rank with no rows), both
strategies and both grad_scale conventions, against one process on the concatenated batch."""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

pml = pytest.importorskip("pytorch_metric_learning")
from pytorch_metric_learning import distances, losses, reducers  # noqa: E402

F64 = torch.float64
TOL = (1e-10, 1e-9)
BACKENDS = [("reference", None), ("dense", None), ("tiled", 5), ("tiled", None)]

# (PML's ContrastiveLoss arguments, flashcl's)
CONFIGS: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {
    "defaults": ({}, {}),
    "margins": (dict(pos_margin=0.1, neg_margin=0.7), dict(pos_margin=0.1, neg_margin=0.7)),
    "squared": (dict(distance=distances.LpDistance(power=2), neg_margin=1.5), dict(distance="squared", neg_margin=1.5)),
    "cosine": (
        dict(distance=distances.CosineSimilarity(), pos_margin=1.0, neg_margin=0.2),
        dict(distance="similarity", pos_margin=1.0, neg_margin=0.2),
    ),
    "dot, unnormalised": (
        dict(distance=distances.DotProductSimilarity(normalize_embeddings=False), pos_margin=1.0, neg_margin=0.0),
        dict(distance="similarity", normalize=False, pos_margin=1.0, neg_margin=0.0),
    ),
    "euclidean, unnormalised": (
        dict(distance=distances.LpDistance(normalize_embeddings=False), neg_margin=3.0),
        dict(normalize=False, neg_margin=3.0),
    ),
    "squared, unnormalised": (
        dict(distance=distances.LpDistance(normalize_embeddings=False, power=2), pos_margin=0.5, neg_margin=6.0),
        dict(distance="squared", normalize=False, pos_margin=0.5, neg_margin=6.0),
    ),
    "MeanReducer": (dict(reducer=reducers.MeanReducer()), dict(reduction="mean")),
    "SumReducer": (dict(reducer=reducers.SumReducer(), neg_margin=0.9), dict(reduction="sum", neg_margin=0.9)),
}


def _data(seed: int, b: int = 23, n: int = 11, d: int = 5) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(b, d, generator=g, dtype=F64),
        "y": torch.randint(0, 4, (b,), generator=g),
        "r": torch.randn(n, d, generator=g, dtype=F64),
        "ry": torch.randint(0, 4, (n,), generator=g),
    }


def _pml(x: torch.Tensor, y: torch.Tensor, r: Any, ry: Any, **kw: Any) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    leaves = [x.clone().requires_grad_(True)] + ([] if r is None else [r.clone().requires_grad_(True)])
    loss = losses.ContrastiveLoss(**kw)(leaves[0], y, ref_emb=None if r is None else leaves[1], ref_labels=ry)
    return loss.detach(), list(torch.autograd.grad(loss, leaves, allow_unused=True)) if loss.requires_grad else []


def _ours(x: torch.Tensor, y: torch.Tensor, r: Any, ry: Any, **kw: Any) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    leaves = [x.clone().requires_grad_(True)] + ([] if r is None else [r.clone().requires_grad_(True)])
    loss = flashcl.contrastive_loss(leaves[0], y, None if r is None else leaves[1], ry, **kw)
    return loss.detach(), list(torch.autograd.grad(loss, leaves, allow_unused=True))


@pytest.mark.parametrize("ref", [False, True])
@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_equals_pytorch_metric_learning(config: str, backend: str, block: Any, ref: bool) -> None:
    theirs, ours = CONFIGS[config]
    d = _data(1)
    r, ry = (d["r"], d["ry"]) if ref else (None, None)
    want, want_grads = _pml(d["x"], d["y"], r, ry, **theirs)
    got, grads = _ours(d["x"], d["y"], r, ry, backend=backend, block_size=block, **ours)
    assert_close(got, want, f"{config}/{backend}: value", *TOL)
    for i, (a, e) in enumerate(zip(grads, want_grads)):
        assert_close(a, torch.zeros_like(a) if e is None else e, f"{config}/{backend}: gradient {i}", *TOL)


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_per_anchor_sums(backend: str, block: Any) -> None:
    """``reduction="none"``: each anchor's terms summed (the formula, written out), with an
    upstream gradient that is not 1."""
    d = _data(2)
    x = d["x"].clone().requires_grad_(True)
    got = flashcl.contrastive_loss(x, d["y"], neg_margin=0.8, reduction="none", backend=backend, block_size=block)
    xw = d["x"].clone().requires_grad_(True)
    z = torch.nn.functional.normalize(xw, dim=-1)
    dist = torch.cdist(z, z)
    same = d["y"][:, None] == d["y"][None, :]
    eye = torch.eye(len(d["y"]), dtype=torch.bool)
    want = (torch.where(same & ~eye, dist, 0.0) + torch.where(~same, (0.8 - dist).relu(), 0.0)).sum(1)
    up = torch.linspace(0.5, 1.5, len(d["y"]), dtype=F64)
    assert_close(got, want, f"{backend}: rows", *TOL)
    assert_close(
        torch.autograd.grad((got * up).sum(), x)[0], torch.autograd.grad((want * up).sum(), xw)[0], "grad", *TOL
    )


@pytest.mark.parametrize("towers", [False, True])
@pytest.mark.parametrize("distance", ["euclidean", "squared"])
@pytest.mark.parametrize("backend,block", BACKENDS)
def test_pair_sum_on_unnormalised_distances(backend: str, block: Any, distance: str, towers: bool) -> None:
    """A flex pair sum on distances of the rows as given (``normalize=False``): Hadsell's
    squared form with a per-pair weight and an exclusion, against torch.cdist written out,
    value and the gradients of both sides (self-contrast: the self pair out)."""
    d = _data(4)
    b = len(d["y"])
    x, k = d["x"].clone().requires_grad_(True), d["x"].flip(0).clone().requires_grad_(True)
    xw, kw = d["x"].clone().requires_grad_(True), d["x"].flip(0).clone().requires_grad_(True)
    ky = d["y"].flip(0)
    kwargs: Dict[str, Any] = dict(
        rows={"y": d["y"]},
        positive=lambda a, b: a.y == b.y,
        exclude=lambda a, b: (a.index + b.index) % 7 == 0,
        weight=lambda a, b: 1.0 + (a.index % 3 == b.index % 2).to(F64),
        kind=flashcl.FlexPairSum(distance=distance),
        pos_mod=lambda dd, a, b: 0.5 * dd.pow(2),
        neg_mod=lambda dd, a, b: 0.5 * (4.0 - dd).relu().pow(2),
        temperature=1.0,
        normalize=False,
        reduction="none",
        backend=backend,
        block_size=block,
    )
    if towers:
        got = flashcl.flex_loss(x, k, cols={"y": ky}, **kwargs)
    else:
        got = flashcl.flex_loss(x, **kwargs)
    other, other_y = (kw, ky) if towers else (xw, d["y"])
    dist = torch.cdist(xw, other)
    dist = dist.pow(2) if distance == "squared" else dist
    i, j = torch.arange(b)[:, None], torch.arange(b)[None, :]
    out = ((i + j) % 7 == 0) | (torch.zeros(b, b, dtype=torch.bool) if towers else (i == j))
    w = 1.0 + (i % 3 == j % 2).to(F64)
    same = d["y"][:, None] == other_y[None, :]
    terms = torch.where(same, 0.5 * dist.pow(2), 0.5 * (4.0 - dist).relu().pow(2)) * w
    want = torch.where(out, 0.0, terms).sum(1)
    up = torch.linspace(0.5, 1.5, b, dtype=F64)
    assert_close(got, want, f"{backend}: rows", *TOL)
    wrt, wrt_want = ([x, k], [xw, kw]) if towers else ([x], [xw])
    for a, e in zip(torch.autograd.grad((got * up).sum(), wrt), torch.autograd.grad((want * up).sum(), wrt_want)):
        assert_close(a, e, f"{backend}: gradient", *TOL)


def test_unnormalised_distances_refuse_what_they_cannot_form() -> None:
    """The scores are not formed on unnormalised distances: an exclusion reading them and
    the row statistics are refused by name; temperature must be 1."""
    d = _data(5)
    base: Dict[str, Any] = dict(
        rows={"y": d["y"]},
        positive=lambda a, b: a.y == b.y,
        kind=flashcl.FlexPairSum(distance="euclidean"),
        pos_mod=lambda dd, a, b: dd,
        neg_mod=lambda dd, a, b: (1.0 - dd).relu(),
        temperature=1.0,
        normalize=False,
    )
    with pytest.raises(ValueError, match="exclude of \\(a, b, s\\) reads the scores"):
        flashcl.flex_loss(d["x"], **dict(base, exclude=lambda a, b, s: s > 0.5))
    with pytest.raises(ValueError, match="row statistics"):
        flashcl.flex_loss(d["x"], **dict(base, weight=lambda a, b: (a.hardest_negative > 0).to(F64) + 1.0))
    with pytest.raises(ValueError, match="temperature=1.0"):
        flashcl.flex_loss(d["x"], **dict(base, temperature=0.5))
    with pytest.raises(ValueError, match="positive is required"):
        flashcl.flex_loss(d["x"], **dict(base, positive=None))
    x = d["x"].clone()
    x[3, 1] = float("nan")
    rows = flashcl.flex_loss(x, **dict(base, reduction="none"))
    assert torch.isnan(rows[3]) and torch.isnan(rows).sum() == len(rows)  # row 3 is every anchor's key


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_corners_as_pytorch_metric_learning(backend: str, block: Any) -> None:
    """One sample (no pair: 0), a pair of one label (one positive pair each way), one label
    for all (no negative), duplicate rows (distance 0: the gradient finite and PML's, whose
    cdist takes the slope at 0 as 0), every sample its own label (no positive)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 4, generator=g, dtype=F64)
    x[5] = x[2]  # duplicates, the same label
    x[7] = x[1]  # duplicates, other labels
    cases = {
        "one sample": (x[:1], torch.tensor([0])),
        "two of one label": (x[:2], torch.tensor([1, 1])),
        "one label": (x, torch.zeros(9, dtype=torch.long)),
        "duplicates": (x, torch.tensor([0, 1, 2, 0, 1, 2, 0, 2, 1])),
        "no positive": (x, torch.arange(9)),
    }
    for name, (e, y) in cases.items():
        want, want_grads = _pml(e, y, None, None)
        got, grads = _ours(e, y, None, None, backend=backend, block_size=block)
        assert_close(got, want, f"{name}/{backend}: value", *TOL)
        g_pml = torch.zeros_like(e) if not want_grads or want_grads[0] is None else want_grads[0]
        assert bool(torch.isfinite(grads[0]).all()), name
        assert_close(grads[0], g_pml, f"{name}/{backend}: gradient", *TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_no_worse_than_dense(dtype: torch.dtype) -> None:
    d = _data(4, b=40, d=16)
    x = d["x"].to(dtype)
    want, want_grads = _ours(x.double(), d["y"], None, None, backend="reference")
    errs = {}
    for backend in ("dense", "tiled"):
        got, grads = _ours(x, d["y"], None, None, backend=backend, block_size=7)
        assert got.dtype == dtype or got.dtype == torch.float32
        errs[backend] = (float((got.double() - want).abs()), float((grads[0].double() - want_grads[0]).abs().max()))
    margin = 1e-3 if dtype == torch.float16 else 1e-2
    for e, ed in zip(errs["tiled"], errs["dense"]):
        assert e <= 1.5 * ed + margin, (dtype, errs)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(distance="manhattan"), ValueError, "distance"),
        (dict(pos_margin=float("nan")), ValueError, "pos_margin"),
        (dict(neg_margin="1"), (TypeError, ValueError), "neg_margin"),
        (dict(reduction="max"), ValueError, "reduction"),
        (dict(ref=torch.randn(4, 3, dtype=F64)), ValueError, "ref_labels"),
        (dict(ref=torch.randn(4, 2, dtype=F64), ref_labels=torch.arange(4)), ValueError, "ref"),
    ],
)
def test_bad_arguments_are_named(kwargs: Dict[str, Any], error: Any, match: str) -> None:
    with pytest.raises(error, match=match):
        flashcl.contrastive_loss(torch.randn(6, 3, dtype=F64), torch.arange(6) % 2, **kwargs)


def test_inputs_untouched_and_module_twin() -> None:
    d = _data(5)
    x, y = d["x"].clone().requires_grad_(True), d["y"].clone()
    before = (x.detach().clone(), y.clone())
    loss_fn = flashcl.ContrastiveLoss(pos_margin=0.05, neg_margin=0.9, reduction="mean", backend="tiled")
    value = loss_fn(x, y)
    value.backward()
    assert torch.equal(x.detach(), before[0]) and torch.equal(y, before[1])
    assert_close(
        value,
        flashcl.contrastive_loss(d["x"], d["y"], pos_margin=0.05, neg_margin=0.9, reduction="mean"),
        "module",
        *TOL,
    )


# ----------------------------------------------------------------------------- across processes

SIZES = {2: [5, 8], 3: [4, 0, 7]}
RUNS = [
    ("all_gather", "reference", "sum"),
    ("all_gather", "dense", "ddp"),
    ("all_gather", "tiled", "sum"),
    ("all_gather", "tiled", "ddp"),
    ("ring", "tiled", "sum"),
    ("ring", "tiled", "ddp"),
]
REDUCTIONS = ("mean_nonzero", "mean", "sum")


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    import torch.distributed as dist

    sizes = SIZES[world]
    d = _data(world, b=sum(sizes))
    sl = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out: Dict[Any, Any] = {}
    for strategy, backend, grad_scale in RUNS:
        for reduction in REDUCTIONS:
            for normalize in (True, False):
                x = d["x"][sl].clone().requires_grad_(True)
                loss = flashcl.contrastive_loss(
                    x, d["y"][sl], neg_margin=0.9 if normalize else 3.0, normalize=normalize, reduction=reduction,
                    backend=backend, block_size=3, process_group=dist.group.WORLD, strategy=strategy,
                    grad_scale=grad_scale,
                )  # fmt: skip
                out[(strategy, backend, grad_scale, reduction, normalize)] = (
                    loss.detach(),
                    torch.autograd.grad(loss, x)[0],
                )
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path: Any) -> None:
    """Each set's mean counts its terms over every rank: the sum of the ranks' values (over
    the world size with "ddp") and each rank's gradient equal one process's."""
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    d = _data(world, b=sum(sizes))
    for reduction, normalize in [(r, n) for r in REDUCTIONS for n in (True, False)]:
        x = d["x"].clone().requires_grad_(True)
        want = flashcl.contrastive_loss(
            x, d["y"], neg_margin=0.9 if normalize else 3.0, normalize=normalize, reduction=reduction,
            backend="reference",
        )  # fmt: skip
        want_grad = torch.autograd.grad(want, x)[0]
        for strategy, backend, grad_scale in RUNS:
            key = (strategy, backend, grad_scale, reduction, normalize)
            scale = world if grad_scale == "ddp" else 1
            what = "/".join(map(str, key))
            assert_close(sum(r[key][0] for r in ranks) / scale, want, f"{what}: value", *TOL)
            for r in range(world):
                sl = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
                assert_close(ranks[r][key][1] / scale, want_grad[sl], f"{what}: rank {r} gradient", *TOL)


# ----------------------------------------------------------------------------- the drop-in


def _drop_in_cases() -> Dict[str, Tuple[Dict[str, Any], Any]]:
    from pytorch_metric_learning import miners, regularizers

    return {
        "defaults": ({}, lambda loss, x, y, r, ry: loss(x, y)),
        "ref_emb": ({}, lambda loss, x, y, r, ry: loss(x, y, ref_emb=r, ref_labels=ry)),
        "cosine": (
            dict(distance=distances.CosineSimilarity(), pos_margin=1.0, neg_margin=0.3),
            lambda loss, x, y, r, ry: loss(x, y),
        ),
        "squared, MeanReducer": (
            dict(distance=distances.LpDistance(power=2), reducer=reducers.MeanReducer()),
            lambda loss, x, y, r, ry: loss(x, y),
        ),
        "a pair miner": ({}, lambda loss, x, y, r, ry: loss(x, y, miners.PairMarginMiner(0.2, 0.8)(x, y))),
        "a triplet miner (its pairs repeated)": (
            {},
            lambda loss, x, y, r, ry: loss(x, y, miners.TripletMarginMiner(margin=0.3)(x, y)),
        ),
        "batch-hard triplets": ({}, lambda loss, x, y, r, ry: loss(x, y, miners.BatchHardMiner()(x, y))),
        "unnormalised, a pair miner": (
            dict(distance=distances.LpDistance(normalize_embeddings=False), neg_margin=3.0),
            lambda loss, x, y, r, ry: loss(x, y, miners.PairMarginMiner(1.0, 2.5)(x, y)),
        ),
        "unnormalised squared, ref_emb": (
            dict(distance=distances.LpDistance(normalize_embeddings=False, power=2), neg_margin=6.0),
            lambda loss, x, y, r, ry: loss(x, y, ref_emb=r, ref_labels=ry),
        ),
        "an embedding regularizer": (
            dict(embedding_regularizer=regularizers.LpRegularizer()),
            lambda loss, x, y, r, ry: loss(x, y),
        ),
    }


@pytest.mark.parametrize("case", sorted(_drop_in_cases()))
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_drop_in_equals_pytorch_metric_learning(case: str, backend: str) -> None:
    """The drop-in takes PML's arguments (miners' pairs and triplets, each pair counted as
    often as the miner lists it; ref_emb; distances; reducers; regularizers) and equals
    PML's own class in float64, value and every gradient, computed by flashcl (no warning)."""
    import warnings

    from flashcl.integrations.pytorch_metric_learning import ContrastiveLoss

    kwargs, call = _drop_in_cases()[case]
    d = _data(6, b=20, n=9)
    results = []
    for cls in (losses.ContrastiveLoss, ContrastiveLoss):
        x, r = d["x"].clone().requires_grad_(True), d["r"].clone().requires_grad_(True)
        extra = {"backend": backend, "block_size": 4} if cls is ContrastiveLoss else {}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            value = call(cls(**kwargs, **extra), x, d["y"], r, d["ry"])
        grads = torch.autograd.grad(value, [x, r], allow_unused=True)
        results.append((value, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (x, r))]))
    (want, want_grads), (got, grads) = results
    assert_close(got, want, f"{case}/{backend}: value", *TOL)
    for i, (a, e) in enumerate(zip(grads, want_grads)):
        assert_close(a, e, f"{case}/{backend}: gradient {i}", *TOL)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(distance=distances.LpDistance(p=1)), "distance=LpDistance"),
        (dict(reducer=reducers.ThresholdReducer(high=0.5)), "reducer=ThresholdReducer"),
    ],
)
def test_drop_in_says_where_pml_computes(kwargs: Dict[str, Any], match: str) -> None:
    """A distance or a reducer flashcl does not compute: PML's own code, with a warning that
    names it, and PML's value."""
    from flashcl.integrations.pytorch_metric_learning import ContrastiveLoss

    d = _data(7)
    with pytest.warns(UserWarning, match=match):
        got = ContrastiveLoss(**kwargs)(d["x"], d["y"])
    assert_close(got, losses.ContrastiveLoss(**kwargs)(d["x"], d["y"]), "value", *TOL)


@pytest.mark.parametrize("towers", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero", "sum", "none"])
@pytest.mark.parametrize("backend,block", BACKENDS)
def test_pair_sum_with_a_learnable_margin(backend: str, block: Any, reduction: str, towers: bool) -> None:
    """A pair sum whose ``neg_mod`` captures a margin that learns, with denominator weights
    and an exclusion, equals the formula written out over the whole distance matrix: value
    and the gradients of the anchors, the keys and the margin."""
    d = _data(4)
    x, r = d["x"].clone().requires_grad_(True), d["r"].clone().requires_grad_(True)
    y, ry = d["y"], (d["ry"] if towers else d["y"])
    margin = torch.tensor(0.9, dtype=F64, requires_grad=True)
    pos_mod = lambda t, a, b: (t - 0.1).relu().pow(2)  # noqa: E731
    neg_mod = lambda t, a, b: 1.5 * (margin - t).relu().pow(2)  # noqa: E731
    got = flashcl.flex_loss(
        x, r if towers else None, rows={"y": y}, cols={"y": ry} if towers else None,
        positive=lambda a, b: a.y == b.y, exclude=lambda a, b: (a.y + b.y) == 5,
        weight=lambda a, b: torch.where(a.y == b.y, 0.5, 2.0), kind=flashcl.FlexPairSum(distance="euclidean"),
        pos_mod=pos_mod, neg_mod=neg_mod, temperature=1.0, reduction=reduction, backend=backend, block_size=block,
    )  # fmt: skip
    xw, rw, mw = x.detach().clone().requires_grad_(True), r.detach().clone().requires_grad_(True), margin
    z = torch.nn.functional.normalize(xw, dim=-1)
    k = torch.nn.functional.normalize(rw, dim=-1) if towers else z
    dist = torch.cdist(z, k)
    play = (y[:, None] + ry[None, :]) != 5
    if not towers:
        play &= ~torch.eye(len(y), dtype=torch.bool)
    same = y[:, None] == ry[None, :]
    w = torch.where(same, 0.5, 2.0).to(F64)
    tp, tn = w * pos_mod(dist, None, None), w * neg_mod(dist, None, None)
    pos, neg = play & same, play & ~same
    if reduction == "mean_nonzero":
        pos, neg = pos & (tp > 0), neg & (tn > 0)
    rows_p, rows_n = torch.where(pos, tp, 0.0).sum(1), torch.where(neg, tn, 0.0).sum(1)
    if reduction in ("sum", "none"):
        want = rows_p + rows_n if reduction == "none" else (rows_p + rows_n).sum()
    else:
        want = rows_p.sum() / torch.where(pos, w, 0.0).sum() + rows_n.sum() / torch.where(neg, w, 0.0).sum()
    leaves, want_leaves = [x, margin] + ([r] if towers else []), [xw, mw] + ([rw] if towers else [])
    grads = torch.autograd.grad(got.sum(), leaves)
    want_grads = torch.autograd.grad(want.sum(), want_leaves)
    assert_close(got, want, f"{backend}: value", *TOL)
    for i, (a, e) in enumerate(zip(grads, want_grads)):
        assert_close(a, e, f"{backend}: gradient {i}", *TOL)
    assert float(grads[1].abs()) > 0  # the margin learns


@pytest.mark.parametrize("backend,block", BACKENDS[1:])
def test_a_nan_positive_weight_is_a_positive(backend: str, block: Any) -> None:
    """The pair sum takes ``positive`` as membership (``m != 0``): a pair whose weight is NaN
    enters its anchor's positives with its ``pos_mod`` term, on every backend as the
    per-anchor oracle."""
    d = _data(6)
    v = torch.ones(len(d["y"]), dtype=F64)
    v[2] = float("nan")
    opts: Dict[str, Any] = dict(
        rows={"y": d["y"], "v": v}, positive=lambda a, b: (a.y == b.y) * a.v * b.v,
        kind=flashcl.FlexPairSum("euclidean"), pos_mod=lambda t, a, b: t, neg_mod=lambda t, a, b: (0.8 - t).relu(),
        temperature=1.0, reduction="none",
    )  # fmt: skip
    want = flashcl.flex_loss(d["x"], backend="reference", **opts)
    assert bool(torch.isfinite(want).all())
    assert_close(flashcl.flex_loss(d["x"], backend=backend, block_size=block, **opts), want, backend, *TOL)


@pytest.mark.parametrize("backend,block", BACKENDS[2:])
def test_functions_that_ignore_the_scores(backend: str, block: Any) -> None:
    """A pair sum whose functions ignore the scores: the reference's value (each set's pairs
    counted), and a gradient of 0."""
    d = _data(7)
    opts: Dict[str, Any] = dict(
        rows={"y": d["y"]}, positive=lambda a, b: a.y == b.y, kind="pair_sum",
        pos_mod=lambda t, a, b: torch.ones_like(t), neg_mod=lambda t, a, b: 2.0 * torch.ones_like(t), reduction="sum",
    )  # fmt: skip
    x = d["x"].clone().requires_grad_(True)
    got = flashcl.flex_loss(x, backend=backend, block_size=block, **opts)
    assert_close(got.detach(), flashcl.flex_loss(d["x"], backend="reference", **opts), backend, *TOL)
    (grad,) = torch.autograd.grad(got, x)
    assert_close(grad, torch.zeros_like(grad), f"{backend}: gradient", *TOL)


# ----------------------------------------------------------------------------- the compiled tiles


def test_a_compile_that_fails_falls_back_to_the_eager_tiles(monkeypatch: Any) -> None:
    """A tile function that does not compile is computed eagerly, with one warning: the
    eager tiles' value and gradient."""
    from flashcl.losses import flex_head

    def fails(name: str) -> Any:
        raise RuntimeError(f"no compiler for {name}")

    d = _data(5)
    x, y = d["x"], d["y"]
    results = []
    for compiled in (False, True):
        xx = x.clone().requires_grad_(True)
        with monkeypatch.context() as m:
            m.setattr(flex_head, "_compiled", fails)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = flashcl.flex_loss(
                    xx, rows={"y": y}, positive=lambda a, b: a.y == b.y, kind=flashcl.FlexPairSum("euclidean"),
                    pos_mod=lambda t, a, b: t, neg_mod=lambda t, a, b: (0.8 - t).relu(), temperature=1.0,
                    reduction="mean_nonzero", backend="tiled", block_size=5, compiled=compiled,
                )  # fmt: skip
                grad = torch.autograd.grad(loss, xx)[0]
        said = [w for w in caught if "did not compile" in str(w.message)]
        assert len(said) == (1 if compiled else 0), [str(w.message) for w in caught]
        results.append((loss.detach(), grad))
    assert_close(results[1][0], results[0][0], "value", *TOL)
    assert_close(results[1][1], results[0][1], "gradient", *TOL)


@pytest.mark.slow  # three compiles of the tile functions: about 30 s on 2 cores
def test_compiled_tiles_equal_the_eager_ones() -> None:
    """The pair sum's tile functions compiled by torch.compile (the default from 2^24 pairs)
    give the eager tiles' value and gradient, every reduction, with weights, an exclusion
    and a NaN on an excluded pair; options they cannot take are refused by name."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(29, 6, generator=g, dtype=F64)
    y = torch.randint(0, 4, (29,), generator=g)
    v = torch.ones(29, dtype=F64)
    v[3] = float("nan")
    opts: Dict[str, Any] = dict(
        rows={"y": y, "v": v},
        positive=lambda a, b: a.y == b.y,
        exclude=lambda a, b: (a.index == 3) | (b.index == 3),
        weight=lambda a, b: 1.0 + (a.y - b.y).abs() * b.v,
        kind=flashcl.FlexPairSum(distance="euclidean"),
        pos_mod=lambda d, a, b: (d - 0.1).relu(),
        neg_mod=lambda d, a, b: (0.9 - d).relu().pow(2),
        temperature=1.0,
        backend="tiled",
        block_size=8,
    )
    for reduction in ("mean_nonzero", "sum", "none"):
        results = []
        for compiled in (False, True):
            xx = x.clone().requires_grad_(True)
            loss = flashcl.flex_loss(xx, reduction=reduction, compiled=compiled, **opts)
            up = torch.linspace(0.5, 1.5, loss.numel(), dtype=F64).reshape(loss.shape)
            results.append((loss.detach(), torch.autograd.grad((loss * up).sum(), xx)[0]))
        (want, want_grad), (got, grad) = results
        assert bool(torch.isfinite(want).all()), reduction
        assert_close(got, want, f"{reduction}: value", *TOL)
        assert_close(grad, want_grad, f"{reduction}: gradient", *TOL)
    margin = torch.tensor(0.5, dtype=F64, requires_grad=True)
    with pytest.raises(ValueError, match="compiled=True"):
        flashcl.flex_loss(x, rows={"y": y}, positive=lambda a, b: a.y == b.y, compiled=True)
    with pytest.raises(ValueError, match="captures a tensor"):
        flashcl.flex_loss(
            x, rows={"y": y}, positive=lambda a, b: a.y == b.y, kind="pair_sum", pos_mod=lambda s, a, b: s,
            neg_mod=lambda s, a, b: (s - margin).relu(), compiled=True, backend="tiled",
        )  # fmt: skip
