"""Tiny losses keep their relative precision in float32: a model near collapse (each
anchor's one positive far above its negatives: a loss of 1e-7 against scores of 1 /
temperature = 20) on the softmax family's dense and tiled backends, against the float64
reference. ``c LSE - w s_pos`` subtracts two numbers of the scores' size there (float32
returned 0, or a negative loss); the engine takes a row's one positive into the head
(``c softplus(LSE_without - s_pos)``), its gradient as ``-c sigmoid(...)``."""

from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
import torch

import flashcl

F64 = torch.float64
NEAR = 3e-5  # float32 against float64: the loss's and each gradient's relative error (norm-wise)
B, D, T = 16, 32, 0.05


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach()).norm() / want.detach().norm())


def _inputs(seed: int) -> Dict[str, torch.Tensor]:
    """Orthonormal anchors and their positives a little off them: the positive's score
    about 1 / T = 20, every negative's about 0 (a loss near 30 exp(-20), 6e-8)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=F64))[0].T
    q = basis[:B]
    return {"q": q, "k": q + 0.03 * torch.randn(B, D, generator=g, dtype=F64), "neg": basis[B:]}


LABELS = torch.arange(B)
NEG = _inputs(1)["neg"]
CASES: Dict[str, Callable[..., torch.Tensor]] = {
    "info_nce": lambda q, k, **kw: flashcl.info_nce_loss(q, k, temperature=T, **kw),
    "info_nce_index": lambda q, k, **kw: flashcl.info_nce_loss(  # the positives after hard negatives
        q, torch.cat([NEG.to(k.dtype), k]), torch.arange(B) + B, temperature=T, **kw
    ),
    "nt_xent": lambda q, k, **kw: flashcl.nt_xent_loss(q, k, temperature=T, **kw),
    "clip": lambda q, k, **kw: flashcl.clip_loss(q, k, 1.0 / T, **kw),
    "supcon_views": lambda q, k, **kw: flashcl.supcon_loss(torch.stack([q, k], 1), LABELS, temperature=T, **kw),
    "simcse_sum": lambda q, k, **kw: flashcl.supcon_loss(
        torch.stack([q, k], 1), LABELS, temperature=T, positives="sum", **kw
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_tiny_loss_keeps_its_precision(name: str, backend: str, reduction: str) -> None:
    d = _inputs(1)
    fn = CASES[name]
    q64, k64 = (d[n].clone().requires_grad_(True) for n in ("q", "k"))
    want = fn(q64, k64, backend="reference", reduction=reduction)
    assert 0 < float(want.detach().max()) < 1e-6  # near collapse: a loss of 1e-7 against scores of 20
    up = torch.rand(want.shape, generator=torch.Generator().manual_seed(2), dtype=F64) + 0.5
    want_grads = torch.autograd.grad(want, [q64, k64], up)
    q32, k32 = (d[n].float().requires_grad_(True) for n in ("q", "k"))
    got = fn(q32, k32, backend=backend, reduction=reduction)
    assert _rel(got, want) < NEAR, (name, backend, float(got.sum()), float(want.sum()))
    for a, e, which in zip(torch.autograd.grad(got, [q32, k32], up.float()), want_grads, ("q", "k")):
        assert _rel(a, e) < NEAR, f"{name} {backend}: the gradient of {which}, {_rel(a, e):.3g}"


def test_every_row_of_one_pair_keeps_its_loss() -> None:
    """NT-Xent on one pair (each row's denominator is its positive alone: the loss is 0
    exactly, the gradient 0) and on two pairs: tiled equals dense and the reference."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 2):
        a, b = torch.randn(n, 4, generator=g, dtype=F64), torch.randn(n, 4, generator=g, dtype=F64)
        out: Dict[str, Any] = {}
        for backend in ("reference", "dense", "tiled"):
            x, y = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
            loss = flashcl.nt_xent_loss(x, y, temperature=0.5, backend=backend)
            out[backend] = (loss.detach(), *torch.autograd.grad(loss, [x, y]))
        for backend in ("dense", "tiled"):
            for got, want in zip(out[backend], out["reference"]):
                assert torch.allclose(got, want, atol=1e-12, rtol=1e-10), (n, backend, got, want)
        if n == 1:
            assert float(out["tiled"][0]) == 0.0
