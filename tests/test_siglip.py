"""SigLIP's sigmoid loss and CLIP with several positives per image: against open_clip's
own losses, written-out formulas, every backend, float64, value and every gradient."""

from __future__ import annotations

import importlib.util
import os
from typing import Callable, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

import flashcl
from flashcl.bench.peers import open_clip_loss_module
from helpers import assert_close

F64 = torch.float64
TOL = (1e-10, 1e-10)
TRITON = (
    importlib.util.find_spec("triton") is not None
    and os.environ.get("TRITON_INTERPRET") == "1"
    and not torch.cuda.is_available()
)


def _towers(b: int = 13, d: int = 6, seed: int = 0, normalized: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, d, generator=g, dtype=F64), torch.randn(b, d, generator=g, dtype=F64)
    return (F.normalize(x, dim=1), F.normalize(y, dim=1)) if normalized else (x, y)


def _grads(
    fn: Callable[..., torch.Tensor],
    img: torch.Tensor,
    txt: torch.Tensor,
    scale: float,
    bias: float,
    dtype: torch.dtype = F64,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Loss and gradients (image, text, scale, bias) of fn(img, txt, scale, bias) * 1.7."""
    inputs = [
        img.to(dtype).clone().requires_grad_(True),
        txt.to(dtype).clone().requires_grad_(True),
        torch.tensor(scale, dtype=F64, requires_grad=True),
        torch.tensor(bias, dtype=F64, requires_grad=True),
    ]
    loss = fn(*inputs)
    grads = torch.autograd.grad(loss * 1.7, inputs, allow_unused=True)
    return loss.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


def _compare(
    got: Tuple[torch.Tensor, List[torch.Tensor]],
    expected: Tuple[torch.Tensor, List[torch.Tensor]],
    what: str,
    tol: Tuple[float, float] = TOL,
) -> None:
    assert_close(got[0], expected[0], f"{what}: loss", *tol)
    for name, a, e in zip(("image", "text", "scale", "bias"), got[1], expected[1]):
        assert_close(a, e, f"{what}: grad of {name}", *tol)


def _open_clip():
    module, why = open_clip_loss_module()
    if module is None:
        pytest.skip(why)
    return module


BACKENDS = ["reference", "dense", "tiled", "auto"]


@pytest.mark.parametrize("block", [None, 1, 5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_siglip_equals_open_clip(backend: str, block: Optional[int]) -> None:
    oc = _open_clip()
    if block is not None and backend != "tiled":
        pytest.skip("block sizes are the tiled backend's")
    img, txt = _towers()
    expected = _grads(lambda a, b, s, t: oc.SigLipLoss()(a, b, s, t), img, txt, 10.0, -10.0)
    got = _grads(
        lambda a, b, s, t: flashcl.SigLipLoss(backend=backend, block_size=block)(a, b, s, t), img, txt, 10.0, -10.0
    )
    _compare(got, expected, f"SigLIP/{backend}/block={block}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_siglip_formula_and_reductions(backend: str) -> None:
    """-sum_ij log sigmoid(z_ij (scale x_i . y_j + bias)) / B, written out; 'none' gives
    each image's row, 'sum' their sum; unnormalised inputs with normalize=True."""
    img, txt = _towers(11, 5, seed=2, normalized=False)
    z = 2 * torch.eye(11, dtype=F64) - 1

    def formula(a, b, s, t):
        return -F.logsigmoid(z * (s * F.normalize(a, dim=1) @ F.normalize(b, dim=1).T + t)).sum(1)

    for reduction, reduce in (("mean", lambda r: r.sum() / 11), ("sum", torch.sum), ("none", lambda r: r)):
        weights = torch.linspace(0.5, 1.5, 11, dtype=F64) if reduction == "none" else 1.0
        expected = _grads(
            lambda a, b, s, t, f=reduce, w=weights: (f(formula(a, b, s, t)) * w).sum(), img, txt, 3.0, 0.7
        )
        got = _grads(
            lambda a, b, s, t, red=reduction, w=weights: (
                flashcl.siglip_loss(a, b, s, t, normalize=True, reduction=red, backend=backend, block_size=4) * w
            ).sum(),
            img,
            txt,
            3.0,
            0.7,
        )
        _compare(got, expected, f"SigLIP formula/{backend}/{reduction}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_siglip_with_labels(backend: str) -> None:
    """Every image-text pair of the same label is a positive (z = +1)."""
    img, txt = _towers(12, 4, seed=3)
    labels = torch.tensor([0, 1, 1, 2, 0, 3, 3, 3, 4, 5, 5, 6])
    z = torch.where(labels[:, None] == labels[None, :], 1.0, -1.0).to(F64)
    expected = _grads(lambda a, b, s, t: -F.logsigmoid(z * (s * a @ b.T + t)).sum() / 12, img, txt, 5.0, -2.0)
    got = _grads(
        lambda a, b, s, t: flashcl.siglip_loss(a, b, s, t, labels=labels, backend=backend, block_size=5),
        img,
        txt,
        5.0,
        -2.0,
    )
    _compare(got, expected, f"SigLIP labels/{backend}")


def test_siglip_extreme_logits_stay_exact() -> None:
    """Logits of +-1e3: softplus without a cut-off, no overflow."""
    img, txt = _towers(9, 3, seed=5)
    for backend in ("dense", "tiled"):
        got = _grads(
            lambda a, b, s, t, be=backend: flashcl.siglip_loss(a, b, s, t, backend=be), img, txt, 1000.0, -10.0
        )
        ref = _grads(lambda a, b, s, t: flashcl.siglip_loss(a, b, s, t, backend="reference"), img, txt, 1000.0, -10.0)
        assert torch.isfinite(got[0]) and all(torch.isfinite(g).all() for g in got[1])
        _compare(got, ref, f"extreme logits/{backend}", (1e-9, 1e-10))


@pytest.mark.skipif(not TRITON, reason="needs triton's CPU interpreter (TRITON_INTERPRET=1, no CUDA)")
@pytest.mark.parametrize("labels", [False, True])
def test_siglip_triton_interpreter(labels: bool) -> None:
    img, txt = _towers(37, 33, seed=7)
    lab = torch.randint(0, 5, (37,), generator=torch.Generator().manual_seed(1)) if labels else None
    ref = _grads(
        lambda a, b, s, t: flashcl.siglip_loss(a, b, s, t, labels=lab, backend="reference"), img, txt, 10.0, -5.0
    )
    got = _grads(
        lambda a, b, s, t: flashcl.siglip_loss(a, b, s, t, labels=lab, backend="triton"),
        img,
        txt,
        10.0,
        -5.0,
        dtype=torch.float32,
    )
    _compare(got, ref, f"SigLIP triton labels={labels}", (2e-5, 2e-5))


def test_siglip_second_derivatives() -> None:
    img, txt = _towers(10, 4, seed=4)
    out = []
    for backend in ("dense", "tiled"):
        inputs = [
            img.clone().requires_grad_(True),
            txt.clone().requires_grad_(True),
            torch.tensor(4.0, dtype=F64, requires_grad=True),
            torch.tensor(-1.0, dtype=F64, requires_grad=True),
        ]
        loss = flashcl.siglip_loss(*inputs, backend=backend, block_size=3)
        grads = torch.autograd.grad(loss, inputs, create_graph=True)
        out.append(torch.autograd.grad(loss + sum((g**2).sum() for g in grads), inputs))
    for i, (a, e) in enumerate(zip(*out)):
        assert_close(a, e, f"gradient penalty, input {i}", *TOL)


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (
            lambda: flashcl.siglip_loss(torch.randn(4, 3), torch.randn(4, 3), 1.0, float("nan")),
            ValueError,
            "logit_bias",
        ),
        (lambda: flashcl.siglip_loss(torch.randn(4, 3), torch.randn(4, 3), -1.0, 0.0), ValueError, "logit_scale"),
        (lambda: flashcl.siglip_loss(torch.randn(4, 3), torch.randn(5, 3), 1.0, 0.0), ValueError, "same shape"),
        (
            lambda: flashcl.siglip_loss(torch.randn(4, 3), torch.randn(4, 3), 1.0, 0.0, labels=torch.zeros(3).long()),
            ValueError,
            "labels",
        ),
        (lambda: flashcl.siglip_loss(torch.randn(4, 3), torch.randn(4, 3), 1.0, "0"), TypeError, "logit_bias"),
        (
            lambda: flashcl.clip_loss(torch.randn(4, 3), torch.randn(4, 3), 1.0, labels=torch.zeros(4)),
            TypeError,
            "labels",
        ),
    ],
)
def test_bad_input(call, exc, words) -> None:  # noqa: ANN001
    with pytest.raises(exc, match=words):
        call()


# ----------------------------------------------------------------------------- CLIP with labels

CLIP_BACKENDS = ["reference", "dense", "tiled", "auto"] + (["triton"] if TRITON else [])


@pytest.mark.parametrize("backend", CLIP_BACKENDS)
def test_clip_with_labels_equals_soft_target_cross_entropy(backend: str) -> None:
    img, txt = _towers(14, 5, seed=8, normalized=False)
    labels = torch.tensor([0, 1, 1, 2, 0, 3, 3, 3, 4, 5, 5, 6, 7, 0])
    p = (labels[:, None] == labels[None, :]).to(F64)

    def formula(a, b, s, t):
        logits = s * F.normalize(a, dim=1) @ F.normalize(b, dim=1).T
        return (
            F.cross_entropy(logits, p / p.sum(1, keepdim=True))
            + F.cross_entropy(logits.T, p.T / p.T.sum(1, keepdim=True))
        ) / 2

    dtype = torch.float32 if backend == "triton" else F64
    tol = (2e-5, 2e-5) if backend == "triton" else TOL
    expected = _grads(formula, img, txt, 7.0, 0.0)
    got = _grads(
        lambda a, b, s, t: flashcl.clip_loss(a, b, s, labels=labels, backend=backend, block_size=4),
        img,
        txt,
        7.0,
        0.0,
        dtype=dtype,
    )
    _compare(got[:1] + (got[1][:3],), expected[:1] + (expected[1][:3],), f"CLIP labels/{backend}", tol)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_clip_with_distinct_labels_is_clip(backend: str) -> None:
    img, txt = _towers(9, 5, seed=9)
    plain = flashcl.clip_loss(img, txt, 6.0, backend=backend, reduction="none")
    labelled = flashcl.clip_loss(img, txt, 6.0, labels=torch.arange(9) * 3, backend=backend, reduction="none")
    assert_close(labelled, plain, f"{backend}: labels all distinct", *TOL)


@pytest.mark.parametrize("backend", ["dense", "tiled", "reference"])
def test_clip_logit_bias_equals_open_clip(backend: str) -> None:
    oc = _open_clip()
    img, txt = _towers(10, 6, seed=10)
    expected = _grads(lambda a, b, s, t: oc.ClipLoss()(a, b, s, t), img, txt, 14.0, -3.0)
    got = _grads(
        lambda a, b, s, t: flashcl.ClipLoss(normalize=False, backend=backend)(a, b, s, t), img, txt, 14.0, -3.0
    )
    _compare(got, expected, f"CLIP with logit_bias/{backend}", (1e-10, 1e-9))
    assert float(got[1][3]) == 0.0
