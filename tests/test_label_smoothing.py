"""label_smoothing on info_nce_loss and clip_loss equals torch's
F.cross_entropy(..., label_smoothing=eps) (uniform mass over every column, the
target's included; CLIP: both directions), on every backend, with gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashcl
from helpers import assert_close

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]


def _grads(loss, inputs):
    return torch.autograd.grad(loss.sum(), inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_negatives", [False, True])
def test_info_nce_equals_cross_entropy(backend: str, reduction: str, with_negatives: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(10, 5, dtype=torch.float64, generator=g, requires_grad=True)
    neg = torch.randn(4, 5, dtype=torch.float64, generator=g) if with_negatives else None
    t = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([3, 0, 7, 1, 9, 2])
    eps = 0.15
    got = flashcl.info_nce_loss(
        q, k, pos, temperature=t, negatives=neg, label_smoothing=eps, reduction=reduction, backend=backend, block_size=4
    )
    cols = F.normalize(k, dim=1) if neg is None else torch.cat([F.normalize(k, dim=1), F.normalize(neg, dim=1)])
    logits = F.normalize(q, dim=1) @ cols.T / t
    want = F.cross_entropy(logits, pos, label_smoothing=eps, reduction=reduction)
    assert_close(got, want, f"{backend} {reduction}: value", *TOL)
    for a, b, name in zip(_grads(got, [q, k, t]), _grads(want, [q, k, t]), "qkt"):
        assert_close(a, b, f"{backend} {reduction}: grad {name}", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_clip_equals_cross_entropy_both_directions(backend: str, reduction: str) -> None:
    g = torch.Generator().manual_seed(1)
    img = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    txt = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    s = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
    eps = 0.2
    got = flashcl.clip_loss(img, txt, s, label_smoothing=eps, reduction=reduction, backend=backend, block_size=3)
    logits = s * F.normalize(img, dim=1) @ F.normalize(txt, dim=1).T
    target = torch.arange(7)
    want = 0.5 * (
        F.cross_entropy(logits, target, label_smoothing=eps, reduction=reduction)
        + F.cross_entropy(logits.T, target, label_smoothing=eps, reduction=reduction)
    )
    assert_close(got, want, f"{backend} {reduction}: value", *TOL)
    for a, b, name in zip(_grads(got, [img, txt, s]), _grads(want, [img, txt, s]), ["img", "txt", "scale"]):
        assert_close(a, b, f"{backend} {reduction}: grad {name}", *TOL)


def test_modules_take_it_and_zero_is_the_plain_loss() -> None:
    q, k = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    assert_close(
        flashcl.InfoNCELoss(label_smoothing=0.1)(q, k),
        flashcl.info_nce_loss(q, k, label_smoothing=0.1),
        "InfoNCELoss",
        *TOL,
    )
    assert_close(
        flashcl.ClipLoss(label_smoothing=0.1)(q, k, 3.0),
        flashcl.clip_loss(q, k, 3.0, label_smoothing=0.1),
        "ClipLoss",
        *TOL,
    )
    assert_close(flashcl.info_nce_loss(q, k, label_smoothing=0.0), flashcl.info_nce_loss(q, k), "eps 0", *TOL)


@pytest.mark.parametrize(
    "call",
    [
        lambda: flashcl.info_nce_loss(torch.randn(4, 3), torch.randn(4, 3), label_smoothing=1.0),
        lambda: flashcl.info_nce_loss(torch.randn(4, 3), torch.randn(4, 3), label_smoothing=-0.1),
        lambda: flashcl.info_nce_loss(
            torch.randn(4, 3),
            torch.randn(4, 3),
            label_smoothing=0.1,
            query_labels=torch.arange(4),
            key_labels=torch.arange(4),
        ),
        lambda: flashcl.info_nce_loss(
            torch.randn(4, 3),
            torch.randn(4, 3),
            label_smoothing=0.1,
            negatives=torch.randn(2, 3),
            in_batch_negatives=False,
        ),
        lambda: flashcl.info_nce_loss(
            torch.randn(4, 4), torch.randn(4, 4), label_smoothing=0.1, matryoshka_dims=[2, 4]
        ),
        lambda: flashcl.clip_loss(
            torch.randn(4, 3), torch.randn(4, 3), 2.0, label_smoothing=0.1, labels=torch.tensor([0, 0, 1, 1])
        ),
    ],
)
def test_what_it_does_not_combine_with_is_an_error(call) -> None:
    with pytest.raises(ValueError, match="label_smoothing"):
        call()
