"""flashcl.flex_loss against the formulas written out densely (tests/flex_oracle.py), in
float64: every kind and positives mode, each function (positive, exclude with and without
the scores, score_mod with a captured learnable tensor, weight), self-contrast and two
towers, both directions, every reduction, the reference, dense and tiled backends (odd
blocks); values and every gradient (the embeddings, a learnable temperature and bias, the
captured tensor). The built-ins written as flex calls equal the built-ins."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import flex_oracle
import pytest
import torch
from flex_oracle import BACKENDS, TOL, reduce, rows_of
from flex_oracle import grads as _grads
from flex_oracle import sample_data as _data

import flashcl
from helpers import assert_close


@pytest.fixture(autouse=True, params=["as_needed", "sparse"])
def _positives_form(request: Any, monkeypatch: Any) -> None:
    """Every test with the binary positives in their default form and always sparse."""
    flex_oracle.positives_forms(request, monkeypatch)


F64 = torch.float64


# the self-contrast cases: (name, flex options, the oracle's options)
SELF_CASES = {
    "labels": dict(positive=lambda a, b: a.y == b.y),
    "time window": dict(positive=lambda a, b: (a.t - b.t).abs() <= 1.5),
    "soft weights": dict(positive=lambda a, b: (a.soft * b.soft).sum(-1) * (a.y == b.y), positives="weighted_mean"),
    "pairs": dict(positive=lambda a, b: (a.y == b.y).double() * 2.0, positives="pairs"),
    "sum, self in": dict(positive=lambda a, b: a.y == b.y, positives="sum", include_self=True),
    "exclude": dict(positive=lambda a, b: a.y == b.y, exclude=lambda a, b: (a.doc == b.doc) & (a.y != b.y)),
    "exclude by score": dict(positive=lambda a, b: a.y == b.y, exclude=lambda a, b, s: (s > 5.0) & (a.y != b.y)),
    "weight": dict(positive=lambda a, b: a.y == b.y, weight=lambda a, b: torch.where(a.doc == b.doc, 0.5, 1.5)),
    "sigmoid": dict(positive=lambda a, b: a.y == b.y, kind="sigmoid", bias=-1.0),
    "sigmoid weighted": dict(
        positive=lambda a, b: a.y == b.y, kind="sigmoid", bias=-0.5, weight=lambda a, b: 1.0 + (a.doc == b.doc)
    ),
}


def _rows(d: Dict[str, Any]) -> Dict[str, Any]:
    return {"y": d["y"], "t": d["t"], "soft": d["soft"], "doc": d["doc"]}


@pytest.mark.parametrize("case", sorted(SELF_CASES))
@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("variant", ["plain", "symmetric", "cold"])
def test_self_contrast_equals_the_formula(case: str, backend: str, block: Any, reduction: str, variant: str) -> None:
    """Every case (its functions symmetric) as given, with ``symmetric=True`` (the tiled
    backend visits the panels on and above the diagonal) and at a temperature whose
    scores are too wide for one fixed shift of the exponentials."""
    d = _data(1)
    opts = dict(SELF_CASES[case])
    temp = torch.tensor(0.02 if variant == "cold" else 0.3, dtype=F64)
    symmetric = {"symmetric": True} if variant == "symmetric" else {}
    bias = opts.pop("bias", None)
    q1, t1 = d["q"].clone().requires_grad_(True), temp.clone().requires_grad_(True)
    b1 = None if bias is None else torch.tensor(bias, dtype=F64, requires_grad=True)
    loss_rows, valid = rows_of(q1, None, _rows(d), None, temperature=t1, bias=0.0 if b1 is None else b1, **opts)
    want = reduce(loss_rows, valid, reduction)
    up = torch.rand(want.shape, generator=torch.Generator().manual_seed(2), dtype=F64) + 0.5
    leaves1 = [q1, t1] + ([b1] if b1 is not None else [])
    want_grads = _grads(want, leaves1, up)
    q2, t2 = d["q"].clone().requires_grad_(True), temp.clone().requires_grad_(True)
    b2 = None if bias is None else torch.tensor(bias, dtype=F64, requires_grad=True)
    extra = {} if b2 is None else {"bias": b2}
    got = flashcl.flex_loss(
        q2,
        rows=_rows(d),
        temperature=t2,
        reduction=reduction,
        backend=backend,
        block_size=block,
        **extra,
        **symmetric,
        **opts,
    )
    assert_close(got, want, f"{case} {backend}: value", *TOL)
    leaves2 = [q2, t2] + ([b2] if b2 is not None else [])
    for a, e, name in zip(_grads(got, leaves2, up), want_grads, ("q", "temperature", "bias")):
        assert_close(a, e, f"{case} {backend} {reduction}: d/d{name}", *TOL)


TOWER_CASES = {
    "diagonal": dict(),
    "key labels": dict(positive=lambda a, b: a.y == b.ky),
    "false negatives out": dict(exclude=lambda a, b: (a.doc == b.kdoc) & (a.index != b.index)),
    "hard score out": dict(exclude=lambda a, b, s: (s > 2.0) & (a.index != b.index)),
    "soft targets": dict(positive=lambda a, b: (a.soft * b.ksoft).sum(-1), positives="weighted_mean"),
    "sigmoid": dict(kind="sigmoid", bias=-2.0),
}


@pytest.mark.parametrize("case", sorted(TOWER_CASES))
@pytest.mark.parametrize("backend,block", BACKENDS)
def test_two_towers_equal_the_formula(case: str, backend: str, block: Any) -> None:
    d = _data(3)
    opts = dict(TOWER_CASES[case])
    cols = {"ky": d["ky"], "ksoft": d["ksoft"], "kdoc": d["kdoc"]}
    rows = {"y": d["y"], "soft": d["soft"], "doc": d["doc"]}
    bias = opts.pop("bias", 0.0)
    q1, k1 = d["q"].clone().requires_grad_(True), d["k"].clone().requires_grad_(True)
    loss_rows, valid = rows_of(q1, k1, rows, cols, temperature=0.2, bias=bias, **opts)
    want = reduce(loss_rows, valid, "mean")
    q2, k2 = d["q"].clone().requires_grad_(True), d["k"].clone().requires_grad_(True)
    extra = {"bias": bias} if opts.get("kind") == "sigmoid" else {}
    got = flashcl.flex_loss(
        q2, k2, rows=rows, cols=cols, temperature=0.2, backend=backend, block_size=block, **extra, **opts
    )
    assert_close(got, want, f"{case} {backend}", *TOL)
    for a, e, name in zip(_grads(got, [q2, k2]), _grads(want, [q1, k1]), ("q", "k")):
        assert_close(a, e, f"{case} {backend}: d/d{name}", *TOL)


@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_a_captured_learnable_margin_gets_its_gradient(backend: str, block: Any, symmetric: bool) -> None:
    """score_mod capturing a learnable margin (and a non-leaf computed from a leaf): the
    margin's gradient is exact, as autograd gives it through the dense formula (also on
    the symmetric panels, where a diagonal block holds each pair twice)."""
    d = _data(4)

    def check(make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        raw1 = torch.tensor(0.3, dtype=F64, requires_grad=True)
        raw2 = torch.tensor(0.3, dtype=F64, requires_grad=True)
        q1, q2 = d["q"].clone().requires_grad_(True), d["q"].clone().requires_grad_(True)
        margin1 = make(raw1)
        want = reduce(
            *rows_of(
                q1,
                None,
                _rows(d),
                None,
                positive=lambda a, b: a.y == b.y,
                score_mod=lambda s, a, b: s - margin1 * (a.y == b.y),
            ),
            "mean",
        )
        margin2 = make(raw2)
        got = flashcl.flex_loss(
            q2,
            rows=_rows(d),
            positive=lambda a, b: a.y == b.y,
            score_mod=lambda s, a, b: s - margin2 * (a.y == b.y),
            symmetric=symmetric,
            backend=backend,
            block_size=block,
        )
        assert_close(got, want, f"{backend}: value", *TOL)
        for a, e, name in zip(_grads(got, [q2, raw2]), _grads(want, [q1, raw1]), ("q", "margin")):
            assert_close(a, e, f"{backend}: d/d{name}", *TOL)

    check(lambda p: p)
    check(lambda p: torch.nn.functional.softplus(p) * 2.0)


@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_both_directions_average_as_clip(backend: str, block: Any, reduction: str) -> None:
    d = _data(5, m=11, n=11)
    rows, cols = {"y": d["y"][:11]}, {"ky": d["ky"][:11]}
    q1, k1 = d["q"].clone().requires_grad_(True), d["k"][:11].clone().requires_grad_(True)
    r1, v1 = rows_of(q1, k1, rows, cols, positive=lambda a, b: a.y == b.ky, temperature=0.25)
    # the column direction: the keys as anchors, the same pairs
    r2, v2 = rows_of(k1, q1, {"ky": cols["ky"]}, {"y": rows["y"]}, positive=lambda a, b: b.y == a.ky, temperature=0.25)
    want = 0.5 * (r1 + r2) if reduction == "none" else 0.5 * (reduce(r1, v1, "mean") + reduce(r2, v2, "mean"))
    q2, k2 = d["q"].clone().requires_grad_(True), d["k"][:11].clone().requires_grad_(True)
    got = flashcl.flex_loss(
        q2,
        k2,
        rows=rows,
        cols=cols,
        positive=lambda a, b: a.y == b.ky,
        both_directions=True,
        temperature=0.25,
        reduction=reduction,
        backend=backend,
        block_size=block,
    )
    assert_close(got, want, f"{backend}", *TOL)
    up = torch.ones_like(want) if reduction == "mean" else torch.rand(want.shape, dtype=F64) + 0.5
    for a, e in zip(_grads(got, [q2, k2], up), _grads(want, [q1, k1], up)):
        assert_close(a, e, f"{backend}: gradient", *TOL)


# ----------------------------------------------------------------------------- the built-ins as flex calls


def _both(fn_a: Any, fn_b: Any, inputs: List[torch.Tensor], what: str) -> None:
    a_in = [x.clone().requires_grad_(True) for x in inputs]
    b_in = [x.clone().requires_grad_(True) for x in inputs]
    va, vb = fn_a(*a_in), fn_b(*b_in)
    assert_close(va, vb, f"{what}: value", *TOL)
    for x, y in zip(_grads(va, a_in), _grads(vb, b_in)):
        assert_close(x, y, f"{what}: gradient", *TOL)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_the_built_ins_are_flex_calls(backend: str) -> None:
    d = _data(6, m=16, n=24)
    y = d["y"][:16] % 3
    kw = dict(backend=backend)
    _both(
        lambda e: flashcl.flex_loss(e, rows={"y": y}, positive=lambda a, b: a.y == b.y, temperature=0.2, **kw),
        lambda e: flashcl.supcon_loss(e, y, temperature=0.2, **kw),
        [d["q"][:16]],
        "SupCon",
    )
    _both(
        lambda e: flashcl.flex_loss(
            e,
            rows={"y": y},
            positive=lambda a, b: a.y == b.y,
            positives="sum",
            include_self=True,
            temperature=0.05,
            **kw,
        ),
        lambda e: flashcl.supcon_loss(e, y, positives="sum", include_self=True, temperature=0.05, **kw),
        [d["q"][:16]],
        "supervised SimCSE",
    )
    pair = torch.arange(32) % 16
    _both(
        lambda z1, z2: flashcl.flex_loss(
            torch.cat([z1, z2]),
            rows={"pair": pair},
            positive=lambda a, b: a.pair == b.pair,
            symmetric=True,
            temperature=0.3,
            **kw,
        ),
        lambda z1, z2: flashcl.nt_xent_loss(z1, z2, temperature=0.3, **kw),
        [d["q"][:16], d["k"][:16]],
        "NT-Xent",
    )
    ky = torch.cat([y, d["ky"][16:24] % 3])  # each query's own key shares its label
    _both(
        lambda q, k: flashcl.flex_loss(
            q,
            k,
            rows={"y": y},
            cols={"y": ky},
            positive=lambda a, b: a.index == b.index,
            exclude=lambda a, b: (a.y == b.y) & (a.index != b.index),
            temperature=0.1,
            **kw,
        ),
        lambda q, k: flashcl.info_nce_loss(
            q, k, temperature=0.1, query_labels=y, key_labels=ky, duplicates="mask", **kw
        ),
        [d["q"][:16], d["k"][:24]],
        "InfoNCE with hard negatives and false negatives left out",
    )
    _both(
        lambda i, t: flashcl.flex_loss(
            i,
            t,
            rows={"y": y},
            cols={"y": y},
            positive=lambda a, b: a.y == b.y,
            both_directions=True,
            temperature=1 / 14.0,
            **kw,
        ),
        lambda i, t: flashcl.clip_loss(i, t, 14.0, labels=y, **kw),
        [d["q"][:16], d["k"][:16]],
        "CLIP with labels",
    )
    _both(
        lambda i, t: flashcl.flex_loss(i, t, kind="sigmoid", temperature=0.1, bias=-3.0, **kw),
        lambda i, t: flashcl.siglip_loss(i, t, 10.0, -3.0, normalize=True, **kw),
        [d["q"][:16], d["k"][:16]],
        "SigLIP",
    )
    # multi-hot label sets: Jaccard-weighted positives above the overlap threshold
    hot = torch.nn.functional.one_hot(y, 4).bool() | torch.nn.functional.one_hot((y + 1) % 4, 4).bool()

    def jaccard(a: Any, b: Any) -> torch.Tensor:
        j = (a.hot & b.hot).sum(-1).double() / (a.hot | b.hot).sum(-1).double()
        return torch.where(j > 0.3, j, torch.zeros_like(j))

    _both(
        lambda e: flashcl.flex_loss(e, rows={"hot": hot}, positive=jaccard, temperature=0.2, **kw),
        lambda e: flashcl.supcon_loss(e, hot, temperature=0.2, **kw),
        [d["q"][:16]],
        "SupCon, multi-hot labels",
    )
    # InfoNCE with hard negatives (a queue: no gradient): more keys, the diagonal still the positive
    _both(
        lambda q, k, h: flashcl.flex_loss(q, torch.cat([k, h.detach()]), temperature=0.1, **kw),  # a queue
        lambda q, k, h: flashcl.info_nce_loss(q, k, temperature=0.1, negatives=h, **kw),
        [d["q"][:16], d["k"][:16], d["k"][16:24]],
        "InfoNCE with hard negatives",
    )
    # the sampled-neighbours loss on the scores of unnormalised embeddings, repeats counted
    g = torch.Generator().manual_seed(3)
    nbr = (torch.arange(16).unsqueeze(1) + torch.randint(1, 16, (16, 3), generator=g)) % 16  # never the row itself
    _both(
        lambda e: flashcl.flex_loss(
            e,
            rows={"nbr": nbr},
            positive=lambda a, b: (a.nbr == b.index.unsqueeze(-1)).sum(-1).double(),
            positives="pairs",
            temperature=1.0,
            normalize=False,
            reduction="sum",
            **kw,
        ),
        lambda e: flashcl.neighbor_loss(e @ e.T, nbr, reduction="sum", **kw),
        [d["q"][:16]],
        "the sampled-neighbours loss",
    )


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda q, y: flashcl.flex_loss(q), ValueError, "positive is required"),
        (lambda q, y: flashcl.flex_loss(q, rows={"y": y[:3]}, positive=lambda a, b: a.y == b.y), ValueError, "rows"),
        (lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=lambda a, b: a.z == b.z), AttributeError, "a.z"),
        (
            lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=lambda a, b: a.y),
            TypeError,
            "positive must return",
        ),
        (
            lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=lambda a, b: torch.ones(3, 3, dtype=torch.bool)),
            ValueError,
            "broadcasts to the tile.s pairs",
        ),
        (
            lambda q, y: flashcl.flex_loss(
                q, rows={"y": y}, positive=lambda a, b: a.y == b.y, exclude=lambda a, b: (a.y == b.y).int()
            ),
            TypeError,
            "exclude must return a bool",
        ),
        (
            lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=lambda a, b: -(a.y == b.y).double()),
            ValueError,
            "negative",
        ),
        (
            lambda q, y: flashcl.flex_loss(
                q,
                rows={"y": y},
                positive=lambda a, b: a.y == b.y,
                score_mod=lambda s, a, b: s.masked_fill(a.y == b.y, float("-inf")),
            ),
            ValueError,
            "-inf on a positive",
        ),
        (
            lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=lambda a, b: a.y == b.y, kind="max"),
            ValueError,
            "kind",
        ),
        (
            lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=lambda a, b: a.y == b.y, backend="triton"),
            ValueError,
            "Triton",
        ),
        (
            lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=lambda a, b: a.y == b.y, bias=1.0),
            ValueError,
            "bias",
        ),
        (lambda q, y: flashcl.flex_loss(q, rows={"index": y}, positive=lambda a, b: a.y == b.y), ValueError, "index"),
        (lambda q, y: flashcl.flex_loss(q, rows=[y], positive=lambda a, b: a.y == b.y), TypeError, "dict"),
        (lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=3), TypeError, "positive"),
        (
            lambda q, y: flashcl.flex_loss(q, rows={"y": y}, positive=lambda a, b: a.y == b.y, both_directions=True),
            ValueError,
            "two towers",
        ),
        (
            lambda q, y: flashcl.flex_loss(q, q[:5], both_directions=True, reduction="none"),
            ValueError,
            "M == N",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call: Any, error: type, match: str) -> None:
    q, y = torch.randn(9, 4), torch.randint(0, 3, (9,))
    with pytest.raises(error, match=match):
        call(q, y)


def test_inputs_and_data_are_not_modified() -> None:
    d = _data(7)
    saved = {k: v.clone() for k, v in d.items()}
    for backend in ("reference", "dense", "tiled"):
        flashcl.flex_loss(
            d["q"],
            rows=_rows(d),
            positive=lambda a, b: a.y == b.y,
            score_mod=lambda s, a, b: s - 0.1 * (a.y == b.y),
            exclude=lambda a, b, s: s > 4.0,
            backend=backend,
        )
    for k in d:
        assert torch.equal(d[k], saved[k]), k


def test_the_module_and_the_dense_mask() -> None:
    d = _data(8)
    fn = dict(positive=lambda a, b: a.y == b.y, exclude=lambda a, b: a.doc == b.doc)
    got = flashcl.FlexLoss(temperature=0.2, **fn)(d["q"], rows=_rows(d))
    assert_close(got, flashcl.flex_loss(d["q"], rows=_rows(d), temperature=0.2, **fn), "FlexLoss", 0, 0)
    masks = flashcl.flex_dense_mask(d["q"], rows=_rows(d), **fn)
    y, doc = d["y"], d["doc"]
    excluded = (doc[:, None] == doc[None, :]) | torch.eye(13, dtype=torch.bool)
    assert torch.equal(masks["excluded"], excluded)
    assert torch.equal(masks["positive"] > 0, (y[:, None] == y[None, :]) & ~excluded)


# ----------------------------------------------------------------------------- a given score matrix

SCORE_CASES = {
    "labels": dict(positive=lambda a, b: a.y == b.y),
    "sampled neighbours": dict(
        positive=lambda a, b: (a.nbr == b.index.unsqueeze(-1)).sum(-1).double(), positives="pairs"
    ),
    "exclude, weight": dict(
        positive=lambda a, b: a.y == b.y,
        exclude=lambda a, b, s: (s > 20.0) & (a.y != b.y),
        weight=lambda a, b: torch.where(a.doc == b.doc, 0.5, 1.0),
    ),
    "sigmoid": dict(positive=lambda a, b: a.y == b.y, kind="sigmoid", bias=-1.0),
}


@pytest.mark.parametrize("case", sorted(SCORE_CASES))
@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_given_score_matrix_equals_the_formula(case: str, backend: str, block: Any, reduction: str) -> None:
    """``scores=``: ``s = scores / temperature`` read a block of rows at a time; the
    gradient of the matrix, of a learnable temperature and bias, as the formula's."""
    d = _data(7)
    g = torch.Generator().manual_seed(8)
    sc = 3.0 * torch.randn(13, 13, generator=g, dtype=F64)
    nbr = (torch.arange(13).unsqueeze(1) + torch.randint(1, 13, (13, 2), generator=g)) % 13
    rows = {"y": d["y"], "doc": d["doc"], "nbr": nbr}
    opts = dict(SCORE_CASES[case])
    bias = opts.pop("bias", None)
    s1, t1 = sc.clone().requires_grad_(True), torch.tensor(0.7, dtype=F64, requires_grad=True)
    b1 = None if bias is None else torch.tensor(bias, dtype=F64, requires_grad=True)
    loss_rows, valid = rows_of(
        None,
        None,
        rows,
        None,
        scores=s1,
        temperature=t1,
        bias=0.0 if b1 is None else b1,
        **opts,  # type: ignore[arg-type]
    )
    want = reduce(loss_rows, valid, reduction)
    up = torch.linspace(0.5, 1.5, want.numel(), dtype=F64).reshape(want.shape)
    leaves1 = [s1, t1] + ([b1] if b1 is not None else [])
    want_grads = _grads(want, leaves1, up)
    s2, t2 = sc.clone().requires_grad_(True), torch.tensor(0.7, dtype=F64, requires_grad=True)
    b2 = None if bias is None else torch.tensor(bias, dtype=F64, requires_grad=True)
    extra = {} if b2 is None else {"bias": b2}
    got = flashcl.flex_loss(
        scores=s2, rows=rows, temperature=t2, reduction=reduction, backend=backend, block_size=block, **extra, **opts
    )
    assert_close(got, want, f"{case} {backend}: value", *TOL)
    for a, e, name in zip(_grads(got, [s2, t2] + ([b2] if b2 is not None else []), up), want_grads, "stb"):
        assert_close(a, e, f"{case} {backend} {reduction}: d/d{name}", *TOL)


def test_a_given_score_matrix_of_two_towers_and_the_neighbour_loss() -> None:
    g = torch.Generator().manual_seed(9)
    sc = torch.randn(7, 11, generator=g, dtype=F64)
    ky = torch.randint(0, 3, (11,), generator=g)
    y = torch.randint(0, 3, (7,), generator=g)
    for backend in ("reference", "dense", "tiled"):
        got = flashcl.flex_loss(
            scores=sc, rows={"y": y}, cols={"y": ky}, positive=lambda a, b: a.y == b.y, backend=backend
        )
        rows_, valid = rows_of(None, None, {"y": y}, {"y": ky}, positive=lambda a, b: a.y == b.y, scores=sc)  # type: ignore[arg-type]
        assert_close(got, reduce(rows_, valid, "mean"), f"two towers {backend}", *TOL)
    # the sampled-neighbours loss (its seed's form) on its own score matrix
    x = 4.0 * torch.randn(20, 20, generator=g, dtype=F64)
    nb = torch.randint(0, 20, (20, 2), generator=g)
    nb = torch.where(nb == torch.arange(20).unsqueeze(1), (nb + 1) % 20, nb)  # never the row itself
    for backend in ("reference", "dense", "tiled"):
        x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        got = flashcl.flex_loss(
            scores=x1,
            rows={"nb": nb},
            positive=lambda a, b: (a.nb == b.index.unsqueeze(-1)).sum(-1).double(),
            positives="pairs",
            temperature=1.0,
            reduction="sum",
            backend=backend,
            block_size=6,
        )
        want = flashcl.neighbor_loss(x2, nb)
        assert_close(got, want, f"neighbour loss {backend}", *TOL)
        assert_close(_grads(got, [x1])[0], _grads(want, [x2])[0], f"neighbour loss {backend}: gradient", *TOL)


@pytest.mark.parametrize(
    "kw,error,match",
    [
        (dict(), ValueError, "q \\(M, D\\), or a given score matrix"),
        (dict(scores=torch.randn(4, 5), positive=lambda a, b: a.index == b.index), ValueError, "square"),
        (dict(scores=torch.randn(4, 4), symmetric=True, positive=lambda a, b: a.index == b.index), ValueError, "score"),
        (
            dict(scores=torch.randn(4, 4), positive=lambda a, b: a.index == b.index, process_group=object()),
            ValueError,
            "one process",
        ),
        (
            dict(scores=torch.randn(4, 4), positive=lambda a, b: a.index == b.index, matryoshka_dims=[2]),
            ValueError,
            "matryoshka",
        ),
        (
            dict(scores=torch.randn(4, 4), positive=lambda a, b: a.index == b.index, backend="triton"),
            ValueError,
            "backend",
        ),
        (dict(scores=torch.randn(4), positive=lambda a, b: a.index == b.index), ValueError, "scores"),
    ],
)
def test_bad_score_matrices_are_clear_errors(kw: Dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        flashcl.flex_loss(**kw)


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_nan_from_a_function_stays_out_where_the_pair_is_excluded(backend: str) -> None:
    """A NaN a function gives on an excluded pair never reaches the loss or the
    gradient; on a pair the loss uses it propagates, as in torch."""
    d = _data(10)
    nan_on_doc = {"doc": d["doc"], "y": d["y"]}

    def score_mod(s: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
        return torch.where(a.doc == b.doc, torch.full_like(s, float("nan")), s)

    q = d["q"].clone().requires_grad_(True)
    out = flashcl.flex_loss(
        q,
        rows=nan_on_doc,
        positive=lambda a, b: (a.y == b.y) & (a.doc != b.doc),
        exclude=lambda a, b: a.doc == b.doc,
        score_mod=score_mod,
        backend=backend,
    )
    (grad,) = torch.autograd.grad(out, q)
    assert torch.isfinite(out) and bool(torch.isfinite(grad).all()), backend
    used = flashcl.flex_loss(
        d["q"], rows=nan_on_doc, positive=lambda a, b: a.y == b.y, score_mod=score_mod, backend=backend
    )
    assert torch.isnan(used), backend


# ----------------------------------------------------------------------------- corners


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_corners_one_sample_one_pair_width_one_and_strided_data(backend: str, block: Any) -> None:
    g = torch.Generator().manual_seed(11)
    # one sample: no positive, an empty denominator: 0, counted by no mean
    one = torch.randn(1, 4, dtype=F64, requires_grad=True)
    val = flashcl.flex_loss(one, rows={"y": torch.zeros(1)}, positive=lambda a, b: a.y == b.y, backend=backend)
    assert float(val) == 0.0 and float(torch.autograd.grad(val, one)[0].abs().sum()) == 0.0
    # one pair, width 1; data given as an expanded (stride 0) and a sliced tensor
    q = torch.randn(2, 1, dtype=F64)
    y = torch.zeros(1).expand(2)
    t = torch.arange(4.0, dtype=F64)[::2]
    got = flashcl.flex_loss(q, rows={"y": y, "t": t}, positive=lambda a, b: a.y == b.y, backend=backend)
    want = reduce(*rows_of(q, None, {"y": y, "t": t}, None, positive=lambda a, b: a.y == b.y), "mean")
    assert_close(got, want, f"{backend}: one pair", *TOL)
    # extreme temperatures: the fixed shift's range and beyond
    x = torch.randn(9, 5, generator=g, dtype=F64)
    lab = torch.randint(0, 2, (9,), generator=g)
    for temp in (1e-3, 1e3):
        got = flashcl.flex_loss(
            x, rows={"y": lab}, positive=lambda a, b: a.y == b.y, temperature=temp, backend=backend, block_size=block
        )
        want = reduce(*rows_of(x, None, {"y": lab}, None, positive=lambda a, b: a.y == b.y, temperature=temp), "mean")
        assert_close(got, want, f"{backend}: temperature {temp}", 1e-9, 1e-9)


def test_second_derivatives_retain_graph_and_accumulation() -> None:
    d = _data(12)
    opts = dict(rows=_rows(d), positive=lambda a, b: a.y == b.y, weight=lambda a, b: 1.0 + (a.doc == b.doc))
    grads = {}
    for backend in ("dense", "tiled"):
        q = d["q"].clone().requires_grad_(True)
        loss = flashcl.flex_loss(q, backend=backend, block_size=4, **opts)
        (g,) = torch.autograd.grad(loss, q, create_graph=True)
        (h,) = torch.autograd.grad((g * g).sum(), q)
        grads[backend] = (g.detach(), h)
        # retain_graph and a second backward accumulate into .grad
        again = flashcl.flex_loss(q, backend=backend, block_size=4, **opts)
        again.backward(retain_graph=True)
        first = q.grad.clone()  # type: ignore[union-attr]
        again.backward()
        assert_close(q.grad, 2 * first, f"{backend}: accumulated", *TOL)  # type: ignore[arg-type]
    assert_close(grads["tiled"][0], grads["dense"][0], "gradient", *TOL)
    assert_close(grads["tiled"][1], grads["dense"][1], "second derivative", *TOL)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=0.0), "temperature"),
        (dict(bias=float("inf"), kind="sigmoid"), "bias"),
        (dict(positives="max"), "positives"),
        (dict(reduction="avg"), "reduction"),
        (dict(symmetric=1), "symmetric"),
    ],
)
def test_bad_hyperparameters_are_named(kw: Dict[str, Any], match: str) -> None:
    d = _data(13)
    with pytest.raises((ValueError, TypeError), match=match):
        flashcl.flex_loss(d["q"], rows=_rows(d), positive=lambda a, b: a.y == b.y, **kw)


def test_mixed_dtypes_give_one_answer_or_one_error() -> None:
    d = _data(14)
    q32, k64 = d["q"].float(), d["k"]
    outcomes = set()
    for backend in ("reference", "dense", "tiled"):
        try:
            outcomes.add(round(float(flashcl.flex_loss(q32, k64[:13], backend=backend)), 5))
        except (ValueError, TypeError) as e:
            outcomes.add(type(e).__name__)
    assert len(outcomes) == 1, outcomes


def _wider(a: Any, b: Any) -> torch.Tensor:
    """One column too many for any tile."""
    return torch.ones(a.index.shape[0], b.index.shape[1] + 1, dtype=torch.bool)


BAD_RESULTS = {
    "positive of a wider shape": (dict(positive=_wider), ValueError, "positive must return"),
    "exclude as float 0/1": (
        dict(positive=lambda a, b: a.y == b.y, exclude=lambda a, b: (a.y == b.y).double()),
        TypeError,
        "exclude must return a bool tensor",
    ),
    "weight as int": (
        dict(positive=lambda a, b: a.y == b.y, weight=lambda a, b: (a.y == b.y).long()),
        TypeError,
        "weight must return a bool or floating tensor",
    ),
    "score_mod as bool": (
        dict(positive=lambda a, b: a.y == b.y, score_mod=lambda s, a, b: s > 0),
        TypeError,
        "score_mod must return a floating tensor",
    ),
    "score_mod of a wider shape": (
        dict(positive=lambda a, b: a.y == b.y, score_mod=lambda s, a, b: torch.cat([s, s[:, :1]], 1)),
        ValueError,
        "score_mod must return",
    ),
    "pos_mod of a wider shape": (
        dict(positive=lambda a, b: a.y == b.y, kind="circle", pos_mod=lambda s, a, b: torch.cat([s, s[:, :1]], 1)),
        ValueError,
        "pos_mod must return",
    ),
    "positive on another device": (
        dict(positive=lambda a, b: (a.y == b.y).to("meta")),
        ValueError,
        "positive must return .* on the scores' device",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RESULTS))
@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("given", ["embeddings", "scores"])
def test_a_bad_function_result_is_named_on_every_backend(case: str, backend: str, block: Any, given: str) -> None:
    """Each function's result checked before it is used, on every backend and on a given score
    matrix: the error names the function, what it must return and the tile's shape."""
    d = _data(0)
    opts, error, match = BAD_RESULTS[case]
    x = d["q"] if given == "embeddings" else d["q"] @ d["q"].T
    where = {"q": x} if given == "embeddings" else {"scores": x}
    with pytest.raises(error, match=match) as caught:
        flashcl.flex_loss(**where, rows={"y": d["y"]}, backend=backend, block_size=block, **opts)
    assert "the tile's pairs (" in str(caught.value)
