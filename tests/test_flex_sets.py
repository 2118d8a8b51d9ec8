"""flashcl.flex_loss's row statistics (``a.hardest_positive``, ``a.hardest_negative``,
``a.positive_score``) and its two-set kinds (``"multi_similarity"``, ``"circle"``) against
the formulas written out densely (tests/flex_oracle.py, from the definitions and
pytorch-metric-learning 2.9's), in float64 on the reference, dense and tiled backends;
the mined Multi-Similarity and the Circle loss written as flex calls against the
built-ins and pytorch-metric-learning itself; the embedders' false-negative margin
against its dense formula; the errors."""

from __future__ import annotations

from typing import Any

import flex_oracle
import pytest
import torch
import torch.nn.functional as F
from flex_oracle import BACKENDS, TOL, reduce, rows_of
from flex_oracle import grads as _grads
from flex_oracle import sample_data as _data

import flashcl
from helpers import assert_close

pytest.importorskip("pytorch_metric_learning")
from pytorch_metric_learning import losses, miners  # noqa: E402


@pytest.fixture(autouse=True, params=["as_needed", "sparse", "tile passes"])
def _positives_form(request: Any, monkeypatch: Any) -> None:
    """The binary positives in both forms; and the tiled driver's passes over single tiles
    (reduce, then the gradient) instead of complete row blocks, as the ring and a block
    mask visit them."""
    if request.param == "tile passes":
        monkeypatch.setattr(flashcl.losses.flex_head.FlexHead, "fuses_rows", False)
        return
    flex_oracle.positives_forms(request, monkeypatch)


F64 = torch.float64


def _labels(a: Any, b: Any) -> torch.Tensor:
    return a.y == b.y


def _mined(eps: float) -> Any:
    """pytorch-metric-learning's MultiSimilarityMiner as an exclusion (strict: a positive kept
    below the hardest negative + eps, a negative above the hardest positive - eps)."""
    return lambda a, b, s: torch.where(a.y == b.y, s >= a.hardest_negative + eps, s <= a.hardest_positive - eps)


# (flex options, the oracle's options)
SELF_CASES = {
    "statistics: false negatives over the positives' mean": (
        dict(positive=_labels, exclude=lambda a, b, s: (a.y != b.y) & (s > a.positive_score + 0.5)),
        {},
    ),
    "statistics: the keys' too, in exclude and weight": (
        dict(
            positive=_labels,
            exclude=lambda a, b, s: (a.y != b.y) & (s > torch.minimum(a.positive_score, b.positive_score)),
            weight=lambda a, b: torch.where(a.hardest_negative + b.hardest_negative > 2.0, 0.5, 1.5),
        ),
        {},
    ),
    "statistics: score_mod": (
        dict(
            positive=_labels, score_mod=lambda s, a, b: s - 0.1 * (a.hardest_positive + b.hardest_positive).clamp(-9, 9)
        ),
        {},
    ),
    "multi-similarity": (dict(positive=_labels, kind="multi_similarity"), dict(kind="multi_similarity")),
    "multi-similarity, constants, weights": (
        dict(
            positive=_labels,
            kind=flashcl.FlexMultiSimilarity(alpha=3.0, beta=20.0, base=0.2),
            weight=lambda a, b: torch.where(a.doc == b.doc, 0.5, 1.0),
        ),
        dict(kind="multi_similarity", constants=dict(alpha=3.0, beta=20.0, base=0.2)),
    ),
    "multi-similarity, mined": (
        dict(positive=_labels, kind="multi_similarity", exclude=_mined(0.1)),
        dict(kind="multi_similarity"),
    ),
    "circle": (dict(positive=_labels, kind="circle"), dict(kind="circle")),
    "circle, constants, duplicates out": (
        dict(positive=_labels, kind=flashcl.FlexCircle(m=0.25, gamma=32.0), exclude=lambda a, b: a.doc == b.doc),
        dict(kind="circle", constants=dict(m=0.25, gamma=32.0)),
    ),
    "circle, own pos_mod and neg_mod": (
        dict(
            positive=_labels,
            kind="circle",
            pos_mod=lambda s, a, b: -8.0 * (s - a.hardest_negative),
            neg_mod=lambda s, a, b: 8.0 * (s - 0.3),
        ),
        dict(kind="circle"),
    ),
}


ASYMMETRIC = {"statistics: false negatives over the positives' mean", "circle, own pos_mod and neg_mod"}


@pytest.mark.parametrize("case", sorted(SELF_CASES))
@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_self_contrast_equals_the_formula(case: str, backend: str, block: Any, reduction: str, temperature: float):
    d = _data(1)
    opts, oracle = SELF_CASES[case]
    rows = {"y": d["y"], "doc": d["doc"]}
    same = {k: v for k, v in opts.items() if k != "kind"}
    q1 = d["q"].clone().requires_grad_(True)
    loss_rows, valid = rows_of(q1, None, rows, None, temperature=temperature, **same, **oracle)
    want = reduce(loss_rows, valid, reduction)
    up = torch.rand(want.shape, generator=torch.Generator().manual_seed(2), dtype=F64) + 0.5
    q2 = d["q"].clone().requires_grad_(True)
    # the panels where the functions are symmetric in (a, b) (a two-set kind visits every tile)
    sym = {"symmetric": True} if block == 5 and case not in ASYMMETRIC else {}
    got = flashcl.flex_loss(
        q2, rows=rows, temperature=temperature, reduction=reduction, backend=backend, block_size=block, **sym, **opts
    )
    assert_close(got, want, f"{case} {backend}: value", *TOL)
    assert_close(_grads(got, [q2], up)[0], _grads(want, [q1], up)[0], f"{case} {backend}: gradient", *TOL)


TOWER_CASES = {
    "false-negative margin": (dict(exclude=lambda a, b, s: (a.index != b.index) & (s > a.positive_score + 0.5)), {}),
    "hardest negative as a shift": (dict(score_mod=lambda s, a, b: s - 0.2 * a.hardest_negative.clamp(-9, 9)), {}),
    "multi-similarity, key labels, mined": (
        dict(
            positive=lambda a, b: a.y == b.ky,
            kind="multi_similarity",
            exclude=lambda a, b, s: torch.where(
                a.y == b.ky, s >= a.hardest_negative + 0.2, s <= a.hardest_positive - 0.2
            ),
        ),
        dict(kind="multi_similarity"),
    ),
    "circle, key labels": (dict(positive=lambda a, b: a.y == b.ky, kind="circle"), dict(kind="circle")),
}


@pytest.mark.parametrize("case", sorted(TOWER_CASES))
@pytest.mark.parametrize("backend,block", BACKENDS)
def test_two_towers_equal_the_formula(case: str, backend: str, block: Any) -> None:
    d = _data(3)
    opts, oracle = TOWER_CASES[case]
    rows, cols = {"y": d["y"]}, {"ky": d["ky"]}
    same = {k: v for k, v in opts.items() if k != "kind"}
    q1, k1 = d["q"].clone().requires_grad_(True), d["k"].clone().requires_grad_(True)
    want = reduce(*rows_of(q1, k1, rows, cols, temperature=0.5, **same, **oracle), "mean")
    q2, k2 = d["q"].clone().requires_grad_(True), d["k"].clone().requires_grad_(True)
    got = flashcl.flex_loss(q2, k2, rows=rows, cols=cols, temperature=0.5, backend=backend, block_size=block, **opts)
    assert_close(got, want, f"{case} {backend}", *TOL)
    for a, e in zip(_grads(got, [q2, k2]), _grads(want, [q1, k1])):
        assert_close(a, e, f"{case} {backend}: gradient", *TOL)


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_the_embedders_false_negative_margin_both_directions(backend: str, block: Any) -> None:
    """Qwen3-Embedding / NV-Retriever's InfoNCE: a candidate scoring above the positive's
    cosine plus a margin is left out, in both directions (the functions see each pair as
    (query, document): the column direction reads the queries' statistics)."""
    d = _data(4, m=11, n=11)
    margin, temp = 0.1, 0.05
    q1, k1 = d["q"].clone().requires_grad_(True), d["k"][:11].clone().requires_grad_(True)
    c = F.normalize(q1, dim=-1) @ F.normalize(k1, dim=-1).T  # (queries, documents)
    own = torch.eye(11, dtype=torch.bool)
    out = ~own & (c > c.diagonal().detach().unsqueeze(1) + margin)  # pair (i, j) left out of both directions
    z = (c / temp).masked_fill(out, float("-inf"))
    want = 0.5 * ((torch.logsumexp(z, 1) - z.diagonal()).mean() + (torch.logsumexp(z, 0) - z.diagonal()).mean())
    q2, k2 = d["q"].clone().requires_grad_(True), d["k"][:11].clone().requires_grad_(True)
    got = flashcl.flex_loss(
        q2,
        k2,
        exclude=lambda a, b, s: s > a.positive_score + margin / temp,
        both_directions=True,
        temperature=temp,
        backend=backend,
        block_size=block,
    )
    assert bool(out.any()), "the margin leaves some pair out"
    assert_close(got, want, backend, *TOL)
    for a, e in zip(_grads(got, [q2, k2]), _grads(want, [q1, k1])):
        assert_close(a, e, f"{backend}: gradient", *TOL)


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_a_given_score_matrix_reads_statistics(backend: str, block: Any) -> None:
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(12, 12, generator=g, dtype=F64)
    rows = {"y": torch.randint(0, 3, (12,), generator=g)}
    opts = dict(positive=_labels, kind="multi_similarity", exclude=_mined(0.3))
    s1 = scores.clone().requires_grad_(True)
    same = {k: v for k, v in opts.items() if k != "kind"}
    want = reduce(*rows_of(None, None, rows, None, scores=s1, temperature=1.0, kind="multi_similarity", **same), "mean")
    s2 = scores.clone().requires_grad_(True)
    got = flashcl.flex_loss(scores=s2, rows=rows, temperature=1.0, backend=backend, block_size=block, **opts)
    assert_close(got, want, backend, *TOL)
    assert_close(_grads(got, [s2])[0], _grads(want, [s1])[0], f"{backend}: gradient", *TOL)


# ----------------------------------------------------------------------------- the peers


@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("epsilon", [None, 0.1])
def test_multi_similarity_as_flex_equals_pml_and_the_built_in(backend: str, block: Any, epsilon: Any) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 8, generator=g, dtype=F64)
    y = torch.randint(0, 5, (40,), generator=g)
    x1 = x.clone().requires_grad_(True)
    pairs = None if epsilon is None else miners.MultiSimilarityMiner(epsilon=epsilon)(x1, y)
    want = losses.MultiSimilarityLoss(alpha=2.0, beta=50.0, base=0.5)(x1, y, pairs)
    x2 = x.clone().requires_grad_(True)
    got = flashcl.flex_loss(
        x2,
        rows={"y": y},
        positive=_labels,
        exclude=None if epsilon is None else _mined(epsilon),
        kind="multi_similarity",
        temperature=1.0,
        backend=backend,
        block_size=block,
    )
    x3 = x.clone().requires_grad_(True)
    built_in = flashcl.multi_similarity_loss(x3, y, epsilon=epsilon)
    assert_close(got, want, f"{backend}: against pytorch-metric-learning", *TOL)
    assert_close(got, built_in, f"{backend}: against multi_similarity_loss", *TOL)
    assert_close(_grads(got, [x2])[0], _grads(want, [x1])[0], f"{backend}: gradient", *TOL)


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_circle_as_flex_equals_pml(backend: str, block: Any) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 8, generator=g, dtype=F64)
    y = torch.randint(0, 5, (40,), generator=g)
    x1 = x.clone().requires_grad_(True)
    want = losses.CircleLoss(m=0.25, gamma=64.0)(x1, y)
    x2 = x.clone().requires_grad_(True)
    kind = flashcl.FlexCircle(m=0.25, gamma=64.0)
    got = flashcl.flex_loss(
        x2, rows={"y": y}, positive=_labels, kind=kind, temperature=1.0, backend=backend, block_size=block
    )
    assert_close(got, want, backend, *TOL)
    assert_close(_grads(got, [x2])[0], _grads(want, [x1])[0], f"{backend}: gradient", *TOL)


def test_second_derivatives_of_a_two_set_kind() -> None:
    d = _data(8)
    opts = dict(rows={"y": d["y"]}, positive=_labels, kind="multi_similarity", exclude=_mined(0.2), temperature=1.0)
    got = {}
    for backend in ("dense", "tiled"):
        q = d["q"].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(flashcl.flex_loss(q, backend=backend, block_size=4, **opts), q, create_graph=True)
        (h,) = torch.autograd.grad((g * g).sum(), q)
        got[backend] = (g.detach(), h)
    assert_close(got["tiled"][0], got["dense"][0], "gradient", *TOL)
    assert_close(got["tiled"][1], got["dense"][1], "second derivative", *TOL)


def test_inputs_kept_and_the_module() -> None:
    d = _data(9)
    q, y = d["q"].clone(), d["y"].clone()
    rows = {"y": y}
    loss_fn = flashcl.FlexLoss(positive=_labels, kind="circle", exclude=_mined(0.1), temperature=1.0)
    got = loss_fn(q, rows=rows)
    want = flashcl.flex_loss(q, rows=rows, positive=_labels, kind="circle", exclude=_mined(0.1), temperature=1.0)
    assert_close(got, want, "module", *TOL)
    assert torch.equal(q, d["q"]) and torch.equal(y, d["y"]) and list(rows) == ["y"]


def _call(**kw: Any) -> Any:
    d = _data(10)
    args = dict(rows={"y": d["y"]}, positive=_labels)
    args.update(kw)
    return lambda: flashcl.flex_loss(d["q"], **args)


def _towers(**kw: Any) -> Any:
    d = _data(10)
    return lambda: flashcl.flex_loss(d["q"], d["k"], **kw)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (_call(kind="triplet"), ValueError, "kind"),
        (_call(kind=losses.CircleLoss()), TypeError, "kind must be"),
        (_call(kind="circle", score_mod=lambda s, a, b: s), ValueError, "pos_mod and neg_mod, not score_mod"),
        (_call(pos_mod=lambda s, a, b: s), ValueError, "kinds with two sets of pairs"),
        (_call(kind="circle", positives="sum"), ValueError, "positives"),
        (_call(kind="circle", include_self=True), ValueError, "include_self"),
        (_towers(kind="circle", both_directions=True), ValueError, "both_directions"),
        (
            _call(kind="circle", pos_mod=lambda s, a, b: s.new_zeros(2, 3)),
            ValueError,
            "pos_mod must return a floating tensor that broadcasts",
        ),
        (_call(rows={"y": torch.zeros(13), "hardest_positive": torch.zeros(13)}), ValueError, "row statistic"),
        (_towers(exclude=lambda a, b, s: s > b.positive_score), AttributeError, "self-contrast only"),
        (_call(positive=lambda a, b: (a.y == b.y) & (a.hardest_negative > 0)), ValueError, "positive reads"),
        (lambda: flashcl.FlexMultiSimilarity(alpha=0.0), ValueError, "alpha"),
        (lambda: flashcl.FlexMultiSimilarity(beta=float("nan")), ValueError, "beta"),
        (lambda: flashcl.FlexCircle(gamma=-1.0), ValueError, "gamma"),
        (lambda: flashcl.FlexCircle(m="0.4"), ValueError, "m must be"),
    ],
)
def test_bad_input_is_a_clear_error(call: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("backend,block", BACKENDS)
@pytest.mark.parametrize("kind", ["multi_similarity", "circle"])
def test_corners_of_the_two_set_kinds(backend: str, block: Any, kind: str) -> None:
    """One sample; every label the same (no negatives: the miner keeps no positive); no
    positives at all; a width of one; an extreme temperature; each against the formula."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(9, 5, generator=g, dtype=F64)
    cases = [
        (x[:1], torch.zeros(1, dtype=torch.long), 1.0),
        (x, torch.zeros(9, dtype=torch.long), 1.0),
        (x, torch.arange(9), 1.0),
        (x[:, :1], torch.randint(0, 3, (9,), generator=g), 1.0),
        (x, torch.randint(0, 3, (9,), generator=g), 1e-3),
    ]
    for i, (e, y, temp) in enumerate(cases):
        for exclude in (None, _mined(0.1)):
            e1 = e.clone().requires_grad_(True)
            want = reduce(
                *rows_of(e1, None, {"y": y}, None, positive=_labels, exclude=exclude, temperature=temp, kind=kind),
                "mean",
            )
            e2 = e.clone().requires_grad_(True)
            got = flashcl.flex_loss(
                e2,
                rows={"y": y},
                positive=_labels,
                exclude=exclude,
                kind=kind,
                temperature=temp,
                backend=backend,
                block_size=block,
            )
            assert torch.isfinite(got), (i, float(got))
            assert_close(got, want, f"{kind} case {i}", *TOL)
            assert_close(_grads(got, [e2])[0], _grads(want, [e1])[0], f"{kind} case {i}: gradient", *TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_no_worse_than_the_dense_backend(dtype: torch.dtype) -> None:
    d = _data(13, m=40)
    x, y = d["q"], torch.randint(0, 4, (40,), generator=torch.Generator().manual_seed(1))
    opts = dict(rows={"y": y}, positive=_labels, exclude=_mined(0.1), kind="multi_similarity", temperature=1.0)
    exact = flashcl.flex_loss(x, backend="dense", **opts)
    dense = flashcl.flex_loss(x.to(dtype), backend="dense", **opts)
    tiled = flashcl.flex_loss(x.to(dtype), backend="tiled", block_size=8, **opts)
    assert tiled.dtype == dense.dtype
    assert abs(float(tiled) - float(exact)) <= abs(float(dense) - float(exact)) + 1e-2 * abs(float(exact))


def test_the_dense_mask_gives_the_statistics_it_uses() -> None:
    d = _data(14)
    rows = {"y": d["y"]}
    got = flashcl.flex_dense_mask(d["q"], rows=rows, positive=_labels, exclude=_mined(0.1), temperature=1.0)
    eye = torch.eye(13, dtype=torch.bool)
    s = F.normalize(d["q"], dim=-1) @ F.normalize(d["q"], dim=-1).T
    want = flex_oracle.statistics(s, _labels, *flex_oracle.views(rows, rows, 13, 13), eye)
    for name, value in want.items():
        assert_close(got[name], value, name, *TOL)
    pos = (d["y"][:, None] == d["y"][None, :]) & ~eye
    out = torch.where(pos, s >= want["hardest_negative"][:, None] + 0.1, s <= want["hardest_positive"][:, None] - 0.1)
    assert torch.equal(got["excluded"], out | eye)
