"""The tiled backend's stripe driver (tensor-core GEMMs on CUDA for half precision),
run on the CPU with the half GEMMs emulated: every embedding loss against the
float64 reference, half precision no worse than the dense backend, determinism."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

import flashcl
from flashcl.engine import engine  # the module the runner calls (not the package's re-export)
from flashcl.engine.stripes import Stripes
from helpers import CASES, TOL, Case, assert_close, moved

# Matryoshka widths take a pass of their own (flashcl.engine.matryoshka), not the engine's drivers
EMBEDDING = sorted(
    n for n, c in CASES.items() if c.fn is not flashcl.neighbor_loss and "matryoshka_dims" not in c.kwargs
)


def _run(case: Case, dtype: torch.dtype, reduction: str, block: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The case with the stripe driver in place of the tiled backend's usual one (every call
    of the engine the runner makes: a case that never reached it fails)."""
    original = engine.run
    calls = []

    def with_stripes(q, k, scale, problem, driver, reduce_weights, blk, param=()):  # noqa: ANN001
        calls.append(type(driver).__name__)
        return original(q, k, scale, problem, Stripes(), reduce_weights, block, param)

    engine.run = with_stripes
    try:
        out = case.run("tiled", reduction, dtype)
    finally:
        engine.run = original
    assert calls, f"{case.name}: the engine was not called"
    return out


@pytest.mark.parametrize("block", [4, 1000])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", EMBEDDING)
def test_stripes_float64_equal_reference(name: str, reduction: str, block: int) -> None:
    ref_loss, ref_grads = CASES[name].run("reference", reduction, torch.float64)
    loss, grads = _run(CASES[name], torch.float64, reduction, block)
    assert_close(loss, ref_loss, f"{name}/{reduction}/block {block}: loss", *TOL[torch.float64])
    for i, (a, e) in enumerate(zip(grads, ref_grads)):
        assert_close(a, e, f"{name}/{reduction}/block {block}: grad {i}", *TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg", "nt_xent", "supcon_views"])
def test_stripes_half_precision_no_worse_than_dense(name: str, dtype: torch.dtype) -> None:
    """The oracle: the float64 reference on the same, already rounded, inputs. G is
    rounded once to the inputs' dtype for the gradient GEMMs, as on tensor cores."""
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
    dense = rounded.run("dense", "mean", dtype)
    stripes = _run(rounded, dtype, "mean", 5)
    assert stripes[0].dtype == torch.float32
    assert all(g.dtype == dtype for g in stripes[1][: len(case.tensors)])
    margin = 1e-3 if dtype == torch.float16 else 1e-2
    for i, (s_out, d_out, r_out) in enumerate(
        zip([stripes[0]] + stripes[1], [dense[0]] + dense[1], [ref_loss] + ref_grads)
    ):
        es = float((s_out.double() - r_out).abs().max())
        ed = float((d_out.double() - r_out).abs().max())
        assert es <= 1.5 * ed + margin, f"{name}/{dtype}: output {i}: stripes {es:.3g} vs dense {ed:.3g}"


def test_stripes_deterministic() -> None:
    case = CASES["clip"]
    first = _run(case, torch.bfloat16, "mean", 3)
    again = _run(case, torch.bfloat16, "mean", 3)
    assert torch.equal(first[0], again[0]) and all(torch.equal(a, b) for a, b in zip(first[1], again[1]))


def test_tiled_half_takes_stripes() -> None:
    """Half precision takes the stripes: on CUDA always; elsewhere for two sets of rows (the
    symmetric self-contrast panels compute 2/3 of the products there)."""
    from flashcl import backends
    from flashcl.engine import Problem
    from flashcl.engine.heads import SoftmaxHead

    problem = Problem(SoftmaxHead(torch.ones(4)))
    keys = torch.ones(4, 2)
    assert isinstance(backends.driver("tiled", problem, None, "cuda", torch.bfloat16), Stripes)
    assert not isinstance(backends.driver("tiled", problem, None, "cuda", torch.float32), Stripes)
    assert not isinstance(backends.driver("tiled", problem, None, "cpu", torch.bfloat16), Stripes)
    assert isinstance(backends.driver("tiled", problem, keys, "cpu", torch.bfloat16), Stripes)
    assert not isinstance(backends.driver("tiled", problem, keys, "cpu", torch.float32), Stripes)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", EMBEDDING)
def test_stripes_never_modify_the_inputs(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    inputs = [t.to(dtype).requires_grad_(True) for t in case.tensors]
    kwargs = {k: moved(v, "cpu", dtype) for k, v in case.kwargs.items()}
    keys = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    before = [t.detach().clone() for t in inputs + keys]
    original = engine.run
    engine.run = lambda q, k, s, p, d, w, blk, param=(): original(q, k, s, p, Stripes(), w, 3, param)
    try:
        for reduction in ("mean", "none"):
            case.fn(*inputs, *case.extra, backend="tiled", reduction=reduction, **kwargs).sum().backward()
    finally:
        engine.run = original
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, inputs + keys)), name
