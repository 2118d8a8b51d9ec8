"""dense and tiled against the reference in float64: every loss, option, reduction, gradient."""

from __future__ import annotations

import functools

import pytest
import torch

import flashcl
from helpers import BACKENDS, CASES, REDUCTIONS, TOL, Case, assert_close, compare_to_reference, make_cases


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_float64(case: Case, backend: str, reduction: str) -> None:
    compare_to_reference(case, backend, reduction, torch.float64, *TOL[torch.float64])


@pytest.mark.parametrize("block_size", [1, 7, 10_000])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_tiled_block_sizes(case: Case, block_size: int, reduction: str) -> None:
    compare_to_reference(case, "tiled", reduction, torch.float64, *TOL[torch.float64], block_size=block_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32(case: Case, backend: str) -> None:
    if case.name in ("supcon_tiny_temperature", "clip_large_scale", "info_nce_tiny_temperature"):
        pytest.skip("scores of 1e3: float32 rounding alone exceeds the float32 tolerance; float64 covers it")
    compare_to_reference(case, backend, "mean", torch.float32, *TOL[torch.float32])


def test_larger_batches_tiled_float64() -> None:
    # Sizes where the automatic block size splits the batch, and no block divides it.
    for case in make_cases(seed=3, scale=9):
        compare_to_reference(case, "tiled", "mean", torch.float64, *TOL[torch.float64], block_size=31)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg", "neighbor", "nt_xent"])
def test_half_precision_no_worse_than_dense(name: str, dtype: torch.dtype) -> None:
    """Tiled's error in half precision is at most dense's (same dtype) plus a small margin.

    The oracle is the float64 reference on the same, already rounded, inputs.
    """
    case = CASES[name]
    rounded = Case(
        case.name,
        case.fn,
        [t.to(dtype).to(torch.float64) for t in case.tensors],
        case.extra,
        case.kwargs,
        case.scalar_kw,
    )
    ref_loss, ref_grads = rounded.run("reference", "mean", torch.float64)
    errs = {}
    for backend in BACKENDS:
        loss, grads = rounded.run(backend, "mean", dtype)
        assert loss.dtype == torch.float32, "half inputs give a float32 loss"
        assert all(gr.dtype == dtype for gr in grads[: len(case.tensors)]), "gradients come back in the input dtype"
        errs[backend] = [float((loss.double() - ref_loss).abs())] + [
            float((gr.double() - rg).abs().max()) for gr, rg in zip(grads, ref_grads)
        ]
    margin = 1e-3 if dtype == torch.float16 else 1e-2
    for i, (et, ed) in enumerate(zip(errs["tiled"], errs["dense"])):
        assert et <= ed * 1.5 + margin, f"{name}/{dtype}: output {i}: tiled error {et:.3g} vs dense {ed:.3g}"


@pytest.mark.parametrize("backend", ["dense", "tiled", "reference"])
def test_gradcheck(backend: str) -> None:
    g = torch.Generator().manual_seed(1)
    e = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 1, 0, 1, 2])
    z2 = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    s = torch.randn(5, 5, dtype=torch.float64, generator=g, requires_grad=True)
    nb = torch.tensor([[1, 1], [0, 4], [3, 3], [2, 0], [4, 1]])
    kw = {"backend": backend}
    if backend == "tiled":
        kw["block_size"] = 2
    # A second backward of the fused tiled path recomputes its gradient rather
    # than replaying the one stored in forward: equal up to rounding, not bitwise.
    gradcheck = functools.partial(torch.autograd.gradcheck, nondet_tol=1e-10)
    for red in ("mean", "none"):
        assert gradcheck(
            lambda x, tt, red=red: flashcl.supcon_loss(x, labels, temperature=tt, reduction=red, **kw), (e, t)
        )
        assert gradcheck(lambda a, b_, tt, red=red: flashcl.clip_loss(a, b_, tt, reduction=red, **kw), (e, z2, t))
        assert gradcheck(
            lambda a, b_, tt, red=red: flashcl.info_nce_loss(a, b_, temperature=tt, reduction=red, **kw), (e, z2, t)
        )
        assert gradcheck(lambda a, b_, red=red: flashcl.nt_xent_loss(a, b_, reduction=red, **kw), (e, z2))
        assert gradcheck(lambda x, red=red: flashcl.neighbor_loss(x, nb, reduction=red, **kw), (s,))


def test_tiled_second_backward_recomputes() -> None:
    """The fused forward hands its stored gradient over once; a second backward
    (retain_graph) recomputes and gives the same gradient."""
    case = CASES["supcon"]
    e = case.tensors[0].clone().requires_grad_(True)
    loss = flashcl.supcon_loss(e, case.extra[0], backend="tiled", block_size=4)
    (g1,) = torch.autograd.grad(loss * 2.0, e, retain_graph=True)
    (g2,) = torch.autograd.grad(loss * 2.0, e)
    assert_close(g2, g1, "second backward", 1e-12, 1e-10)
    s = CASES["neighbor"].tensors[0].clone().requires_grad_(True)
    loss = flashcl.neighbor_loss(s, CASES["neighbor"].extra[0], backend="tiled", block_size=4)
    (h1,) = torch.autograd.grad(loss, s, retain_graph=True)
    (h2,) = torch.autograd.grad(loss * 3.0, s)
    assert_close(h2, 3.0 * h1, "second backward of neighbor_loss", 1e-12, 1e-10)


def test_tiled_no_grad_mode_gives_same_loss() -> None:
    for case in CASES.values():
        with_grad, _ = case.run("tiled", "mean")
        with torch.no_grad():
            loss = case.fn(*case.tensors, *case.extra, backend="tiled", reduction="mean", **case.kwargs)
        assert_close(loss, with_grad, f"{case.name}: no_grad", 1e-12, 1e-10)
        assert not loss.requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_embedding_row(backend: str) -> None:
    """A zero row normalises to zero (F.normalize's eps): same loss and gradient
    (of size 1/eps on that row) as the reference."""
    g = torch.Generator().manual_seed(4)
    emb = torch.randn(9, 4, dtype=torch.float64, generator=g)
    emb[3] = 0.0
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 0, 1, 2])
    case = Case("zero_row", flashcl.supcon_loss, [emb], [labels], {"temperature": 0.2})
    compare_to_reference(
        case, backend, "mean", torch.float64, 1e-10, 1e-9, **({"block_size": 4} if backend == "tiled" else {})
    )


@pytest.mark.parametrize("gap", [60.0, 1000.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_neighbor_loss_self_score_far_above_the_row(gap: float, dtype: torch.dtype, reduction: str) -> None:
    # The tiled neighbour loss shifts each row by its maximum *including* the
    # excluded self score; when that score towers over the rest (by 1000: every
    # other exp underflows), the row must be redone with its masked maximum.
    # With a gap of 60 it need not be, and must stay exact in float32.
    g = torch.Generator().manual_seed(4)
    n = 23
    scores = torch.randn(n, n, generator=g, dtype=torch.float64)
    scores.diagonal().add_(gap)
    scores[5, 5] = -3.0  # one ordinary row among them
    case = Case(
        "neighbor_big_self",
        flashcl.neighbor_loss,
        [scores],
        [flashcl.sample_neighbors(n, 3, generator=g)],
        {"exclude_diagonal": True},
    )
    compare_to_reference(case, "tiled", reduction, dtype, *TOL[dtype], block_size=7)
