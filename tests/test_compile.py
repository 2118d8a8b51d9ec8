"""torch.compile around the losses: graph breaks are allowed (the tiled backend is a
custom autograd Function with Python loops), values and gradients equal eager."""

from __future__ import annotations

import pytest
import torch

from helpers import CASES, assert_close


def _loss_and_grads(fn, case, backend: str):
    inputs = [t.detach().float().clone().requires_grad_(True) for t in case.tensors]
    loss = fn(*inputs, *case.extra, backend=backend, **case.kwargs)
    return loss.detach(), torch.autograd.grad(loss, inputs)


def _check(name: str, backend: str, compile_backend: str) -> None:
    case = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(case.fn, backend=compile_backend)
    eager = _loss_and_grads(case.fn, case, backend)
    got = _loss_and_grads(compiled, case, backend)
    assert_close(got[0], eager[0], f"{name}/{backend}: compiled loss", 1e-6, 1e-6)
    for i, (a, e) in enumerate(zip(got[1], eager[1])):
        assert_close(a, e, f"{name}/{backend}: compiled grad {i}", 1e-6, 1e-6)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg", "neighbor"])
def test_torch_compile_equals_eager(name: str, backend: str) -> None:
    _check(name, backend, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_torch_compile_inductor(backend: str) -> None:
    _check("supcon", backend, "inductor")
