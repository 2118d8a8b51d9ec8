"""NaN is never swallowed, and never leaks: a NaN that a loss uses (a flex weight, a score
mod's value, a positive weight, a teacher row that joins Sinkhorn-Knopp's normalisation)
makes the anchor's term and the reduced loss NaN on every backend, as torch's own formula
does; a NaN (or an infinite slope) on a pair the loss leaves out reaches neither the value
nor any gradient: the call equals the same call with that entry made finite."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict

import flex_oracle
import pytest
import torch

import flashcl
from helpers import assert_close

F64 = torch.float64
TOL = (1e-10, 1e-9)
FLEX_BACKENDS = [("reference", None), ("dense", None), ("tiled", 3), ("tiled", None)]
NAN = float("nan")
ANCHOR, KEY = 2, 5  # the pair that holds the NaN


@pytest.fixture(autouse=True, params=["as_needed", "sparse"])
def _positives_form(request: Any, monkeypatch: Any) -> None:
    flex_oracle.positives_forms(request, monkeypatch)


def _data() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "x": torch.randn(9, 5, generator=g, dtype=F64),
        "y": torch.tensor([0, 1, 0, 2, 1, 0, 2, 1, 0]),
    }


def _at_pair(a: Any, b: Any) -> torch.Tensor:
    return (a.index == ANCHOR) & (b.index == KEY)


def _weight(value: float) -> Callable[..., torch.Tensor]:
    return lambda a, b: torch.where(_at_pair(a, b), value, 1.0 + 0.5 * (a.y == b.y))


def _positive(value: float) -> Callable[..., torch.Tensor]:
    return lambda a, b: torch.where(_at_pair(a, b), value, (a.y == b.y).to(F64))


def _score_mod(value: float) -> Callable[..., torch.Tensor]:
    return lambda s, a, b: s + torch.where(_at_pair(a, b), value, 0.1 * (a.y == b.y))


# (name, kind, options with the NaN at the pair (ANCHOR, KEY), the same with a finite value)
USED = {
    "softmax weight": ("softmax", lambda v: dict(weight=_weight(v))),
    "sigmoid weight": ("sigmoid", lambda v: dict(weight=_weight(v))),
    "circle weight": ("circle", lambda v: dict(weight=_weight(v))),
    "softmax score_mod": ("softmax", lambda v: dict(score_mod=_score_mod(v))),
    "sigmoid score_mod": ("sigmoid", lambda v: dict(score_mod=_score_mod(v))),
    "weighted_mean positive weight": ("softmax", lambda v: dict(positive=_positive(v), positives="weighted_mean")),
    "mean positive weight": ("softmax", lambda v: dict(positive=_positive(v))),
    "pairs positive weight": ("softmax", lambda v: dict(positive=_positive(v), positives="pairs")),
    "multi-similarity membership": ("multi_similarity", lambda v: dict(positive=_positive(v))),
}


def _call(kind: str, options: Dict[str, Any], backend: str, block: Any, **kw: Any) -> Any:
    d = _data()
    x = d["x"].clone().requires_grad_(True)
    args: Dict[str, Any] = dict(rows={"y": d["y"]}, positive=lambda a, b: a.y == b.y, temperature=0.5)
    args.update(options)
    args.update(kw)
    loss = flashcl.flex_loss(x, kind=kind, backend=backend, block_size=block, **args)
    return loss, x


@pytest.mark.parametrize("case", sorted(USED))
@pytest.mark.parametrize("backend,block", FLEX_BACKENDS)
def test_a_nan_the_loss_uses_gives_nan(case: str, backend: str, block: Any) -> None:
    """The anchor's own term is NaN, every other anchor's term unchanged, the mean NaN."""
    kind, make = USED[case]
    rows, _ = _call(kind, make(NAN), backend, block, reduction="none")
    clean, _ = _call(kind, make(0.75), backend, block, reduction="none")
    term = float(rows[ANCHOR].detach())
    assert math.isnan(term), f"{case}/{backend}: anchor {ANCHOR}'s term {term}"
    others = torch.arange(rows.shape[0]) != ANCHOR
    assert_close(rows[others], clean[others], f"{case}/{backend}: the other anchors' terms", *TOL)
    mean, _ = _call(kind, make(NAN), backend, block)
    assert math.isnan(float(mean.detach())), f"{case}/{backend}: mean {float(mean.detach())}"


# the same functions, with the pair (ANCHOR, KEY) excluded
EXCLUDED = {
    **USED,
    # the slope (v: NaN or inf) at the pair alone: a constant factor there
    "score_mod with a slope of v": (
        "softmax",
        lambda v: dict(score_mod=lambda s, a, b: s * torch.where(_at_pair(a, b), v, 1.0)),
    ),
    "sigmoid score_mod with a slope of v": (
        "sigmoid",
        lambda v: dict(score_mod=lambda s, a, b: s * torch.where(_at_pair(a, b), v, 1.0)),
    ),
}


@pytest.mark.parametrize("case", sorted(EXCLUDED))
@pytest.mark.parametrize("backend,block", FLEX_BACKENDS)
@pytest.mark.parametrize("value", [NAN, float("inf")])
def test_a_nan_on_an_excluded_pair_reaches_nothing(case: str, backend: str, block: Any, value: float) -> None:
    """The pair out of every set (``exclude``): value and gradient equal the call whose entry
    there is finite, on every kind (the sigmoid kind's bias gradient included)."""
    kind, make = EXCLUDED[case]
    excl = {"exclude": _at_pair}
    bias = {"bias": torch.tensor(-0.5, dtype=F64, requires_grad=True)} if kind == "sigmoid" else {}
    got, x = _call(kind, {**make(value), **excl, **bias}, backend, block)
    leaves = [x] + list(bias.values())
    got_grads = torch.autograd.grad(got, leaves)
    bias = {k: v.detach().clone().requires_grad_(True) for k, v in bias.items()}
    want, wx = _call(kind, {**make(0.75), **excl, **bias}, backend, block)
    want_grads = torch.autograd.grad(want, [wx] + list(bias.values()))
    assert_close(got, want, f"{case}/{backend}: value", *TOL)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_close(g, w, f"{case}/{backend}: gradient {i}", *TOL)


@pytest.mark.parametrize("backend,block", FLEX_BACKENDS)
def test_an_infinite_slope_on_the_self_pair_reaches_nothing(backend: str, block: Any) -> None:
    """``-log(1 - s)`` at temperature 1: the self pair's score is 1 (its slope infinite); the
    self pair is out of every set, so the gradient is torch's formula's on the other pairs."""
    d = _data()
    x = d["x"].clone().requires_grad_(True)
    mod = lambda s, a, b: -torch.log1p(-s.clamp(max=1.0))  # noqa: E731
    loss = flashcl.flex_loss(
        x, rows={"y": d["y"]}, positive=lambda a, b: a.y == b.y, score_mod=mod, temperature=1.0, backend=backend,
        block_size=block,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, [x])
    xn = x.detach().clone().requires_grad_(True)
    s = torch.nn.functional.normalize(xn, dim=-1) @ torch.nn.functional.normalize(xn, dim=-1).T
    eye = torch.eye(9, dtype=torch.bool)
    sp = -torch.log1p(-torch.where(eye, 0.0, s))  # the self pair out before the function: torch's own way
    pos = (d["y"][:, None] == d["y"][None, :]) & ~eye
    lse = torch.logsumexp(sp.masked_fill(eye, -math.inf), 1)
    want = ((lse[:, None] - sp) * pos).sum(1) / pos.sum(1)
    (wg,) = torch.autograd.grad(want.mean(), [xn])
    assert_close(loss, want.mean(), f"{backend}: value", *TOL)
    assert_close(g, wg, f"{backend}: gradient", *TOL)


@pytest.mark.parametrize("targets", ["softmax", "sinkhorn"])
@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_a_nan_teacher_row_gives_nan(targets: str, backend: str) -> None:
    """A NaN in one teacher row: with softmax targets that image's term is NaN (the others
    unchanged); Sinkhorn-Knopp's normalisation joins every row, so every term is NaN, on every
    backend (as DINOv2's own code gives)."""
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(2, 9, 24, generator=g, dtype=F64), torch.randn(2, 9, 24, generator=g, dtype=F64)
    w = torch.randn(31, 24, generator=g, dtype=F64)
    clean = flashcl.dino_loss(s, t, w, targets=targets, backend=backend, reduction="none", block_size=4)
    t[1, 3, 5] = NAN
    rows = flashcl.dino_loss(s, t, w, targets=targets, backend=backend, reduction="none", block_size=4)
    assert math.isnan(float(flashcl.dino_loss(s, t, w, targets=targets, backend=backend, block_size=4)))
    bad = torch.isnan(rows)
    if targets == "sinkhorn":
        assert bool(bad.all()), f"{backend}: {rows}"
        return
    assert bool(bad.any()), f"{backend}: {rows}"
    assert_close(rows[~bad], clean[~bad], f"{backend}: the other images' terms", *TOL)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("backend,block", FLEX_BACKENDS)
def test_a_nan_row_gives_nan_through_the_pair_sums_distances(backend: str, block: Any, normalize: bool) -> None:
    """A NaN embedding's distances are NaN (the distance view read a NaN cosine as 0): every
    anchor pairs with that row, so every anchor's sum and the mean are NaN."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 4, dtype=F64, generator=g), torch.randint(0, 3, (9,), generator=g)
    x[ANCHOR, 1] = NAN
    rows = flashcl.contrastive_loss(x, y, normalize=normalize, reduction="none", backend=backend, block_size=block)
    assert torch.isnan(rows).all(), rows
    assert torch.isnan(flashcl.contrastive_loss(x, y, normalize=normalize, backend=backend, block_size=block))
