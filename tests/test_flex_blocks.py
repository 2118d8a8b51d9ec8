"""Block masks of flex losses (flashcl.BlockMask, flashcl.flex_block_mask): the tiled
backend visits only the kept tiles, in the forward and the backward, and gives the loss
of the formula when the mask keeps every tile with a pair not excluded (one run of tiles
per row block: the fused visit; several: the two-visit path); the dense and reference
backends check the mask's promise; the masks equal their brute-force definition."""

from __future__ import annotations

from typing import Any, Dict, List, Set, Tuple

import flex_oracle
import pytest
import torch
from flex_oracle import reduce, rows_of

import flashcl
from helpers import assert_close


@pytest.fixture(autouse=True, params=["as_needed", "sparse"])
def _positives_form(request: Any, monkeypatch: Any) -> None:
    """Every test with the binary positives in their default form and always sparse."""
    flex_oracle.positives_forms(request, monkeypatch)


F64 = torch.float64
TOL = (1e-10, 1e-9)
B = 8  # tile size of the tests' masks


def _data(seed: int, m: int = 37, n: int = 29) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(m, 6, generator=g, dtype=F64),
        "k": torch.randn(n, 6, generator=g, dtype=F64),
        "t": (torch.rand(m, generator=g, dtype=F64) * 20).sort().values,
        "kt": (torch.rand(n, generator=g, dtype=F64) * 20).sort().values,
        "y": torch.randint(0, 3, (m,), generator=g),
        "ky": torch.randint(0, 3, (n,), generator=g),
    }


def _window(a: Any, b: Any) -> torch.Tensor:
    return (a.t - b.t).abs() > 3.0


def _stripes(a: Any, b: Any) -> torch.Tensor:
    """Pairs whose tile parities differ are out: each row block keeps every other tile
    (several runs of tiles per row block)."""
    return (a.index // B) % 2 != (b.index // B) % 2


SELF = {
    "time window": dict(positive=lambda a, b: (a.t - b.t).abs() <= 1.0, exclude=_window),
    "stripes": dict(positive=lambda a, b: a.y == b.y, exclude=_stripes),
    "stripes, sigmoid": dict(positive=lambda a, b: a.y == b.y, exclude=_stripes, kind="sigmoid", bias=-1.0),
    "window, self in, sum": dict(
        positive=lambda a, b: (a.t - b.t).abs() <= 1.0, exclude=_window, include_self=True, positives="sum"
    ),
}


@pytest.mark.parametrize("case", sorted(SELF))
@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_masked_loss_equals_the_formula(case: str, backend: str, reduction: str) -> None:
    d = _data(0)
    opts = dict(SELF[case])
    rows = {"t": d["t"], "y": d["y"]}
    mask = flashcl.flex_block_mask(
        opts["exclude"], 37, rows=rows, include_self=bool(opts.get("include_self")), block_size=B
    )
    assert 0 < mask.density < 1
    bias = opts.pop("bias", None)
    q1 = d["q"].clone().requires_grad_(True)
    loss_rows, valid = rows_of(q1, None, rows, None, temperature=0.3, bias=0.0 if bias is None else bias, **opts)
    want = reduce(loss_rows, valid, reduction)
    up = torch.linspace(0.5, 1.5, want.numel(), dtype=F64).reshape(want.shape)
    (want_grad,) = torch.autograd.grad(want, q1, up)
    q2 = d["q"].clone().requires_grad_(True)
    extra = {} if bias is None else {"bias": bias}
    got = flashcl.flex_loss(
        q2, rows=rows, temperature=0.3, reduction=reduction, backend=backend, block_mask=mask, **extra, **opts
    )
    assert_close(got, want, f"{case} {backend}: value", *TOL)
    (got_grad,) = torch.autograd.grad(got, q2, up)
    assert_close(got_grad, want_grad, f"{case} {backend}: gradient", *TOL)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_two_towers_and_both_directions_with_a_mask(backend: str) -> None:
    d = _data(1, m=29, n=29)
    rows, cols = {"t": d["t"]}, {"t": d["kt"]}
    opts = dict(positive=lambda a, b: a.index == b.index, exclude=lambda a, b: _window(a, b) & (a.index != b.index))
    mask = flashcl.flex_block_mask(opts["exclude"], 29, 29, rows=rows, cols=cols, block_size=B)
    assert 0 < mask.density < 1
    q1, k1 = d["q"][:29].clone().requires_grad_(True), d["k"].clone().requires_grad_(True)
    fwd, v1 = rows_of(q1, k1, rows, cols, temperature=0.25, **opts)
    back, v2 = rows_of(k1, q1, cols, rows, temperature=0.25, **opts)  # the pairs' functions are index-symmetric
    want = 0.5 * (reduce(fwd, v1, "mean") + reduce(back, v2, "mean"))
    want_grads = torch.autograd.grad(want, [q1, k1])
    q2, k2 = d["q"][:29].clone().requires_grad_(True), d["k"].clone().requires_grad_(True)
    got = flashcl.flex_loss(
        q2, k2, rows=rows, cols=cols, both_directions=True, temperature=0.25, backend=backend, block_mask=mask, **opts
    )
    assert_close(got, want, f"{backend}: value", *TOL)
    for a, e, name in zip(torch.autograd.grad(got, [q2, k2]), want_grads, ("q", "k")):
        assert_close(a, e, f"{backend}: d/d{name}", *TOL)


def test_the_tiled_backend_never_visits_a_skipped_tile() -> None:
    """The functions see only the kept tiles' keys, in the forward and the backward
    (reduction="none": the backward is a second visit)."""
    d = _data(2)
    rows = {"t": d["t"], "y": d["y"]}
    mask = flashcl.flex_block_mask(_stripes, 37, rows=rows, block_size=B)
    seen: Set[Tuple[int, int]] = set()

    def positive(a: Any, b: Any) -> torch.Tensor:
        for i in a.index.reshape(-1).tolist():
            for j in b.index.reshape(-1).tolist():
                seen.add((i // B, j // B))
        return a.y == b.y

    q = d["q"].clone().requires_grad_(True)
    loss = flashcl.flex_loss(q, rows=rows, positive=positive, exclude=_stripes, backend="tiled", block_mask=mask)
    loss.backward()
    kept = {(int(i), int(j)) for i, j in mask.keep.nonzero()}
    assert seen and seen <= kept, sorted(seen - kept)
    seen.clear()
    per_row = flashcl.flex_loss(
        q, rows=rows, positive=positive, exclude=_stripes, backend="tiled", block_mask=mask, reduction="none"
    )
    per_row.sum().backward()
    assert seen and seen <= kept, sorted(seen - kept)


@pytest.mark.parametrize("backend", ["reference", "dense"])
def test_a_mask_that_skips_a_contributing_pair_is_refused(backend: str) -> None:
    d = _data(3)
    rows = {"t": d["t"]}
    mask = flashcl.BlockMask.from_sorted(d["t"], max_distance=1.0, block_size=B)  # narrower than the exclusion
    with pytest.raises(ValueError, match="block_mask skips tile"):
        flashcl.flex_loss(
            d["q"],
            rows=rows,
            positive=lambda a, b: (a.t - b.t).abs() <= 0.5,
            exclude=_window,
            backend=backend,
            block_mask=mask,
        )


def _brute_keep(out: torch.Tensor, block: int) -> torch.Tensor:
    m, n = out.shape
    rb, cb = -(-m // block), -(-n // block)
    keep = torch.zeros(rb, cb, dtype=torch.bool)
    for i in range(rb):
        for j in range(cb):
            keep[i, j] = not bool(out[i * block : (i + 1) * block, j * block : (j + 1) * block].all())
    return keep


@pytest.mark.parametrize("block", [1, 5, 8, 64])
def test_the_masks_equal_their_definition(block: int) -> None:
    d = _data(4)
    t, kt = d["t"], d["kt"]
    dist = (t.unsqueeze(1) - t.unsqueeze(0)).abs()
    own = torch.eye(37, dtype=torch.bool)
    for include_self in (False, True):
        got = flashcl.flex_block_mask(_window, 37, rows={"t": t}, include_self=include_self, block_size=block)
        want = _brute_keep((dist > 3.0) | (own & (not include_self)), block)
        assert torch.equal(got.keep, want), (block, include_self)
    # sorted keys: from the tiles' ranges; the self pair is never left out there
    assert torch.equal(
        flashcl.BlockMask.from_sorted(t, max_distance=3.0, block_size=block).keep, _brute_keep(dist > 3.0, block)
    )
    cross = (t.unsqueeze(1) - kt.unsqueeze(0)).abs() > 3.0
    got = flashcl.flex_block_mask(_window, 37, 29, rows={"t": t}, cols={"t": kt}, block_size=block)
    assert torch.equal(got.keep, _brute_keep(cross, block))
    assert torch.equal(
        flashcl.BlockMask.from_sorted(t, kt, max_distance=3.0, block_size=block).keep, _brute_keep(cross, block)
    )


BAD: List[Tuple[Any, type, str]] = [
    (
        lambda q, t: flashcl.flex_loss(q, rows={"t": t}, positive=_window, block_mask=torch.ones(5, 5)),
        TypeError,
        "BlockMask",
    ),
    (
        lambda q, t: flashcl.flex_loss(
            q, rows={"t": t}, positive=_window, block_mask=flashcl.BlockMask(torch.ones(4, 5, dtype=torch.bool), B)
        ),
        ValueError,
        "blocks",
    ),
    (
        lambda q, t: flashcl.flex_loss(
            q,
            rows={"t": t},
            positive=_window,
            block_size=4,
            block_mask=flashcl.BlockMask(torch.ones(5, 5, dtype=torch.bool), B),
        ),
        ValueError,
        "block_size",
    ),
    (
        lambda q, t: flashcl.flex_loss(
            q,
            rows={"t": t},
            positive=_window,
            process_group=object(),
            block_mask=flashcl.BlockMask(torch.ones(5, 5, dtype=torch.bool), B),
        ),
        ValueError,
        "one process",
    ),
    (lambda q, t: flashcl.BlockMask(torch.ones(2, 2), B), TypeError, "bool"),
    (lambda q, t: flashcl.BlockMask(torch.ones(2, 2, dtype=torch.bool), 0), ValueError, "block_size"),
    (lambda q, t: flashcl.BlockMask.from_sorted(t.flip(0), max_distance=1.0), ValueError, "sorted"),
    (lambda q, t: flashcl.flex_block_mask(lambda a, b, s: s > 0, 37, rows={"t": t}), ValueError, "scores"),
    (lambda q, t: flashcl.flex_block_mask(_window, 36, rows={"t": t}), ValueError, "one entry per sample"),
    (lambda q, t: flashcl.flex_block_mask(lambda a, b: a.t - b.t, 37, rows={"t": t}), TypeError, "bool"),
]


@pytest.mark.parametrize("call,error,match", BAD)
def test_bad_masks_are_clear_errors(call: Any, error: type, match: str) -> None:
    d = _data(5)
    with pytest.raises(error, match=match):
        call(d["q"], d["t"])


def test_the_module_takes_a_mask_per_call() -> None:
    d = _data(6)
    rows = {"t": d["t"]}
    mask = flashcl.BlockMask.from_sorted(d["t"], max_distance=3.0, block_size=B)
    fn = flashcl.FlexLoss(positive=lambda a, b: (a.t - b.t).abs() <= 1.0, exclude=_window, backend="tiled")
    got = fn(d["q"], rows=rows, block_mask=mask)
    want = flashcl.flex_loss(
        d["q"], rows=rows, positive=lambda a, b: (a.t - b.t).abs() <= 1.0, exclude=_window, backend="dense"
    )
    assert_close(got, want, "FlexLoss with a mask", *TOL)
