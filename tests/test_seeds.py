"""The seeds' own programs against flashcl: equal losses and gradients."""

from __future__ import annotations

import random

import pytest
import torch
from seeds import (
    naive_supervised_simcse_loss,
    seed1_gather_fix,
    seed1_indices,
    seed1_log_form,
    seed1_program,
    vectorized_supervised_simcse_loss,
)

import flashcl
from helpers import assert_close

ALL_BACKENDS = ("reference", "dense", "tiled", "auto")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("n,k", [(40, 2), (33, 1), (25, 3)])
def test_seed1_program_equals_neighbor_loss(backend: str, n: int, k: int) -> None:
    x = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    xs = x.clone().requires_grad_(True)
    expected = seed1_program(xs, k, random.Random(7))
    expected.backward()
    indices = seed1_indices(n, k, random.Random(7))
    xf = x.clone().requires_grad_(True)
    got = flashcl.neighbor_loss(xf, indices, backend=backend, block_size=6 if backend == "tiled" else None)
    got.backward()
    assert_close(got, expected, "loss", 1e-10, 1e-10)
    assert_close(xf.grad, xs.grad, "d loss / d scores", 1e-10, 1e-10)
    for fix in (seed1_gather_fix, seed1_log_form):
        assert_close(got, fix(x, indices), fix.__name__, 1e-10, 1e-10)


def test_seed1_overflow_where_flashcl_stays_finite() -> None:
    """Scores of 1e4: the seed's sum(exp) - exp(diag) gives inf/NaN; flashcl is finite and exact."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 20, generator=g) * 1e4
    idx = flashcl.sample_neighbors(20, 2, generator=g)
    assert not torch.isfinite(seed1_gather_fix(x, idx))
    for backend in ALL_BACKENDS:
        xs = x.clone().requires_grad_(True)
        loss = flashcl.neighbor_loss(xs, idx, backend=backend)
        loss.backward()
        expected = sum(
            torch.logsumexp(torch.cat([x[i, :i], x[i, i + 1 :]]).double(), 0) - x[i, j].double()
            for i in range(20)
            for j in idx[i].tolist()
        )
        assert torch.isfinite(loss) and torch.isfinite(xs.grad).all(), backend
        assert_close(loss, expected, f"{backend}: loss at 1e4", 0.0, 1e-6)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("b,classes", [(32, 5), (17, 3), (9, 9)])
def test_seed2_naive_and_vectorized_equal_supcon(backend: str, b: int, classes: int) -> None:
    g = torch.Generator().manual_seed(b)
    emb = torch.randn(b, 24, dtype=torch.float64, generator=g)
    labels = torch.randint(0, classes, (b,), generator=g)
    e1 = emb.clone().requires_grad_(True)
    naive = naive_supervised_simcse_loss(e1, labels)
    naive.backward()
    e2 = emb.clone().requires_grad_(True)
    vec = vectorized_supervised_simcse_loss(e2, labels)
    vec.backward()
    e3 = emb.clone().requires_grad_(True)
    ours = flashcl.supcon_loss(
        e3,
        labels,
        temperature=0.05,
        positives="sum",
        include_self=True,
        backend=backend,
        block_size=5 if backend == "tiled" else None,
    )
    ours.backward()
    assert_close(ours, naive, "vs naive", 1e-10, 1e-10)
    assert_close(ours, vec, "vs vectorized", 1e-10, 1e-10)
    assert_close(e3.grad, e1.grad, "grad vs naive", 1e-10, 1e-10)
    assert_close(e3.grad, e2.grad, "grad vs vectorized", 1e-10, 1e-10)
