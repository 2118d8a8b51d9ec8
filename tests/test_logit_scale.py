"""flashcl.LogitScale: exp of a learnable log-scale, clamped at max as open_clip clamps."""

from __future__ import annotations

import math

import pytest
import torch

import flashcl


def test_value_and_gradient_below_and_above_the_bound() -> None:
    scale = flashcl.LogitScale(init=20.0, max=100.0)
    value = scale()
    assert abs(float(value) - 20.0) < 1e-4
    value.backward()
    assert abs(float(scale.log_scale.grad) - 20.0) < 1e-4  # d exp(u) / du = exp(u)
    with torch.no_grad():
        scale.log_scale.fill_(math.log(150.0))
    scale.log_scale.grad = None
    value = scale()
    assert float(value) == pytest.approx(100.0)
    value.backward()
    assert float(scale.log_scale.grad) == 0.0  # past the bound: constant
    scale.clamp_()
    assert float(scale.log_scale) == pytest.approx(math.log(100.0))


def test_trains_clip_temperature_and_unbounded() -> None:
    torch.manual_seed(0)
    scale = flashcl.LogitScale(init=1 / 0.07, max=None)
    img, txt = torch.randn(16, 8), torch.randn(16, 8)
    loss = flashcl.clip_loss(img, txt, scale())
    want = flashcl.clip_loss(img, txt, torch.tensor(1 / 0.07))
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    loss.backward()
    assert scale.log_scale.grad is not None and torch.isfinite(scale.log_scale.grad)


@pytest.mark.parametrize(
    "kwargs", [{"init": 0.0}, {"init": -1.0}, {"max": float("inf")}, {"init": 200.0}, {"init": True}]
)
def test_bad_arguments_are_errors(kwargs) -> None:
    with pytest.raises(ValueError):
        flashcl.LogitScale(**kwargs)


@pytest.mark.parametrize("start", ["init at max", "after clamp_"])
def test_a_scale_at_its_bound_can_come_down_as_open_clip_s(start: str) -> None:
    """At max (init = max, or clamp_ after it grew past), a loss that wants a smaller
    scale brings it down as open_clip's convention does (the log-scale parameter,
    exp in the forward, clamp_ after each step): five SGD steps of a CLIP loss whose
    logits are too sharp."""
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)  # unrelated pairs
    ours = flashcl.LogitScale(init=100.0 if start == "init at max" else 50.0, max=100.0)
    if start == "after clamp_":
        with torch.no_grad():
            ours.log_scale.fill_(math.log(300.0))
        ours.clamp_()
    theirs = torch.nn.Parameter(torch.tensor(math.log(100.0)))  # open_clip's logit_scale
    opt = torch.optim.SGD([ours.log_scale, theirs], lr=0.05)
    history = []
    for _ in range(5):
        value = ours()
        assert float(value) <= 100.0
        loss = flashcl.clip_loss(img, txt, value) + flashcl.clip_loss(img, txt, theirs.exp())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ours.clamp_()
        with torch.no_grad():
            theirs.clamp_(0, math.log(100))
        history.append((float(ours.log_scale.exp()), float(theirs.exp())))
    assert history[-1][1] < 50.0, history  # the loss wants a smaller scale
    for mine, peer in history:
        assert mine == pytest.approx(peer, rel=1e-4), history
