"""Flex losses inside training: ``torch.compile`` around a step that calls ``flex_loss``
with lambdas (one graph break, eager's values and gradients, a captured margin's
included), ``cached_step`` (GradCache) and Matryoshka widths, equal to the plain eager
computation in float64."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

import flashcl
from helpers import assert_close

F64 = torch.float64
TOL = (1e-10, 1e-9)


def _grads(loss: torch.Tensor, leaves: List[torch.Tensor]) -> List[torch.Tensor]:
    return [g for g in torch.autograd.grad(loss, leaves)]


def test_a_compiled_step_with_lambdas_equals_eager_with_one_graph_break() -> None:
    g = torch.Generator().manual_seed(0)
    enc = torch.nn.Linear(8, 6).double()
    x, t = torch.randn(40, 8, generator=g, dtype=F64), torch.randn(40, generator=g, dtype=F64)
    margin = torch.nn.Parameter(torch.tensor(0.1, dtype=F64))

    def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = torch.tanh(enc(x))
        return flashcl.flex_loss(
            emb,
            rows={"t": t},
            positive=lambda a, b: (a.t - b.t).abs() <= 0.5,
            score_mod=lambda s, a, b: s - margin * ((a.t - b.t).abs() <= 0.5),
            backend="tiled",
            block_size=16,
        )

    leaves = [*enc.parameters(), margin]
    want = step(x, t)
    want_grads = _grads(want, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    for _ in range(2):  # the second call runs the cached graphs
        got = compiled(x, t)
        assert_close(got, want, "compiled: value", *TOL)
        for a, e in zip(_grads(got, leaves), want_grads):
            assert_close(a, e, "compiled: gradient", *TOL)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, t)
    # one break, at the flex call (the encoder before it is one graph)
    assert len(explained.break_reasons) == 1, explained.break_reasons
    assert "disable" in explained.break_reasons[0].reason and explained.graph_count == 1


def test_fullgraph_refuses_the_flex_call() -> None:
    torch._dynamo.reset()
    step = torch.compile(
        lambda e, y: flashcl.flex_loss(e, rows={"y": y}, positive=lambda a, b: a.y == b.y),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(Exception, match="(?i)skip|disable|graph break"):
        step(torch.randn(8, 4), torch.randint(0, 2, (8,)))


def test_cached_step_takes_a_flex_loss() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 10, generator=g, dtype=F64), torch.randint(0, 4, (48,), generator=g)

    def loss_fn(e: torch.Tensor) -> torch.Tensor:
        return flashcl.flex_loss(e, rows={"y": y}, positive=lambda a, b: a.y == b.y, backend="tiled", block_size=8)

    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.Tanh(), torch.nn.Linear(12, 6)).double()
    want = loss_fn(enc(x))
    want_grads = _grads(want, list(enc.parameters()))
    got = flashcl.cached_step(enc, [x], loss_fn, chunk_size=16)
    assert_close(got, want.detach(), "cached_step: value", *TOL)
    for p, e in zip(enc.parameters(), want_grads):
        assert p.grad is not None
        assert_close(p.grad, e, "cached_step: gradient", *TOL)


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
@pytest.mark.parametrize("towers", [1, 2])
def test_matryoshka_widths_are_the_weighted_sum_of_each_width(backend: str, towers: int) -> None:
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(20, 8, generator=g, dtype=F64), torch.randn(20, 8, generator=g, dtype=F64)
    y = torch.randint(0, 3, (20,), generator=g)
    opts: Any = dict(rows={"y": y}, positive=lambda a, b: a.y == b.y)
    if towers == 2:
        opts = dict(rows={"y": y}, cols={"y": y}, exclude=lambda a, b: (a.y == b.y) & (a.index != b.index))
    leaves1 = [q.clone().requires_grad_(True), k.clone().requires_grad_(True)]
    leaves2 = [q.clone().requires_grad_(True), k.clone().requires_grad_(True)]

    def call(a: torch.Tensor, b: torch.Tensor, **kw: Any) -> torch.Tensor:
        return flashcl.flex_loss(a, b if towers == 2 else None, backend=backend, **opts, **kw)

    want = sum(w * call(leaves1[0][:, :d], leaves1[1][:, :d]) for d, w in ((2, 0.5), (4, 1.0), (8, 2.0)))
    got = call(leaves2[0], leaves2[1], matryoshka_dims=[8, 2, 4], matryoshka_weights=[2.0, 0.5, 1.0])
    assert_close(got, want, f"{backend}: value", *TOL)
    used = leaves1[:towers]
    for a, e in zip(_grads(got, leaves2[:towers]), _grads(want, used)):
        assert_close(a, e, f"{backend}: gradient", *TOL)
    with pytest.raises(ValueError, match="matryoshka_dims"):
        call(leaves2[0], leaves2[1], matryoshka_dims=[9])
    with pytest.raises(ValueError, match="matryoshka_weights needs"):
        call(leaves2[0], leaves2[1], matryoshka_weights=[1.0])
