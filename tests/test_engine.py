"""The tile engine with a head written here, in this file only: a sigmoid over
pairs (SigLIP's form with a fixed bias). Every backend drives it without a
change, and its loss and gradients equal a dense formula written independently
with plain torch ops."""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from flashcl import backends, engine
from flashcl.engine import Problem
from flashcl.engine.heads import AutogradHead, Head, Tile
from helpers import assert_close, close_group, spawn

F64 = torch.float64


class _State:
    def __init__(self, m: int, like: Tensor) -> None:
        self.row = like.new_zeros(m)
        self.g_row: Optional[Tensor] = None
        self.g_col: Optional[Tensor] = None


class SigmoidPairsHead(Head):
    """Row i's loss: ``sum_j -log sigmoid(z_ij (s_ij + bias))``, ``z_ij = +1`` when
    ``labels_i == col_labels_j``, else -1. One pass, no logsumexp."""

    def __init__(self, labels: Tensor, col_labels: Tensor, bias: float, symmetric: bool) -> None:
        self.labels, self.col_labels, self.bias = labels, col_labels, bias
        self.symmetric_tiles = symmetric  # the same labels on both sides: z_ij = z_ji
        self.fuses_rows = True

    def _z(self, tile: Tile, like: Tensor) -> Tensor:
        same = self.labels[tile.r0 : tile.r1].unsqueeze(1) == self.col_labels[tile.c0 : tile.c1].unsqueeze(0)
        return same.to(like.dtype) * 2 - 1

    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _State:
        return _State(m, like)

    def reduce(self, s: Tensor, tile: Tile, st: _State, p: int = 0) -> None:
        st.row[tile.r0 : tile.r1] += -F.logsigmoid(self._z(tile, s) * (s + self.bias)).sum(1)

    def values(self, st: _State) -> Tuple[Tensor, Optional[Tensor]]:
        return st.row, None

    def grad(self, s: Tensor, tile: Tile, st: _State, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        z = self._z(tile, s)
        return -z * torch.sigmoid(-z * (s + self.bias)) * st.g_row[tile.r0 : tile.r1].unsqueeze(1)

    def rows_fused(self, s: Tensor, tile: Tile, st: _State, g_row: Optional[Tensor]) -> Optional[Tensor]:
        z = self._z(tile, s)
        st.row[tile.r0 : tile.r1] = -F.logsigmoid(z * (s + self.bias)).sum(1)
        if g_row is None:
            return None
        return -z * torch.sigmoid(-z * (s + self.bias)) * g_row[tile.r0 : tile.r1].unsqueeze(1)

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        return -F.logsigmoid(self._z(tile, s) * (s + self.bias)).sum(1), None


class AutogradSigmoidPairsHead(AutogradHead):
    """The same loss written as its forward alone: the gradient is autograd's."""

    def __init__(self, labels: Tensor, col_labels: Tensor, bias: float, symmetric: bool = False) -> None:
        self.labels, self.col_labels, self.bias = labels, col_labels, bias

    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        same = self.labels[tile.r0 : tile.r1].unsqueeze(1) == self.col_labels[tile.c0 : tile.c1].unsqueeze(0)
        return -F.logsigmoid((same.to(s.dtype) * 2 - 1) * (s + self.bias)).sum(1), None


def formula(q: Tensor, k: Tensor, labels: Tensor, col_labels: Tensor, scale: Tensor, bias: float) -> Tensor:
    """The same loss written out: pairs of normalised rows, one sigmoid each."""
    qn, kn = F.normalize(q, dim=1), F.normalize(k, dim=1)
    total = q.new_zeros(q.shape[0])
    for i in range(q.shape[0]):
        s = scale * (kn @ qn[i]) + bias
        z = torch.where(col_labels == labels[i], 1.0, -1.0).to(q.dtype)
        total = total + F.one_hot(torch.tensor(i), q.shape[0]).to(q.dtype) * torch.log1p(torch.exp(-z * s)).sum()
    return total


def _data(m: int = 13, n: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, 6, generator=g, dtype=F64),
        torch.randn(n, 6, generator=g, dtype=F64),
        torch.randint(0, 3, (m,), generator=g),
        torch.randint(0, 3, (n,), generator=g),
    )


def _check(backend: str, self_contrast: bool, reduce: bool, block: int, make: Any = SigmoidPairsHead) -> None:
    q, k, lq, lk = _data()
    if self_contrast:
        k, lk = q, lq
    scale0, bias = 3.0, -1.5
    w = torch.linspace(0.5, 1.5, q.shape[0], dtype=F64)
    results = []
    for impl in ("flashcl", "formula"):
        qq = q.clone().requires_grad_(True)
        kk = qq if self_contrast else k.clone().requires_grad_(True)
        sc = torch.tensor(scale0, dtype=F64, requires_grad=True)
        if impl == "formula":
            rows = formula(qq, kk, lq, lk, sc, bias)
            out = (w * rows).sum() if reduce else rows
        else:
            problem = Problem(make(lq, lk, bias, symmetric=self_contrast))
            out, _ = backends.run_problem(
                qq, None if self_contrast else kk, sc, problem, backend, (w, None) if reduce else None, block
            )
        loss = out if reduce else (out * w).sum()
        grads = torch.autograd.grad(loss * 1.3, [qq, sc] if self_contrast else [qq, kk, sc])
        results.append((out.detach(), grads))
    (got, got_g), (exp, exp_g) = results
    what = f"{backend}/self={self_contrast}/reduce={reduce}/block={block}"
    assert_close(got, exp, f"{what}: loss", 1e-10, 1e-10)
    for i, (a, e) in enumerate(zip(got_g, exp_g)):
        assert_close(a, e, f"{what}: grad {i}", 1e-10, 1e-10)


@pytest.mark.parametrize("block", [1, 4, 100])
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("self_contrast", [False, True])
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_test_only_head_on_every_backend(backend: str, self_contrast: bool, reduce: bool, block: int) -> None:
    """tiled takes the row-block driver for two sets and the upper-panel driver for
    self-contrast (built from the head's reduce and grad alone)."""
    _check(backend, self_contrast, reduce, block)


@pytest.mark.parametrize("block", [1, 4, 100])
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("self_contrast", [False, True])
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_a_head_written_as_its_forward_alone(backend: str, self_contrast: bool, reduce: bool, block: int) -> None:
    """An AutogradHead (its dense form alone) on blocks of complete rows: the values and
    every gradient of the formula, reduced (the gradient in the forward's visit) or per
    row (in the backward's)."""
    _check(backend, self_contrast, reduce, block, AutogradSigmoidPairsHead)


def test_a_head_written_as_its_forward_alone_on_the_stripes() -> None:
    """Half-precision rows take the stripes (complete rows too): the autograd head's value
    and gradients equal the hand-written head's."""
    q, k, lq, lk = _data()
    results = []
    for make in (AutogradSigmoidPairsHead, SigmoidPairsHead):
        qq, kk = q.bfloat16().requires_grad_(True), k.bfloat16().requires_grad_(True)
        sc = torch.tensor(3.0, requires_grad=True)
        problem = Problem(make(lq, lk, -1.5, False))
        assert type(backends.driver("tiled", problem, kk, "cpu", torch.bfloat16)).__name__ == "Stripes"
        out, _ = backends.run_problem(qq, kk, sc, problem, "tiled", (torch.linspace(0.5, 1.5, 13), None), 4)
        results.append((out.detach(), torch.autograd.grad(out, [qq, kk, sc])))
    (got, got_g), (exp, exp_g) = results
    assert_close(got, exp, "loss", 1e-5, 1e-5)
    for name, a, e in zip(("rows", "columns", "scale"), got_g, exp_g):
        assert_close(a.float(), e.float(), f"{name}' gradient", 1e-2, 1e-2)


def test_a_head_written_as_its_forward_alone_refuses_part_of_its_rows() -> None:
    """A tile of part of its rows' columns (the ring's, a panel's) is a ValueError."""
    _, _, lq, lk = _data()
    head = AutogradSigmoidPairsHead(lq, lk, -1.5)
    st = head.state(13, 11, torch.zeros(1, dtype=F64), None)
    for call in (lambda s, t: head.reduce(s, t, st), lambda s, t: head.rows_fused(s, t, st, torch.ones(13, dtype=F64))):
        with pytest.raises(ValueError, match="complete rows"):
            call(torch.zeros(2, 5, dtype=F64), Tile(0, 2, 3, 8))
    head.reduce(torch.zeros(2, 11, dtype=F64), Tile(0, 2, 0, 11), st)  # complete rows: taken
    same = (lq[:2].unsqueeze(1) == lk.unsqueeze(0)).sum(1).to(F64)
    sp = F.softplus(torch.tensor([1.5, -1.5], dtype=F64))  # -log sigmoid(-1.5), -log sigmoid(1.5)
    assert_close(st.rows[:2], same * sp[0] + (11 - same) * sp[1], "rows' losses", 1e-12, 1e-12)


class FactoredSigmoidPairsHead(SigmoidPairsHead):
    """The same loss, its gradient tiles returned less the upstream gradient of each
    row, which the driver applies to the block's rows (``factored_rows``)."""

    factored_rows = True

    def begin_grad(self, st: _State, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.g_row = g_row

    def grad(self, s: Tensor, tile: Tile, st: _State, buf: Optional[Tensor] = None) -> Tensor:
        z = self._z(tile, s)
        return -z * torch.sigmoid(-z * (s + self.bias))

    def rows_fused(self, s: Tensor, tile: Tile, st: _State, g_row: Optional[Tensor]) -> Optional[Tensor]:
        st.g_row = g_row
        g = super().rows_fused(s, tile, st, None if g_row is None else torch.ones_like(g_row))
        return g

    def row_factor(self, st: _State, tile: Tile) -> Tensor:
        assert st.g_row is not None
        return st.g_row[tile.r0 : tile.r1]


def _driver_against_formula(
    q: Tensor, k: Tensor, lq: Tensor, lk: Tensor, head: Head, driver: Any, reduce: bool, block: int
) -> None:
    """The test's head run by ``driver`` (two sets of rows) against the formula: the
    loss and every gradient (rows, columns, scale); the inputs untouched."""
    w = torch.linspace(0.5, 1.5, q.shape[0], dtype=F64)
    results = []
    for impl in ("flashcl", "formula"):
        qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        sc = torch.tensor(3.0, dtype=F64, requires_grad=True)
        if impl == "formula":
            rows = formula(qq, kk, lq, lk, sc, -1.5)
            out = (w * rows).sum() if reduce else rows
        else:
            out = engine.run(qq, kk, sc, Problem(head), driver, (w, None) if reduce else None, block)[0]
            assert torch.equal(qq.detach(), q) and torch.equal(kk.detach(), k)
        loss = out if reduce else (out * w).sum()
        results.append((out.detach(), torch.autograd.grad(loss * 1.3, [qq, kk, sc])))
    (got, got_g), (exp, exp_g) = results
    assert_close(got, exp, "loss", 1e-10, 1e-10)
    for name, a, e in zip(("rows", "columns", "scale"), got_g, exp_g):
        assert_close(a, e, f"{name}' gradient", 1e-10, 1e-10)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("reduce", [True, False])
def test_row_blocks_with_lazy_rows_and_row_factors(reduce: bool, factored: bool, lazy: bool, fused: bool) -> None:
    """RowBlocks with the normalised rows never copied (``lazy``: the columns' norms
    scale each tile and the gradient's) and with a head that leaves each row's
    upstream gradient to the driver, with or without the fused forward, on rows of
    very different norms."""
    from flashcl.engine.tiled import RowBlocks

    q, k, lq, lk = _data()
    q[3] *= 1e-3
    k[5] *= 40.0
    head = (FactoredSigmoidPairsHead if factored else SigmoidPairsHead)(lq, lk, -1.5, symmetric=False)
    head.fuses_rows = fused
    _driver_against_formula(q, k, lq, lk, head, RowBlocks("cpu", lazy=lazy), reduce, 4)


@pytest.mark.parametrize("block", [1, 4, 100])
@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("reduce", [True, False])
def test_column_blocks(reduce: bool, factored: bool, block: int) -> None:
    """ColumnBlocks (blocks of columns against every row, two visits) with the test's
    head as it is, or leaving each row's upstream gradient to the driver."""
    from flashcl.engine.columns import ColumnBlocks

    q, k, lq, lk = _data()
    head = (FactoredSigmoidPairsHead if factored else SigmoidPairsHead)(lq, lk, -1.5, symmetric=False)
    _driver_against_formula(q, k, lq, lk, head, ColumnBlocks(), reduce, block)


def test_row_factors_and_lazy_rows_are_refused_where_no_driver_applies_them() -> None:
    """A head with row factors on a driver that does not apply them, and lazy row
    blocks of one set of rows (``k`` is ``q``), are errors, not a wrong gradient."""
    from flashcl.engine.columns import ColumnBlocks
    from flashcl.engine.panels import UpperPanels
    from flashcl.engine.tiled import RowBlocks

    q, _, lq, _ = _data()
    sc = torch.tensor(2.0, dtype=F64)
    head = FactoredSigmoidPairsHead(lq, lq, 0.0, symmetric=True)
    with pytest.raises(ValueError, match="row factors"):
        engine.run(q, None, sc, Problem(head), UpperPanels("cpu"), None, 4)
    with pytest.raises(ValueError, match="two sets of rows"):
        engine.run(q, None, sc, Problem(SigmoidPairsHead(lq, lq, 0.0, False)), RowBlocks("cpu", lazy=True), None, 4)
    with pytest.raises(ValueError, match="two sets of rows"):
        engine.run(q, None, sc, Problem(SigmoidPairsHead(lq, lq, 0.0, False)), ColumnBlocks(), None, 4)


def test_drivers_chosen() -> None:
    q, k, lq, lk = _data()
    head = SigmoidPairsHead(lq, lq, 0.0, symmetric=True)
    assert type(backends.driver("tiled", Problem(head), None, "cpu")).__name__ == "UpperPanels"
    assert type(backends.driver("tiled", Problem(head), k, "cpu")).__name__ == "RowBlocks"
    assert backends.driver("dense", Problem(head), k, "cpu") is None


def test_a_layout_is_a_driver_of_the_tiled_backend() -> None:
    """A family of one tile layout names it; an unknown layout is a ValueError that lists them."""
    assert type(backends.layout_driver("columns", "cpu")).__name__ == "ColumnBlocks"
    rows = backends.layout_driver("lazy rows", "cpu")
    assert type(rows).__name__ == "RowBlocks" and rows.lazy
    with pytest.raises(ValueError, match="lazy rows, columns"):
        backends.layout_driver("diagonal", "cpu")


def test_second_derivatives_of_the_head() -> None:
    q, k, lq, lk = _data()
    out = []
    for backend in ("dense", "tiled"):
        qq = q.clone().requires_grad_(True)
        loss, _ = backends.run_problem(
            qq,
            k,
            torch.tensor(2.0, dtype=F64),
            Problem(SigmoidPairsHead(lq, lk, 0.5, False)),
            backend,
            (torch.ones(13, dtype=F64), None),
            4,
        )
        (g,) = torch.autograd.grad(loss, qq, create_graph=True)
        out.append(torch.autograd.grad((g**2).sum(), qq)[0])
    assert_close(out[1], out[0], "second derivative", 1e-10, 1e-10)


def test_a_head_without_kernels_is_refused_by_triton() -> None:
    pytest.importorskip("triton")
    q, k, lq, lk = _data()
    with pytest.raises(ValueError, match="softmax and softplus heads only"):
        backends.run_problem(
            q.float(), k.float(), torch.tensor(2.0), Problem(SigmoidPairsHead(lq, lk, 0.5, False)), "triton", None, 4
        )


def _ring_worker(rank: int, world: int, out_dir: str) -> None:
    from flashcl.parallel.ring import RingDriver

    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    q, k, lq, lk = _data()
    rows_at, cols_at = [0, 6, 13], [0, 5, 11]  # uneven shards of the anchors and of the candidates
    q_local = q[rows_at[rank] : rows_at[rank + 1]].clone().requires_grad_(True)
    k_local = k[cols_at[rank] : cols_at[rank + 1]].clone().requires_grad_(True)
    sc = torch.tensor(3.0, dtype=F64, requires_grad=True)
    ring = RingDriver([5, 6], None)
    head = SigmoidPairsHead(lq[rows_at[rank] : rows_at[rank + 1]], lk, -1.5, False)
    rows = engine.run(q_local, k_local, sc, Problem(head), ring, None, 4)[0]
    grads = torch.autograd.grad(rows.sum(), [q_local, k_local, sc])
    torch.save((rows.detach(), [g.detach() for g in grads]), os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def test_test_only_head_on_the_distributed_ring(tmp_path: Any) -> None:
    """Two ranks, each with a shard of the anchors and of the candidates: each rank's
    rows equal the formula's, the candidates' gradients come home to their rank."""
    spawn(_ring_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    q, k, lq, lk = _data()
    qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    sc = torch.tensor(3.0, dtype=F64, requires_grad=True)
    rows = formula(qq, kk, lq, lk, sc, -1.5)
    gq, gk, gs = torch.autograd.grad(rows.sum(), [qq, kk, sc])
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert_close(torch.cat([p[0] for p in parts]), rows.detach(), "rows, by rank", 1e-10, 1e-10)
    for i, (name, expected) in enumerate((("q", gq), ("k", gk))):
        assert_close(torch.cat([p[1][i] for p in parts]), expected, f"grad of {name}, by rank", 1e-10, 1e-10)
    assert_close(parts[0][1][2] + parts[1][1][2], gs, "grad of the scale, summed over ranks", 1e-10, 1e-10)


def test_all_finite_sees_every_non_finite_entry() -> None:
    from flashcl.engine import all_finite

    x = torch.full((64, 8), 3e38)  # float32's largest magnitudes: their float32 sum would overflow
    assert all_finite(x) and all_finite(-x) and all_finite(torch.empty(0, 8))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[17, 3] = bad
        assert not all_finite(y), bad
    y = torch.zeros(5, 3)
    y[0, 0], y[4, 2] = float("inf"), float("-inf")  # opposite infinities: their sum is NaN, still caught
    assert not all_finite(y)
    assert not all_finite(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16))
    assert all_finite(torch.tensor(2.0)) and not all_finite(torch.tensor(float("nan")))
    # every position (the vectorised body and its tail), every float dtype, strided, transposed and expanded views
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        z = torch.randn(37, 19).to(dtype)
        assert all_finite(z) and all_finite(z[:, ::2]) and all_finite(z.T) and all_finite(z[:1].expand(5, 19))
        for at in ((0, 0), (12, 4), (36, 18), (36, 17), (20, 16)):
            for bad in (float("nan"), float("inf"), float("-inf")):
                w = z.clone()
                w[at] = bad
                assert not all_finite(w) and not all_finite(w.T), (dtype, at, bad)
                assert not all_finite(w[:, at[1] % 2 :: 2]) and not all_finite(w[at[0] : at[0] + 1].expand(4, 19))


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
def test_row_max_is_max_by_runs(dtype: torch.dtype) -> None:
    """heads.row_max: the rows' largest entries and an index of each, as ``max(1)``, by
    runs of columns where the width allows, else ``max(1)`` itself."""
    from flashcl.engine.heads import row_max

    g = torch.Generator().manual_seed(3)
    for m, n, width in ((5, 1024, 128), (4, 1024, 32), (3, 1000, 128), (2, 256, 128), (0, 1024, 128)):
        s = torch.randn(m, n, generator=g).to(dtype)
        if m > 2:
            s[1] = -5.0
            s[1, [7, 300, 900]] = 2.0  # ties: any of them
            s[2] = float("-inf")
            s[2, n - 1] = -1e30  # the largest in the last run
        for t in (s, s[:, ::1], torch.cat([s, s], 1)[:, :n]):  # contiguous, and rows with a wider stride
            top, idx = row_max(t, width)
            want = t.max(1).values
            assert torch.equal(top, want), (m, n, width)
            assert idx.dtype == torch.long and torch.equal(t.gather(1, idx.unsqueeze(1)).squeeze(1), want)
        if m > 2:
            assert int(row_max(s, width)[1][2]) == n - 1


def _given_formula(s: Tensor, lq: Tensor, lk: Tensor, scale: Tensor, bias: float) -> Tensor:
    """The test's loss on a given score matrix, written out: one sigmoid per pair."""
    z = torch.where(lq.unsqueeze(1) == lk.unsqueeze(0), 1.0, -1.0).to(s.dtype)
    return torch.log1p(torch.exp(-z * (scale * s + bias))).sum(1)


GIVEN_HEADS = [
    (SigmoidPairsHead, True),
    (SigmoidPairsHead, False),
    (FactoredSigmoidPairsHead, True),
    (FactoredSigmoidPairsHead, False),
    (AutogradSigmoidPairsHead, True),  # an AutogradHead always reduces complete rows at once
]


@pytest.mark.parametrize("block", [1, 4, 100])
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize(
    "make,fused", GIVEN_HEADS, ids=["hand", "hand-passes", "factored", "factored-passes", "autograd"]
)
def test_a_head_on_a_given_score_matrix(make: Any, fused: bool, reduce: bool, block: int) -> None:
    """``run_given``: any head on blocks of complete rows of ``scale * scores`` (its rows
    reduced and their gradient formed at once, or its passes then a gradient visit),
    equal to the formula in value and in the gradients of the scores and the scale,
    reduced (the gradient in the forward's visit) or per row; the scores untouched."""
    from flashcl.engine.given import run_given

    _, _, lq, lk = _data()
    s0 = torch.randn(13, 11, generator=torch.Generator().manual_seed(3), dtype=F64)
    w = torch.linspace(0.5, 1.5, 13, dtype=F64)
    head = make(lq, lk, -1.5, False)
    head.fuses_rows = fused
    results = []
    for impl in ("flashcl", "formula"):
        s = s0.clone().requires_grad_(True)
        sc = torch.tensor(3.0, dtype=F64, requires_grad=True)
        if impl == "formula":
            rows = _given_formula(s, lq, lk, sc, -1.5)
            out = (w * rows).sum() if reduce else rows
        else:
            out, found = run_given(s, sc, head, w if reduce else None, block)
            assert found == () and torch.equal(s.detach(), s0)
        loss = out if reduce else (out * w).sum()
        results.append((out.detach(), torch.autograd.grad(loss * 1.3, [s, sc])))
    (got, got_g), (exp, exp_g) = results
    assert_close(got, exp, "loss", 1e-10, 1e-10)
    for name, a, e in zip(("scores", "scale"), got_g, exp_g):
        assert_close(a, e, f"{name}' gradient", 1e-10, 1e-10)


def test_a_head_on_a_given_score_matrix_in_half_precision_and_twice_differentiated() -> None:
    """bfloat16 scores (the blocks formed in a float32 buffer, the gradient in the scores'
    dtype), a scale without a gradient (none formed for it), and second derivatives
    through the head's dense form."""
    from flashcl.engine.given import run_given

    _, _, lq, lk = _data()
    s0 = torch.randn(13, 11, generator=torch.Generator().manual_seed(4))
    sc = torch.tensor(3.0)
    s = s0.bfloat16().requires_grad_(True)
    out, _ = run_given(s, sc, SigmoidPairsHead(lq, lk, -1.5, False), torch.ones(13), 4)
    (g,) = torch.autograd.grad(out, [s])
    ref = s0.bfloat16().float().requires_grad_(True)
    want = _given_formula(ref, lq, lk, sc, -1.5).sum()
    (g_want,) = torch.autograd.grad(want, [ref])
    assert g.dtype == torch.bfloat16
    assert_close(out, want, "loss", 1e-5, 1e-5)
    assert_close(g.float(), g_want, "scores' gradient", 1e-2, 1e-2)
    s = s0.double().requires_grad_(True)
    out, _ = run_given(s, sc.double(), SigmoidPairsHead(lq, lk, -1.5, False), torch.ones(13, dtype=F64), 4)
    (g,) = torch.autograd.grad(out, [s], create_graph=True)
    (h,) = torch.autograd.grad((g * g).sum(), [s])
    ref = s0.double().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(_given_formula(ref, lq, lk, sc.double(), -1.5).sum(), [ref], create_graph=True)
    (h_ref,) = torch.autograd.grad((g_ref * g_ref).sum(), [ref])
    assert_close(h, h_ref, "second derivative", 1e-10, 1e-10)
