"""What a demanding user tries beyond the plain call: second derivatives, NaN in an
excluded entry, a low-precision temperature, mistyped flags, autocast. Every
backend either gives the right number or raises a clear error."""

from __future__ import annotations

import importlib.util
import os
from typing import List

import pytest
import torch

import flashcl
from helpers import CASES, Case, assert_close

F64 = torch.float64
TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)


def _inputs(case: Case, dtype: torch.dtype = F64) -> List[torch.Tensor]:
    return [t.detach().to(dtype).clone().requires_grad_(True) for t in case.tensors]


def _block(backend: str) -> dict:
    # several blocks on the tiled backend, so that its block loops are exercised
    return {"block_size": 4} if backend == "tiled" else {}


def _penalty_grads(case: Case, backend: str, reduction: str, dtype: torch.dtype = F64) -> List[torch.Tensor]:
    """Gradients of loss + |d loss / d inputs|^2 (a gradient penalty: needs second derivatives)."""
    inputs = _inputs(case, dtype)
    loss = case.fn(*inputs, *case.extra, backend=backend, reduction=reduction, **case.kwargs, **_block(backend))
    loss = loss.sum() if reduction == "none" else loss
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    total = loss + sum((g**2).sum() for g in grads)
    return list(torch.autograd.grad(total, inputs))


def _hvp(case: Case, backend: str, dtype: torch.dtype = F64) -> List[torch.Tensor]:
    """Hessian-vector product of loss**2 with a fixed vector."""
    inputs = _inputs(case, dtype)
    loss = case.fn(*inputs, *case.extra, backend=backend, **case.kwargs, **_block(backend)) ** 2
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    g = torch.Generator().manual_seed(1)
    vs = [torch.randn(x.shape, generator=g, dtype=F64).to(dtype) for x in inputs]
    return list(torch.autograd.grad(sum((gr * v).sum() for gr, v in zip(grads, vs)), inputs))


SECOND_ORDER_CASES = [
    "supcon",
    "supcon_sum_self",
    "supcon_views",
    "nt_xent",
    "info_nce_hard_neg",
    "clip",
    "supcon_matryoshka",
    "info_nce_matryoshka",
    "clip_matryoshka",
    "neighbor",
    "neighbor_with_diag",
]


@pytest.mark.parametrize("backend", ["tiled", "reference", "auto"])
@pytest.mark.parametrize("name", SECOND_ORDER_CASES)
def test_second_derivatives_equal_dense(name: str, backend: str) -> None:
    case = CASES[name]
    for reduction in ("mean", "none"):
        expected = _penalty_grads(case, "dense", reduction)
        got = _penalty_grads(case, backend, reduction)
        for i, (a, e) in enumerate(zip(got, expected)):
            assert_close(a, e, f"{name}/{backend}/{reduction}: gradient penalty, input {i}", 1e-10, 1e-9)
    for i, (a, e) in enumerate(zip(_hvp(case, backend), _hvp(case, "dense"))):
        assert_close(a, e, f"{name}/{backend}: Hessian-vector product, input {i}", 1e-10, 1e-9)


@pytest.mark.skipif(not TRITON, reason="triton is not installed, or neither CUDA nor its interpreter is here")
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg"])
def test_second_derivatives_triton(name: str) -> None:
    case = CASES[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    moved = Case(
        case.name,
        case.fn,
        [t.to(device) for t in case.tensors],
        [x.to(device) if isinstance(x, torch.Tensor) else x for x in case.extra],
        case.kwargs,
    )
    for a, e in zip(_hvp(moved, "triton", torch.float32), _hvp(moved, "dense", torch.float32)):
        assert_close(a.cpu(), e.cpu(), f"{name}/triton: Hessian-vector product", 1e-4, 1e-4)


def test_learnable_temperature_second_derivative() -> None:
    case = CASES["supcon"]
    out = []
    for backend in ("dense", "tiled"):
        t = torch.tensor(0.3, dtype=F64, requires_grad=True)
        e = case.tensors[0].clone().requires_grad_(True)
        loss = flashcl.supcon_loss(e, case.extra[0], temperature=t, backend=backend, **_block(backend))
        (gt,) = torch.autograd.grad(loss, t, create_graph=True)
        out.append(torch.autograd.grad(gt, [t, e]))
    for a, b in zip(*out):
        assert_close(a, b, "d2 loss / dt dt and dt de", 1e-10, 1e-9)


# ----------------------------------------------------------------------------- excluded entries


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_neighbor_loss_ignores_an_excluded_nan(value: float, reduction: str) -> None:
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(9, 9, generator=g, dtype=F64)
    scores[3, 3] = value
    scores[6, 6] = value
    nb = (torch.arange(9) + 1).remainder(9).unsqueeze(1).repeat(1, 2)  # never the diagonal
    results = {}
    for backend in ("reference", "dense", "tiled", "auto"):
        for dtype in (F64, torch.float32):
            x = scores.to(dtype).clone().requires_grad_(True)
            loss = flashcl.neighbor_loss(x, nb, backend=backend, reduction=reduction, **_block(backend))
            loss.sum().backward()
            assert torch.isfinite(loss).all() and torch.isfinite(x.grad).all(), (backend, dtype)
            assert float(x.grad[3, 3]) == 0.0 and float(x.grad[6, 6]) == 0.0
            results[(backend, dtype)] = (loss.detach(), x.grad)
    ref_loss, ref_grad = results[("reference", F64)]
    for (backend, dtype), (loss, grad) in results.items():
        tol = 1e-10 if dtype == F64 else 2e-5
        assert_close(loss, ref_loss, f"{backend}/{dtype}: loss", tol, tol)
        assert_close(grad, ref_grad, f"{backend}/{dtype}: grad", tol, tol)


def test_neighbor_loss_on_infinite_and_far_apart_scores_as_torch_logsumexp() -> None:
    """Rows whose denominator is empty of finite terms (every other column at -inf), with
    a +inf term, or with its other terms 2e4 below the diagonal: the tiled backend's
    values are the dense formula's (``torch.logsumexp``'s: -inf, +inf, finite), and where
    they are finite, so are the gradients, equal to it."""
    scores = torch.randn(6, 6, generator=torch.Generator().manual_seed(5), dtype=F64)
    scores[1] = -float("inf")  # the excluded diagonal finite: an empty denominator
    scores[1, 1] = 0.0
    scores[2, 4] = float("inf")
    scores[5] = -1e4  # far below its diagonal: the rows' masked maximum is the shift
    scores[5, 5] = 1e4
    nb = (torch.arange(6) + 1).remainder(6).unsqueeze(1)
    results = {}
    for backend in ("dense", "tiled"):
        x = scores.clone().requires_grad_(True)
        loss = flashcl.neighbor_loss(x, nb, backend=backend, reduction="none")
        loss[[0, 3, 4, 5]].sum().backward()
        results[backend] = (loss.detach(), x.grad)
    (loss, grad), (want, want_grad) = results["tiled"], results["dense"]
    assert torch.equal(torch.isnan(loss), torch.isnan(want)) and bool(torch.isposinf(loss[2]))
    finite = [0, 3, 4, 5]
    assert_close(loss[finite], want[finite], "finite rows' losses", 1e-12, 1e-12)
    assert torch.isfinite(grad[finite]).all()
    assert_close(grad[finite], want_grad[finite], "finite rows' gradients", 1e-12, 1e-12)


# ----------------------------------------------------------------------------- scalars


@pytest.mark.parametrize("backend", ["dense", "tiled", "reference"])
def test_half_precision_temperature_is_promoted(backend: str) -> None:
    case = CASES["supcon"]
    emb = case.tensors[0].float()
    t16 = torch.tensor(0.07, dtype=torch.float16, requires_grad=True)
    t32 = torch.tensor(float(t16.detach()), dtype=torch.float32, requires_grad=True)  # the same value
    l16 = flashcl.supcon_loss(emb, case.extra[0], temperature=t16, backend=backend)
    l32 = flashcl.supcon_loss(emb, case.extra[0], temperature=t32, backend=backend)
    assert_close(l16, l32, f"{backend}: float16 temperature", 0.0, 2e-7)
    l16.backward()
    l32.backward()
    assert t16.grad is not None and t16.grad.dtype == torch.float16
    assert_close(t16.grad, t32.grad.half(), "temperature gradient", 0.0, 1e-3)
    s16 = torch.tensor(14.3, dtype=torch.bfloat16)
    img, txt = CASES["clip"].tensors
    assert_close(
        flashcl.clip_loss(img.float(), txt.float(), s16, backend=backend),
        flashcl.clip_loss(img.float(), txt.float(), float(s16), backend=backend),
        "bfloat16 logit_scale",
        0.0,
        2e-7,
    )


# ----------------------------------------------------------------------------- flags

FLAG_CALLS = {
    "supcon include_self": lambda: flashcl.supcon_loss(
        torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), include_self="False"
    ),
    "supcon normalize": lambda: flashcl.supcon_loss(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), normalize=1),
    "nt_xent normalize": lambda: flashcl.nt_xent_loss(torch.randn(4, 3), torch.randn(4, 3), normalize="no"),
    "info_nce normalize": lambda: flashcl.info_nce_loss(torch.randn(4, 3), torch.randn(4, 3), normalize=None),
    "clip normalize": lambda: flashcl.clip_loss(torch.randn(4, 3), torch.randn(4, 3), 2.0, normalize=0),
    "neighbor exclude_diagonal": lambda: flashcl.neighbor_loss(
        torch.randn(4, 4), torch.zeros(4, 1).long(), exclude_diagonal="False"
    ),
    "sample exclude_self": lambda: flashcl.sample_neighbors(4, 2, exclude_self="yes"),
    "module include_self": lambda: flashcl.SupConLoss(include_self="False")(
        torch.randn(4, 3), torch.tensor([0, 0, 1, 1])
    ),
    "distributed include_self": lambda: flashcl.supcon_loss(
        torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), include_self="False", process_group=object()
    ),
    "distributed normalize": lambda: flashcl.clip_loss(
        torch.randn(4, 3), torch.randn(4, 3), 2.0, normalize="True", process_group=object()
    ),
}


@pytest.mark.parametrize("name", sorted(FLAG_CALLS))
def test_flags_must_be_bool(name: str) -> None:
    flag = name.split()[-1]
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        FLAG_CALLS[name]()


# ----------------------------------------------------------------------------- autocast

AUTOCAST_BACKENDS = ["reference", "dense", "tiled", "auto"] + (
    ["triton"] if TRITON and not torch.cuda.is_available() else []
)


@pytest.mark.parametrize("backend", AUTOCAST_BACKENDS)
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg", "nt_xent", "neighbor"])
def test_autocast_does_not_lower_the_precision(name: str, backend: str) -> None:
    """Under autocast every backend computes in the inputs' dtype (float32 here), as
    torch's own losses do: the loss and gradients equal the ones without autocast
    (backward called after the autocast region, as torch recommends)."""
    case = CASES[name]
    if backend == "triton" and case.fn is flashcl.neighbor_loss:
        pytest.skip("the neighbour loss takes a score matrix: no triton backend")
    results = []
    for autocast in (False, True):
        inputs = _inputs(case, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = case.fn(*inputs, *case.extra, backend=backend, **case.kwargs)
        results.append((loss.detach(), torch.autograd.grad(loss, inputs)))
    (plain, plain_grads), (under, under_grads) = results
    assert under.dtype == torch.float32
    assert_close(under, plain, f"{name}/{backend}: loss under autocast", 1e-6, 1e-6)
    for i, (a, e) in enumerate(zip(under_grads, plain_grads)):
        assert_close(a, e, f"{name}/{backend}: grad {i} under autocast", 1e-6, 1e-6)


@pytest.mark.parametrize("backend", ["tiled"] + (["triton"] if TRITON and not torch.cuda.is_available() else []))
def test_autocast_in_backward_of_flashcl_functions(backend: str) -> None:
    """flashcl's own autograd Functions also run their backward without autocast."""
    case = CASES["clip"]
    results = []
    for autocast in (False, True):
        inputs = _inputs(case, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = case.fn(*inputs, *case.extra, backend=backend, reduction="none", **case.kwargs)
            results.append(torch.autograd.grad(loss.sum(), inputs))
    for a, e in zip(*results):
        assert_close(a, e, f"{backend}: backward inside autocast", 1e-6, 1e-6)
